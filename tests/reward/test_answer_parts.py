"""The verifier's parts one by one: extraction, normalisation, exact numbers and each checker (SPEC 3)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rstar_jax.reward import Verifier, VerifierPool, answers_equivalent, extract_final_answer, normalize_answer
from rstar_jax.reward.exact_numbers import exact_number, exact_numbers_equal
from rstar_jax.reward.math_verify_check import math_verify_equal
from rstar_jax.reward.normalization import is_text_answer
from rstar_jax.reward.sympy_check import sympy_equal


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("<answer>\\boxed{3}</answer> \\boxed{4}", "3"),
        ("<answer>\\boxed{3}", "3"),  # unclosed answer tag: its block runs to the end
        ("<answer>no box</answer> \\boxed{4}", "4"),
        ("\\boxed 5.", "5."),
        ("\\boxed \\pi", "\\pi"),
        ("\\fbox{7}", "7"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
        ("\\boxed{ \\text{(B)} }", "\\text{(B)}"),
        ("$\\boxed{x}$", "x"),
        ("\\boxed{a{b{c}}d}", "a{b{c}}d"),
    ],
)
def test_extract_final_answer(response: str, answer: str) -> None:
    assert extract_final_answer(response) == answer


@pytest.mark.parametrize("response", ["no box at all", "\\boxed{1", "\\boxedfoo{1}", "\\boxed{" + "{" * 10000])
def test_extract_final_answer_none(response: str) -> None:
    assert extract_final_answer(response) is None


def test_extraction_of_10000_nested_braces_is_linear() -> None:
    nested = "{" * 10000 + "1" + "}" * 10000
    assert extract_final_answer(f"\\boxed{{{nested}}}") == nested


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("1,000", "1000"),
        ("1 000", "1000"),
        ("-1,234.50", "-1234.5"),
        ("10{,}000", "10000"),
        ("11,\\! 111,\\! 100", "11111100"),
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("50\\%", "50"),
        ("30^{\\circ}", "30"),
        ("5 \\text{ cm}", "5"),
        ("864 \\mbox{ inches}^2", "864"),
        ("\\text{Evelyn}", "Evelyn"),
        ("x = \\frac{1}{2}", "\\frac{1}{2}"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("\\pi r^2", "\\pi r^2"),
        ("27.0", "27"),
        (".5", "0.5"),
        ("\\$18.", "18"),
        ("2, 3, \\text{ and } 4", "2,3,4"),
        ("−5", "-5"),
        ("2π", "2\\pi"),
        ("6, 8\\text{, and }10", "6,8,10"),
        ("x=2 \\text{ or } x=3", "2,3"),
        ("y = 2x + 3", "2x+3"),
        ("x_1 = 1, x_2 = -1", "1,-1"),
        ("x + y = 5", "x+y=5"),
        ("1,2", "1,2"),
    ],
)
def test_normalize_answer(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("12", Fraction(12)),
        ("-0.25", Fraction(-1, 4)),
        ("\\frac{3}{6}", Fraction(1, 2)),
        ("-7/2", Fraction(-7, 2)),
        ("\\frac{1}{0}", None),
        ("0.\\overline{6}", Fraction(2, 3)),
        ("0.1\\overline{6}", Fraction(1, 6)),
        ("-1.\\overline{142857}", Fraction(-8, 7)),
        ("\\sqrt{2}", None),
        ("1,000", None),
    ],
)
def test_exact_number(text: str, value: Fraction | None) -> None:
    assert exact_number(text) == value


@pytest.mark.parametrize(
    ("answer", "reference", "decision"),
    [("3", "3", True), ("0.5", "\\frac{1}{2}", True), ("4", "3", False), ("\\frac{1}{3}", "\\frac{1}{2}", False),
     ("0.333", "\\frac{1}{3}", None), ("x", "3", None)],
)
def test_exact_numbers_equal(answer: str, reference: str, decision: bool | None) -> None:
    assert exact_numbers_equal(answer, reference) is decision


@pytest.mark.parametrize(
    ("answer", "reference", "math_verify", "sympy"),
    [
        ("sqrt(2)/2", "\\frac{\\sqrt{2}}{2}", True, True),
        ("2**10", "1024", False, True),
        ("pi/4", "\\frac{\\pi}{4}", False, True),
        ("1e-3", "0.001", False, True),
        ("\\log_2 8", "3", True, True),
        ("\\begin{pmatrix}1/2\\\\2\\end{pmatrix}", "\\begin{pmatrix}\\frac{1}{2}\\\\2\\end{pmatrix}", True, True),
        ("0.3333333", "\\frac13", True, False),  # math-verify rounds to 6 places; sympy wants near-exact decimals
        ("1000000.5", "1000000", False, False),
        ("(x+1)(x-1)", "x^2-1", True, True),
    ],
)
def test_each_checker(answer: str, reference: str, math_verify: bool, sympy: bool) -> None:
    """Either checker may accept (SPEC 3); these cases show each catching what the other misses."""
    assert math_verify_equal(answer, reference) is math_verify
    assert sympy_equal(normalize_answer(answer), normalize_answer(reference)) is sympy


@pytest.mark.parametrize(
    ("answer", "text"),
    [
        ("Evelyn", True),
        ("two lines", True),
        ("\\sqrt{2}", False),
        ("sqrt(2)/2", False),
        ("ad+bc", False),
        ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", False),
    ],
)
def test_is_text_answer(answer: str, text: bool) -> None:
    assert is_text_answer(answer) is text


def test_words_only_match_by_normal_form() -> None:
    """math-verify alone reads both as the product E*e*l*n*v*y and calls them equal."""
    assert math_verify_equal("Evelyn", "Evenly")
    assert not answers_equivalent("Evelyn", "Evenly")
    assert answers_equivalent("\\text{Evelyn}", "Evelyn")
    assert answers_equivalent("\\text{east}", "\\text{East}")


def test_pool_implements_the_verifier_protocol() -> None:
    with VerifierPool(num_workers=1) as pool:
        assert isinstance(pool, Verifier)
        assert pool.verify("\\boxed{2}", "2") is True
