"""The warm zygote of one pool slot: isolates itself once, preloads the math stack, then forks one child per call.

Issue 3, points 2-4. Started by the server as `python -m sandbox_server.zygote SETTINGS_JSON`. The started process
joins the slot's cgroups, unshares its namespaces and forks PID 1 of the new PID namespace (the zygote proper); it
then only waits, so the zygote dies with it and it dies with the server. PID 1 builds the private file-system view,
imports numpy/sympy with single-threaded BLAS, freezes the heap for cheap copy-on-write forks and serves calls over
its socket: per call it forks a confined child, watches it through a pidfd with the deadline and the output cap,
then kills every other process in its namespace, reaps them and wipes the temp dirs.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import io
import json
import math
import os
import random
import select
import signal
import socket
import sys
import time
import traceback
from typing import Any, NoReturn

from sandbox_server import confinement, exposure, framing, linux, outcome, snippet

_CHUNK = 65536


@dataclasses.dataclass(frozen=True)
class ZygoteSettings:
    """What the server tells a slot's zygote at start (JSON on the command line)."""

    channel_fd: int
    uid: int
    isolate: bool
    cgroup_procs: list[str]
    memory_cgroup: str | None
    tmpfs_size_mb: int
    preload_modules: list[str]
    max_processes: int
    max_open_files: int
    max_file_size_mb: int
    output_cap_bytes: int
    workdir: str


def _warm_up() -> None:
    """Exercise the preloaded math stack once so per-call work finds its caches filled."""
    if "sympy" in sys.modules:
        sympy = sys.modules["sympy"]
        x = sympy.Symbol("x")
        sympy.factorint(2**32 + 1)
        sympy.simplify(sympy.sin(x) ** 2 + sympy.cos(x) ** 2)
        sympy.solve(x**2 - 2, x)
        sympy.Rational(1, 3) + sympy.sqrt(2)
    if "numpy" in sys.modules:
        numpy = sys.modules["numpy"]
        numpy.linalg.solve(numpy.eye(3), numpy.ones(3))
        numpy.random.seed()  # the first call builds lazy state (~50 ms); children reseed in 0.2 ms after this


def _read_oom_kills(memory_cgroup: str | None) -> int:
    if memory_cgroup is None:
        return 0
    with open(os.path.join(memory_cgroup, "memory.oom_control")) as handle:
        for line in handle:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    return 0


def _reseed_random_state() -> None:
    """Forked children inherit the zygote's PRNG state; give each call fresh entropy."""
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _run_child(
    code: str, fds: tuple[int, int, int], limits: confinement.CallLimits, settings: ZygoteSettings
) -> NoReturn:
    """Body of the forked call process: confine, then run the snippet; never returns."""
    exit_code = 1
    try:
        os.setsid()
        linux.set_parent_death_signal(signal.SIGKILL)
        confinement.prefer_for_oom_kill()
        confinement.attach_standard_fds(*fds)
        confinement.apply_rlimits(limits)
        if settings.isolate:
            confinement.enter_private_ipc()
        if os.geteuid() == 0:
            confinement.drop_privileges(settings.uid)
        else:
            linux.set_no_new_privs()
        os.chdir(settings.workdir)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _reseed_random_state()
        sys.argv = [""]
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="backslashreplace")
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True
        )
        exit_code = snippet.run_snippet(code)
    except BaseException:  # noqa: BLE001 - a failed set-up must still end the child, with a reason on stderr
        try:
            os.write(2, ("sandbox set-up failed:\n" + traceback.format_exc()).encode())
        except OSError:
            pass
    os._exit(exit_code)


def _stdin_fd(text: str) -> int:
    fd = os.memfd_create("stdin")
    data = text.encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Capture:
    """Collects one output stream up to the cap; remembers whether anything was cut."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap, self.data, self.overflowed = fd, cap, bytearray(), False

    def feed(self, chunk: bytes) -> None:
        room = self.cap - len(self.data)
        if len(chunk) > room:
            self.overflowed = True
        self.data += chunk[: max(room, 0)]

    def drain(self) -> None:
        """Read what is left without blocking (every writer is dead by now)."""
        os.set_blocking(self.fd, False)
        try:
            while chunk := os.read(self.fd, _CHUNK):
                self.feed(chunk)
                if self.overflowed:
                    break
        except BlockingIOError:
            pass

    def text(self) -> str:
        return self.data.decode("utf-8", "replace")


def _kill_all_but_self(main_pid: int, isolated: bool) -> None:
    """Kill the call's process group and, as PID 1 of the slot's namespace, every other process in it."""
    try:
        os.killpg(main_pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if isolated:
        try:
            os.kill(-1, signal.SIGKILL)  # PID 1 is exempt; setsid escapees and daemons are not
        except ProcessLookupError:
            pass


def _reap_all(isolated: bool) -> None:
    """Collect every leftover child; in the isolated case keep sweeping until the namespace is empty."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if isolated else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if isolated:
            try:
                os.kill(-1, signal.SIGKILL)  # anything forked while the previous sweep ran
            except ProcessLookupError:
                pass


def _watch(pid: int, captures: list[_Capture], deadline: float) -> tuple[bool, bool]:
    """Stream output until the main process exits, the deadline passes or a stream overflows.

    Returns (timed_out, truncated).
    """
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    by_fd = {c.fd: c for c in captures}
    for fd in (*by_fd, pidfd):
        poller.register(fd, select.POLLIN)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True, False
            for fd, _ in poller.poll(max(1, math.ceil(remaining * 1000))):
                if fd == pidfd:
                    return False, False
                chunk = os.read(fd, _CHUNK)
                if not chunk:
                    poller.unregister(fd)
                    continue
                capture = by_fd[fd]
                capture.feed(chunk)
                if capture.overflowed:
                    return False, True
    finally:
        os.close(pidfd)


