"""Held-out evaluation of a model's parameters: sampled (avg@k at T=1) and greedy, through the agent loop and a
sandbox server (SPEC section 7, scaled to the CPU demo).

The engines are those of the `RolloutBackend` passed in, the one gin builds for training (in-process JAX engines, a
vLLM fleet, failover router or balancer), started once for both evaluations by
`rstar_jax.eval.backend_run.run_evaluations`, as benchmark evaluation is. The problems come from a
`ProblemSource`; for the synthetic tasks use split "heldout", which no training stage or SFT transcript can draw
from, so a before/after comparison measures what was learned, not what was seen.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import gin

from rstar_jax.data.problem import Problem
from rstar_jax.data.problem_source import ProblemSource
from rstar_jax.eval.agentic import EvalResult
from rstar_jax.eval.backend_run import Evaluation, run_evaluations
from rstar_jax.model import ModelConfig
from rstar_jax.model.lm import Params
from rstar_jax.reward.verifier import Verifier
from rstar_jax.rollout.backends import RolloutBackend

BUDGET = "HeldOutEval.max_response_tokens"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class HeldOutEval:
    """What to evaluate on and how: `problems`; `samples` (k) at `temperature` for avg@k, plus one greedy solve each
    when `greedy`; the agent loop's `max_turns` and `max_response_tokens`; `seed` fixes sampling. The engines (and
    so the token limit of one trajectory) are the `RolloutBackend`'s."""

    problems: ProblemSource = ProblemSource(source="synthetic", count=64, seed=7, split="heldout")
    samples: int = 4
    temperature: float = 1.0
    greedy: bool = True
    max_turns: int = 4
    max_response_tokens: int = 640
    seed: int = 12345

    def evaluations(self, problems: Sequence[Problem]) -> dict[str, Evaluation]:
        """{"sampled": k solves at `temperature`, "greedy": one at T=0} (only "sampled" without `greedy`)."""
        settings = {"max_turns": self.max_turns, "max_response_tokens": self.max_response_tokens, "seed": self.seed,
                    "budget": BUDGET}
        evaluations = {"sampled": Evaluation(problems, self.samples, self.temperature, **settings)}
        if self.greedy:
            evaluations["greedy"] = Evaluation(problems, 1, 0.0, **settings)
        return evaluations

    def run(self, config: ModelConfig, params: Params, tokenizer_name: str, tokenizer: Any,
            sandbox_urls: Sequence[str], verifier: Verifier, backend: RolloutBackend,
            work_dir: str | Path) -> dict[str, EvalResult]:
        """{"sampled": avg@k at `temperature`, "greedy": T=0} (only "sampled" without `greedy`) of `params`, on the
        engines `backend` starts (a vLLM fleet it launches serves WORK_DIR/serving_model, with `tokenizer_name`'s
        files), tools on the sandbox servers at `sandbox_urls`, answers checked by `verifier`. Prompts that leave no
        room for `max_response_tokens` within `backend.token_limit` are refused before the engines start."""
        return run_evaluations(backend, config, params, tokenizer_name, tokenizer, sandbox_urls, verifier, work_dir,
                               self.evaluations(self.problems.load()))
