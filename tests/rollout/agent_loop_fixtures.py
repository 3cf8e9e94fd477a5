"""A tiny model that calls the Python tool, for the agent-loop and rollout tests (issue 5 items 4-5, must-show).

A random model almost never writes `<tool_call>`, so the tests overfit a small Qwen3 decoder (the tiny tokenizer's
vocabulary; head_dim 32 so vLLM's CPU attention serves it too) on a few transcripts in the agent format: after any
question it calls the tool with one fixed program, reads the real sandbox's answer and writes a boxed answer. Loss is
on the assistant tokens only, so it is cheap enough to train in a test (about a minute on 2 cores). Sampled at
temperature 1 it mostly follows the transcript and sometimes drifts (broken JSON, a second call), which the loop
must handle too. The weights are written once per pytest session as a Hugging Face folder that both the JAX engine
and vLLM load.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path
from typing import Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from transformers import PreTrainedTokenizerBase

from experiments.make_tiny_model import TINY_MODEL_GIN, make_tiny_model
from rstar_jax.agent import (FinishReason, ToolCall, ToolOutcome, Trajectory, TrajectoryBuilder, prompt_token_ids,
                             tool_call_text)
from rstar_jax.data.problem import Problem
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import CausalLM, ModelConfig, load_hf, positions_from_mask, save_hf, token_logprobs
from rstar_jax.model.lm import Params
from rstar_jax.rollout.agent_loop import AgentLoop, RolloutSample
from rstar_jax.rollout.engine import GenerationEngine
from rstar_jax.tokenizers import load_tokenizer
from sandbox_server.api import Status
from sandbox_server.client import SandboxClient

TOOL_MODEL_SHAPE = ("ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 192",
                    "ModelConfig.num_layers = 2", "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 1",
                    "ModelConfig.head_dim = 32", "ModelConfig.max_position_embeddings = 1024")
PROGRAM = ToolCall(code="print(6 * 7)")
ANSWER_TURN = "<answer>\\boxed{42}</answer>"
# 16 questions, not 4: with 4 the model's behaviour on new questions was left to chance (after a numerically
# equivalent rewrite of the projections, 36 of 64 rollouts called the tool instead of 64); with 16, 64 of 64 did.
SFT_QUESTIONS, SFT_STEPS, SFT_LEARNING_RATE = 16, 200, 1e-2
SANDBOX_ARGS = ("--workers", "2", "--default-timeout-s", "10")
TRAINED_MARK = "sft_loss.txt"
MAX_TURNS, BUDGET = 4, 512  # the rollouts' turn limit and response budget
TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)
INVALID_CALL = "invalid_call"  # FailedToolCall.status


def transcript(tokenizer: PreTrainedTokenizerBase, question: str, outcome: ToolOutcome) -> Trajectory:
    """The transcript the model learns: call PROGRAM, read `outcome`, answer."""
    builder = TrajectoryBuilder(tokenizer, prompt_token_ids(tokenizer, question))
    builder.add_written_turn(tool_call_text(PROGRAM))
    builder.add_tool_responses([outcome])
    builder.add_written_turn(ANSWER_TURN)
    return builder.finish(FinishReason.ANSWERED)


async def _transcripts(url: str, count: int) -> list[Trajectory]:
    async with SandboxClient([url]) as client:
        outcome = await client.run(PROGRAM.code)
    if not outcome.ok:
        raise RuntimeError(f"the sandbox failed to run {PROGRAM.code!r}: {outcome}")
    outcome = dataclasses.replace(outcome, duration_ms=0.0)  # the same training data, however fast the sandbox ran
    tokenizer = load_tokenizer("tiny")
    return [transcript(tokenizer, problem.question, outcome) for problem in synthetic_problems(count, seed=11)]


def padded_batch(trajectories: Sequence[Trajectory], multiple: int = 64) -> tuple[np.ndarray, ...]:
    """ids, attention mask and loss mask [N, W], right-padded to a multiple of `multiple` tokens."""
    width = -(-max(len(t.token_ids) for t in trajectories) // multiple) * multiple
    ids, attention, loss = (np.zeros((len(trajectories), width), np.int32) for _ in range(3))
    for row, trajectory in enumerate(trajectories):
        length = len(trajectory.token_ids)
        ids[row, :length] = trajectory.token_ids
        attention[row, :length] = 1
        loss[row, :length] = trajectory.loss_mask
    return ids, attention, loss


def overfit(config: ModelConfig, params: Params, trajectories: Sequence[Trajectory], steps: int,
            learning_rate: float) -> tuple[Params, float]:
    """Adam (clipped gradients) on the masked next-token loss of `trajectories`, whole batch each step; returns the
    parameters with the lowest loss seen (a late loss spike cannot spoil them) and that loss."""
    ids, attention, loss_mask = padded_batch(trajectories)
    inputs, targets = jnp.asarray(ids[:, :-1]), jnp.asarray(ids[:, 1:])
    mask, weights = jnp.asarray(attention[:, :-1]), jnp.asarray(loss_mask[:, 1:], jnp.float32)
    positions = positions_from_mask(mask)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate))

    def loss_fn(p: Params) -> jax.Array:
        logprobs = token_logprobs(p, config, inputs, positions, mask, targets)
        return -(logprobs * weights).sum() / weights.sum()

    @jax.jit
    def step(p: Params, state: optax.OptState) -> tuple[Params, optax.OptState, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    state = optimizer.init(params)
    best_params, best_loss = params, np.inf
    for _ in range(steps):
        updated, state, loss = step(params, state)
        if float(loss) < best_loss:  # `loss` is that of `params`, before this update
            best_params, best_loss = params, float(loss)
        params = updated
    return best_params, best_loss


def tool_calling_model(folder: Path, sandbox_url: str) -> CausalLM:
    """The tool-calling tiny model in `folder` (an HF folder with the tiny tokenizer), trained there if absent."""
    if not (folder / TRAINED_MARK).exists():
        try:
            parse_gin([TINY_MODEL_GIN], ["ModelConfig.tie_word_embeddings = False", *TOOL_MODEL_SHAPE])
            model = make_tiny_model(folder, seed=0)
        finally:
            gin.clear_config()
        params, loss = overfit(model.config, model.params, asyncio.run(_transcripts(sandbox_url, SFT_QUESTIONS)),
                               SFT_STEPS, SFT_LEARNING_RATE)
        save_hf(CausalLM(model.config, params), folder)
        (folder / TRAINED_MARK).write_text(f"{loss:.4f}\n")
    return load_hf(folder)


async def run_rollout(engine: GenerationEngine, sandbox_urls: Sequence[str], problems: Sequence[Problem], n: int,
                      seed: int = 0, **loop_options: object) -> list[RolloutSample]:
    """`AgentLoop.rollout` of `n` samples per problem with a sandbox client of `sandbox_urls` (closed after)."""
    async with SandboxClient(sandbox_urls, attempts=2, retry_backoff_s=0.05) as client:
        loop = AgentLoop(engine, client, load_tokenizer("tiny"), **{"max_turns": MAX_TURNS,
                                                                    "max_response_tokens": BUDGET, **loop_options})
        return await loop.rollout(problems, n, seed=seed)


def check_trajectory(trajectory: Trajectory, tokenizer: PreTrainedTokenizerBase, max_turns: int = MAX_TURNS,
                     budget: int = BUDGET) -> list[str]:
    """Checks every trajectory must pass (masks, logprobs, limits, one response per call and one new assistant
    turn after each, response text matching the call's status); returns its tool-response texts."""
    prompt = trajectory.prompt_length
    mask = np.asarray(trajectory.loss_mask)
    logprobs = np.asarray(trajectory.rollout_logprobs)
    assert not mask[:prompt].any() and (logprobs[mask == 0] == 0).all()
    assert mask[prompt] == 1, "the response starts with a sampled token"
    assert trajectory.response_length <= budget and 1 <= trajectory.turns <= max_turns
    context = tokenizer.decode([t for t, m in zip(trajectory.token_ids[prompt:], mask[prompt:]) if not m],
                               skip_special_tokens=False)
    responses = TOOL_RESPONSE.findall(context)
    assert context.count("<|im_start|>assistant") == len(responses), "one new assistant turn after each response"
    assert context.count("<tool_response>") == len(responses)
    if trajectory.finish_reason in (FinishReason.ANSWERED, FinishReason.MAX_TURNS):
        assert trajectory.token_ids[-1] in tokenizer.convert_tokens_to_ids(["<|im_end|>", "</tool_call>"])
    if trajectory.finish_reason == FinishReason.TOOL_RESPONSE_OVERFLOW:
        assert len(responses) < len(trajectory.tool_calls)
    else:
        assert len(responses) == len(trajectory.tool_calls)
    for call, response in zip(trajectory.tool_calls, responses):
        if call.status == INVALID_CALL:
            assert response.startswith("Tool call failed")
        else:
            assert call.status in Status.ALL
            assert response.startswith("succeeded" if call.ok else f"failed ({call.status})")
    return responses


def learner_logprobs(model: CausalLM, trajectory: Trajectory) -> np.ndarray:
    """log p(token t | tokens before t) from the learner for every token after the first."""
    ids = np.asarray([trajectory.token_ids], np.int32)
    mask = np.ones_like(ids)
    return np.asarray(token_logprobs(model.params, model.config, ids[:, :-1], positions_from_mask(mask[:, :-1]),
                                     mask[:, :-1], ids[:, 1:]))[0]
