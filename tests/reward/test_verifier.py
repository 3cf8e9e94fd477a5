"""The verifier against hand-written (response, reference, expected) cases, in-process and through the pool
(issue 4, item 2; SPEC 3)."""

from __future__ import annotations

import pytest

from rstar_jax.reward import VerifierPool, answers_equivalent, verify


def boxed(answer: str) -> str:
    """A short response whose final answer is `answer`, in the SPEC 2 format."""
    return f"<reason>I worked it out.</reason>\n<answer>The answer is \\boxed{{{answer}}}</answer>"


CASES: list[tuple[str, str, str, bool]] = [
    # (kind, response, reference, expected)
    # integers with commas or spaces
    ("integer", boxed("1,000"), "1000", True),
    ("integer", boxed("1 000"), "1000", True),
    ("integer", boxed("1{,}000{,}000"), "1000000", True),
    ("integer", boxed("1\\,000"), "1000", True),
    ("integer", boxed("12,345,678"), "12345678", True),
    ("integer", boxed("1000"), "1,000", True),
    ("integer", boxed("1,001"), "1000", False),
    ("integer", boxed("1,2"), "12", False),
    ("integer", boxed("007"), "7", True),
    ("integer", boxed("27"), "27.0", True),
    ("integer", boxed("204"), "204", True),
    ("integer", boxed("205"), "204", False),
    # fractions: \frac, \dfrac, \tfrac, a/b
    ("fraction", boxed("\\frac{1}{2}"), "\\frac12", True),
    ("fraction", boxed("\\dfrac{3}{4}"), "\\frac{3}{4}", True),
    ("fraction", boxed("\\tfrac{3}{4}"), "\\frac{3}{4}", True),
    ("fraction", boxed("3/4"), "\\frac{3}{4}", True),
    ("fraction", boxed("\\frac{6}{8}"), "\\frac{3}{4}", True),
    ("fraction", boxed("\\frac{4}{3}"), "\\frac{3}{4}", False),
    ("fraction", boxed("\\frac{1311}{2017}"), "\\frac{1311}{2017}", True),
    ("fraction", boxed("\\frac{1312}{2017}"), "\\frac{1311}{2017}", False),
    ("fraction", boxed("\\frac{14}{3}"), "\\frac{14}{3}", True),
    ("fraction", boxed("4\\frac{2}{3}"), "\\frac{14}{3}", True),
    # decimals against fractions
    ("decimal", boxed("0.5"), "\\frac{1}{2}", True),
    ("decimal", boxed("0.75"), "\\frac{3}{4}", True),
    ("decimal", boxed(".25"), "\\frac14", True),
    ("decimal", boxed("2.50"), "\\frac{5}{2}", True),
    ("decimal", boxed("0.333"), "\\frac{1}{3}", False),
    ("decimal", boxed("0.6"), "\\frac{2}{3}", False),
    ("decimal", boxed("1.5"), "1.50", True),
    ("decimal", boxed("3.14"), "\\pi", False),
    # negatives
    ("negative", boxed("-5"), "-5", True),
    ("negative", boxed("-5"), "5", False),
    ("negative", boxed("5"), "-5", False),
    ("negative", boxed("-\\frac{1}{2}"), "\\frac{-1}{2}", True),
    ("negative", boxed("-984"), "-984", True),
    ("negative", boxed("-0.5"), "-\\frac{1}{2}", True),
    # percentages
    ("percent", boxed("50\\%"), "50", True),
    ("percent", boxed("50%"), "50", True),
    ("percent", boxed("25"), "25\\%", True),
    ("percent", boxed("51\\%"), "50", False),
    ("percent", boxed("100\\%"), "1", True),
    ("decimal", boxed("0.\\overline{6}"), "\\frac{2}{3}", True),
    ("decimal", boxed("0.\\overline{6}"), "0.6", False),
    # degrees
    ("degrees", boxed("30^\\circ"), "30", True),
    ("degrees", boxed("30^{\\circ}"), "30", True),
    ("degrees", boxed("45"), "45^\\circ", True),
    ("degrees", boxed("60^\\circ"), "30", False),
    # units and \text{}
    ("units", boxed("5 \\text{ cm}"), "5", True),
    ("units", boxed("18 \\text{ dollars}"), "18", True),
    ("units", boxed("\\$18"), "18", True),
    ("units", boxed("12 inches"), "12", True),
    ("units", boxed("\\text{Evelyn}"), "\\text{Evelyn}", True),
    ("units", boxed("Evelyn"), "\\text{Evelyn}", True),
    ("units", boxed("\\text{Evenly}"), "\\text{Evelyn}", False),
    ("units", boxed("\\text{(B)}"), "\\text{(B)}", True),
    ("units", boxed("\\text{(C)}"), "\\text{(B)}", False),
    ("units", boxed("6 \\text{ cm}"), "5", False),
    # intervals
    ("interval", boxed("(1,2]"), "(1,2]", True),
    ("interval", boxed("(1, 2)"), "(1,2]", False),
    ("interval", boxed("[-2, 7]"), "[-2,7]", True),
    ("interval", boxed("(-\\infty, 3)"), "(-\\infty,3)", True),
    ("interval", boxed("(-\\infty,-2) \\cup (2,\\infty)"), "(-\\infty,-2)\\cup(2,\\infty)", True),
    ("interval", boxed("(-\\infty,-2] \\cup (2,\\infty)"), "(-\\infty,-2)\\cup(2,\\infty)", False),
    ("interval", boxed("3 \\le x \\le 5"), "[3,5]", True),
    ("interval", boxed("3 \\le x < 5"), "[3,5]", False),
    ("interval", boxed("5 > x \\geq -1"), "[-1,5)", True),
    ("interval", boxed("x > 2"), "(2,\\infty)", True),
    ("interval", boxed("x \\ge 2"), "(2,\\infty)", False),
    ("interval", boxed("4 \\geq t"), "(-\\infty,4]", True),
    ("set", boxed("\\varnothing"), "\\emptyset", True),
    ("set", boxed("∅"), "\\emptyset", True),
    # sets and tuples
    ("set", boxed("\\{1,2,3\\}"), "\\{3,2,1\\}", True),
    ("set", boxed("\\{1,2\\}"), "\\{1,2,3\\}", False),
    ("tuple", boxed("\\left( 3, \\frac{\\pi}{2} \\right)"), "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("tuple", boxed("(3,\\frac{\\pi}{2})"), "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("tuple", boxed("(\\frac{\\pi}{2}, 3)"), "\\left( 3, \\frac{\\pi}{2} \\right)", False),
    ("tuple", boxed("(1, -2)"), "(1,-2)", True),
    ("tuple", boxed("(1, 2)"), "(1,-2)", False),
    (
        "list",
        boxed("\\frac{-1-\\sqrt{17}}{2}, \\frac{-1+\\sqrt{17}}{2}"),
        "\\frac{-1+\\sqrt{17}}{2}, \\frac{-1-\\sqrt{17}}{2}",
        True,
    ),
    # roots and pi
    ("root", boxed("2\\sqrt{2}"), "\\sqrt{8}", True),
    ("root", boxed("\\sqrt{2}/2"), "\\frac{\\sqrt{2}}{2}", True),
    ("root", boxed("\\frac{1}{\\sqrt{2}}"), "\\frac{\\sqrt{2}}{2}", True),
    ("root", boxed("8\\sqrt{10}"), "8\\sqrt{10}", True),
    ("root", boxed("8\\sqrt{11}"), "8\\sqrt{10}", False),
    ("root", boxed("\\sqrt{23}-2\\sqrt{3}"), "\\sqrt{23}-2 \\sqrt{3}", True),
    ("pi", boxed("\\frac{\\pi}{2}"), "\\pi/2", True),
    ("pi", boxed("1-\\frac{2}{\\pi}"), "1-\\frac{2}{\\pi}", True),
    ("pi", boxed("2\\pi"), "\\pi", False),
    ("pi", boxed("6.2832"), "2\\pi", False),
    ("expression", boxed("x^2+2x+1"), "(x+1)^2", True),
    ("expression", boxed("p - q"), "p-q", True),
    ("expression", boxed("q - p"), "p-q", False),
    ("expression", boxed("2^{25} \\cdot 26!"), "2^{25} \\cdot 26!", True),
    # x = 3 against 3
    ("equation", boxed("x=3"), "3", True),
    ("equation", boxed("x = \\frac{1}{2}"), "\\frac{1}{2}", True),
    ("equation", boxed("n=12"), "12", True),
    ("equation", boxed("x=4"), "3", False),
    # several boxes: the last counts; inside <answer> first
    ("several", "First \\boxed{3}, then I corrected it: \\boxed{5}", "5", True),
    ("several", "First \\boxed{3}, then I corrected it: \\boxed{5}", "3", False),
    ("several", "<answer>\\boxed{7}</answer> and a stray \\boxed{8} afterwards", "7", True),
    ("several", "<answer>\\boxed{7}</answer> and a stray \\boxed{8} afterwards", "8", False),
    ("several", "<answer>\\boxed{1}</answer> <answer>\\boxed{2}</answer>", "2", True),
    ("several", "\\boxed{2} <answer>no box here</answer>", "2", True),
    ("box-forms", "The answer is \\boxed 9.", "9", True),
    ("box-forms", "The answer is \\fbox{9}.", "9", True),
    ("box-forms", "$\\boxed{\\{1,2\\}}$", "\\{1,2\\}", True),
    # unicode signs, multiple choice, other notations
    ("unicode", boxed("−5"), "-5", True),
    ("unicode", boxed("2π"), "2\\pi", True),
    ("unicode", boxed("√2"), "\\sqrt{2}", True),
    ("unicode", boxed("∞"), "\\infty", True),
    ("unicode", boxed("3×4"), "12", True),
    ("choice", boxed("A"), "(A)", True),
    ("choice", boxed("\\textbf{(C)}"), "\\text{(C)}", True),
    ("choice", boxed("B"), "(A)", False),
    ("notation", boxed("10^{6}"), "1000000", True),
    ("notation", boxed("1e6"), "1000000", True),
    ("notation", boxed("2 \\times 10^3"), "2000", True),
    ("notation", boxed("2^{1/2}"), "\\sqrt{2}", True),
    ("notation", boxed("\\binom{10}{3}"), "120", True),
    ("notation", boxed("\\frac{\\sqrt{570}}{12}"), "\\sqrt{\\frac{95}{24}}", True),
    ("notation", boxed("4\\sqrt{37}+14"), "14+4\\sqrt{37}", True),
    ("notation", boxed("26!\\cdot 2^{25}"), "2^{25} \\cdot 26!", True),
    ("notation", boxed("3 \\frac{1}{2}"), "\\frac72", True),
    ("notation", boxed("x \\in [1,5)"), "[1,5)", True),
    ("notation", boxed("x=2 \\text{ or } x=3"), "2, 3", True),
    ("notation", boxed("\\$1,250.00"), "1250", True),
    ("notation", boxed("1250"), "1,250", True),
    ("notation", boxed("\\frac{\\pi}{3}"), "60^\\circ", False),
    ("notation", boxed("x^2"), "x^3", False),
    ("notation", boxed("1/3"), "0.3", False),
    # no answer at all
    ("no-answer", "I do not know.", "3", False),
    ("no-answer", "<answer>3</answer>", "3", False),
    ("no-answer", "", "3", False),
    ("no-answer", "\\boxed{}", "3", False),
    ("no-answer", "\\boxed{3", "3", False),
    # wrong answers that look close
    ("close", boxed("1000001"), "1000000", False),
    ("close", boxed("999999"), "1000000", False),
    ("close", boxed("0.5001"), "\\frac{1}{2}", False),
    ("close", boxed("\\frac{1}{2}"), "\\frac{1}{3}", False),
    ("close", boxed("2\\sqrt{3}"), "3\\sqrt{2}", False),
    ("close", boxed("103"), "130", False),
]


@pytest.mark.parametrize(
    ("kind", "response", "reference", "expected"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_verify_case(kind: str, response: str, reference: str, expected: bool) -> None:
    assert verify(response, reference) is expected


def test_there_are_at_least_80_cases_covering_every_kind() -> None:
    kinds = {kind for kind, *_ in CASES}
    assert len(CASES) >= 80
    assert {"integer", "fraction", "decimal", "negative", "percent", "degrees", "units", "interval", "set", "tuple",
            "root", "pi", "equation", "several", "no-answer", "close"} <= kinds


def test_overlong_answers_are_rejected_unparsed() -> None:
    long_answer = "1+" * 600 + "1"
    assert not answers_equivalent(long_answer, long_answer, max_answer_chars=1000)
    assert answers_equivalent(long_answer, long_answer, max_answer_chars=2000)


def test_empty_reference_never_matches() -> None:
    assert not answers_equivalent("3", "")
    assert not answers_equivalent("", "")


def test_pool_agrees_with_every_case_in_one_batch() -> None:
    responses = [response for _, response, _, _ in CASES]
    references = [reference for _, _, reference, _ in CASES]
    with VerifierPool(num_workers=2, timeout_s=10.0) as pool:
        assert pool.verify_batch(responses, references) == [expected for *_, expected in CASES]


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("10080", "10,\\!080"),
        ("11111111100", "11,\\! 111,\\! 111,\\! 100"),
        ("32348", "\\$32,\\!348"),
        ("864", "864 \\mbox{ inches}^2"),
        ("\\frac{270}{7}", "\\frac{270}7\\text{ degrees}"),
        ("5,-11", "5,\\,-11"),
    ],
)
def test_math500_reference_presentations_accept_the_plain_answer(answer: str, reference: str) -> None:
    assert answers_equivalent(answer, reference)
