"""The paper's reported scores, shown beside ours in the benchmark table (SPEC section 7).

Only numbers SPEC.md section 7 states (the rStar2-Agent paper's headline table and its per-stage results): avg@16
pass@1 in percent at temperature 0.6. A set the paper does not report for a model (AMC23, GSM8K) has no entry.
"""

from __future__ import annotations

import dataclasses

SOURCE = ("../shared/docs/SPEC.md section 7 (rStar2-Agent paper: avg@16 pass@1 %, temperature 0.6, up to 30K tokens "
          "and 30 turns)")


@dataclasses.dataclass(frozen=True)
class ReferenceRow:
    """One model's reported scores in percent, by benchmark name (`rstar_jax.eval.benchmarks.BENCHMARKS`)."""

    model: str
    scores: dict[str, float]


PAPER_REFERENCES: tuple[ReferenceRow, ...] = (
    ReferenceRow("rStar2-Agent-14B", {"math500": 97.8, "aime24": 80.6, "aime25": 69.8, "hmmt25": 52.7}),
    ReferenceRow("DeepSeek-R1", {"math500": 97.3, "aime24": 79.8, "aime25": 70.0, "hmmt25": 44.4}),
    ReferenceRow("o3-mini (medium)", {"math500": 98.0, "aime24": 79.6, "aime25": 77.0, "hmmt25": 53.0}),
    ReferenceRow("QwQ-32B", {"math500": 98.0, "aime24": 79.5, "aime25": 65.8, "hmmt25": 47.5}),
    ReferenceRow("Qwen3-14B", {"math500": 96.8, "aime24": 79.3, "aime25": 70.4, "hmmt25": 48.9}),
    ReferenceRow("rStar2-Agent-14B after RL stage 1", {"aime24": 72.1, "aime25": 64.2}),
    ReferenceRow("rStar2-Agent-14B after RL stage 2", {"aime24": 77.0, "aime25": 64.8}),
    ReferenceRow("rStar2-Agent-14B after RL stage 3", {"aime24": 80.6, "aime25": 69.8}),
)

# Mean response length on AIME24 in tokens (SPEC 7).
PAPER_AIME24_RESPONSE_TOKENS: dict[str, int] = {"rStar2-Agent-14B": 9_340, "Qwen3-14B": 14_748}
