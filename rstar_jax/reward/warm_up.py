"""Importing this module warms math-verify's and sympy's parsers; only the verifier pool's zygote imports it.

The first use of each parser path builds grammars and caches (up to 0.6 s), which would otherwise count against the
time limit of a worker's first real items; workers forked from the warm zygote inherit them.
"""

from __future__ import annotations

from rstar_jax.reward.verifier import verify

# One pair per parser path: expressions, intervals, roots, tuples, decimals against fractions.
_PAIRS = (
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{(3,4)}", "(3,4]"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{(1, \\frac{\\pi}{2})}", "\\left(1,\\frac{\\pi}{2}\\right)"),
    ("\\boxed{0.333}", "\\frac13"),
)

for _response, _reference in _PAIRS:
    verify(_response, _reference)
