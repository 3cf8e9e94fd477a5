"""Agentic evaluation: k sampled solves per problem through the agent loop, verified (SPEC section 7).

avg@k pass@1 is the mean over problems of the share of their k samples that verify (SPEC 7 reports avg@16 at
temperature 0.6); pass@k whether any does. Greedy decoding is k = 1 at temperature 0. The figures of the trajectories
(tool calls, tool-error ratio among correct ones, lengths) come from `trajectory_metrics`, the same numbers the
trainer logs, so a before/after comparison reads alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from rstar_jax.agent.tool_protocol import ToolExecutor
from rstar_jax.console import Progress
from rstar_jax.data.problem import Problem
from rstar_jax.eval.metrics import avg_at_k, pass_at_k, verdict_matrix
from rstar_jax.reward.verifier import Verifier
from rstar_jax.rl.metrics import trajectory_metrics
from rstar_jax.rollout.agent_loop import AgentLoop, RolloutSample
from rstar_jax.rollout.engine import GenerationEngine
from rstar_jax.rollout.verified import verified_rollouts


@dataclasses.dataclass(frozen=True)
class EvalResult:
    """Summary figures and one record per problem (its id, reference, how many of its samples verified)."""

    summary: dict[str, Any]
    problems: list[dict[str, Any]]
    samples: list[RolloutSample]
    correct: list[bool]


async def evaluate(engine: GenerationEngine, executor: ToolExecutor, tokenizer: Any, problems: Sequence[Problem],
                   verifier: Verifier, samples: int = 1, temperature: float = 0.0, max_turns: int = 30,
                   max_response_tokens: int = 30_000, seed: int = 0, verify_timeout_s: float = 10.0) -> EvalResult:
    """Solve every problem `samples` times at `temperature` (0: greedy) with the tool, and verify each answer with
    `verifier` (through `verified_rollouts`, the trainer's own rollout -> answer -> verdict path).

    summary: problems, samples, avg@k ("accuracy"), pass@k, and `trajectory_metrics` of all trajectories.
    """
    if not problems:
        raise ValueError("evaluate needs at least one problem")
    loop = AgentLoop(engine, executor, tokenizer, max_turns=max_turns, max_response_tokens=max_response_tokens,
                     temperature=temperature)
    label = "greedy" if temperature == 0 else f"T={temperature:g}"
    with Progress(len(problems) * samples, f"evaluation ({label})", every=64,
                  unit="trajectory") as progress:
        verified = await verified_rollouts(loop, problems, samples, seed, verifier, verify_timeout_s,
                                           on_done=lambda _: progress.advance())
    rollouts, correct = verified.samples, verified.correct
    per_problem = verdict_matrix(correct, len(problems), samples)
    records = [{"id": problem.id, "answer": problem.answer, "correct": int(row.sum()), "samples": samples}
               for problem, row in zip(problems, per_problem)]
    summary = {"problems": len(problems), "samples": samples, "temperature": temperature,
               **trajectory_metrics([sample.trajectory for sample in rollouts], correct),
               "pass_at_k": pass_at_k(per_problem)}
    summary["accuracy"] = avg_at_k(per_problem)  # avg@k: the mean over problems of each one's solved share
    return EvalResult(summary, records, rollouts, correct)
