"""Where a training stage or an evaluation takes its problems from, as one gin-configurable record.

A `ProblemSource` names either a data set (any name or path `load_problems` accepts: MATH train, an eval set, a
JSONL file) or the synthetic tool tasks of the CPU demo (with their difficulty, kinds and seed), and how many
problems to take. Records are frozen and hashable, so a stage's data is part of its configuration and a resumed run
rebuilds exactly the same problem list.
"""

from __future__ import annotations

import dataclasses

import gin

from rstar_jax.data.problem import Problem
from rstar_jax.data.registry import load_problems
from rstar_jax.data.synthetic import KINDS, synthetic_problems

SYNTHETIC = "synthetic"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ProblemSource:
    """`source`: "synthetic" or a data set name / path; `count`: how many problems (None: all of a data set; required
    for synthetic ones); `seed`, `difficulty`, `kinds`: the synthetic generator's arguments (ignored otherwise)."""

    source: str = "math_train"
    count: int | None = None
    seed: int = 0
    difficulty: int = 1
    kinds: tuple[str, ...] = KINDS
    split: str | None = None

    def __post_init__(self) -> None:
        if self.count is not None and self.count < 1:
            raise ValueError(f"ProblemSource count must be >= 1 or None, got {self.count}")
        if self.source == SYNTHETIC and self.count is None:
            raise ValueError("a synthetic ProblemSource needs a count")
        object.__setattr__(self, "kinds", tuple(self.kinds))

    def load(self) -> list[Problem]:
        """The problems, in a fixed order (a missing data set raises FileNotFoundError naming where it looked)."""
        if self.source == SYNTHETIC:
            return synthetic_problems(self.count, seed=self.seed, difficulty=self.difficulty, kinds=self.kinds,
                                      split=self.split)
        problems = list(load_problems(self.source).problems)
        return problems if self.count is None else problems[:self.count]

    def describe(self) -> str:
        """One line for logs: what and how many."""
        if self.source == SYNTHETIC:
            split = f", {self.split} split" if self.split else ""
            return (f"{self.count} synthetic tasks ({', '.join(self.kinds)}; difficulty {self.difficulty}, "
                    f"seed {self.seed}{split})")
        return f"{self.source}" + ("" if self.count is None else f" (first {self.count})")
