"""Benchmark evaluation of one model: every chosen set solved k times through the agent loop (SPEC section 7).

`BenchmarkEval` (gin) holds the protocol: k samples per problem at a temperature, the turn limit and the response
budget; its code defaults are SPEC 7's (avg@16, T = 0.6, 30 turns, 30K tokens). The sets run through
`rstar_jax.eval.backend_run.run_evaluations`, as held-out evaluation does: engines from the `RolloutBackend` gin
switch (in-process JAX engines or a vLLM fleet, failover router or balancer), tools from sandbox servers, answers
checked by the verifier passed in, scoring by `rstar_jax.eval.agentic.evaluate`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import gin

from rstar_jax.data.problem import Problem
from rstar_jax.eval.agentic import EvalResult
from rstar_jax.eval.backend_run import Evaluation, check_evaluations_fit, run_evaluations
from rstar_jax.model import ModelConfig
from rstar_jax.model.lm import Params
from rstar_jax.reward.verifier import Verifier
from rstar_jax.rollout.backends import RolloutBackend


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

    def evaluations(self, sets: Mapping[str, Sequence[Problem]]) -> dict[str, Evaluation]:
        """Each set under this protocol, by name."""
        return {name: Evaluation(problems, self.samples, self.temperature, self.max_turns, self.max_response_tokens,
                                 self.seed, self.verify_timeout_s, "BenchmarkEval.max_response_tokens")
                for name, problems in sets.items()}

    def check_fits(self, tokenizer: Any, sets: Mapping[str, Sequence[Problem]], token_limit: int | None) -> None:
        """Refuse, before any work, a set whose longest prompt plus `max_response_tokens` (SPEC 7's budget) exceeds
        what one engine slot holds (`RolloutBackend.token_limit`; None: unknown, as for a vLLM server, so nothing
        is checked)."""
        check_evaluations_fit(tokenizer, self.evaluations(sets), token_limit)

    def run(self, config: ModelConfig, params: Params, tokenizer_name: str, tokenizer: Any,
            sets: Mapping[str, Sequence[Problem]], sandbox_urls: Sequence[str], verifier: Verifier,
            backend: RolloutBackend, work_dir: str | Path,
            on_set_done: Callable[[str, EvalResult, float], None] | None = None) -> dict[str, EvalResult]:
        """Each set's `EvalResult` (SPEC 7: avg@k and pass@k), in `sets`' order, from engines `backend` starts once
        on `params` (served from `work_dir` for a vLLM fleet), answers checked by `verifier`; `on_set_done(name,
        result, seconds)` is called as each set finishes."""
        return run_evaluations(backend, config, params, tokenizer_name, tokenizer, sandbox_urls, verifier, work_dir,
                               self.evaluations(sets), on_set_done)
