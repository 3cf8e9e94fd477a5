"""The RL rollout batch the fleet simulator replays (SPEC sections 2, 4-6): prompts x samples of multi-turn
trajectories with long-tailed lengths and tool calls, reproducible by seed.

Each of `prompts` problems has a prompt length (system prompt with the tool schema plus the problem) and a
difficulty; its `samples` trajectories share both, so a hard problem's samples are all long (what makes an even
split of the batch uneven). A trajectory's response length is its problem's mean times a per-sample factor, both
log-normal with mean 1 (long right tail); it makes a Poisson number of tool calls (at most max_turns - 1) that cut
the response into turns at uniform random points; each call returns a tool response of a uniform number of tokens
after a log-normal latency fitted to the sandbox's measured p50 and p99 (BENCHMARKS.md, "Sandbox server": the sympy
snippet on one warm worker, p50 19.2 ms, p99 67.0 ms). The simulated model generates exactly the planned tokens of
each turn (`TurnScript`), and the agent loop's budget rules cut what does not fit.
"""

from __future__ import annotations

import dataclasses
import math

import gin
import numpy as np

from rstar_jax.rollout.engine import RoutingKey, SamplingParams
from rstar_jax.rollout.turn_parts import PositionalIds

_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Workload:
    """How the simulated batch is drawn (defaults: the paper's batch of 512 prompts x 32 samples, stage 1's 8K
    budget and 10 turns, responses averaging 3K tokens: SPEC sections 4-5)."""

    prompts: int = 512
    samples: int = 32
    max_response_tokens: int = 8192
    max_turns: int = 10
    prompt_tokens_median: int = 450
    prompt_tokens_sigma: float = 0.3
    response_tokens_mean: float = 3000.0
    difficulty_sigma: float = 0.6
    sample_sigma: float = 0.6
    tool_calls_mean: float = 2.0
    tool_response_tokens: tuple[int, int] = (40, 120)
    tool_latency_p50_s: float = 0.0192
    tool_latency_p99_s: float = 0.0670
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.samples < 1 or self.max_turns < 1 or self.max_response_tokens < 1:
            raise ValueError(f"prompts, samples, max_turns and max_response_tokens must be >= 1: {self}")
        if not 0 < self.tool_latency_p50_s <= self.tool_latency_p99_s:
            raise ValueError("tool latency needs 0 < p50 <= p99")


@dataclasses.dataclass(frozen=True)
class TrajectoryPlan:
    """One planned trajectory: its prompt, the tokens each turn generates, and each tool call's response size and
    latency (one fewer than turns)."""

    index: int
    group: int
    prompt_tokens: int
    turn_tokens: tuple[int, ...]
    tool_tokens: tuple[int, ...]
    tool_latency_s: tuple[float, ...]


class ContextIds(PositionalIds):
    """A simulated trajectory's first `length` context ids, as a prefix cache sees them: its group's prompt (the
    same ids for every sample of one problem), then ids of its own (what it generated, and its tool responses)."""

    def __init__(self, plan: TrajectoryPlan, length: int) -> None:
        self._plan, self._length = plan, length

    def __len__(self) -> int:
        return self._length

    def at(self, position: int) -> int:
        """The group's id in the prompt, the trajectory's after it."""
        return -1 - self._plan.group if position < self._plan.prompt_tokens else self._plan.index


class TurnScript:
    """What the simulated model generates: each trajectory's current turn ends at a planned context length.

    The simulated agent says where its turn starts and how long it is meant to be (`expect`); a simulated engine
    asked to continue that trajectory from a context of n tokens generates up to the planned end (so a turn
    generated in parts ends at the same token as a whole one).
    """

    def __init__(self) -> None:
        self._turns: dict[RoutingKey, tuple[int, int]] = {}

    def expect(self, key: RoutingKey, start: int, tokens: int) -> None:
        """The trajectory `key`'s next turn starts at context length `start` and generates `tokens` tokens."""
        self._turns[key] = (start, start + tokens)

    def __call__(self, prompt_tokens: int, sampling: SamplingParams) -> int:
        """Tokens the model generates continuing `sampling.routing_key`'s trajectory from `prompt_tokens` tokens."""
        if sampling.routing_key not in self._turns:
            raise KeyError(f"no turn is planned for routing key {sampling.routing_key}")
        start, end = self._turns[sampling.routing_key]
        if not start <= prompt_tokens < end:
            raise KeyError(f"the planned turn of {sampling.routing_key} spans context [{start}, {end}), "
                           f"not {prompt_tokens}")
        return end - prompt_tokens


def _lognormal(rng: np.random.Generator, mean_one_sigma: float, size: int) -> np.ndarray:
    """Log-normal factors with mean 1."""
    return rng.lognormal(-mean_one_sigma ** 2 / 2, mean_one_sigma, size)


def plan_batch(workload: Workload) -> list[TrajectoryPlan]:
    """The batch's trajectories in (problem, sample) order, drawn from `workload.seed` (SPEC section 6)."""
    rng = np.random.default_rng(workload.seed)
    count = workload.prompts * workload.samples
    groups = np.repeat(np.arange(workload.prompts), workload.samples)
    prompt = np.maximum(1, rng.lognormal(math.log(workload.prompt_tokens_median), workload.prompt_tokens_sigma,
                                         workload.prompts).round().astype(int))[groups]
    difficulty = _lognormal(rng, workload.difficulty_sigma, workload.prompts)[groups]
    response = workload.response_tokens_mean * difficulty * _lognormal(rng, workload.sample_sigma, count)
    calls = np.minimum(rng.poisson(workload.tool_calls_mean, count), workload.max_turns - 1)
    low, high = workload.tool_response_tokens
    latency_sigma = math.log(workload.tool_latency_p99_s / workload.tool_latency_p50_s) / _Z99
    plans = []
    for index in range(count):
        turns = int(calls[index]) + 1
        cuts = np.sort(rng.uniform(0, 1, turns - 1))
        shares = np.diff(np.concatenate(([0.0], cuts, [1.0])))
        tokens = np.maximum(1, (shares * response[index]).round().astype(int))
        plans.append(TrajectoryPlan(
            index=index, group=int(groups[index]), prompt_tokens=int(prompt[index]),
            turn_tokens=tuple(int(t) for t in tokens),
            tool_tokens=tuple(int(t) for t in rng.integers(low, high + 1, turns - 1)),
            tool_latency_s=tuple(float(s) for s in rng.lognormal(math.log(workload.tool_latency_p50_s), latency_sigma,
                                                                  turns - 1))))
    return plans
