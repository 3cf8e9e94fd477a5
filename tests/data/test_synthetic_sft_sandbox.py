"""SFT transcripts generated against a real sandbox server (started in its own PID namespace)."""

from __future__ import annotations

import asyncio
import random
import re

import gin
import pytest

from rstar_jax.data.copy_drills import FAULT_STDERR, fault_outcome
from rstar_jax.data.synthetic import synthetic_tasks
from rstar_jax.data.synthetic_sft import DEFAULT_FAULT_KINDS, faulty_version, sft_transcripts
from rstar_jax.processes import running_sandbox
from rstar_jax.tokenizers import load_tokenizer
from sandbox_server.client import SandboxClient

pytestmark = pytest.mark.slow


async def _generate(url: str, tasks, tokenizer, fault_kinds=("name", "syntax")):
    async with SandboxClient([url]) as client:
        return await sft_transcripts(tasks, client, tokenizer, seed=4, faulty_fraction=0.5, fault_kinds=fault_kinds)


def test_transcripts_carry_the_sandbox_real_outputs_and_are_deterministic() -> None:
    tokenizer = load_tokenizer("tiny")
    tasks = synthetic_tasks(8, seed=9, difficulty=2)
    with gin.unlock_config():
        gin.parse_config(["format_tool_response.show_duration = False"])  # run time is the one varying output
    try:
        with running_sandbox(("--workers", "2", "--default-timeout-s", "10")) as server:
            first = asyncio.run(_generate(server.url, tasks, tokenizer))
            second = asyncio.run(_generate(server.url, tasks, tokenizer))
            trailing = asyncio.run(_generate(server.url, tasks, tokenizer, fault_kinds=("trailing",)))
    finally:
        gin.clear_config()

    # A trailing fault: the sandbox reports the failing exit with the answer already on stdout, and the transcript
    # answers from it with no second call.
    assert sum(t.faulty_first_call for t in trailing) == 4
    for transcript in trailing:
        text = tokenizer.decode(list(transcript.trajectory.token_ids))
        [response] = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
        answer = transcript.problem.answer
        if transcript.faulty_first_call:
            assert response in (f"failed (error), exit code 1\nstdout:\n{answer}",
                                f"failed (error), exit code 1\nstdout:\n{answer}\nstderr:\nunchecked"), response
        assert text.endswith(f"<answer>\\boxed{{{answer}}}</answer><|im_end|>")

    assert first == second
    assert sum(t.faulty_first_call for t in first) == 4
    for transcript in first:
        trajectory = transcript.trajectory
        text = tokenizer.decode(list(trajectory.token_ids))
        answer = transcript.problem.answer
        assert text.endswith(f"<answer>\\boxed{{{answer}}}</answer><|im_end|>")
        assert f"<tool_response>\nsucceeded, exit code 0\nstdout:\n{answer}\n</tool_response>" in text
        responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)
        if transcript.faulty_first_call:
            assert [c.status for c in trajectory.tool_calls] == ["error", "ok"]
            assert re.search(r"(SyntaxError|NameError)", responses[0]), responses[0]
            assert responses[0].startswith("failed (error), exit code 1")
        else:
            assert [c.status for c in trajectory.tool_calls] == ["ok"]
        masked = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m]
        assert "<tool_response>" not in tokenizer.decode(masked)


def test_retry_drills_show_the_error_the_sandbox_gives() -> None:
    """The copy drills' retries write each broken program's error without running it (FAULT_STDERR): it must be the
    real server's, word for word, for every broken last line and both program lengths of the synthetic tasks."""
    programs = [faulty_version(code, fault, random.Random(draw))
                for code in ("result = 12 * 34\nprint(result)", "n = 7\nresult = n * 6\nprint(result)")
                for fault in DEFAULT_FAULT_KINDS for draw in range(8)]
    assert {program.splitlines()[-1] for program in programs} == set(FAULT_STDERR)

    async def run_all(url: str) -> list:
        async with SandboxClient([url]) as client:
            return [await client.run(program) for program in programs]

    with running_sandbox(("--workers", "2")) as server:
        outcomes = asyncio.run(run_all(server.url))
    for program, outcome in zip(programs, outcomes):
        expected = fault_outcome(program)
        assert (outcome.status, outcome.stdout, outcome.stderr, outcome.exit_code) == (
            expected.status, expected.stdout, expected.stderr, expected.exit_code), program
