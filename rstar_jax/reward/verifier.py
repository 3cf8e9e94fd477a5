"""Deciding whether a response's final answer equals the reference (SPEC 3), in-process.

`verify` is for trusted, small input (tests, a REPL); the trainer goes through `VerifierPool.verify_batch`, which
runs this same function in worker processes under a time and memory limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from rstar_jax.reward.digit_groups import has_spaced_digits
from rstar_jax.reward.exact_numbers import exact_numbers_equal
from rstar_jax.reward.extraction import extract_final_answer
from rstar_jax.reward.math_verify_check import math_verify_equal
from rstar_jax.reward.normalization import has_styled_symbol, is_text_answer, latex_from_unicode, normalize_answer
from rstar_jax.reward.primes import has_prime
from rstar_jax.reward.sympy_check import sympy_equal


@runtime_checkable
class Verifier(Protocol):
    """The reward boundary of DESIGN.md: (response, reference) -> bool, one at a time or as a batch."""

    def verify(self, response: str, reference: str) -> bool:
        """Whether the final answer of `response` equals `reference`."""
        ...

    def verify_batch(
        self, responses: Sequence[str], references: Sequence[str], timeout_s: float | None = None
    ) -> list[bool]:
        """`verify` over pairs, each bounded by `timeout_s` seconds (False when it runs out)."""
        ...


DEFAULT_MAX_ANSWER_CHARS = 1000


def _misread_by_checkers(normal_answer: str) -> bool:
    """Whether both checkers are known to misread a normalised answer, so their yes cannot be trusted: a prime
    (dropped: `E'` would equal `E`) or digits separated by a space (`1 2` read as 3 or 2)."""
    return has_prime(normal_answer) or has_spaced_digits(normal_answer)


def answers_equivalent(answer: str, reference: str, max_answer_chars: int = DEFAULT_MAX_ANSWER_CHARS) -> bool:
    """Whether an extracted answer equals a reference (SPEC 3): equal normal forms, equal exact numbers, or else
    math-verify or sympy accepts. Answers in words ("Evelyn") match only by normal form, ignoring case; answers the
    checkers misread (primes, digits separated by a space) match only by normal form; math-verify is not asked about
    styled symbols (`has_styled_symbol`).

    Answers longer than `max_answer_chars` are rejected without parsing (references in shared/data are at most 159
    characters; a 100 KB blob is never a right answer and would only tie up a worker).
    """
    if len(answer) > max_answer_chars or len(reference) > max_answer_chars:
        return False
    normal_answer, normal_reference = normalize_answer(answer), normalize_answer(reference)
    if not normal_answer or not normal_reference:
        return False
    if normal_answer == normal_reference:
        return True
    if is_text_answer(normal_answer) or is_text_answer(normal_reference):
        return normal_answer.casefold() == normal_reference.casefold()
    if _misread_by_checkers(normal_answer) or _misread_by_checkers(normal_reference):
        return False  # their normal forms differ (compared above), and the checkers' yes would not be trustworthy
    exact = exact_numbers_equal(normal_answer, normal_reference)
    if exact is not None and (exact or "%" not in answer + reference):
        return exact  # a percent sign lost in normalisation may still make 100% equal 1: the checkers decide
    math_verify_trusted = not (has_styled_symbol(answer) or has_styled_symbol(reference))
    return (
        math_verify_trusted and math_verify_equal(latex_from_unicode(answer), latex_from_unicode(reference))
    ) or sympy_equal(normal_answer, normal_reference)


def verify(response: str, reference: str, max_answer_chars: int = DEFAULT_MAX_ANSWER_CHARS) -> bool:
    """Binary outcome reward of SPEC 3 for one response: its final answer (see `extract_final_answer`) vs reference."""
    answer = extract_final_answer(response)
    return answer is not None and answers_equivalent(answer, reference, max_answer_chars)
