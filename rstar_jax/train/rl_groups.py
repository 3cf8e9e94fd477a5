"""Verified rollouts -> the groups the learner trains on (SPEC section 4, steps 1-5).

The agent loop returns each prompt's rollouts together, in (group, sample) order. Here each group becomes a
`GroupOutcome` of counts, the configured selector keeps some of its rollouts with training rewards (RoC, penalty
rewards or plain GRPO), groups whose kept rewards are all equal are set aside (they carry no signal, SPEC 4.2), and
the rest get group-relative advantages. Seeds are derived from the step's seed and the group's index, so a rerun
selects exactly the same rollouts.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rstar_jax.agent.trajectory import Trajectory
from rstar_jax.rl import GroupOutcome, Selector, group_advantages, has_signal
from rstar_jax.rollout.agent_loop import RolloutSample
from rstar_jax.seeds import derived_seed


@dataclasses.dataclass(frozen=True)
class TrainingGroups:
    """Kept rollouts (group after group, `group_size` each), their training rewards and advantages, and how many
    groups were seen, kept, and left out of a full batch (`groups_surplus`: groups with signal a refill round
    brought beyond the batch's room)."""

    samples: tuple[RolloutSample, ...] = ()
    rewards: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    advantages: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))
    groups_seen: int = 0
    groups_kept: int = 0
    group_size: int = 0
    groups_surplus: int = 0

    def __post_init__(self) -> None:
        rows = self.groups_kept * self.group_size
        if not len(self.samples) == len(self.rewards) == len(self.advantages) == rows:
            raise ValueError(f"{self.groups_kept} kept groups of {self.group_size} need {rows} samples, rewards and "
                             f"advantages, got {len(self.samples)}, {len(self.rewards)}, {len(self.advantages)}")

    @property
    def groups_without_signal(self) -> int:
        """Groups dropped because every kept rollout had the same reward."""
        return self.groups_seen - self.groups_kept - self.groups_surplus

    @property
    def trajectories(self) -> list[Trajectory]:
        """The kept trajectories, in order."""
        return [sample.trajectory for sample in self.samples]

    def merged(self, more: "TrainingGroups", max_groups: int) -> "TrainingGroups":
        """These groups followed by `more`'s, keeping at most `max_groups` in all (for refilling a batch): whole
        groups of `group_size` rows, the first of `more`'s that fit (the rest count as `groups_surplus`)."""
        if self.group_size and more.group_size and self.group_size != more.group_size:
            raise ValueError(f"cannot merge groups of {self.group_size} with groups of {more.group_size}")
        group_size = self.group_size or more.group_size
        take = min(more.groups_kept, max(0, max_groups - self.groups_kept))
        count = take * group_size
        return TrainingGroups(self.samples + more.samples[:count], np.concatenate([self.rewards, more.rewards[:count]]),
                              np.concatenate([self.advantages, more.advantages[:count]]),
                              self.groups_seen + more.groups_seen, self.groups_kept + take, group_size,
                              self.groups_surplus + more.groups_surplus + more.groups_kept - take)


def group_outcome(trajectories: Sequence[Trajectory], verified: Sequence[bool]) -> GroupOutcome:
    """The counts a selector reads of one prompt's rollouts (SPEC 4.4), failures from structured tool statuses."""
    return GroupOutcome(
        rewards=np.asarray(verified, np.float64),
        tool_calls=np.array([len(t.tool_calls) for t in trajectories]),
        failed_calls=np.array([t.tool_errors for t in trajectories]),
        answer_tags=np.array([t.answer_tags for t in trajectories]),
        turns=np.array([t.turns for t in trajectories]),
    )


def training_groups(samples: Sequence[RolloutSample], verified: Sequence[bool], selector: Selector,
                    group_size: int, step_seed: int) -> TrainingGroups:
    """Select each prompt's kept rollouts and compute their advantages (SPEC 4.2-4.5).

    `samples` hold `selector.rollouts_per_prompt(group_size)` rollouts per group, grouped as the agent loop returns
    them; `verified` says whether each one's answer is right (SPEC 3).
    """
    if len(samples) != len(verified):
        raise ValueError(f"{len(samples)} samples but {len(verified)} verdicts")
    per_prompt = selector.rollouts_per_prompt(group_size)
    if len(samples) % per_prompt:
        raise ValueError(f"{len(samples)} rollouts do not split into groups of {per_prompt}")
    kept: list[RolloutSample] = []
    rewards, advantages = [], []
    groups = len(samples) // per_prompt
    for group in range(groups):
        members = samples[group * per_prompt:(group + 1) * per_prompt]
        if len({sample.group for sample in members}) != 1:
            raise ValueError(f"group {group}'s rollouts belong to different prompts")
        outcome = group_outcome([sample.trajectory for sample in members],
                                verified[group * per_prompt:(group + 1) * per_prompt])
        selection = selector.select(outcome, group_size, derived_seed(step_seed, group, bits=32))
        if len(selection.indices) != group_size:  # the Selector contract; merged() cuts batches by whole groups
            raise ValueError(f"{type(selector).__name__} kept {len(selection.indices)} rollouts of group {group}, "
                             f"not group_size = {group_size}")
        if not has_signal(selection.rewards):
            continue
        kept += [members[index] for index in selection.indices]
        rewards.append(selection.rewards)
        advantages.append(group_advantages(selection.rewards[None, :])[0])
    if not kept:
        return TrainingGroups(groups_seen=groups, group_size=group_size)
    return TrainingGroups(tuple(kept), np.concatenate(rewards), np.concatenate(advantages), groups, len(rewards),
                          group_size)
