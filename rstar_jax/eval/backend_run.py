"""Several named evaluations of one model's parameters on the engines of one `RolloutBackend` (SPEC section 7).

Held-out evaluation (`HeldOutEval`) and benchmark evaluation (`BenchmarkEval`) both come here: the engines are the
ones gin's `RolloutBackend` chooses for training (in-process JAX engines, a vLLM fleet, behind the failover router
or SPEC 6's balancer), started once for all the evaluations, with one sandbox client, and closed after; every
evaluation is scored by `rstar_jax.eval.agentic.evaluate`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rstar_jax.data.problem import Problem
from rstar_jax.eval.agentic import EvalResult, evaluate
from rstar_jax.model import ModelConfig
from rstar_jax.model.lm import Params
from rstar_jax.reward.verifier import Verifier
from rstar_jax.rollout.backends import RolloutBackend, RolloutEngines, check_prompts_fit
from sandbox_server.client import SandboxClient


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """One evaluation: each of `problems` solved `samples` times at `temperature` (0: greedy), at most `max_turns`
    turns and `max_response_tokens` tokens after the prompt, sampling seeded by `seed`, each answer's check bounded
    by `verify_timeout_s`. `budget` names the binding that set `max_response_tokens` (quoted when a prompt leaves
    it no room)."""

    problems: Sequence[Problem]
    samples: int
    temperature: float
    max_turns: int
    max_response_tokens: int
    seed: int = 0
    verify_timeout_s: float = 10.0
    budget: str = "max_response_tokens"


def check_evaluations_fit(tokenizer: Any, evaluations: Mapping[str, Evaluation], token_limit: int | None) -> None:
    """Refuse, before any work, an evaluation whose longest prompt plus its response budget exceeds `token_limit`
    (`RolloutBackend.token_limit`; None: unknown, nothing checked); the error names the evaluation."""
    for name, evaluation in evaluations.items():
        check_prompts_fit(tokenizer, evaluation.problems, evaluation.max_response_tokens, token_limit, name,
                          evaluation.budget)


def run_evaluations(backend: RolloutBackend, config: ModelConfig, params: Params, tokenizer_name: str,
                    tokenizer: Any, sandbox_urls: Sequence[str], verifier: Verifier, work_dir: str | Path,
                    evaluations: Mapping[str, Evaluation],
                    on_done: Callable[[str, EvalResult, float], None] | None = None) -> dict[str, EvalResult]:
    """Each evaluation's `EvalResult`, in `evaluations`' order, from engines `backend` starts once on `params` (a
    vLLM fleet it launches is served from WORK_DIR/serving_model, with `tokenizer_name`'s files); tools run on the
    sandbox servers at `sandbox_urls`, answers are checked by `verifier`. Prompts are checked against
    `backend.token_limit` before the engines start. `on_done(name, result, seconds)` is called as each finishes."""
    if not sandbox_urls:
        raise ValueError("run_evaluations needs at least one sandbox server URL")
    check_evaluations_fit(tokenizer, evaluations, backend.token_limit)
    with backend.start(config, params, work_dir, tokenizer_name) as engines:
        return asyncio.run(_solve(engines, tokenizer, list(sandbox_urls), verifier, evaluations, on_done))


async def _solve(engines: RolloutEngines, tokenizer: Any, sandbox_urls: list[str], verifier: Verifier,
                 evaluations: Mapping[str, Evaluation],
                 on_done: Callable[[str, EvalResult, float], None] | None) -> dict[str, EvalResult]:
    results: dict[str, EvalResult] = {}
    try:
        async with SandboxClient(sandbox_urls) as client:
            for name, evaluation in evaluations.items():
                started = time.monotonic()
                results[name] = await evaluate(
                    engines.engine, client, tokenizer, evaluation.problems, verifier, evaluation.samples,
                    evaluation.temperature, max_turns=evaluation.max_turns,
                    max_response_tokens=evaluation.max_response_tokens, seed=evaluation.seed,
                    verify_timeout_s=evaluation.verify_timeout_s)
                if on_done is not None:
                    on_done(name, results[name], time.monotonic() - started)
    finally:
        await engines.aclose()
    return results
