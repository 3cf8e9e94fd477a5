"""Which commas and spaces join digits into one number (issue 14; SPEC 3; conventions in `digit_groups`).

`1,234` (no space) is one number, `1, 234` (comma and space) is a list; digits grouped in threes by `{,}`, `,\\!`,
`\\,` or a space are one number; `1 2` is never 12.
"""

from __future__ import annotations

import pytest

from rstar_jax.reward import answers_equivalent, normalize_answer
from rstar_jax.reward.digit_groups import bare_group_commas, has_spaced_digits, joined_digit_groups
from rstar_jax.reward.math_verify_check import math_verify_equal


@pytest.mark.parametrize(
    ("raw", "bare"),
    [
        ("1{,}000", "1,000"),
        ("10,\\!080", "10,080"),
        ("11,\\! 111,\\! 100", "11,111,100"),
        ("5,\\,-11", "5,\\,-11"),  # a comma and a thin space separate list items
        ("1, 234", "1, 234"),
    ],
)
def test_bare_group_commas(raw: str, bare: str) -> None:
    assert bare_group_commas(raw) == bare


@pytest.mark.parametrize(
    ("text", "joined"),
    [
        ("1,234", "1234"),
        ("1 234", "1234"),
        ("12,345,678", "12345678"),
        ("1 000 000", "1000000"),
        ("-1,234.50", "-1234.50"),
        ("999", "999"),
        # not one number grouped in threes: unchanged
        ("1, 234", "1, 234"),
        ("12, 345, 678", "12, 345, 678"),
        ("1,2", "1,2"),
        ("1 2", "1 2"),
        ("1,2345", "1,2345"),
        ("12,34", "12,34"),
        ("1234,567", "1234,567"),
        ("1,234 567", "1,234 567"),  # one separator throughout
        ("1,234, 5", "1,234, 5"),  # inside a list, a comma group is not read as thousands
        ("x=1,000", "x=1,000"),
    ],
)
def test_joined_digit_groups(text: str, joined: str) -> None:
    assert joined_digit_groups(text) == joined


@pytest.mark.parametrize(
    ("normal", "spaced"),
    [
        ("1 2", True),
        ("3128 1/2", True),
        ("(1 2)", True),
        ("-1 2", True),
        ("1.5 2", True),
        ("12", False),
        ("1,2", False),
        ("\\log_2 8", False),  # a one-digit subscript and the argument
        ("x^2 3", False),
        ("\\frac3 8", False),  # \dfrac 3 8: a command's one-digit arguments
    ],
)
def test_has_spaced_digits(normal: str, spaced: bool) -> None:
    assert has_spaced_digits(normal) is spaced


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("1\\,234", "1234"),
        ("1\\;234", "1234"),
        ("1~234", "1234"),
        ("12\\,345\\,678", "12345678"),
        ("\\$1{,}234.50", "1234.5"),
        ("1\\,2", "1 2"),
        ("1  2", "1 2"),
        ("32, 349", "32,349"),
        ("12, 345, 678", "12,345,678"),
        ("\\dfrac 3 8", "\\frac3 8"),
    ],
)
def test_normal_forms(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("32, 349", "32349"),
        ("1, 234", "1234"),
        ("1, 100", "1100"),
        ("12, 345, 678", "12345678"),
        ("1, 234", "1,234"),  # a list against a number
        ("1,2345", "12345"),
        ("1 2", "12"),
        ("1 2", "3"),  # math-verify alone reads 1 2 as 1 + 2
        ("1 2", "2"),  # sympy's parser alone reads 1 2 as 1 * 2
        ("1\\,2", "12"),
        ("1 23", "123"),
        ("3128 1/2", "3128.5"),  # a mixed number written with a space matches by spelling only
    ],
)
def test_lists_and_spaced_digits_are_not_one_number(answer: str, reference: str) -> None:
    assert not answers_equivalent(answer, reference)
    assert not answers_equivalent(reference, answer)


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("1,234", "1234"),
        ("1 234", "1234"),
        ("1\\,234", "1234"),
        ("1{,}234", "1234"),
        ("1,\\!234", "1234"),
        ("12,345,678", "12345678"),
        ("-1,234.5", "-\\frac{2469}{2}"),
        ("1, 234", "234, 1"),  # a list of solutions has no order
        ("1, 234", "1,\\ 234"),
        ("1 2", "1 2"),
        ("\\dfrac 3 8", "\\frac{3}{8}"),
        ("\\log_2 8", "3"),
    ],
)
def test_numbers_grouped_in_threes_are_accepted(answer: str, reference: str) -> None:
    assert answers_equivalent(answer, reference)
    assert answers_equivalent(reference, answer)


def test_math_verify_reads_spaced_digits_as_a_sum() -> None:
    """The upstream misreading the spaced-digits rule guards against (math-verify 0.9.0)."""
    assert math_verify_equal("1 2", "3")
