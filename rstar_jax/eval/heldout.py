"""Held-out evaluation of a model's parameters: sampled (avg@k at T=1) and greedy, through the JAX engine, the agent
loop and a sandbox server (SPEC section 7, scaled to the CPU demo).

The problems come from a `ProblemSource`; for the synthetic tasks use split "heldout", which no training stage or
SFT transcript can draw from, so a before/after comparison measures what was learned, not what was seen.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import gin

from rstar_jax.data.problem_source import ProblemSource
from rstar_jax.eval.agentic import EvalResult, evaluate
from rstar_jax.model import ModelConfig
from rstar_jax.model.lm import Params
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.rollout.router import FailoverEngine
from sandbox_server.client import SandboxClient


@gin.configurable
@dataclasses.dataclass(frozen=True)
class HeldOutEval:
    """What to evaluate on and how: `problems`; `samples` (k) at `temperature` for avg@k, plus one greedy solve each
    when `greedy`; the agent loop's `max_turns` and `max_response_tokens`; engines of `slots` x `max_len`."""

    problems: ProblemSource = ProblemSource(source="synthetic", count=64, seed=7, split="heldout")
    samples: int = 4
    temperature: float = 1.0
    greedy: bool = True
    max_turns: int = 4
    max_response_tokens: int = 640
    engines: int = 1
    slots: int = 16
    max_len: int = 1024
    seed: int = 12345

    def run(self, config: ModelConfig, params: Params, tokenizer: Any, sandbox_url: str) -> dict[str, EvalResult]:
        """{"sampled": avg@k at `temperature`, "greedy": T=0} (only "sampled" without `greedy`)."""
        problems = self.problems.load()
        engines = [JaxEngine(config, params, slots=self.slots, max_len=self.max_len, seed=index)
                   for index in range(self.engines)]

        async def solve() -> dict[str, EvalResult]:
            router = FailoverEngine(engines)
            async with SandboxClient([sandbox_url]) as client:
                settings = {"max_turns": self.max_turns, "max_response_tokens": self.max_response_tokens,
                            "seed": self.seed}
                results = {"sampled": await evaluate(router, client, tokenizer, problems, self.samples,
                                                     self.temperature, **settings)}
                if self.greedy:
                    results["greedy"] = await evaluate(router, client, tokenizer, problems, 1, 0.0, **settings)
                return results

        try:
            return asyncio.run(solve())
        finally:
            for engine in engines:
                engine.close()
