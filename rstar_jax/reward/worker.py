"""The verifier pool's worker process: answers verification requests one at a time under a memory limit.

Workers are forked by the pool's zygote (see `zygote.py`) with the verifier loaded and its parsers warm.
"""

from __future__ import annotations

import pathlib
import resource
from multiprocessing.connection import Connection

from rstar_jax.reward.verifier import verify

READY = "ready"


def _address_space_bytes() -> int:
    """This process's current virtual size (Linux /proc), the baseline the memory limit is added to."""
    pages = int(pathlib.Path("/proc/self/statm").read_text().split()[0])
    return pages * resource.getpagesize()


def _limit_memory(extra_bytes: int) -> None:
    """Caps the worker's address space at its start-up size plus `extra_bytes` (0: no cap), so a blow-up raises
    MemoryError here instead of starving the machine."""
    if extra_bytes:
        limit = _address_space_bytes() + extra_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def serve(connection: Connection, extra_memory_bytes: int, max_answer_chars: int) -> None:
    """Worker loop: announce readiness, then answer `(index, response, reference)` with `(index, bool)`.

    Any failure inside verification (MemoryError, RecursionError, a parser bug) answers False: an answer the
    checkers cannot handle is not a right answer. The loop ends when the pool closes its end of the socket.
    """
    _limit_memory(extra_memory_bytes)
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
