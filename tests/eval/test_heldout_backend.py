"""Held-out evaluation runs on the engines of the `RolloutBackend` it is given (issue 25 item 4): the backend's
choice (here two JAX engines behind SPEC 6's balancer) reaches evaluation, prompts that do not fit the backend's
slots are refused before any engine starts, and the figures are the verifier's verdicts on real trajectories.

The model is the rollout tests' tiny tool-calling model (tests/rollout/agent_loop_fixtures.py, trained once a
session): after any question it calls the tool with `print(6 * 7)` and answers \\boxed{42}. Three of the four
held-out problems here have the reference 42, so greedy decoding scores exactly 3 / 4.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import gin
import pytest

from rstar_jax.data.problem_source import ProblemSource
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.eval.heldout import HeldOutEval
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import CausalLM
from rstar_jax.processes import running_sandbox
from rstar_jax.rollout.backends import RolloutBackend, RolloutEngines
from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.tokenizers import load_tokenizer
from tests.rollout.agent_loop_fixtures import BUDGET, MAX_TURNS, SANDBOX_ARGS, tool_calling_model

ANSWERS = ("42", "42", "42", "7")  # the model's answer, three times, and one it never gives
# Two prefill shapes (prompts ~330 tokens, later turns' contexts up to ~850) and two decode windows to compile.
ENGINE_SHAPES = ("JaxEngine.prefill_buckets = (512, 1024)", "JaxEngine.decode_windows = (512, 1024)")


class RecordingBackend(RolloutBackend):
    """`RolloutBackend` as configured, keeping the engines each `start` returned."""

    def start(self, *args: Any, **kwargs: Any) -> RolloutEngines:
        engines = super().start(*args, **kwargs)
        STARTED.append(engines)
        return engines


STARTED: list[RolloutEngines] = []


@pytest.fixture(autouse=True)
def engine_shapes() -> Iterator[None]:
    gin.clear_config()
    parse_gin([], ENGINE_SHAPES)
    STARTED.clear()
    yield
    gin.clear_config()


@pytest.fixture(scope="module")
def sandbox_url() -> Iterator[str]:
    with running_sandbox(SANDBOX_ARGS) as server:
        yield server.url


@pytest.fixture(scope="module")
def heldout_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four new synthetic questions (seed 23, not the model's training seed 11) with the references of ANSWERS, as
    the JSONL file a `ProblemSource` loads."""
    path = tmp_path_factory.mktemp("heldout") / "heldout.jsonl"
    rows = [{"id": index, "problem": problem.question, "answer": answer}
            for index, (problem, answer) in enumerate(zip(synthetic_problems(len(ANSWERS), seed=23), ANSWERS))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _evaluation(heldout_file: Path) -> HeldOutEval:
    return HeldOutEval(problems=ProblemSource(source=str(heldout_file)), samples=3, temperature=1.0, greedy=True,
                       max_turns=MAX_TURNS, max_response_tokens=BUDGET, seed=5)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_held_out_evaluation_runs_on_two_jax_engines_behind_the_balancer(heldout_file: Path, sandbox_url: str,
                                                                         verifier, tmp_path: Path,
                                                                         tmp_path_factory: pytest.TempPathFactory
                                                                         ) -> None:
    model: CausalLM = tool_calling_model(tmp_path_factory.getbasetemp() / "tool-calling-model", sandbox_url)
    # 4 slots an engine: the 12 sampled trajectories' first turns cannot all fit one engine, nor both at once
    backend = RecordingBackend(router="balancer", jax_engines=2, slots=4, max_len=1024)
    results = _evaluation(heldout_file).run(model.config, model.params, "tiny", load_tokenizer("tiny"),
                                            [sandbox_url], verifier, backend, tmp_path)

    # the backend's engines ran the evaluation: started once for both modes, the balancer over two JAX engines, each
    # of which took prompts, and turns queued in the balancer when the 8 slots were full
    assert len(STARTED) == 1
    router = STARTED[0].engine
    assert type(router) is Balancer and len(router.engines) == 2
    assert all(isinstance(engine, JaxEngine) for engine in router.engines)
    served = [engine.prefills + engine.copies for engine in router.engines]
    assert min(served) > 0, served
    assert router.queued_requests > 0 and router.down == {}
    assert router.in_flight == (0, 0) and router.reserved == (0, 0)

    assert set(results) == {"sampled", "greedy"}
    greedy, sampled = results["greedy"], results["sampled"]
    # greedy: every problem answered 42 after one tool call; three references are 42
    assert greedy.summary["problems"] == 4 and greedy.summary["samples"] == 1 and len(greedy.samples) == 4
    assert greedy.correct == [True, True, True, False]
    assert greedy.summary["accuracy"] == greedy.summary["pass_at_k"] == 0.75
    assert greedy.summary["tool_calls"] == 1.0 and greedy.summary["finish_reasons"] == {"answered": 4}
    assert [record["correct"] for record in greedy.problems] == [1, 1, 1, 0]
    # sampled at T=1: 3 per problem, the figures are the verdicts' (avg@3: mean of per-problem shares)
    assert sampled.summary["problems"] == 4 and sampled.summary["samples"] == 3 and len(sampled.samples) == 12
    assert [(s.group, s.sample) for s in sampled.samples] == [(g, k) for g in range(4) for k in range(3)]
    per_problem = [record["correct"] for record in sampled.problems]
    assert per_problem == [sum(sampled.correct[3 * g:3 * g + 3]) for g in range(4)]
    assert per_problem[3] == 0, "no trajectory answers 7"
    assert sampled.summary["accuracy"] == pytest.approx(sum(per_problem) / 12)
    assert sampled.summary["pass_at_k"] == pytest.approx(sum(count > 0 for count in per_problem) / 4)
    assert sum(per_problem[:3]) >= 6, f"the model mostly follows its transcript at T=1: {per_problem}"


def test_prompts_that_do_not_fit_the_backend_are_refused_before_any_engine_starts(heldout_file: Path,
                                                                                  verifier) -> None:
    backend = RecordingBackend(slots=4, max_len=600)  # ~330-token prompts + 512 response tokens do not fit 600
    with pytest.raises(ValueError, match=r"exceeds the engine's 600 tokens.*HeldOutEval\.max_response_tokens"):
        _evaluation(heldout_file).run(None, None, "tiny", load_tokenizer("tiny"), ["http://127.0.0.1:9"], verifier,
                                      backend, "unused")
    assert STARTED == []
