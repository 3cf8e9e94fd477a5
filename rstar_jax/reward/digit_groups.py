"""Which commas and spaces join digits into one number (SPEC 3: answers are "normalised" before comparison).

The conventions, chosen so that no list is ever read as a number (a false accept pays the policy):

- A whole answer that is one number may group its digits in threes: `1,234,567`, `1{,}234` and `1,\\!234` (LaTeX's
  and the MATH data set's spellings of that comma), `1\\,234` (a LaTeX thin space), `1 234` (SI style). The first
  group has one to three digits, every later group exactly three, with one separator throughout; a sign and a
  decimal part may surround them. Such a number is read with its separators removed: `1,234` is 1234.
- A comma followed by a space separates list items and never thousands: `1, 234` is the list 1 and 234, and
  `32, 349` is not 32349. Nobody writes thousands that way, while "enter all solutions separated by commas" is
  answered exactly that way. The price: a two-item list written without the space, `1,234`, reads as a number, as
  English-language references (MATH, AIME) mean it.
- Groups of other sizes are not joined: `1,2` is a list, `56,\\!01,\\!78` is a list, and `1 2` is two numbers side
  by side, which no checker reads faithfully (see `has_spaced_digits`).
- A decimal comma is not recognised: `1,5` is the list 1 and 5.
"""

from __future__ import annotations

import re

_LATEX_GROUP_COMMA = re.compile(r"\{,\}|,\\!\s*")
_GROUPED_NUMBER = re.compile(r"^(-?\d{1,3})((?:,\d{3})+|(?: \d{3})+)(\.\d+)?$")
# A number that is not a command's argument or a one-digit script (`\frac3 8` is 3/8, `\log_2 8` is 3), then a
# space and a digit.
_SPACED_DIGITS = re.compile(r"(?:^|[^A-Za-z\\_^\d])\d+ \d")


def bare_group_commas(text: str) -> str:
    """`1{,}000` and `11,\\! 111` (LaTeX spellings of a thousands comma) as `1,000` and `11,111` (SPEC 3 normalising).

    Must run before LaTeX spacing commands become spaces, or `,\\!` would turn into the list separator `, `.
    """
    return _LATEX_GROUP_COMMA.sub(",", text)


def joined_digit_groups(text: str) -> str:
    """A whole answer that is one number grouped in threes (`-1,234.5`, `1 000 000`) with its separators removed;
    anything else (`1, 234`, `1,2`, `1 2`, `x = 1,000`) unchanged (SPEC 3 normalising; conventions above).

    Expects single spaces (runs of whitespace collapsed) and commas already bare (`bare_group_commas`).
    """
    match = _GROUPED_NUMBER.match(text)
    if match is None:
        return text
    lead, groups, decimals = match.groups()
    return lead + groups.replace(",", "").replace(" ", "") + (decimals or "")


def has_spaced_digits(normal_answer: str) -> bool:
    """Whether a normalised answer still has two numbers separated only by a space: `1 2`, `3128 1/2`, `(1 2)`, but
    not the arguments of `\\frac3 8` (from `\\dfrac 3 8`) or the script and argument of `\\log_2 8`.

    Such an answer is not one number (`joined_digit_groups` joins every valid grouping), and the checkers misread
    it: math-verify 0.9 reads `1 2` as 3 and sympy's parser as 2. SPEC 3's verifier matches it by spelling only.
    """
    return _SPACED_DIGITS.search(normal_answer) is not None
