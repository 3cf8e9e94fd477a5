"""A whole eval file and a synthetic batch go through the grain loader, the prompt builder and the verifier.

No model is involved: each problem's response is the assistant turn a perfect model would write (its reference
boxed inside <answer>), appended to the prompt ids by the TrajectoryBuilder and decoded back, so the test covers
loading, prompt ids, piecewise trajectories, answer extraction and verification on every row of real data.
"""

from __future__ import annotations

import re

import pytest

from rstar_jax.agent import FinishReason, TrajectoryBuilder, prompt_text, prompt_token_ids
from rstar_jax.data.pipeline import prompt_batches
from rstar_jax.data.problem import Problem
from rstar_jax.data.registry import load_problems
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.reward import VerifierPool
from rstar_jax.tokenizers import load_tokenizer

pytestmark = pytest.mark.slow

_INTEGER = re.compile(r"-?\d+")


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(num_workers=2, timeout_s=20.0) as verifier_pool:
        yield verifier_pool


def _responses(tokenizer, batch: list[Problem], answers: list[str]) -> list[str]:
    """Prompt ids per problem, then a written answer turn appended piecewise; returns the decoded responses."""
    responses = []
    for problem, answer in zip(batch, answers):
        prompt = prompt_token_ids(tokenizer, problem.question)
        assert tokenizer.decode(prompt) == prompt_text(tokenizer, problem.question)
        builder = TrajectoryBuilder(tokenizer, prompt)
        builder.add_written_turn(f"<reason>Done.</reason>\n<answer>\\boxed{{{answer}}}</answer>")
        trajectory = builder.finish(FinishReason.ANSWERED)
        assert trajectory.answer_tags == 1
        responses.append(tokenizer.decode(list(trajectory.token_ids[trajectory.prompt_length :])))
    return responses


def test_every_math500_problem_is_prompted_and_its_reference_verified(pool: VerifierPool) -> None:
    loaded = load_problems("math500")
    assert len(loaded.problems) == 500 and loaded.skipped.total == 0
    tokenizer = load_tokenizer("qwen2.5")
    seen: list[Problem] = []
    for batch in prompt_batches(loaded.problems, batch_size=128, seed=0):
        answers = [problem.answer for problem in batch]
        rewards = pool.verify_batch(_responses(tokenizer, batch, answers), answers)
        assert all(rewards), [p.answer for p, r in zip(batch, rewards) if not r]
        seen += batch
    assert sorted(p.id for p in seen) == sorted(p.id for p in loaded.problems)

    # Distinct integer references must never be judged equal.
    integers = [p for p in loaded.problems if _INTEGER.fullmatch(p.answer)]
    pairs = [(a, b) for a, b in zip(integers, integers[1:]) if int(a.answer) != int(b.answer)][:60]
    wrong = _responses(tokenizer, [a for a, _ in pairs], [a.answer for a, _ in pairs])
    assert not any(pool.verify_batch(wrong, [b.answer for _, b in pairs]))


def test_a_synthetic_batch_is_prompted_and_verified(pool: VerifierPool) -> None:
    problems = synthetic_problems(32, seed=3, difficulty=2)
    [batch] = list(prompt_batches(problems, batch_size=32, seed=1))
    tokenizer = load_tokenizer("tiny")
    answers = [problem.answer for problem in batch]
    references = [problem.answer for problem in batch]
    assert all(pool.verify_batch(_responses(tokenizer, batch, answers), references))
    off_by_one = [str(int(answer) + 1) for answer in answers]
    assert not any(pool.verify_batch(_responses(tokenizer, batch, off_by_one), references))
