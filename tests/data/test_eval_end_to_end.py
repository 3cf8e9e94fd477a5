"""Must-show of issue 4: a whole eval file and a synthetic batch through loader, grain pipeline, prompt builder and
the batched verifier (SPEC 2 prompt format, SPEC 3 reward)."""

from __future__ import annotations

import pytest

from rstar_jax.agent import TOOL_NAME, prompt_token_ids
from rstar_jax.data.pipeline import prompt_batches
from rstar_jax.data.problem import Problem
from rstar_jax.data.registry import load_problems
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.reward import VerifierPool, normalize_answer
from rstar_jax.reward.exact_numbers import exact_number
from rstar_jax.tokenizers.loading import load_tokenizer


@pytest.fixture(scope="module")
def pool() -> VerifierPool:
    with VerifierPool(num_workers=2, timeout_s=10.0) as verifier_pool:
        yield verifier_pool


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("qwen2.5")


def _responses(batch: list[Problem], first_index: int) -> tuple[list[str], list[bool]]:
    """Every other problem answered right; the rest answered with a value off by one, or with no boxed answer."""
    responses, expected = [], []
    for index, problem in enumerate(batch, start=first_index):
        if index % 2 == 0:
            responses.append(f"<reason>Working.</reason>\n<answer>The result is \\boxed{{{problem.answer}}}.</answer>")
            expected.append(True)
            continue
        value = exact_number(normalize_answer(problem.answer))
        wrong = f"\\boxed{{{value + 1}}}" if value is not None and value.denominator == 1 else "I could not finish."
        responses.append(f"<reason>Working.</reason>\n<answer>{wrong}</answer>")
        expected.append(False)
    return responses, expected


def _run_through(problems: list[Problem], tokenizer, pool: VerifierPool, batch_size: int) -> int:
    seen = 0
    for batch in prompt_batches(problems, batch_size=batch_size, seed=0, num_epochs=1):
        for problem in batch:
            text = tokenizer.decode(prompt_token_ids(tokenizer, problem.question))
            assert TOOL_NAME in text
            assert text.endswith(problem.question + "<|im_end|>\n<|im_start|>assistant\n")
        responses, expected = _responses(batch, seen)
        assert pool.verify_batch(responses, [p.answer for p in batch]) == expected
        seen += len(batch)
    return seen


@pytest.mark.parametrize("name", ["math500", "aime25"])
def test_whole_eval_file_through_loader_prompts_and_verifier(name: str, tokenizer, pool: VerifierPool) -> None:
    loaded = load_problems(name)
    assert loaded.skipped.total == 0
    assert _run_through(list(loaded.problems), tokenizer, pool, batch_size=64) == len(loaded.problems)


def test_synthetic_batch_through_loader_prompts_and_verifier(tokenizer, pool: VerifierPool) -> None:
    problems = synthetic_problems(16, seed=0, difficulty=1)
    assert _run_through(problems, tokenizer, pool, batch_size=8) == 16
