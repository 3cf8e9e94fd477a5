"""Which rollouts of a prompt the learner trains on, and with what reward (SPEC section 4; DESIGN "Selector").

Three algorithms share one protocol, chosen by one gin switch (`make_selector.algorithm`):
- "roc": GRPO-RoC. Oversample 2G rollouts, keep G: negatives uniformly at random, positives by quality
  (`select_roc`), binary rewards.
- "penalty": the ablation baseline. G rollouts, all kept; a correct answer earns 1 - lambda * p_err.
- "grpo": plain GRPO. G rollouts, all kept, binary rewards.
A selector sees only arrays of per-rollout counts (`GroupOutcome`), never trajectories or engines.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import gin
import numpy as np

from rstar_jax.rl.penalties import roc_penalty, tool_error_penalty

ROC_MODES = ("paper", "release")


@dataclasses.dataclass(frozen=True)
class GroupOutcome:
    """One prompt's rollouts as a selector sees them: verified rewards (0/1) and the counts of SPEC 4.4, each [n]."""

    rewards: np.ndarray
    tool_calls: np.ndarray
    failed_calls: np.ndarray
    answer_tags: np.ndarray
    turns: np.ndarray

    def __post_init__(self) -> None:
        sizes = {name: np.shape(getattr(self, name)) for name in
                 ("rewards", "tool_calls", "failed_calls", "answer_tags", "turns")}
        if len(set(sizes.values())) != 1 or len(sizes["rewards"]) != 1:
            raise ValueError(f"a GroupOutcome needs 1-D arrays of one length, got shapes {sizes}")

    @property
    def size(self) -> int:
        """Rollouts in the group."""
        return len(self.rewards)

    @property
    def penalties(self) -> np.ndarray:
        """p_total of every rollout (SPEC 4.4)."""
        return roc_penalty(self.tool_calls, self.failed_calls, self.answer_tags, self.turns)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The kept rollouts' indices into the group (ascending) and the reward each is trained with."""

    indices: np.ndarray
    rewards: np.ndarray


def _round_half_up(value: float) -> int:
    return int(np.floor(value + 0.5))


RELEASE_MINIMUM = 2  # the release's min_zero_reward_trace_num and min_non_zero_reward_trace_num


def roc_class_sizes(num_positive: int, num_negative: int, keep: int, mode: str = "paper") -> tuple[int, int]:
    """How many positives and negatives RoC keeps out of a group (SPEC 4.3-4.4): (positives, negatives), summing to
    `keep`, neither more than its class has.

    Each class keeps its share of `keep`, count * keep / total (about half of each when keep = total / 2), and at
    least 2 of a class where it has them (1 each when `keep` is too small for 2 + 2).
    - mode "paper" (the paper does not say how it rounds; this is the project's own rule): the positives' share
      rounded half UP, then raised to the minimum of 2 (or lowered so the negatives keep theirs); the negatives
      take the rest.
    - mode "release": the release's rule (rStar2-Agent's `resample_of_correct`, down-sampling to G): each class's
      share rounded with Python's `round`, half to EVEN (32 -> 16 with 5 positives: round(2.5) = 2 positives,
      round(13.5) = 14 negatives, where "paper" keeps 3 and 13); then a class whose share is at most its minimum
      (min(2, count)) is set to that minimum and the other takes the rest, the negatives checked first and the
      positives last (so the positives' minimum wins). The release asserts that its sizes sum to `keep`, which
      its two roundings guarantee only when keep = total / 2 with `keep` even (G = 16 of 32: every count); where
      they do not (an odd G, or keep != total / 2), the positives keep their rounded share and the negatives
      take the rest. Where `keep` < 4 the release keeps the whole group; this function, which must return `keep`,
      keeps 1 of each class instead, as "paper" does.
    """
    total = num_positive + num_negative
    if min(num_positive, num_negative) < 0 or not 0 < keep <= total:
        raise ValueError(f"cannot keep {keep} of {num_positive} positive and {num_negative} negative rollouts")
    if mode not in ROC_MODES:
        raise ValueError(f"unknown RoC mode {mode!r}; choose from {ROC_MODES}")
    least_positive, least_negative = min(2, num_positive), min(2, num_negative)
    if least_positive + least_negative > keep:
        least_positive, least_negative = min(1, num_positive), min(1, num_negative)
    if mode == "release":
        positive = round(num_positive * keep / total)  # half to even, as the release's Python `round`
        negative = round(num_negative * keep / total)
        if negative <= least_negative:
            negative = least_negative
            positive = keep - negative
        if positive <= least_positive:
            positive = least_positive
        positive = min(positive, keep - least_negative, num_positive)
    else:
        positive = _round_half_up(num_positive * keep / total)
        positive = min(max(positive, least_positive), keep - least_negative, num_positive)
    negative = keep - positive
    if negative > num_negative:
        negative, positive = num_negative, keep - num_negative
    return positive, negative


