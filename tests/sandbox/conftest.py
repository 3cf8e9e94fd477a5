"""A real sandbox server for the sandbox tests, started once per session in its own PID namespace."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandbox_http import SERVER_SECRET, SERVER_UID_BASE

from rstar_jax.processes import SandboxProcess, start_sandbox

SERVER_ARGS = ("--workers", "4", "--default-timeout-s", "5", "--max-queue", "5000", "--uid-base", str(SERVER_UID_BASE))


@pytest.fixture(scope="session")
def sandbox() -> Iterator[SandboxProcess]:
    server = start_sandbox(SERVER_ARGS, extra_env=dict([SERVER_SECRET]))
    try:
        yield server
    finally:
        server.stop()
