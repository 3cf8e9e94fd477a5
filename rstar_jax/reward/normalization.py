"""Rewriting an answer string into a canonical form before comparison (SPEC 3: "normalised").

Only presentation is removed: display commands, spacing, units in `\\text{}` and the other text commands, degree
and percent signs, thousands separators (see `digit_groups` for which commas and spaces those are), `x =` before a
value, "and"/"or" between listed values; the range of one variable (`3 \\le x < 5`) is written as its interval, and
the empty set and primes (see `primes`) have one spelling each. Two answers with equal normal forms are equal;
different normal forms go on to the math-verify and sympy checkers, which decide mathematical equivalence.
"""

from __future__ import annotations

import re

from rstar_jax.reward.digit_groups import bare_group_commas, joined_digit_groups
from rstar_jax.reward.primes import canonical_primes

_UNICODE_MATH = str.maketrans(
    {
        "−": "-",
        "–": "-",
        "π": "\\pi ",
        "∞": "\\infty ",
        "×": "\\times ",
        "·": "\\cdot ",
        "√": "\\sqrt ",
        "≤": "\\le ",
        "≥": "\\ge ",
        "∅": "\\emptyset ",
        "′": "'",
        "″": "''",
        "‴": "'''",
    }
)
_DISPLAY_COMMANDS = re.compile(r"\\(?:displaystyle|textstyle|left|right|big|Big|bigg|Bigg)(?![A-Za-z])")
_FRACTION_VARIANTS = re.compile(r"\\[dt]frac(?![A-Za-z])")
_SPACING = re.compile(r"\\[,!;: ]|\\q?quad(?![A-Za-z])|~")
_WHITESPACE = re.compile(r"\s+")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|°|\\degree(?![A-Za-z])")
_PERCENT = re.compile(r"\\?%")
_DOLLAR = re.compile(r"\\?\$")
# Commands whose argument may be words (a unit, a name, "and"); math alphabets hold symbols (\mathbf{v} is a vector).
_WORD_COMMANDS = r"\\(?:text|textnormal|textrm|textbf|textit|textsl|textup|textsf|texttt|emph|mbox|hbox|mathrm)"
_MATH_ALPHABETS = r"\\(?:mathbf|mathit|mathsf|mathtt|mathnormal)"
_TEXT_COMMAND = re.compile(rf"(?:{_WORD_COMMANDS}|{_MATH_ALPHABETS}|\\operatorname)\s*\{{([^{{}}]*)\}}")
_STYLED_SYMBOL = re.compile(rf"{_MATH_ALPHABETS}\s*\{{|{_WORD_COMMANDS}\s*\{{[A-Za-z]\}}")
_WHOLE_TEXT = re.compile(rf"^{_WORD_COMMANDS}\s*\{{([^{{}}]*)\}}$")
_NUMBER = r"-?(?:\d+(?:\.\d*)?|\.\d+)"
_NUMBER_WITH_UNIT_WORDS = re.compile(rf"^({_NUMBER})\s+[A-Za-z]{{2,}}(?:\s+[A-Za-z]+)*$")
# A unit is a word, or a letter set off by a space (`5\text{ m}`); `2\mathrm{e}` and `3\textbf{v}` are symbols.
_TRAILING_UNIT_TEXT = re.compile(
    rf"^(.+?)\s*{_WORD_COMMANDS}\s*\{{(?:\s*[A-Za-z]{{2,}}|\s+[A-Za-z])[A-Za-z ]*\}}(?:\^\{{?\d\}}?)?$"
)
_VARIABLE_ASSIGNMENT = re.compile(r"(^|,)\s*[A-Za-z](?:_\{?\w+\}?)?\s*=(?!=)\s*")
_DECIMAL = re.compile(r"^(-?)(\d*)\.(\d+)$")
_CONJUNCTION = re.compile(
    rf"\s*(?:,\s*)?(?:{_WORD_COMMANDS}\s*\{{\s*,?\s*(?:and|or)\s*\}}|(?<![A-Za-z\\])(?:and|or)(?![A-Za-z]))\s*"
)
_WORD = re.compile(r"[A-Za-z]{3,}")
_LATEX_COMMAND = re.compile(r"\\(?:begin|end)\s*\{[A-Za-z*]+\}|\\[A-Za-z]+")
_MATH_WORDS = frozenset({"sqrt", "pi", "sin", "cos", "tan", "cot", "sec", "csc", "log", "ln", "exp", "oo", "inf"})
# Spaces kept: one between two letters ("two lines") and one between two digits (`1 2` must not become 12).
_INSIGNIFICANT_SPACE = re.compile(r"(?<![A-Za-z0-9]) | (?![A-Za-z0-9])|(?<=[A-Za-z]) (?=\d)|(?<=\d) (?=[A-Za-z])")
_EMPTY_SET = re.compile(r"\\varnothing(?![A-Za-z])|\\\{\s*\\\}")
_COMPARISON = re.compile(r"\s*((?:\\leq?|\\geq?|\\lt|\\gt)(?![A-Za-z])|<=|>=|<|>)\s*")
_INCLUSIVE = {"\\le", "\\leq", "\\ge", "\\geq", "<=", ">="}
_GREATER = {"\\ge", "\\geq", "\\gt", ">=", ">"}
_VARIABLE = re.compile(r"^[A-Za-z]$")
_MIRRORED = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "\\lt": "\\gt", "\\gt": "\\lt",
             "\\le": "\\ge", "\\ge": "\\le", "\\leq": "\\geq", "\\geq": "\\leq"}  # a < x is x > a


