"""Flux for the e2e suite: source-controller and kustomize-controller (built from their Go modules by
localcluster's components `source-controller` and `kustomize-controller`) run as local processes against the test cluster, and a Git repository
served over smart HTTP from loopback (`git http-backend` behind a tiny Python HTTP server)."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from localcluster.components import provided
from localcluster.pki import free_port


def binaries() -> dict[str, Path] | None:
    out = {name: provided(name) for name in ("source-controller", "kustomize-controller")}
    return out if all(os.access(p, os.X_OK) for p in out.values()) else None


def crd_files() -> list[Path]:
    bins = binaries() or {}
    files: list[Path] = []
    for p in bins.values():
        files += sorted((p.parent / "crds").glob("*.yaml"))
    return files


def git(*args: str, cwd: Path) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "e2e", "GIT_AUTHOR_EMAIL": "e2e@example.invalid",
           "GIT_COMMITTER_NAME": "e2e", "GIT_COMMITTER_EMAIL": "e2e@example.invalid"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def make_repo(root: Path, files: dict[str, str]) -> Path:
    """A bare repository `root/embedops.git` whose main branch holds `files`."""
    work = root / "work"
    work.mkdir(parents=True)
    git("init", "-q", "-b", "main", cwd=work)
    for rel, text in files.items():
        p = work / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    git("add", ".", cwd=work)
    git("commit", "-q", "-m", "embedops examples", cwd=work)
    bare = root / "embedops.git"
    git("clone", "-q", "--bare", str(work), str(bare), cwd=root)
    git("config", "http.receivepack", "false", cwd=bare)
    return bare


class GitHTTPServer:
    """Smart-HTTP Git server on 127.0.0.1: each request runs `git http-backend` (CGI)."""

    def __init__(self, project_root: Path):
        self.root = project_root
        backend = subprocess.run(["git", "--exec-path"], capture_output=True, text=True, check=True).stdout.strip()
        self.backend = str(Path(backend) / "git-http-backend")
        root, backend_path = self.root, self.backend

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _cgi(self):
                path, _, query = self.path.partition("?")
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                env = {"GIT_PROJECT_ROOT": str(root), "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path,
                       "QUERY_STRING": query, "REQUEST_METHOD": self.command,
                       "CONTENT_TYPE": self.headers.get("Content-Type", ""), "CONTENT_LENGTH": str(len(body)),
                       "REMOTE_ADDR": self.client_address[0], "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
                if self.headers.get("Content-Encoding"):
                    env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
                if self.headers.get("Git-Protocol"):
                    env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
                out = subprocess.run([backend_path], input=body, env=env, capture_output=True).stdout
                head, _, payload = out.partition(b"\r\n\r\n")
                if not _:
                    head, _, payload = out.partition(b"\n\n")
                status = 200
                headers = []
                for line in head.decode("latin-1").splitlines():
                    k, _, v = line.partition(":")
                    if k.lower() == "status":
                        status = int(v.strip().split()[0])
                    elif k:
                        headers.append((k, v.strip()))
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _cgi

        self.port = free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, repo: str) -> str:
        return f"http://127.0.0.1:{self.port}/{repo}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class Controllers:
    """source-controller and kustomize-controller as local processes (stopped by PID on exit)."""

    def __init__(self, kubeconfig: str, workdir: Path, watch_namespace: str):
        self.kubeconfig, self.dir, self.ns = kubeconfig, workdir, watch_namespace
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        bins = binaries()
        assert bins, "Flux controllers not built (python -m localcluster.build source-controller kustomize-controller)"
        storage_port = free_port()
        env = {**os.environ, "KUBECONFIG": self.kubeconfig, "RUNTIME_NAMESPACE": self.ns}
        (self.dir / "storage").mkdir(parents=True, exist_ok=True)
        # controller-runtime reads KUBECONFIG; --watch-all-namespaces=false watches RUNTIME_NAMESPACE
        common = ["--enable-leader-election=false", "--watch-all-namespaces=false", "--log-level=info"]
        specs = {
            "source-controller": [f"--storage-path={self.dir / 'storage'}",
                                  f"--storage-addr=127.0.0.1:{storage_port}",
                                  f"--storage-adv-addr=127.0.0.1:{storage_port}"],
            "kustomize-controller": [],
        }
        for name, extra in specs.items():
            argv = [str(bins[name]), *common, f"--metrics-addr=127.0.0.1:{free_port()}",
                    f"--health-addr=127.0.0.1:{free_port()}", *extra]
            log = open(self.dir / f"{name}.log", "wb")
            self.procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                               cwd=self.dir, start_new_session=True))
            log.close()
        return self

    def logs(self) -> str:
        out = []
        for name in ("source-controller", "kustomize-controller"):
            p = self.dir / f"{name}.log"
            if p.exists():
                out.append(f"--- {name} ---\n" + p.read_text(errors="replace")[-4000:])
        return "\n".join(out)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def __exit__(self, *exc):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def have_git_http_backend() -> bool:
    try:
        ep = subprocess.run(["git", "--exec-path"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return False
    return (Path(ep) / "git-http-backend").exists() and shutil.which("git") is not None
