"""Primes are part of a symbol: `E'` is not `E` whichever way they are spelled (issue 14; SPEC 3)."""

from __future__ import annotations

import pytest

from rstar_jax.reward import answers_equivalent, normalize_answer
from rstar_jax.reward.math_verify_check import math_verify_equal
from rstar_jax.reward.primes import canonical_primes, has_prime


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("x^{\\prime}", "x'"),
        ("x^\\prime", "x'"),
        ("x^{ \\prime }", "x'"),
        ("x^{\\prime\\prime}", "x''"),
        ("x^{\\prime \\prime \\prime}", "x'''"),
        ("x^{''}", "x''"),
        ("x\\prime", "x'"),
        ("f^{\\prime}(x)", "f'(x)"),
        ("A^{\\prime}B^\\prime", "A'B'"),
        ("x'", "x'"),
        ("x^{2}", "x^{2}"),
        ("x^2", "x^2"),
        ("\\primes", "\\primes"),  # another command, not \prime
    ],
)
def test_canonical_primes(raw: str, canonical: str) -> None:
    assert canonical_primes(raw) == canonical


@pytest.mark.parametrize(
    ("raw", "normal"),
    [("E′", "E'"), ("f″(x)", "f''(x)"), ("y‴", "y'''"), ("$f^{\\prime}(x)$", "f'(x)"), ("f ' (x)", "f'(x)")],
)
def test_normal_forms_spell_primes_as_apostrophes(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize(("normal", "primed"), [("x'", True), ("f''(x)", True), ("x", False), ("x^2", False)])
def test_has_prime(normal: str, primed: bool) -> None:
    assert has_prime(normal) is primed


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("E'", "E"),
        ("x'", "x"),
        ("x^{\\prime}", "x"),
        ("x^\\prime", "x"),
        ("x''", "x'"),
        ("x^{\\prime\\prime}", "x^{\\prime}"),
        ("A'B'", "AB"),
        ("B'C'", "BC"),
        ("A'B", "AB'"),
        ("f'(x)", "f(x)"),
        ("f''(x)", "f(x)"),
        ("f''(x)", "f'(x)"),
        ("2'", "2"),
        ("30'", "30^\\circ"),  # 30 arcminutes are half a degree
        ("x'-x", "x-x'"),  # the same primed symbols, in a different expression
        ("E'", "e'"),  # case is kept: E and e are different points
    ],
)
def test_a_dropped_or_moved_prime_is_rejected(answer: str, reference: str) -> None:
    assert not answers_equivalent(answer, reference)
    assert not answers_equivalent(reference, answer)


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("x'", "x^{\\prime}"),
        ("x''", "x^{\\prime\\prime}"),
        ("f'(x)", "f^{\\prime}(x)"),
        ("A'B'", "A^\\prime B^\\prime"),
        ("E′", "E'"),
        ("x\\prime", "x'"),
        ("\\left(x'\\right)", "(x')"),
    ],
)
def test_the_same_primes_spelled_differently_are_accepted(answer: str, reference: str) -> None:
    assert answers_equivalent(answer, reference)
    assert answers_equivalent(reference, answer)


def test_primed_answers_match_by_spelling_only() -> None:
    """The price of not trusting the checkers with primes: a reordered sum of primed symbols is rejected."""
    assert not answers_equivalent("x'+y'", "y'+x'")


def test_math_verify_still_drops_primes() -> None:
    """The upstream bug the prime rule guards against (math-verify 0.9.0, latex2sympy2_extended 1.11.0)."""
    assert math_verify_equal("E'", "E")
    assert math_verify_equal("f'(x)", "f(x)")
    assert math_verify_equal("B'C'", "BC")