def _canonical_decimal(text: str) -> str:
    """`27.0` -> `27`, `2.50` -> `2.5`, `.5` -> `0.5`; other strings unchanged."""
    match = _DECIMAL.match(text)
    if match is None:
        return text
    sign, whole, fraction = match.groups()
    fraction = fraction.rstrip("0")
    whole = whole.lstrip("0") or "0"
    if not fraction:
        return "0" if whole == "0" else f"{sign}{whole}"
    return f"{sign}{whole}.{fraction}"


def _without_units(text: str) -> str:
    """A value followed by a unit (`5 \\text{ cm}`, `\\frac{270}7\\text{ degrees}`, `864 \\mbox{ inches}^2`,
    `12 inches`) becomes the value alone."""
    for pattern in (_TRAILING_UNIT_TEXT, _NUMBER_WITH_UNIT_WORDS):
        match = pattern.match(text)
        if match:
            return match.group(1)
    return text


def _interval_from_inequality(text: str) -> str:
    """`3 \\le x < 5` -> `[3,5)`, `x > 2` -> `(2,\\infty)`, `5 \\ge x` -> `(-\\infty,5]`: an answer given as the
    range of one variable becomes the interval a reference would write; anything else is unchanged."""
    parts = _COMPARISON.split(text.strip())
    if len(parts) == 3 and _VARIABLE.match(parts[2]):  # a < x or b > x: read as x > a or x < b
        parts = [parts[2], _MIRRORED[parts[1]], parts[0]]
    if len(parts) == 3 and _VARIABLE.match(parts[0]):  # x < b or x > a
        _, op, bound = parts
        low, high, ops = (bound, "\\infty", (op, "<")) if op in _GREATER else ("-\\infty", bound, ("<", op))
    elif len(parts) == 5 and _VARIABLE.match(parts[2]) and (parts[1] in _GREATER) == (parts[3] in _GREATER):
        first, op1, _, op2, last = parts
        low, high, ops = (last, first, (op2, op1)) if op1 in _GREATER else (first, last, (op1, op2))
    else:
        return text
    if not low or not high:
        return text
    opening = "[" if ops[0] in _INCLUSIVE else "("
    closing = "]" if ops[1] in _INCLUSIVE else ")"
    return f"{opening}{low},{high}{closing}"


def latex_from_unicode(text: str) -> str:
    """Unicode math signs a model may write (−, π, √, ∞, ×, ′) as the LaTeX both checkers read (SPEC 3)."""
    return text.translate(_UNICODE_MATH)


def normalize_answer(text: str) -> str:
    """Canonical form of an answer (SPEC 3), used for a fast exact comparison and as the sympy checker's input."""
    text = canonical_primes(_DOLLAR.sub("", latex_from_unicode(text))).strip()
    text = _CONJUNCTION.sub(",", text)
    text = _DISPLAY_COMMANDS.sub("", text)
    text = _FRACTION_VARIANTS.sub(r"\\frac", text)
    text = _SPACING.sub(" ", bare_group_commas(text))
    text = _DEGREES.sub("", text)
    text = _PERCENT.sub("", text)
    text = text.strip().rstrip(".").strip()
    whole_text = _WHOLE_TEXT.match(text)
    if whole_text:
        text = whole_text.group(1).strip()
    text = _without_units(text)
    text = _TEXT_COMMAND.sub(r"\1", text).strip()
    text = _EMPTY_SET.sub("\\\\emptyset", text)
    text = _interval_from_inequality(text)
    if text.count("=") == text.count(",") + 1:  # `x = 3`, `x = 2, x = 3`: each value assigned to one variable
        text = _VARIABLE_ASSIGNMENT.sub(r"\1", text).strip()
    text = joined_digit_groups(_WHITESPACE.sub(" ", text).strip())
    text = _INSIGNIFICANT_SPACE.sub("", text)
    return _canonical_decimal(text)


def has_styled_symbol(answer: str) -> bool:
    """Whether an answer styles a symbol (`\\mathbf{v}`, `\\mathrm{e}`, `\\text{x}`) rather than a unit word.

    math-verify 0.9 drops such a group as a unit and with it everything after it: `2\\mathbf{i}+3\\mathbf{j}` is 2
    to it, and equal to `2\\mathbf{i}+4\\mathbf{j}`. So its yes is not trusted for these answers (SPEC 3); the normal
    forms, where the styling is unwrapped (`2i+3j`), go to the sympy checker.
    """
    return _STYLED_SYMBOL.search(answer) is not None


def is_text_answer(normal_answer: str) -> bool:
    """Whether a normalised answer is words (a name, "east", "two lines") rather than mathematics.

    Both checkers read letters as symbols, so "Evelyn" and "Evenly" would be the same product of six symbols; such
    answers are compared by their normal forms only.
    """
    words = _WORD.findall(_LATEX_COMMAND.sub("", normal_answer))
    return any(word not in _MATH_WORDS for word in words)
