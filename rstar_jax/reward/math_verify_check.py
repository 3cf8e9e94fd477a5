"""The math-verify checker (SPEC 3: math-verify is one of the two checkers; either may accept)."""

from __future__ import annotations

import math_verify


def _parsed(answer: str) -> list:
    """math-verify's parse of an answer given as the content of a `\\boxed{}` (the form it extracts best)."""
    return math_verify.parse(f"\\boxed{{{answer}}}", parsing_timeout=None)


def math_verify_equal(answer: str, reference: str) -> bool:
    """True when math-verify judges `answer` equivalent to `reference` (gold first, as its API expects).

    Its own signal-based timeouts are off: they cannot interrupt long C-level arithmetic and only work on the main
    thread; the verifier pool's per-item limit bounds this call instead.
    """
    gold, target = _parsed(reference), _parsed(answer)
    if not gold or not target:
        return False
    return bool(math_verify.verify(gold, target, timeout_seconds=None))
