"""Every reference answer in shared/data against itself and against itself plus one (issue 4, item 2; SPEC 3)."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from rstar_jax.data.problem import Problem
from rstar_jax.data.registry import DATASETS, load_problems
from rstar_jax.reward import VerifierPool, normalize_answer
from rstar_jax.reward.exact_numbers import exact_number
from rstar_jax.reward.math_verify_check import math_verify_equal


@pytest.fixture(scope="module")
def problems() -> list[Problem]:
    return [problem for name in DATASETS for problem in load_problems(name).problems]


@pytest.fixture(scope="module")
def pool() -> VerifierPool:
    with VerifierPool(num_workers=2, timeout_s=10.0) as verifier_pool:
        yield verifier_pool


def _latex(value: Fraction) -> str:
    return str(value) if value.denominator == 1 else f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def test_every_reference_verifies_against_itself(problems: list[Problem], pool: VerifierPool) -> None:
    assert len(problems) == 9419
    references = [problem.answer for problem in problems]
    started = time.monotonic()
    results = pool.verify_batch([f"<answer>\\boxed{{{answer}}}</answer>" for answer in references], references)
    print(f"{len(references)} self-verifications in {time.monotonic() - started:.2f} s")
    assert [problem.id for problem, ok in zip(problems, results) if not ok] == []


def test_numeric_references_reject_their_value_plus_one(problems: list[Problem], pool: VerifierPool) -> None:
    numeric = [(problem, exact_number(normalize_answer(problem.answer))) for problem in problems]
    numeric = [(problem, value) for problem, value in numeric if value is not None]
    assert len(numeric) > 7000  # the integer-answer bulk of GSM8K, MATH train and the competitions
    started = time.monotonic()
    results = pool.verify_batch(
        [f"\\boxed{{{_latex(value + 1)}}}" for _, value in numeric], [problem.answer for problem, _ in numeric]
    )
    print(f"{len(numeric)} changed-by-one rejections in {time.monotonic() - started:.2f} s")
    assert [problem.id for (problem, _), accepted in zip(numeric, results) if accepted] == []


def _latex_references(problems: list[Problem], sources: set[str]) -> list[Problem]:
    return [p for p in problems if p.source in sources and exact_number(normalize_answer(p.answer)) is None]


@pytest.mark.parametrize(
    "sources",
    [
        pytest.param({"aime24", "amc23", "aime25", "hmmt25", "math500", "gsm8k"}, id="eval"),
        pytest.param({"math_train"}, id="math_train", marks=pytest.mark.slow),
    ],
)
def test_math_verify_reads_every_latex_reference(problems: list[Problem], sources: set[str]) -> None:
    """Identical strings never reach the checkers (equal normal forms decide first), so math-verify is asked
    directly: it must parse each LaTeX reference (intervals, matrices, tuples, text) and accept it against itself."""
    latex = _latex_references(problems, sources)
    assert len(latex) > 100
    assert [p.id for p in latex if not math_verify_equal(p.answer, p.answer)] == []