def select_roc(rewards: np.ndarray, penalties: np.ndarray, keep: int, *, mode: str = "paper", seed: int = 0,
               penalty_floor: float = 0.05) -> np.ndarray:
    """The indices (ascending) of the `keep` rollouts GRPO-RoC trains on, out of one prompt's 2G (SPEC 4.3-4.4).

    Class sizes come from `roc_class_sizes` in the same `mode` ("release": the release's half-to-even rounding;
    "paper": this project's half-up rounding, see there). Negatives (reward 0) are drawn uniformly without replacement. Positives
    (reward 1) by quality: mode "release" keeps the lowest `penalties` (ties in a seeded random order); mode "paper"
    draws without replacement with probability proportional to 1 / max(penalty, penalty_floor), the floor keeping a
    zero penalty's weight finite. The same arguments always select the same rollouts.
    """
    rewards, penalties = np.asarray(rewards, np.float64), np.asarray(penalties, np.float64)
    if rewards.shape != penalties.shape or rewards.ndim != 1:
        raise ValueError(f"rewards and penalties must be 1-D of one length, got {rewards.shape} and {penalties.shape}")
    if not np.all((rewards == 0) | (rewards == 1)):
        raise ValueError(f"RoC needs binary rewards, got {rewards}")
    if mode not in ROC_MODES:
        raise ValueError(f"unknown RoC mode {mode!r}; choose from {ROC_MODES}")
    if penalty_floor <= 0:
        raise ValueError(f"penalty_floor must be positive, got {penalty_floor}")
    positives, negatives = np.flatnonzero(rewards == 1), np.flatnonzero(rewards == 0)
    num_positive, num_negative = roc_class_sizes(len(positives), len(negatives), keep, mode)
    rng = np.random.default_rng(seed)
    kept_negatives = rng.choice(negatives, size=num_negative, replace=False)
    if num_positive == 0:
        kept_positives = positives[:0]
    elif mode == "release":
        shuffled = rng.permutation(positives)
        kept_positives = shuffled[np.argsort(penalties[shuffled], kind="stable")[:num_positive]]
    else:
        weights = 1.0 / np.maximum(penalties[positives], penalty_floor)
        kept_positives = rng.choice(positives, size=num_positive, replace=False, p=weights / weights.sum())
    return np.sort(np.concatenate([kept_positives, kept_negatives]).astype(np.int64))


class Selector(Protocol):
    """How many rollouts a prompt gets and which of them, with which rewards, the learner trains on."""

    def rollouts_per_prompt(self, group_size: int) -> int:
        """Rollouts to sample per prompt for training groups of `group_size` (G)."""
        ...

    def select(self, group: GroupOutcome, group_size: int, seed: int) -> Selection:
        """The kept rollouts of one prompt (`group_size` of them) and their training rewards."""
        ...


def _check_group(group: GroupOutcome, expected: int) -> None:
    if group.size != expected:
        raise ValueError(f"expected a group of {expected} rollouts, got {group.size}")


@gin.configurable
@dataclasses.dataclass(frozen=True)
class RocSelector:
    """GRPO-RoC (SPEC 4): 2G rollouts per prompt, G kept by `select_roc` in `mode` ("paper" or "release")."""

    mode: str = "paper"
    penalty_floor: float = 0.05

    def rollouts_per_prompt(self, group_size: int) -> int:
        """2G: RoC oversamples, then keeps half."""
        return 2 * group_size

    def select(self, group: GroupOutcome, group_size: int, seed: int) -> Selection:
        """G of the 2G rollouts, binary rewards."""
        _check_group(group, self.rollouts_per_prompt(group_size))
        indices = select_roc(group.rewards, group.penalties, group_size, mode=self.mode, seed=seed,
                             penalty_floor=self.penalty_floor)
        return Selection(indices, np.asarray(group.rewards, np.float64)[indices])


@gin.configurable
@dataclasses.dataclass(frozen=True)
class PenaltySelector:
    """The penalty-reward baseline (SPEC 4): G rollouts, all kept; correct ones earn 1 - lambda * p_err."""

    penalty_lambda: float = 0.5

    def rollouts_per_prompt(self, group_size: int) -> int:
        """G: no oversampling."""
        return group_size

    def select(self, group: GroupOutcome, group_size: int, seed: int) -> Selection:
        """Every rollout; the reward of a correct one lowered by its tool-error share."""
        _check_group(group, group_size)
        p_err = tool_error_penalty(group.tool_calls, group.failed_calls)
        rewards = np.where(np.asarray(group.rewards) == 1, 1.0 - self.penalty_lambda * p_err, 0.0)
        return Selection(np.arange(group.size), rewards)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class PlainGrpoSelector:
    """Plain GRPO with tools (SPEC 4's other baseline): G rollouts, all kept, binary rewards."""

    def rollouts_per_prompt(self, group_size: int) -> int:
        """G: no oversampling."""
        return group_size

    def select(self, group: GroupOutcome, group_size: int, seed: int) -> Selection:
        """Every rollout as verified."""
        _check_group(group, group_size)
        return Selection(np.arange(group.size), np.asarray(group.rewards, np.float64))


SELECTORS = {"roc": RocSelector, "penalty": PenaltySelector, "grpo": PlainGrpoSelector}


@gin.configurable
def make_selector(algorithm: str = "roc") -> Selector:
    """The selector of `algorithm` ("roc", "penalty" or "grpo"), built with its own gin bindings."""
    if algorithm not in SELECTORS:
        raise ValueError(f"unknown RL algorithm {algorithm!r}; choose from {sorted(SELECTORS)}")
    return SELECTORS[algorithm]()
