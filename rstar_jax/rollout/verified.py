"""Rollouts with their verdicts: the one path from problems to verified trajectories (SPEC sections 2-3).

The trainer's steps, its stage-3 difficulty filter and every evaluation solve problems the same way: the agent
loop rolls them out, each trajectory's answer is read from the model's own turns (never from tool output) and the
verifier checks it against the reference. The two phases are timed apart (the trainer logs them as "rollout" and
"rewards").
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

from rstar_jax.agent.trajectory import sampled_turn_texts
from rstar_jax.data.problem import Problem
from rstar_jax.reward.verifier import Verifier
from rstar_jax.rollout.agent_loop import AgentLoop, RolloutSample


@dataclasses.dataclass(frozen=True)
class VerifiedRollouts:
    """Rollouts in (group, sample) order, whether each one's answer verified, and the seconds of each phase."""

    samples: list[RolloutSample]
    correct: list[bool]
    rollout_seconds: float
    verify_seconds: float


def response_texts(samples: Sequence[RolloutSample], tokenizer: Any) -> list[str]:
    """What each rollout's answer is read from: the model's own turns (SPEC 3), never tool output."""
    return ["\n".join(sampled_turn_texts(sample.trajectory, tokenizer)) for sample in samples]


async def verified_rollouts(loop: AgentLoop, problems: Sequence[Problem], per_problem: int, seed: int,
                            verifier: Verifier, verify_timeout_s: float | None = None,
                            on_done: Callable[[RolloutSample], None] | None = None) -> VerifiedRollouts:
    """`per_problem` rollouts of every problem through `loop` (seeded as `AgentLoop.rollout`), then each answer
    verified by `verifier` within `verify_timeout_s` (SPEC 3: the binary outcome reward)."""
    started = time.monotonic()
    samples = await loop.rollout(list(problems), per_problem, seed=seed, on_done=on_done)
    verify_started = time.monotonic()
    correct = verifier.verify_batch(response_texts(samples, loop.tokenizer),
                                    [sample.problem.answer for sample in samples], timeout_s=verify_timeout_s)
    return VerifiedRollouts(samples, list(correct), verify_started - started, time.monotonic() - verify_started)
