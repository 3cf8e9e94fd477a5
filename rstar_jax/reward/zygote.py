"""The verifier pool's zygote: a warm interpreter that forks a worker process whenever the pool asks for one.

The zygote is started once per pool as a fresh interpreter (never a fork of the trainer, which runs JAX's threads,
and never a spawn that re-imports the trainer's main module): it imports the verifier, warms its parsers, then forks.
A forked worker starts in milliseconds with warm parsers, so a worker killed for running past its time limit is
replaced at once. Workers are this process's children; it ignores SIGCHLD so the kernel reaps them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from multiprocessing.connection import Connection

FORK_REQUEST = b"f"
_PID_BYTES = 8


def zygote_command(control_fd: int, extra_memory_bytes: int | None, max_answer_chars: int) -> list[str]:
    """The command line that starts a zygote serving fork requests on the (inherited) socket `control_fd`."""
    code = "import sys; from rstar_jax.reward.zygote import main; main(sys.argv[1:])"
    return [sys.executable, "-c", code, str(control_fd), str(extra_memory_bytes or 0), str(max_answer_chars)]


def request_worker(control: socket.socket) -> tuple[int, int, Connection]:
    """Pool side: asks the zygote for a new worker; returns its pid, a pidfd to signal it, and its connection."""
    control.sendall(FORK_REQUEST)
    message, fds, _, _ = socket.recv_fds(control, _PID_BYTES, 2)
    if len(message) != _PID_BYTES or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        raise RuntimeError("the verifier zygote exited; its error output is above")
    pidfd, connection_fd = fds
    return int.from_bytes(message, "little"), pidfd, Connection(connection_fd)


def _fork_worker(control: socket.socket, extra_memory_bytes: int, max_answer_chars: int) -> None:
    """Forks one worker connected by a fresh socket pair and hands the pool its end, its pid and a pidfd."""
    from rstar_jax.reward.worker import serve

    pool_end, worker_end = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        try:
            control.close()
            pool_end.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            serve(Connection(worker_end.detach()), extra_memory_bytes, max_answer_chars)
        finally:
            os._exit(0)
    worker_end.close()
    pidfd = os.pidfd_open(pid)
    try:
        socket.send_fds(control, [pid.to_bytes(_PID_BYTES, "little")], [pidfd, pool_end.fileno()])
    finally:
        os.close(pidfd)
        pool_end.close()


def serve_forks(control: socket.socket, extra_memory_bytes: int, max_answer_chars: int) -> None:
    """Zygote loop: warm up once, then fork a worker per request until the pool closes the control socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; the pool stops the zygote
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps exited workers
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout disabled" notice: the pool times items
    import rstar_jax.reward.warm_up  # noqa: F401 - builds the checkers' parsers once, inherited by every fork

    while control.recv(1) == FORK_REQUEST:
        _fork_worker(control, extra_memory_bytes, max_answer_chars)


def main(argv: list[str]) -> None:
    """Entry point of `zygote_command`: control socket fd, extra memory bytes per worker, max answer characters."""
    control_fd, extra_memory_bytes, max_answer_chars = (int(arg) for arg in argv)
    with socket.socket(fileno=control_fd) as control:
        serve_forks(control, extra_memory_bytes, max_answer_chars)
