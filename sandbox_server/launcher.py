"""Start a sandbox server as a child process, in its own PID namespace, and wait until it is healthy.

Used by tests, benchmarks and experiments. The server runs under `unshare --pid --fork --kill-child --mount-proc`,
so that even a sandbox failing to contain `os.kill(-1, 9)` or a fork bomb could only hit the server's namespace,
never the caller's session (issue 3, point 7). The namespace is killed with its caller: a script stopped by a signal
that skips its clean-up (SIGTERM, SIGKILL) leaves no server behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (for any local server: sandbox, vLLM)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A running server: its URL and the `unshare` process holding its namespace."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log_path: str) -> None:
        self.process, self.url, self.log_path = process, url, log_path

    def health(self) -> dict[str, object] | None:
        """The /health body, or None when the server does not answer 200."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return json.load(response)
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's combined stdout/stderr, for failure messages."""
        with open(self.log_path, errors="replace") as handle:
            return handle.read()[-chars:]

    def _server_pid(self) -> int | None:
        """The Python server inside the namespace: the only child of the `unshare` process."""
        try:
            with open(f"/proc/{self.process.pid}/task/{self.process.pid}/children") as handle:
                children = handle.read().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server for a graceful shutdown; SIGKILL the namespace if it takes longer than `grace_s`."""
        if self.process.poll() is None:
            server_pid = self._server_pid()
            if server_pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(server_pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.process.kill()  # --kill-child takes the whole namespace down with it
                self.process.wait()


def killed_with_caller(command: Sequence[str]) -> list[str]:
    """`command` run so that the kernel SIGKILLs it when the thread that started it exits (util-linux `setpriv
    --pdeathsig`; the command as it is where setpriv is missing): a caller killed before its clean-up runs leaves
    no orphan behind. Start it from a thread that lives as long as it should (the main thread)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", *command] if setpriv else list(command)


def start_server(
    args: Sequence[str] = (),
    port: int | None = None,
    log_path: str | None = None,
    start_timeout_s: float = 120.0,
    extra_env: dict[str, str] | None = None,
    interpreter: str = sys.executable,
) -> ServerProcess:
    """Start `interpreter -m sandbox_server` with `args` in a fresh PID namespace; return once /health says ok."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("the util-linux 'unshare' binary is required to start the server in a PID namespace")
    port = free_port() if port is None else port
    log_path = log_path or f"/tmp/sandbox-server-{port}.log"
    command = [
        unshare, "--pid", "--fork", "--kill-child", "--mount-proc",
        interpreter, "-m", "sandbox_server", "--host", "127.0.0.1", "--port", str(port), *args,
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            killed_with_caller(command), stdout=log, stderr=subprocess.STDOUT, cwd=_PACKAGE_PARENT,
            env={**os.environ, **(extra_env or {})},
        )
    server = ServerProcess(process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + start_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"sandbox server exited with {process.returncode}:\n{server.log_tail()}")
        health = server.health()
        if health is not None and health.get("status") == "ok":
            return server
        time.sleep(0.2)
    server.stop(grace_s=5)
    raise RuntimeError(f"sandbox server not healthy after {start_timeout_s} s:\n{server.log_tail()}")


@contextlib.contextmanager
def running_server(args: Sequence[str] = (), **kwargs: object) -> Iterator[ServerProcess]:
    """`start_server` as a context manager that always stops the server."""
    server = start_server(args, **kwargs)  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()
