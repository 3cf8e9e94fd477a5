"""GRPO-RoC as pure functions on arrays and small records (SPEC section 4): advantages, the quality penalty, the
rollout selectors (RoC, penalty rewards, plain GRPO) and the learner's losses. Imports neither `rollout` nor `train`.
"""

from rstar_jax.rl.advantages import group_advantages, has_signal
from rstar_jax.rl.losses import PolicyLossOptions, loss_weights, masked_nll, policy_loss
from rstar_jax.rl.penalties import format_penalty, roc_penalty, tool_error_penalty
from rstar_jax.rl.selection import (
    SELECTORS,
    GroupOutcome,
    PenaltySelector,
    PlainGrpoSelector,
    RocSelector,
    Selection,
    Selector,
    make_selector,
    roc_class_sizes,
    select_roc,
)

__all__ = [
    "SELECTORS",
    "GroupOutcome",
    "PenaltySelector",
    "PlainGrpoSelector",
    "PolicyLossOptions",
    "RocSelector",
    "Selection",
    "Selector",
    "format_penalty",
    "group_advantages",
    "has_signal",
    "loss_weights",
    "make_selector",
    "masked_nll",
    "policy_loss",
    "roc_class_sizes",
    "roc_penalty",
    "select_roc",
    "tool_error_penalty",
]
