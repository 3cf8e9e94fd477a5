"""Benchmark evaluation of one model: every chosen set solved k times through the agent loop (SPEC section 7).

`BenchmarkEval` (gin) holds the protocol: k samples per problem at a temperature, the turn limit and the response
budget; its code defaults are SPEC 7's (avg@16, T = 0.6, 30 turns, 30K tokens). The engines come from the
`RolloutBackend` gin switch (in-process JAX engines or a vLLM fleet), the tools from sandbox servers, the scoring
from `rstar_jax.eval.agentic.evaluate`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import gin

from rstar_jax.data.problem import Problem
from rstar_jax.eval.agentic import EvalResult, evaluate
from rstar_jax.model import ModelConfig
from rstar_jax.model.lm import Params
from rstar_jax.rollout.backends import RolloutBackend, check_prompts_fit
from sandbox_server.client import SandboxClient


@gin.configurable
@dataclasses.dataclass(frozen=True)
class BenchmarkEval:
    """The evaluation protocol (SPEC 7): `samples` (k) solves per problem at `temperature` (0: greedy, then k must
    be 1), at most `max_turns` turns and `max_response_tokens` tokens after the prompt; `seed` fixes sampling;
    `verify_timeout_s` bounds each answer's check."""

    samples: int = 16
    temperature: float = 0.6
    max_turns: int = 30
    max_response_tokens: int = 30_000
    seed: int = 0
    verify_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.samples < 1 or self.max_turns < 1 or self.max_response_tokens < 1:
            raise ValueError(f"BenchmarkEval needs samples, max_turns and max_response_tokens >= 1, got "
                             f"{self.samples}, {self.max_turns}, {self.max_response_tokens}")
        if self.temperature < 0:
            raise ValueError(f"BenchmarkEval.temperature must be >= 0, got {self.temperature}")
        if self.temperature == 0 and self.samples != 1:
            raise ValueError(f"greedy decoding (temperature 0) gives k identical samples; set samples = 1, not "
                             f"{self.samples}")

    def settings(self) -> dict[str, Any]:
        """The SPEC 7 protocol as a JSON-ready dict (recorded beside the scores)."""
        return dataclasses.asdict(self)

    def check_fits(self, tokenizer: Any, sets: Mapping[str, Sequence[Problem]], token_limit: int | None) -> None:
        """Refuse, before any work, a set whose longest prompt plus `max_response_tokens` (SPEC 7's budget) exceeds
        what one engine slot holds (`RolloutBackend.token_limit`; None: unknown, as for a vLLM server, so nothing
        is checked)."""
        for name, problems in sets.items():
            check_prompts_fit(tokenizer, problems, self.max_response_tokens, token_limit, name,
                              "BenchmarkEval.max_response_tokens")

    def run(self, config: ModelConfig, params: Params, tokenizer_name: str, tokenizer: Any,
            sets: Mapping[str, Sequence[Problem]], sandbox_urls: Sequence[str], work_dir: str | Path,
            backend: RolloutBackend | None = None,
            on_set_done: Callable[[str, EvalResult, float], None] | None = None) -> dict[str, EvalResult]:
        """Each set's `EvalResult` (SPEC 7: avg@k and pass@k), in `sets`' order, from engines `backend` starts on
        `params` (served from `work_dir` for a vLLM fleet); `on_set_done(name, result, seconds)` is called as each
        set finishes."""
        backend = backend or RolloutBackend()
        self.check_fits(tokenizer, sets, backend.token_limit)
        with backend.start(config, params, work_dir, tokenizer_name) as engines:
            return asyncio.run(self._solve(engines, tokenizer, sets, sandbox_urls, on_set_done))

    async def _solve(self, engines: Any, tokenizer: Any, sets: Mapping[str, Sequence[Problem]],
                     sandbox_urls: Sequence[str],
                     on_set_done: Callable[[str, EvalResult, float], None] | None) -> dict[str, EvalResult]:
        results: dict[str, EvalResult] = {}
        try:
            async with SandboxClient(list(sandbox_urls)) as client:
                for name, problems in sets.items():
                    started = time.monotonic()
                    results[name] = await evaluate(
                        engines.engine, client, tokenizer, problems, self.samples, self.temperature,
                        max_turns=self.max_turns, max_response_tokens=self.max_response_tokens, seed=self.seed,
                        verify_timeout_s=self.verify_timeout_s)
                    if on_set_done is not None:
                        on_set_done(name, results[name], time.monotonic() - started)
        finally:
            await engines.aclose()
        return results
