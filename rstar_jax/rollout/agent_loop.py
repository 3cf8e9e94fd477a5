"""The agent loop: multi-turn rollouts in which the model reasons with the Python tool (issue 5 item 4; SPEC 2).

One asyncio task per trajectory. Each turn is generated until a tool call closes (`</tool_call>`) or the turn ends
(`<|im_end|>`); the turn's calls go to the tool executor at once, without waiting for any other trajectory, and
their responses are appended as context; then the next turn. A trajectory stops by SPEC section 2's four rules:
a turn without a tool call, the response-token budget used, the turn limit reached, or a tool response that would
overflow the budget. Tool failures of any kind (a dead sandbox included) become tool responses the model reads,
never exceptions. Token ids go end to end (DESIGN): the engine gets the trajectory's ids and returns sampled ids.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable, Sequence

import gin
from transformers import PreTrainedTokenizerBase

from rstar_jax.agent.prompt import prompt_token_ids
from rstar_jax.agent.tool_call import FailedToolCall, ToolCall, has_tool_call, parse_tool_calls
from rstar_jax.agent.tool_protocol import FixedOutcome, ToolExecutor, ToolOutcome
from rstar_jax.agent.trajectory import FinishReason, Trajectory, TrajectoryBuilder
from rstar_jax.data.problem import Problem
from rstar_jax.rollout.engine import FINISH_LENGTH, GenerationEngine, RoutingKey, SamplingParams
from rstar_jax.tokenizers.special_tokens import IM_END, TOOL_CALL_CLOSE

EXECUTOR_FAILED = "unavailable"  # status of a call whose executor raised instead of answering


@dataclasses.dataclass(frozen=True)
class RolloutSample:
    """One trajectory of a rollout with where it belongs: its problem, its group (one per problem) and its index
    within the group, so GRPO-RoC can regroup the oversampled rollouts (SPEC section 4)."""

    problem: Problem
    group: int
    sample: int
    seed: int
    trajectory: Trajectory


def turn_seed(trajectory_seed: int, turn: int) -> int:
    """The sampling seed of one turn: a retry of the turn on another engine samples with the same seed."""
    return (trajectory_seed * 1_000_003 + turn) % (1 << 63)


def single_token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    """The id of `token`, which the tokenizer must hold as one id (the stop tokens of a turn)."""
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer splits {token!r} into {len(ids)} ids; a stop token must be one id")
    return ids[0]


@gin.configurable
class AgentLoop:
    """Runs trajectories on `engine` with tools run by `executor` (SPEC section 2).

    max_turns: the turn limit T (paper: 10 in RL stages 1-2, 15 in stage 3, 30 at evaluation); max_response_tokens:
    the budget of model and tool-response tokens after the prompt (each turn's max_new_tokens is what is left);
    temperature / top_p: sampling (SPEC 5: 1.0 in RL; SPEC 7: 0.6 at evaluation); tool_timeout_s: per-call limit
    sent to the sandbox (None: the server's default).
    """

    def __init__(self, engine: GenerationEngine, executor: ToolExecutor, tokenizer: PreTrainedTokenizerBase,
                 max_turns: int = 10, max_response_tokens: int = 8192, temperature: float = 1.0, top_p: float = 1.0,
                 tool_timeout_s: float | None = None) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_response_tokens < 1:
            raise ValueError(f"max_response_tokens must be >= 1, got {max_response_tokens}")
        SamplingParams(temperature=temperature, top_p=top_p)  # validates both with a clear message
        self.engine, self.executor, self.tokenizer = engine, executor, tokenizer
        self.max_turns, self.max_response_tokens = max_turns, max_response_tokens
        self.temperature, self.top_p, self.tool_timeout_s = temperature, top_p, tool_timeout_s
        self.stop_token_ids = (single_token_id(tokenizer, TOOL_CALL_CLOSE), single_token_id(tokenizer, IM_END))

    def _sampling(self, remaining: int, seed: int, routing_key: RoutingKey) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_new_tokens=remaining,
                              stop_token_ids=self.stop_token_ids, seed=seed, routing_key=routing_key)

    async def run_trajectory(self, problem: Problem, seed: int, routing_key: RoutingKey | None = None) -> Trajectory:
        """One trajectory for `problem`, turn by turn until a stop rule of SPEC section 2 holds; `seed` fixes its
        sampling. Every turn carries `routing_key` (default: the trajectory alone, keyed by its seed), so a
        balancer keeps its turns on one engine (SPEC section 6). Engine errors propagate (a `FailoverEngine`
        retries them); tool failures never do."""
        key = RoutingKey(seed) if routing_key is None else routing_key
        builder = TrajectoryBuilder(self.tokenizer, prompt_token_ids(self.tokenizer, problem.question))
        while True:
            remaining = self.max_response_tokens - builder.response_length
            if remaining <= 0:
                return builder.finish(FinishReason.MAX_LENGTH)
            turn = await self.engine.generate(builder.token_ids,
                                              self._sampling(remaining, turn_seed(seed, builder.turns), key))
            text = builder.add_sampled_turn(turn.token_ids, turn.logprobs)
            if turn.finish_reason == FINISH_LENGTH:
                return builder.finish(FinishReason.MAX_LENGTH)
            if not has_tool_call(text):
                return builder.finish(FinishReason.ANSWERED)
            if builder.turns >= self.max_turns:
                return builder.finish(FinishReason.MAX_TURNS)
            outcomes = await asyncio.gather(*(self._run_call(call) for call in parse_tool_calls(text)))
            if not builder.add_tool_responses(outcomes, self.max_response_tokens):
                return builder.finish(FinishReason.TOOL_RESPONSE_OVERFLOW)

    async def _run_call(self, call: ToolCall | FailedToolCall) -> ToolOutcome | FailedToolCall:
        """The outcome of one parsed call; an executor that raises gives a failed outcome instead (SPEC 2)."""
        if isinstance(call, FailedToolCall):
            return call
        try:
            return await self.executor.run(call.code, call.stdin, timeout_s=self.tool_timeout_s)
        except Exception as error:  # noqa: BLE001 - a broken tool is the model's problem to read, not a crash
            return FixedOutcome(EXECUTOR_FAILED, stderr=f"the tool could not be run: {type(error).__name__}: {error}")

    async def rollout(self, problems: Sequence[Problem], n_per_problem: int, seed: int = 0,
                      on_done: Callable[[RolloutSample], None] | None = None) -> list[RolloutSample]:
        """`n_per_problem` trajectories of every problem, all concurrently (one task each), in (group, sample)
        order. Sample k of group g is sampled with seed `seed + g * n_per_problem + k` and routed with the key
        (that seed, its place g * n_per_problem + k in the batch, the batch's size). `on_done` is called with each
        trajectory as it finishes (e.g. to advance a progress bar)."""
        if n_per_problem < 1:
            raise ValueError(f"n_per_problem must be >= 1, got {n_per_problem}")

        batch_size = len(problems) * n_per_problem

        async def one(group: int, sample: int) -> RolloutSample:
            sample_seed = seed + group * n_per_problem + sample
            key = RoutingKey(sample_seed, group * n_per_problem + sample, batch_size)
            trajectory = await self.run_trajectory(problems[group], sample_seed, key)
            done = RolloutSample(problems[group], group, sample, sample_seed, trajectory)
            if on_done is not None:
                on_done(done)
            return done

        tasks = [asyncio.ensure_future(one(group, sample)) for group in range(len(problems))
                 for sample in range(n_per_problem)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # one failed (e.g. every engine down): stop the rest instead of orphaning them
                task.cancel()
            raise
