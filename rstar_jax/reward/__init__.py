"""Answer extraction and verification (SPEC 3): the binary outcome reward of a response."""

from rstar_jax.reward.extraction import extract_final_answer
from rstar_jax.reward.normalization import normalize_answer
from rstar_jax.reward.pool import VerifierPool
from rstar_jax.reward.verifier import Verifier, answers_equivalent, verify

__all__ = [
    "Verifier",
    "VerifierPool",
    "answers_equivalent",
    "extract_final_answer",
    "normalize_answer",
    "verify",
]
