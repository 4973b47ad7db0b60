"""Small ASGI helpers shared by the server's middleware and the activator (both plain ASGI, no framework)."""
from __future__ import annotations

import socket
from typing import Awaitable, Callable

Receive = Callable[[], Awaitable[dict]]


class BodyTooLarge(Exception):
    pass


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, read chunk by chunk (chunked uploads carry no Content-Length to check first).
    Raises BodyTooLarge as soon as it passes ``limit`` bytes; None when the client went away before the end
    (nothing to answer, and a partial body must not be acted on)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge()
        chunks.append(chunk)
        if not message.get("more_body"):
            return b"".join(chunks)


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands an already read ``body`` to the next app, then passes on what comes after it (the
    disconnect)."""
    sent = False

    async def receive_again() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening socket for uvicorn's `run(sockets=...)`: one server on several ports, a request told
    apart by the port in its scope (`scope["server"]`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock
