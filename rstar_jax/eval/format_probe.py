"""Did the format SFT work? Sample the trained model on held-out synthetic problems, with the real sandbox in the
loop (the SFT's goal, SPEC section 5: RL starts from a model that writes the agent format).

Two numbers measure the format: `tool_call_rate` (first turns sampled at T=1 whose tool calls all parse) and
`greedy_accuracy` (verified answers of greedy multi-turn solves through the RL rollouts' own agent loop, SPEC 3).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import gin

from rstar_jax.agent.prompt import prompt_token_ids
from rstar_jax.agent.tool_call import ToolCall, parse_tool_calls
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.eval.agentic import evaluate
from rstar_jax.processes import running_sandbox
from rstar_jax.reward.verifier import Verifier
from rstar_jax.rollout.engine import SamplingParams
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.tokenizers import load_tokenizer
from rstar_jax.tokenizers.special_tokens import IM_END
from sandbox_server.client import SandboxClient


def calls_parse(turn_text: str) -> bool:
    """Whether an assistant turn makes at least one tool call and every call in it parses into a program."""
    calls = parse_tool_calls(turn_text)
    return bool(calls) and all(isinstance(call, ToolCall) for call in calls)


@gin.configurable
def probe_format(model_dir: str | Path, verifier: Verifier, num_problems: int = 32, seed: int = 1_000_003,
                 max_new_tokens: int = 192, max_turns: int = 3, max_len: int = 1024, slots: int = 8) -> dict[str, Any]:
    """Measure the format on `num_problems` held-out synthetic problems of `seed` (the model folder's tokenizer).

    Runs the model in the in-process JAX engine and the calls in a sandbox server started for the probe; greedy
    answers are checked by `verifier`. Returns the two rates, greedy accuracy and every greedy solve's turns.
    """
    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    problems = synthetic_problems(num_problems, seed=seed, split="heldout")
    tokenizer = load_tokenizer(model_dir)
    stop = (tokenizer.convert_tokens_to_ids(IM_END),)
    longest_prompt = max(len(prompt_token_ids(tokenizer, problem.question)) for problem in problems)
    engine = JaxEngine.from_hf(model_dir, slots=slots, max_len=max_len)

    async def probe(url: str) -> dict[str, Any]:
        firsts = await asyncio.gather(*(
            engine.generate(prompt_token_ids(tokenizer, problem.question),
                            SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, stop_token_ids=stop,
                                           seed=seed + index))
            for index, problem in enumerate(problems)))
        async with SandboxClient([url]) as client:
            greedy = await evaluate(engine, client, tokenizer, problems, verifier, samples=1, temperature=0.0,
                                    max_turns=max_turns, max_response_tokens=max_len - longest_prompt, seed=seed)
        first_texts = [tokenizer.decode(list(turn.token_ids), skip_special_tokens=False) for turn in firsts]
        turns = [[tokenizer.decode([t for t, m in zip(s.trajectory.token_ids, s.trajectory.loss_mask) if m],
                                   skip_special_tokens=False)] for s in greedy.samples]
        return {
            "problems": len(problems),
            "tool_call_rate": sum(calls_parse(text) for text in first_texts) / len(problems),
            "greedy_accuracy": greedy.summary["accuracy"],
            "greedy_tool_calls": greedy.summary["tool_calls"],
            "samples": [{"question": problem.question, "answer": problem.answer, "sampled_first_turn": first,
                         "greedy_model_text": text[0], "greedy_correct": ok}
                        for problem, first, text, ok in zip(problems, first_texts, turns, greedy.correct)],
        }

    try:
        with running_sandbox(("--workers", "2")) as server:
            return asyncio.run(probe(server.url))
    finally:
        engine.close()
