"""Engine profiles for the fleet simulator fitted to timings of a real server (SPEC section 6; issue 26 item 3).

A probe sends `batch` requests to a server at once, each a prompt of `prompt_tokens` ids of its own (no prefix is
shared) asking for exactly `new_tokens` tokens, and times the batch until its last answer. The simulator's engine
model (`sim_engine`) says such a batch takes

    request_s + prefill_token_s * batch * prompt_tokens
      + new_tokens * (step_s + sequence_s * batch)
      + context_token_s * batch * (prompt_tokens * new_tokens + new_tokens ** 2 / 2)

seconds: the request's cost outside the engine's loop, every prompt computed before decoding, then `new_tokens`
decode steps of the whole batch whose context grows by `batch` tokens a step. That is linear in the five costs,
so a set of timings over batch sizes and lengths fits them by non-negative least squares (a negative cost would
be a fit to noise). The fit is only as good as the spread of the probes: prefill needs a long prompt with few new
tokens, the per-sequence cost several batch sizes, the per-context-token cost long contexts at a large batch.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
import scipy.optimize

from rstar_jax.rollout.sim_engine import EngineProfile

COSTS = ("request_s", "prefill_token_s", "step_s", "sequence_s", "context_token_s")


@dataclasses.dataclass(frozen=True)
class BatchTiming:
    """One probe: `batch` requests of `prompt_tokens` + `new_tokens` sent at once, done after `seconds`."""

    batch: int
    prompt_tokens: int
    new_tokens: int
    seconds: float


def cost_terms(batch: int, prompt_tokens: int, new_tokens: int) -> np.ndarray:
    """What each of COSTS is multiplied by in the seconds such a batch takes (the module docstring's model)."""
    return np.array([1.0, batch * prompt_tokens, new_tokens, new_tokens * batch,
                     batch * (prompt_tokens * new_tokens + new_tokens ** 2 / 2)])


def predicted_seconds(costs: dict[str, float], batch: int, prompt_tokens: int, new_tokens: int) -> float:
    """Seconds the model gives a probe batch with these costs."""
    return float(cost_terms(batch, prompt_tokens, new_tokens) @ np.array([costs[name] for name in COSTS]))


def fit_costs(timings: Sequence[BatchTiming]) -> dict[str, float]:
    """The non-negative COSTS that fit `timings` best in relative error (each probe weighted by 1 / its
    seconds, so a 50 ms probe counts as much as a 2 s one)."""
    if len(timings) < len(COSTS):
        raise ValueError(f"fitting {len(COSTS)} costs needs at least as many timings, got {len(timings)}")
    terms = np.stack([cost_terms(t.batch, t.prompt_tokens, t.new_tokens) for t in timings])
    seconds = np.array([t.seconds for t in timings])
    if np.any(seconds <= 0):
        raise ValueError("every timing must take a positive time")
    scale = terms.max(axis=0)  # columns differ by orders of magnitude; solve in units where each peaks at 1
    scale[scale == 0] = 1.0
    solution, _ = scipy.optimize.nnls(terms / scale / seconds[:, None], np.ones_like(seconds))
    return dict(zip(COSTS, (solution / scale).tolist()))


def fitted_profile(name: str, timings: Sequence[BatchTiming], kv_tokens: int, max_num_seqs: int,
                   block_size: int = 1, shares_prefixes: bool = False) -> EngineProfile:
    """An `EngineProfile` with the fitted costs and the server's cache (its usable KV tokens, block size and
    prefix sharing, as its /metrics report them) and sequence limit."""
    return EngineProfile(name, kv_tokens=kv_tokens, max_num_seqs=max_num_seqs, block_size=block_size,
                         shares_prefixes=shares_prefixes, **fit_costs(timings))


def probe_shapes(kv_tokens: int, block_size: int, max_model_len: int) -> list[tuple[int, int, int]]:
    """(batch, prompt tokens, new tokens) probes spread over what the fit needs, keeping those a server of
    `kv_tokens` in blocks of `block_size` holds whole (a probe that preempted would time the preemption)."""
    shapes = [(1, 16, 1), (1, 896, 1), (4, 448, 1),  # prefill
              (1, 32, 64), (2, 32, 64), (4, 32, 64), (8, 32, 64), (16, 32, 64),  # per sequence
              (1, 448, 64), (4, 448, 64), (8, 160, 64), (2, 832, 128)]  # per context token
    return [(batch, prompt, new) for batch, prompt, new in shapes
            if prompt + new <= max_model_len and batch * -(-(prompt + new) // block_size) * block_size <= kv_tokens]
