"""The sympy checker (SPEC 3: the release accepts if a sympy-based checker or math-verify says equal).

Both normalised answers are parsed to sympy objects and compared exactly where both are exact numbers, within a
relative tolerance where a decimal is involved, by simplifying the difference otherwise, and element by element for
tuples, sets and intervals. Runs without its own time limit: callers bound it (the verifier pool kills hung items).
"""

from __future__ import annotations

import sympy
from latex2sympy2_extended import latex2sympy
from sympy.parsing.sympy_parser import (
    convert_xor,
    implicit_multiplication_application,
    parse_expr,
    standard_transformations,
)

_RELATIVE_TOLERANCE = 1e-8  # decimals equal a value only to near machine precision; math-verify handles rounding
_PLAIN_TRANSFORMATIONS = standard_transformations + (implicit_multiplication_application, convert_xor)


def _parse_latex(answer: str) -> sympy.Basic | None:
    try:
        return latex2sympy(answer)
    except Exception:  # noqa: BLE001 - the LaTeX parser raises many exception types on text it cannot read
        return None


def _parse_plain(answer: str) -> sympy.Basic | None:
    try:
        return parse_expr(answer, transformations=_PLAIN_TRANSFORMATIONS, evaluate=True)
    except Exception:  # noqa: BLE001 - likewise for sympy's plain-text parser (SyntaxError, TokenError, ...)
        return None


def _to_sympy(answer: str) -> sympy.Basic | None:
    """Parses LaTeX (`\\frac{1}{2}`, `(1,2]`) or plain text (`sqrt(2)/2`, `2**10`) into sympy; None if neither can.

    Text without backslashes or braces is tried as plain sympy input first: the LaTeX parser would read `sqrt(2)`
    as the product s*q*r*t*2.
    """
    parsers = (_parse_latex, _parse_plain) if "\\" in answer or "{" in answer else (_parse_plain, _parse_latex)
    for parse in parsers:
        parsed = parse(answer)
        if parsed is not None:  # not `or`: the truth value of a parsed relation (x = [-2, 7]) raises TypeError
            return parsed
    return None


def _numbers_equal(answer: sympy.Expr, reference: sympy.Expr) -> bool:
    """Exact for exact numbers (so 1000001 != 1000000); relative tolerance when either is a decimal."""
    if answer.is_Rational and reference.is_Rational:
        return bool(answer == reference)
    if answer.has(sympy.Float) or reference.has(sympy.Float):
        a, r = sympy.N(answer, 30), sympy.N(reference, 30)
        if not (a.is_real and r.is_real):
            return bool(sympy.simplify(a - r) == 0)
        return bool(abs(a - r) <= _RELATIVE_TOLERANCE * max(1, abs(r)))
    return bool(sympy.simplify(answer - reference) == 0)


def _objects_equal(answer: sympy.Basic, reference: sympy.Basic) -> bool:
    """Structural comparison that recurses into tuples, equations and sets, and compares numbers by value."""
    if isinstance(answer, sympy.Tuple) and isinstance(reference, sympy.Tuple):
        return len(answer) == len(reference) and all(_objects_equal(a, r) for a, r in zip(answer, reference))
    if isinstance(answer, sympy.Eq) and isinstance(reference, sympy.Eq):
        return _objects_equal(answer.lhs - answer.rhs, reference.lhs - reference.rhs)
    if isinstance(answer, sympy.Set) and isinstance(reference, sympy.Set):
        return bool(answer == reference) or bool(answer.symmetric_difference(reference).is_empty)
    if isinstance(answer, sympy.MatrixBase) or isinstance(reference, sympy.MatrixBase):
        return (
            isinstance(answer, sympy.MatrixBase)
            and isinstance(reference, sympy.MatrixBase)
            and answer.shape == reference.shape
            and all(_objects_equal(a, r) for a, r in zip(answer, reference))
        )
    if isinstance(answer, sympy.Expr) and isinstance(reference, sympy.Expr):
        if answer.is_number and reference.is_number:
            return _numbers_equal(answer, reference)
        return bool(sympy.simplify(answer - reference) == 0)
    return bool(answer == reference)


def sympy_equal(answer: str, reference: str) -> bool:
    """True when two normalised answers denote the same mathematical object (SPEC 3's sympy checker)."""
    parsed_answer, parsed_reference = _to_sympy(answer), _to_sympy(reference)
    if parsed_answer is None or parsed_reference is None:
        return False
    try:
        return _objects_equal(parsed_answer, parsed_reference)
    except (TypeError, ValueError, AttributeError, NotImplementedError, RecursionError):
        return False
