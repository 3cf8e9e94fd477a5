"""A reusable pool of verifier processes with a per-item time limit (issue 4, item 1; SPEC 3 verification).

math-verify and sympy can hang or exhaust memory on adversarial answers (`9^{9^{9^{9}}}`), and neither can be
interrupted from inside Python once deep in C arithmetic. So each item runs in a worker process with an address-space
limit; the pool hands one item at a time to each idle worker, and a worker still busy when its item's time is up is
killed and replaced, that item counting as not equal. The trainer never blocks longer than the limit per item.

Workers are forked by a zygote, a fresh interpreter with warm parsers (see `zygote.py`), so a replacement is ready in
milliseconds and no worker carries the trainer's JAX threads or re-imports its main module.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait

import gin

from rstar_jax.reward import worker as worker_module
from rstar_jax.reward import zygote
from rstar_jax.reward.verifier import DEFAULT_MAX_ANSWER_CHARS

_STOP_TIMEOUT_S = 5.0
_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])


@dataclasses.dataclass
class _Worker:
    pid: int
    pidfd: int  # signals exactly this process, even after its pid is reused
    connection: Connection
    ready: bool = False
    item: int | None = None
    deadline: float = math.inf

    def kill(self) -> None:
        """Stops the process at once (a hung item) and releases its descriptors."""
        try:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone
        os.close(self.pidfd)
        self.connection.close()


def _worker_environment() -> dict[str, str]:
    """The parent's environment with this checkout importable, so the zygote loads the same `rstar_jax`."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, environment.get("PYTHONPATH")]))
    return environment


def _validated_pairs(responses: Sequence[str], references: Sequence[str]) -> list[tuple[str, str]]:
    """Checks the batch's shape and types, naming the first problem found."""
    if len(responses) != len(references):
        raise ValueError(f"verify_batch got {len(responses)} responses but {len(references)} references")
    for index, (response, reference) in enumerate(zip(responses, references)):
        if not isinstance(response, str) or not isinstance(reference, str):
            raise TypeError(
                f"verify_batch item {index}: response and reference must be str, got "
                f"{type(response).__name__} and {type(reference).__name__}"
            )
    return list(zip(responses, references))


