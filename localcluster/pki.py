"""Certificates and kubeconfigs of the local cluster (a CA of its own, the API server's serving certificate,
client certificates for the admin and the node's components), and free loopback ports. Used by the control
plane and the real node alike; it imports neither."""
from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)


def make_pki(d: Path, extra_ips: tuple[str, ...] = ()) -> None:
    """CA, API server serving cert, admin client cert (system:masters), kubelet client cert (the API server's,
    for logs/exec on a real node), service-account key pair. Cached in ``d``, keyed by the SAN list."""
    d.mkdir(parents=True, exist_ok=True)
    sans = ("subjectAltName=IP:127.0.0.1,IP:10.96.0.1," + "".join(f"IP:{ip}," for ip in extra_ips)
            + "DNS:localhost,DNS:kubernetes,"
            "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local")
    done = d / ".done"
    if done.exists() and done.read_text() == sans:
        return
    done.unlink(missing_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "3650", "-subj", "/CN=embedops-local-ca", cwd=d)
    (d / "serving.ext").write_text(sans + "\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, subj, ext in (("apiserver", "/CN=kube-apiserver", "serving.ext"),
                            ("admin", "/O=system:masters/CN=embedops-admin", "client.ext"),
                            ("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client",
                             "client.ext")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subj, cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "3650", "-extfile", ext, "-out", f"{name}.crt", cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    done.write_text(sans)


def _sign(ca: Path, out: Path, name: str, subj: str, ext: str) -> None:
    """A key and a certificate signed by the CA in ``ca``, into ``out`` (kept when the subject and extensions
    are unchanged and the CA is the same)."""
    out.mkdir(parents=True, exist_ok=True)
    stamp = out / f"{name}.stamp"
    key = subj + "|" + ext + "|" + (ca / "ca.crt").read_text()
    if stamp.exists() and stamp.read_text() == key and (out / f"{name}.crt").exists():
        return
    (out / f"{name}.ext").write_text(ext)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", subj, cwd=out)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(ca / "ca.crt"), "-CAkey", str(ca / "ca.key"),
             "-CAcreateserial", "-CAserial", str(out / "ca.srl"), "-days", "3650", "-extfile", f"{name}.ext",
             "-out", f"{name}.crt", cwd=out)
    stamp.write_text(key)


def make_client_cert(ca: Path, out: Path, name: str, subj: str) -> None:
    _sign(ca, out, name, subj, "extendedKeyUsage=clientAuth\n")


def make_serving_cert(ca: Path, out: Path, name: str, subj: str, sans: list[str]) -> None:
    _sign(ca, out, name, subj, "subjectAltName=" + ",".join(sans) + "\nextendedKeyUsage=serverAuth\n")


def write_kubeconfig(path: Path, server: str, pki: Path, cert: str = "admin") -> None:
    """A kubeconfig for the client certificate `<cert>.crt`/`.key` in `pki` (the admin's unless named)."""
    b64 = lambda p: base64.b64encode((pki / p).read_bytes()).decode()  # noqa: E731
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": "embedops-local",
        "clusters": [{"name": "embedops-local",
                      "cluster": {"server": server, "certificate-authority-data": b64("ca.crt")}}],
        "users": [{"name": "embedops-admin",
                   "user": {"client-certificate-data": b64(f"{cert}.crt"), "client-key-data": b64(f"{cert}.key")}}],
        "contexts": [{"name": "embedops-local",
                      "context": {"cluster": "embedops-local", "user": "embedops-admin"}}],
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    os.chmod(tmp, 0o600)
    tmp.replace(path)