def _wipe_temp_dirs(settings: ZygoteSettings, view: exposure.ViewPlan | None) -> None:
    """Empty what the call could write to: the private temp dirs (but the interpreter trees grafted into them), or
    the unisolated slot's own folder."""
    if view is None:
        confinement.wipe_directory(settings.workdir)
        return
    for directory in exposure.temp_folders():
        confinement.wipe_directory(directory, view.kept_names(directory))


def supervise_call(request: dict[str, Any], settings: ZygoteSettings, view: exposure.ViewPlan | None) -> dict[str, Any]:
    """Run one call in a confined child and return the `/run` response body; `view` is the isolated zygote's."""
    timeout_s = float(request["timeout_s"])
    limits = confinement.CallLimits(
        memory_mb=int(request["memory_mb"]),
        cpu_seconds=math.ceil(timeout_s) + 1,
        max_processes=settings.max_processes,
        max_open_files=settings.max_open_files,
        max_file_size_mb=settings.max_file_size_mb,
    )
    stdin_fd = _stdin_fd(request.get("stdin", ""))
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    oom_before = _read_oom_kills(settings.memory_cgroup)
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _run_child(request["code"], (stdin_fd, out_w, err_w), limits, settings)
    for fd in (stdin_fd, out_w, err_w):
        os.close(fd)
    captures = [_Capture(out_r, settings.output_cap_bytes), _Capture(err_r, settings.output_cap_bytes)]
    try:
        timed_out, truncated = _watch(pid, captures, started + timeout_s)
        if timed_out or truncated:
            _kill_all_but_self(pid, settings.isolate)
        _, wait_status, usage = os.wait4(pid, 0)
        duration_ms = (time.monotonic() - started) * 1000.0
        _kill_all_but_self(pid, settings.isolate)
        _reap_all(settings.isolate)
        for capture in captures:
            capture.drain()
    finally:
        for capture in captures:
            os.close(capture.fd)
    _wipe_temp_dirs(settings, view)
    observation = outcome.Observation(
        wait_status=wait_status,
        wall_timed_out=timed_out,
        output_truncated=truncated or any(c.overflowed for c in captures),
        oom_killed=_read_oom_kills(settings.memory_cgroup) > oom_before,
        cpu_seconds_used=usage.ru_utime + usage.ru_stime,
        cpu_limit_s=limits.cpu_seconds,
    )
    status, note = outcome.classify(observation)
    stderr = captures[1].text()
    if note:
        stderr = f"{stderr}{'' if not stderr or stderr.endswith(chr(10)) else chr(10)}[sandbox] {note}\n"
    return {
        "status": status,
        "stdout": captures[0].text(),
        "stderr": stderr,
        "exit_code": outcome.exit_code_of(wait_status),
        "duration_ms": round(duration_ms, 3),
    }


def _serve(channel: socket.socket, settings: ZygoteSettings, view: exposure.ViewPlan | None) -> NoReturn:
    while (request := framing.recv_message(channel)) is not None:
        framing.send_message(channel, supervise_call(request, settings, view))
    os._exit(0)


def _prepare(settings: ZygoteSettings) -> exposure.ViewPlan | None:
    """Isolate (PID 1 only), preload and warm the math stack, then freeze the heap for copy-on-write forks.

    Returns the file-system view's plan when isolated (the wipe after each call must keep its grafts)."""
    view = None
    if settings.isolate:
        view = exposure.plan_view(exposure.needed_paths())
        confinement.isolate_zygote(view, settings.tmpfs_size_mb)
    os.makedirs(settings.workdir, exist_ok=True)
    os.chdir(settings.workdir)
    for name in settings.preload_modules:
        importlib.import_module(name)
    _warm_up()
    try:
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write("-1000")  # needs CAP_SYS_RESOURCE; without it the children's +1000 still steers the killer
    except PermissionError:
        pass
    gc.collect()
    gc.freeze()
    return view


def _launch_and_wait(settings: ZygoteSettings, channel: socket.socket) -> NoReturn:
    """The started process: join cgroups, unshare, fork PID 1, and live exactly as long as it."""
    confinement.join_cgroups(settings.cgroup_procs)
    confinement.enter_namespaces()
    child = os.fork()
    if child == 0:
        linux.set_parent_death_signal(signal.SIGKILL)
        _start_serving(settings, channel)
    channel.close()
    _, status = os.waitpid(child, 0)
    os._exit(0 if status == 0 else 1)


def _start_serving(settings: ZygoteSettings, channel: socket.socket) -> NoReturn:
    try:
        view = _prepare(settings)
    except BaseException as exc:  # noqa: BLE001 - report any start-up failure to the server, then die
        framing.send_message(channel, {"fatal": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        os._exit(1)
    framing.send_message(channel, {"ready": True, "pid": os.getpid()})
    _serve(channel, settings, view)


def main(argv: list[str]) -> NoReturn:
    """Entry point: `python -m sandbox_server.zygote SETTINGS_JSON`."""
    settings = ZygoteSettings(**json.loads(argv[1]))
    linux.set_parent_death_signal(signal.SIGKILL)
    channel = socket.socket(fileno=settings.channel_fd)
    try:
        if settings.isolate:
            _launch_and_wait(settings, channel)
    except OSError as exc:
        framing.send_message(channel, {"fatal": f"isolation failed: {exc}", "traceback": traceback.format_exc()})
        os._exit(1)
    _start_serving(settings, channel)


if __name__ == "__main__":
    main(sys.argv)
