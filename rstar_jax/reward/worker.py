"""The verifier pool's worker process: answers verification requests one at a time under a memory limit.

The pool's forkserver preloads this module and `warm_up`, so sympy and math-verify are loaded and their parsers
built once, and every new worker (including a replacement for a killed one) starts warm in milliseconds.
"""

from __future__ import annotations

import importlib
import resource
import signal
from multiprocessing.connection import Connection

from rstar_jax.reward.verifier import verify

READY = "ready"
WARM_UP_MODULE = "rstar_jax.reward.warm_up"


def _limit_memory(limit_bytes: int | None) -> None:
    """Caps the worker's address space so a blow-up raises MemoryError here instead of starving the machine."""
    if limit_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def run_worker(connection: Connection, memory_limit_bytes: int | None, max_answer_chars: int) -> None:
    """Worker main loop: warm up, announce readiness, then answer `(index, response, reference)` with `(index, bool)`.

    Any failure inside verification (MemoryError, RecursionError, a parser bug) answers False: an answer the
    checkers cannot handle is not a right answer. The loop ends when the pool closes its end of the pipe.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; the pool stops workers
    _limit_memory(memory_limit_bytes)
    importlib.import_module(WARM_UP_MODULE)  # free when the forkserver preloaded it; warms this worker otherwise
    try:
        connection.send(READY)
        while True:
            index, response, reference = connection.recv()
            try:
                equal = verify(response, reference, max_answer_chars)
            except Exception:  # noqa: BLE001 - MemoryError, RecursionError, parser errors: all mean "not verified"
                equal = False
            connection.send((index, equal))
    except (EOFError, OSError):  # the pool closed its end (broken pipe, reset): this worker is no longer needed
        return
