"""A fast exact comparison for the common case of plain numbers (SPEC 3: training answers are integers).

Integers, decimals, repeating decimals and simple fractions (`\\frac{a}{b}`, `a/b`) are read as exact rationals
without sympy, so the bulk of RL rewards costs microseconds; anything else is left to the math-verify and sympy
checkers.
"""

from __future__ import annotations

import re
from fractions import Fraction

_INTEGER_OR_DECIMAL = r"\d+(?:\.\d*)?|\.\d+"
_PLAIN_NUMBER = re.compile(rf"^(-?)({_INTEGER_OR_DECIMAL})$")
_LATEX_FRACTION = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")
_SLASH_FRACTION = re.compile(r"^(-?)(-?\d+)/(-?\d+)$")
_REPEATING_DECIMAL = re.compile(r"^(-?)(\d*)\.(\d*)\\overline\{(\d+)\}$")


def _repeating_decimal(whole: str, fixed: str, repeating: str) -> Fraction:
    """`0.1\\overline{6}` = 1/6: (digits through one period - digits before it) / (10^len(fixed) (10^len(rep) - 1))."""
    through_period = int(whole + fixed + repeating or "0")
    before_period = int(whole + fixed or "0")
    return Fraction(through_period - before_period, 10 ** len(fixed) * (10 ** len(repeating) - 1))


def exact_number(text: str) -> Fraction | None:
    """The exact value of a normalised plain number, repeating decimal (`0.\\overline{3}`) or simple fraction;
    None for anything else (or a zero divisor)."""
    plain = _PLAIN_NUMBER.match(text)
    if plain:
        value = Fraction(plain.group(2))
        return -value if plain.group(1) else value
    repeating = _REPEATING_DECIMAL.match(text)
    if repeating:
        value = _repeating_decimal(*repeating.groups()[1:])
        return -value if repeating.group(1) else value
    fraction = _LATEX_FRACTION.match(text) or _SLASH_FRACTION.match(text)
    if fraction is None or int(fraction.group(3)) == 0:
        return None
    value = Fraction(int(fraction.group(2)), int(fraction.group(3)))
    return -value if fraction.group(1) else value


def exact_numbers_equal(answer: str, reference: str) -> bool | None:
    """Decides equality when both normalised answers are exact numbers: True if equal; False if they differ and
    neither is a decimal (no checker would accept); None when undecided here (a decimal may be a rounding)."""
    answer_value, reference_value = exact_number(answer), exact_number(reference)
    if answer_value is None or reference_value is None:
        return None
    if answer_value == reference_value:
        return True
    if "." in answer or "." in reference:
        return None
    return False
