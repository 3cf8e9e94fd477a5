"""Words in answers: units in every text command, "and"/"or" between listed values, and styled symbols that are not
units (issue 14; SPEC 3)."""

from __future__ import annotations

import pytest

from rstar_jax.reward import answers_equivalent, normalize_answer
from rstar_jax.reward.math_verify_check import math_verify_equal
from rstar_jax.reward.normalization import has_styled_symbol


@pytest.mark.parametrize(
    "raw",
    [
        "5 \\text{ cm}",
        "5\\textbf{ cm}",
        "5\\textnormal{ cm}",
        "5\\textit{cm}",
        "5\\textrm{ cm}",
        "5\\textsf{ cm}",
        "5\\texttt{ cm}",
        "5\\textup{ cm}",
        "5\\textsl{ cm}",
        "5\\emph{ cm}",
        "5\\mbox{ cm}",
        "5\\hbox{ cm}",
        "5\\mathrm{cm}",
        "5\\text{ m}",  # one letter set off by a space is a unit
        "5\\textbf{ square cm}^2",
    ],
)
def test_a_unit_in_any_text_command_is_dropped(raw: str) -> None:
    assert normalize_answer(raw) == "5"


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("\\frac{1}{3} \\textbf{meters}", "1/3"),
        ("125\\textnormal{ miles}", "125"),
        ("18\\textit{ dollars}", "18"),
        ("\\textnormal{Evelyn}", "Evelyn"),
        ("\\textbf{Evelyn}", "\\text{Evelyn}"),
    ],
)
def test_units_and_words_in_text_commands_are_accepted(answer: str, reference: str) -> None:
    assert answers_equivalent(answer, reference)
    assert answers_equivalent(reference, answer)


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("19, 46, and 82", "19,46,82"),
        ("12 and 13", "12,13"),
        ("12 $ and $13", "12,13"),
        ("1 or 2", "1,2"),
        ("x = 1 or x = 2", "1,2"),
        ("1\\textbf{ and }2", "1,2"),
        ("6, 8\\text{, and }10", "6,8,10"),
        ("\\text{Alice and Bob}", "Alice,Bob"),
        ("Sandra", "Sandra"),  # "and" inside a word is not a separator
        ("p \\land q", "p\\land q"),
    ],
)
def test_and_or_between_listed_values_is_a_separator(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize(
    ("answer", "reference", "equal"),
    [
        ("19, 46, \\text{ and } 82", "19, 46, and 82", True),
        ("12 $ and $13", "12\\text{ and }13", True),
        ("19, 46, and 82", "19, 46, 82", True),
        ("19, 46, and 82", "21, 36, and 82", False),
        ("1 and 2", "12", False),
    ],
)
def test_lists_joined_by_and(answer: str, reference: str, equal: bool) -> None:
    assert answers_equivalent(answer, reference) is equal
    assert answers_equivalent(reference, answer) is equal


@pytest.mark.parametrize(
    ("answer", "styled"),
    [
        ("2\\mathbf{i}+3\\mathbf{j}", True),
        ("\\mathrm{e}", True),
        ("3\\text{v}", True),
        ("\\mathsf{A}", True),
        ("5\\text{ cm}", False),
        ("5\\text{cm}", False),
        ("\\textbf{(C)}", False),
        ("\\operatorname{lcm}(4,6)", False),
    ],
)
def test_has_styled_symbol(answer: str, styled: bool) -> None:
    assert has_styled_symbol(answer) is styled


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("2\\mathbf{i}+3\\mathbf{j}", "2\\mathbf{i}+4\\mathbf{j}"),
        ("2\\mathbf{i}+3\\mathbf{j}", "2\\mathbf{i}"),
        ("3\\mathbf{v}", "3"),
        ("x\\mathbf{v}", "x"),
        ("2\\mathrm{e}", "2"),
        ("3\\textbf{v}", "3"),
    ],
)
def test_a_styled_symbol_is_not_a_unit(answer: str, reference: str) -> None:
    assert not answers_equivalent(answer, reference)
    assert not answers_equivalent(reference, answer)


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("2\\mathbf{i}+3\\mathbf{j}", "3\\mathbf{j}+2\\mathbf{i}"),
        ("\\mathbf{v}+\\mathbf{w}", "\\mathbf{w}+\\mathbf{v}"),
        ("1+\\frac{1}{\\mathrm{e}}", "1+e^{-1}"),
        ("\\mathbf{2340}", "2340"),
    ],
)
def test_styled_symbols_are_compared_by_sympy(answer: str, reference: str) -> None:
    assert answers_equivalent(answer, reference)
    assert answers_equivalent(reference, answer)


def test_math_verify_drops_a_styled_symbol_and_what_follows() -> None:
    """The upstream bug the styled-symbol rule guards against (math-verify 0.9.0)."""
    assert math_verify_equal("2\\mathbf{i}+3\\mathbf{j}", "2\\mathbf{i}+4\\mathbf{j}")
    assert math_verify_equal("3\\mathbf{v}", "3")
