"""Did the format SFT work? Sample the trained model on new synthetic problems, with the real sandbox in the loop.

The goal of the CPU demo's SFT (SPEC section 5: SFT teaches the tool-call format so RL starts from it): sampled at
temperature 1.0 on the agent prompt of a problem it never saw, the model opens with a parseable `<tool_call>`;
decoded greedily by the RL rollouts' own agent loop, it runs the call, reads the sandbox's output and boxes the
right answer. Two numbers measure that: `tool_call_rate` (first turns at T=1 whose calls all parse) and
`greedy_accuracy` (verified final answers of greedy multi-turn solves, SPEC section 3).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Sequence

import gin
from transformers import PreTrainedTokenizerBase

from rstar_jax.agent.prompt import prompt_token_ids
from rstar_jax.agent.tool_call import ToolCall, parse_tool_calls
from rstar_jax.agent.tool_protocol import ToolExecutor
from rstar_jax.agent.trajectory import sampled_turn_texts
from rstar_jax.data.synthetic import SyntheticTask, synthetic_tasks
from rstar_jax.reward.verifier import verify
from rstar_jax.rollout.agent_loop import AgentLoop
from rstar_jax.rollout.engine import GenerationEngine, SamplingParams
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.tokenizers.special_tokens import IM_END
from sandbox_server.client import SandboxClient
from sandbox_server.launcher import running_server


def calls_parse(turn_text: str) -> bool:
    """Whether an assistant turn makes at least one tool call and every call in it parses into a program."""
    calls = parse_tool_calls(turn_text)
    return bool(calls) and all(isinstance(call, ToolCall) for call in calls)


async def sampled_first_turn(engine: GenerationEngine, tokenizer: PreTrainedTokenizerBase, question: str,
                             sampling: SamplingParams) -> str:
    """The text of the model's first assistant turn for `question`'s agent prompt."""
    generation = await engine.generate(prompt_token_ids(tokenizer, question), sampling)
    return tokenizer.decode(list(generation.token_ids), skip_special_tokens=False)


async def _probe(engine: GenerationEngine, executor: ToolExecutor, tokenizer: PreTrainedTokenizerBase,
                 tasks: Sequence[SyntheticTask], max_new_tokens: int, max_turns: int, max_response_tokens: int,
                 seed: int) -> dict[str, Any]:
    stop = (tokenizer.convert_tokens_to_ids(IM_END),)
    firsts = await asyncio.gather(*(
        sampled_first_turn(engine, tokenizer, task.problem.question,
                           SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=stop,
                                          seed=seed + index))
        for index, task in enumerate(tasks)))
    loop = AgentLoop(engine, executor, tokenizer, max_turns=max_turns, max_response_tokens=max_response_tokens,
                     temperature=0.0)
    rollouts = await loop.rollout([task.problem for task in tasks], 1, seed=seed)
    solves = [sampled_turn_texts(sample.trajectory, tokenizer) for sample in rollouts]
    correct = [verify("\n".join(turns), task.problem.answer) for task, turns in zip(tasks, solves)]
    return {
        "problems": len(tasks),
        "tool_call_rate": sum(calls_parse(text) for text in firsts) / len(tasks),
        "greedy_first_turn_call_rate": sum(bool(t) and calls_parse(t[0]) for t in solves) / len(tasks),
        "greedy_accuracy": sum(correct) / len(tasks),
        "samples": [{"question": task.problem.question, "answer": task.problem.answer, "sampled_first_turn": first,
                     "greedy_turns": turns, "greedy_correct": ok}
                    for task, first, turns, ok in zip(tasks, firsts, solves, correct)],
    }


@gin.configurable
def probe_format(model_dir: str | Path, num_problems: int = 32, seed: int = 1_000_003, tokenizer: str = "tiny",
                 max_new_tokens: int = 192, max_turns: int = 3, max_len: int = 1024, slots: int = 8,
                 prefill_buckets: Sequence[int] = (512, 1024)) -> dict[str, Any]:
    """Measure the format on `num_problems` synthetic problems of `seed` (pick one the SFT data did not use).

    Runs the model in the in-process JAX engine and the calls in a sandbox server started for the probe; returns
    the two rates, greedy accuracy and every sampled text.
    """
    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    tasks = synthetic_tasks(num_problems, seed=seed)
    token_source = load_tokenizer(tokenizer)
    longest_prompt = max(len(prompt_token_ids(token_source, task.problem.question)) for task in tasks)
    engine = JaxEngine.from_hf(model_dir, slots=slots, max_len=max_len, prefill_buckets=prefill_buckets)
    try:
        with running_server(("--workers", "2")) as server:
            async def run() -> dict[str, Any]:
                async with SandboxClient([server.url]) as client:
                    return await _probe(engine, client, token_source, tasks, max_new_tokens, max_turns,
                                        max_len - longest_prompt, seed)

            return asyncio.run(run())
    finally:
        engine.close()