@gin.configurable
class VerifierPool:
    """Worker processes that verify (response, reference) pairs in parallel, each item under a time limit.

    Create it once and reuse it (workers stay warm between batches); `close()` or a `with` block stops them.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        timeout_s: float = 10.0,
        memory_limit_mb: int | None = 2048,
        max_answer_chars: int = DEFAULT_MAX_ANSWER_CHARS,
        start_timeout_s: float = 120.0,
    ) -> None:
        """`num_workers` defaults to the CPU count; `timeout_s` is the default per-item limit of `verify_batch`;
        `memory_limit_mb` is the address space each worker may add to its start-up size (None: no cap); answers
        longer than `max_answer_chars` are rejected unparsed; `start_timeout_s` bounds the wait for workers."""
        self.num_workers = (os.cpu_count() or 1) if num_workers is None else num_workers
        if self.num_workers < 1:
            raise ValueError(f"VerifierPool needs at least one worker, got num_workers={num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"VerifierPool timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self.workers_replaced = 0
        self._closed = False
        self._control, zygote_end = socket.socketpair()
        with zygote_end:
            extra_memory_bytes = memory_limit_mb * 2**20 if memory_limit_mb else None
            self._zygote = subprocess.Popen(
                zygote.zygote_command(zygote_end.fileno(), extra_memory_bytes, max_answer_chars),
                pass_fds=(zygote_end.fileno(),),
                env=_worker_environment(),
                stdin=subprocess.DEVNULL,
            )
        self._workers: list[_Worker] = []
        try:
            self._workers = [self._start_worker() for _ in range(self.num_workers)]
            self._await_ready()
        except BaseException:
            self.close()
            raise

    def _start_worker(self) -> _Worker:
        """A new worker forked by the zygote (the first request waits for the zygote to warm up)."""
        pid, pidfd, connection = zygote.request_worker(self._control)
        return _Worker(pid=pid, pidfd=pidfd, connection=connection)

    def _await_ready(self) -> None:
        """Blocks until every first worker has started, so start-up problems surface at construction."""
        deadline = time.monotonic() + self._start_timeout_s
        while not all(w.ready for w in self._workers):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"verifier workers did not start within {self._start_timeout_s} s")
            starting = [w for w in self._workers if not w.ready]
            for connection in wait([w.connection for w in starting], timeout=remaining):
                self._receive_ready(next(w for w in starting if w.connection is connection))

    def _receive_ready(self, worker: _Worker) -> None:
        """Takes a starting worker's READY message, or explains why it died instead."""
        try:
            message = worker.connection.recv()
        except (EOFError, OSError):
            raise RuntimeError("a verifier worker exited while starting; its error output is above") from None
        if message != worker_module.READY:
            raise RuntimeError(f"a starting verifier worker sent {message!r} instead of {worker_module.READY!r}")
        worker.ready = True

    def _replace(self, worker: _Worker) -> None:
        """Kills `worker` (hung, crashed or out of memory) and puts a fresh fork in its slot."""
        worker.kill()
        self._workers[self._workers.index(worker)] = self._start_worker()
        self.workers_replaced += 1

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (for monitoring their resource use and limits)."""
        return [worker.pid for worker in self._workers]

    def verify(self, response: str, reference: str) -> bool:
        """One pair through the pool, under the default time limit."""
        return self.verify_batch([response], [reference])[0]

    def verify_batch(
        self, responses: Sequence[str], references: Sequence[str], timeout_s: float | None = None
    ) -> list[bool]:
        """SPEC 3 rewards for a batch: item i is whether `responses[i]`'s final answer equals `references[i]`.

        Each item gets at most `timeout_s` seconds (default: the pool's) of a worker's time; an item that runs
        out, crashes its worker or exhausts its memory is False, and its worker is replaced. Thread-safe.
        """
        pairs = _validated_pairs(responses, references)
        limit = self.timeout_s if timeout_s is None else timeout_s
        if limit <= 0:
            raise ValueError(f"verify_batch timeout_s must be positive, got {timeout_s}")
        with self._lock:
            if self._closed:
                raise RuntimeError("verify_batch on a closed VerifierPool")
            return self._run(pairs, limit)

    def _dispatch(self, pending: deque[int], pairs: list[tuple[str, str]], limit: float) -> None:
        """Hands the next pending items to idle ready workers, starting each item's clock."""
        for worker in list(self._workers):
            if pending and worker.ready and worker.item is None:
                item = pending.popleft()
                try:
                    worker.connection.send((item, *pairs[item]))
                except OSError:  # it died while idle: replace it and hand the item to the next worker
                    pending.appendleft(item)
                    self._replace(worker)
                    continue
                worker.item, worker.deadline = item, time.monotonic() + limit

    def _run(self, pairs: list[tuple[str, str]], limit: float) -> list[bool]:
        results = [False] * len(pairs)
        pending = deque(range(len(pairs)))
        while pending or any(w.item is not None for w in self._workers):
            self._dispatch(pending, pairs, limit)
            next_deadline = min((w.deadline for w in self._workers if w.item is not None), default=math.inf)
            wait_s = min(max(0.0, next_deadline - time.monotonic()), self._start_timeout_s)
            watched = list(self._workers)
            for connection in wait([w.connection for w in watched], timeout=wait_s):
                worker = next(w for w in watched if w.connection is connection)
                if not worker.ready:
                    self._receive_ready(worker)
                    continue
                try:
                    index, equal = connection.recv()
                except (EOFError, OSError):  # the worker died (segfault, killed by the OS)
                    self._replace(worker)  # its item, if any, stays False
                    continue
                results[index] = equal
                worker.item, worker.deadline = None, math.inf
            now = time.monotonic()
            for worker in [w for w in self._workers if w.item is not None and w.deadline <= now]:
                self._replace(worker)  # its item stays False
        return results

    def close(self) -> None:
        """Stops the workers and the zygote."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                worker.kill()
            self._control.close()  # the zygote exits when its control socket closes
            try:
                self._zygote.wait(_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._zygote.kill()
                self._zygote.wait(_STOP_TIMEOUT_S)

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
