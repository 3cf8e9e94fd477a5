"""Programs the project runs beside itself: free ports, children that die with their caller, servers waited for
until healthy and stopped as a whole (a PID namespace or a process group), and the sandbox server started that way.

One module for the programs the library, the experiments and the tests start: vLLM servers
(`rstar_jax.rollout.vllm_server`), grid points (`rstar_jax.grid.runner`) and the sandbox server (`running_sandbox`).
(The verifier pool's zygote, which forks its workers over a socket and signals them by pidfd, is its own thing:
`rstar_jax.reward.pool`.)
The sandbox server is a separate program: it is started by its command line (`python -m sandbox_server`), so
nothing here imports it, and `sandbox_server` imports nothing of `rstar_jax` (it stays a standalone program).
Standard library only (besides `rstar_jax.paths`), so the sandbox tests import it without the learner's dependencies.
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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from rstar_jax.paths import REPO_ROOT

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local servers never go through a proxy


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now (for any local server: sandbox, vLLM)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def killed_with_caller(command: Sequence[str]) -> list[str]:
    """`command` run so that the kernel SIGKILLs it when the thread that started it exits (util-linux `setpriv
    --pdeathsig`; the command as it is where setpriv is missing): a caller killed before its clean-up runs leaves
    no orphan behind. Start it from a thread that lives as long as it should (the main thread)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", *command] if setpriv else list(command)


def in_pid_namespace(command: Sequence[str]) -> list[str]:
    """`command` run in a fresh PID namespace (`unshare --pid --fork --kill-child --mount-proc`): nothing it does
    (`os.kill(-1, 9)`, a fork bomb) reaches processes outside it, and killing the `unshare` process ends it all."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("the util-linux 'unshare' binary is required to start a server in a PID namespace")
    return [unshare, "--pid", "--fork", "--kill-child", "--mount-proc", *command]


def cpu_list(cpus: Sequence[int]) -> str:
    """CPU ids in the comma-separated form taskset and VLLM_CPU_OMP_THREADS_BIND read ("0,2,3")."""
    if not cpus or any(int(cpu) < 0 for cpu in cpus):
        raise ValueError(f"cpus must be a non-empty list of CPU ids, got {list(cpus)}")
    return ",".join(str(int(cpu)) for cpu in cpus)


def pinned_command(command: Sequence[str], cpus: Sequence[int]) -> list[str]:
    """`command` run under `taskset`, so it and every process it starts may only use `cpus` (a vLLM server on a
    CPU box, `vllm_server.start_server`; demos side by side, `experiments.demo_seeds`)."""
    taskset = shutil.which("taskset")
    if taskset is None:
        raise RuntimeError("pinning a process to CPUs needs taskset (Debian package util-linux)")
    return [taskset, "--cpu-list", cpu_list(cpus), *command]


def start_logged(command: Sequence[str], log_path: str | os.PathLike, env: dict[str, str] | None = None,
                 cwd: str | os.PathLike | None = None, new_session: bool = False) -> subprocess.Popen[bytes]:
    """Start `command` as a child that dies with its caller (`killed_with_caller`), its stdout and stderr both
    written to `log_path`; `new_session` makes it the leader of a process group of its own (see
    `stop_process_group`)."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(killed_with_caller(command), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=new_session)


def log_tail(log_path: str | os.PathLike, chars: int = 4000) -> str:
    """The end of a log file, for failure messages ("" when it cannot be read)."""
    with contextlib.suppress(OSError):
        return Path(log_path).read_text(errors="replace")[-chars:]
    return ""


