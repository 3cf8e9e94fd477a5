"""Prime marks (SPEC 3: normalised answers, then checked): `E'` is not `E`, `f'(x)` is not `f(x)`.

A prime is part of a symbol's name: a reflected point, a derivative, feet or arcminutes. Both checkers lose it:
latex2sympy2_extended 1.11, the parser of math-verify 0.9 and of the sympy checker, parses `E'` as it parses `E`,
`f''(x)` as `f(x)` and `2'` as 2, so both would call `B'C'` equal to `BC`. Primes are therefore written one way here,
and an answer that has any is matched by its normal form alone (see `verifier.answers_equivalent`).
"""

from __future__ import annotations

import re

_PRIME_COMMAND = r"\\prime(?![A-Za-z])"
_SUPERSCRIPT_PRIMES = re.compile(rf"\^\s*\{{((?:\s*(?:{_PRIME_COMMAND}|'))+)\s*\}}|\^\s*{_PRIME_COMMAND}")
_PRIME = re.compile(rf"{_PRIME_COMMAND}|'")


def _as_apostrophes(superscript: re.Match[str]) -> str:
    """`^{\\prime\\prime}` -> `''`, `^\\prime` -> `'`."""
    return "'" * len(_PRIME.findall(superscript.group(0)))


def canonical_primes(text: str) -> str:
    """Every spelling of a prime (`x^{\\prime}`, `x^\\prime`, `x^{\\prime\\prime}`, `x^{''}`, a bare `x\\prime`) as
    apostrophes: `x'`, `x'`, `x''`, `x''`, `x'` (SPEC 3 normalising). Unicode primes are mapped by
    `normalization.latex_from_unicode`."""
    return _PRIME.sub("'", _SUPERSCRIPT_PRIMES.sub(_as_apostrophes, text))


def has_prime(normal_answer: str) -> bool:
    """Whether a normalised answer carries a prime, which neither checker reads (SPEC 3: spelling decides)."""
    return "'" in normal_answer
