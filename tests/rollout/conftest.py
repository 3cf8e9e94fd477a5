"""Fixtures shared by the rollout tests that run a real sandbox and the tiny tool-calling model.

Module-scoped: each test module starts its own sandbox server and loads (training once per session, into the
session's base temp dir) the model of `agent_loop_fixtures.tool_calling_model`.
"""

from __future__ import annotations

from typing import Iterator

import pytest

from agent_loop_fixtures import SANDBOX_ARGS, tool_calling_model
from rstar_jax.model import CausalLM
from rstar_jax.processes import SandboxProcess, running_sandbox


@pytest.fixture(scope="module")
def sandbox() -> Iterator[SandboxProcess]:
    """A real sandbox server (in its own pid namespace) for one test module."""
    with running_sandbox(SANDBOX_ARGS) as server:
        yield server


@pytest.fixture(scope="module")
def model(sandbox: SandboxProcess, tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """The tiny model trained to call the tool (trained on the first request of a session, then reloaded)."""
    return tool_calling_model(tmp_path_factory.getbasetemp() / "tool-calling-model", sandbox.url)