def http_get(url: str, timeout_s: float = 5.0) -> bytes | None:
    """The body of GET `url` when it answers 200 (directly, never through a proxy); None otherwise."""
    try:
        with _DIRECT.open(url, timeout=timeout_s) as response:
            return response.read() if response.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def wait_until_healthy(process: subprocess.Popen, healthy: Callable[[], bool], name: str,
                       log_path: str | os.PathLike, timeout_s: float, poll_s: float = 0.2) -> None:
    """Poll `healthy()` every `poll_s` seconds until it is true. Raises RuntimeError naming `name`, with the end of
    its log, when `process` exits first or `timeout_s` passes (the caller stops what is left)."""
    deadline = time.monotonic() + timeout_s
    while not healthy():
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not healthy after {timeout_s:g} s:\n{log_tail(log_path)}")
        time.sleep(poll_s)


def kill_process_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group `process` leads (started with `new_session=True`) at once, and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def stop_process_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group `process` leads for a clean shutdown; SIGKILL it if that takes longer than
    `grace_s`; then SIGKILL whatever of the group outlived its leader (children share its group id)."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            kill_process_group(process)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def namespace_leader(process: subprocess.Popen) -> int | None:
    """The program an `in_pid_namespace` command runs: the only child of its `unshare` process (None once gone)."""
    try:
        with open(f"/proc/{process.pid}/task/{process.pid}/children") as handle:
            children = handle.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


def stop_pid_namespace(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the program in `process`'s PID namespace for a graceful shutdown; SIGKILL the namespace (`process`,
    the `unshare` holding it: --kill-child takes everything in it down) if it takes longer than `grace_s`."""
    if process.poll() is None:
        leader = namespace_leader(process)
        if leader is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(leader, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ---- the sandbox server, a program of its own --------------------------------------------------------------------


class SandboxProcess:
    """A running sandbox server: its URL, log and the `unshare` process holding its PID namespace."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log_path: str) -> None:
        self.process, self.url, self.log_path = process, url, log_path

    def health(self) -> dict[str, Any] | None:
        """The /health body, or None when the server does not answer 200."""
        body = http_get(self.url + "/health")
        try:
            return None if body is None else json.loads(body)
        except ValueError:
            return None

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's combined stdout/stderr, for failure messages."""
        return log_tail(self.log_path, chars)

    def server_pid(self) -> int | None:
        """The Python server inside the namespace."""
        return namespace_leader(self.process)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the server for a graceful shutdown; SIGKILL the namespace if it takes longer than `grace_s`."""
        stop_pid_namespace(self.process, grace_s)


def start_sandbox(args: Sequence[str] = (), port: int | None = None, log_path: str | None = None,
                  start_timeout_s: float = 120.0, extra_env: dict[str, str] | None = None,
                  interpreter: str = sys.executable) -> SandboxProcess:
    """Start `interpreter -m sandbox_server` with `args` in a fresh PID namespace; return once /health says ok.

    The namespace dies with its caller: even a sandbox failing to contain `os.kill(-1, 9)` or a fork bomb could
    only hit the server's namespace, never the caller's session (issue 3, point 7), and a caller stopped by a
    signal that skips its clean-up (SIGTERM, SIGKILL) leaves no server behind."""
    port = free_port() if port is None else port
    log_path = log_path or f"/tmp/sandbox-server-{port}.log"
    command = in_pid_namespace([interpreter, "-m", "sandbox_server", "--host", "127.0.0.1", "--port", str(port), *args])
    process = start_logged(command, log_path, env={**os.environ, **(extra_env or {})}, cwd=REPO_ROOT)
    server = SandboxProcess(process, f"http://127.0.0.1:{port}", log_path)

    def ok() -> bool:
        health = server.health()
        return health is not None and health.get("status") == "ok"

    try:
        wait_until_healthy(process, ok, "sandbox server", log_path, start_timeout_s)
    except RuntimeError:
        server.stop(grace_s=5)
        raise
    return server


@contextlib.contextmanager
def running_sandbox(args: Sequence[str] = (), **kwargs: Any) -> Iterator[SandboxProcess]:
    """`start_sandbox` as a context manager that always stops the server."""
    server = start_sandbox(args, **kwargs)
    try:
        yield server
    finally:
        server.stop()
