"""Group-relative advantages (SPEC section 4, step 5): each rollout is scored against the others of its prompt.

GRPO needs no value network: a rollout's advantage is its reward standardised within the group of rollouts that
answered the same prompt, so a group in which every rollout scored the same carries no signal (all zeros).
"""

from __future__ import annotations

import numpy as np

ADVANTAGE_EPSILON = 1e-6


def group_advantages(rewards: np.ndarray, *, epsilon: float = ADVANTAGE_EPSILON, ddof: int = 1) -> np.ndarray:
    """(r - mean) / (std + epsilon) within each row of `rewards` [num_groups, group_size] (SPEC 4.5).

    `ddof=1` (the default) is the sample standard deviation, as in the public release (verl's GRPO estimator);
    `ddof=0` the population one. A one-rollout group has no spread and gets advantage 0. Returns float64 of the
    same shape.
    """
    rewards = np.asarray(rewards, np.float64)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [num_groups, group_size], got shape {rewards.shape}")
    if rewards.shape[1] == 0:
        raise ValueError("a group must hold at least one rollout")
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {ddof}")
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if rewards.shape[1] <= ddof:
        return np.zeros_like(rewards)
    return centred / (rewards.std(axis=1, ddof=ddof, keepdims=True) + epsilon)


def has_signal(rewards: np.ndarray) -> bool:
    """Whether one group's rewards differ at all (SPEC 4.2: groups whose rewards are all equal carry no signal)."""
    rewards = np.asarray(rewards, np.float64)
    return rewards.size > 1 and bool(np.ptp(rewards) > 0)
