"""Seeds derived from a run's seed and what they are for (one scheme: numpy's `SeedSequence` hash of the keys), so
every random choice of a run follows from one number and choices for different purposes are independent.

Not derived this way, and kept as they are because the committed runs' numbers depend on them: the agent loop's
per-sample and per-turn sampling seeds (`rstar_jax.rollout.agent_loop`: seed + offsets, `turn_seed`), the prompt
streams' seeds (the run's seed plus the stage index, plus one for the SFT's short transcripts) and the SFT batch
order (`np.random.default_rng([seed, epoch])`).
"""

from __future__ import annotations

import numpy as np


def derived_seed(*keys: int, bits: int = 62) -> int:
    """A `bits`-bit seed (1 to 64) derived from non-negative `keys` (the run's seed, a step, a purpose ...): the top
    `bits` of the first two 32-bit words of `SeedSequence(keys)` (bits=32: the first word alone)."""
    if not 1 <= bits <= 64:
        raise ValueError(f"bits must be in 1..64, got {bits}")
    high, low = (int(word) for word in np.random.SeedSequence(list(keys)).generate_state(2))
    return ((high << 32) | low) >> (64 - bits)


def step_seed(seed: int, step: int) -> int:
    """The seed of RL step `step` (0-based) of a run seeded `seed`: sampling, selection and mini-batch order."""
    return derived_seed(seed, 0, step)
