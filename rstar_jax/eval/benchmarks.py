"""The six evaluation sets of SPEC section 7 and beyond, by name: which shared-data set each is and how it is shown.

AIME24, AIME25, HMMT25 and MATH-500 are the sets the paper reports (SPEC 7); AMC23 and GSM8K are the other two eval
files in `../shared/data/eval`. Loading goes through `rstar_jax.data.registry.load_problems`, so each set is read by
the loader of its format (Qwen2.5-Math JSONL, MathArena folders, MATH-500, GSM8K).
"""

from __future__ import annotations

import dataclasses

from rstar_jax.data.problem import Problem
from rstar_jax.data.registry import load_problems


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """`name`: the command-line name (also the `load_problems` data set); `title`: as the paper's tables write it."""

    name: str
    title: str


BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("aime24", "AIME24"),
    Benchmark("aime25", "AIME25"),
    Benchmark("hmmt25", "HMMT25"),
    Benchmark("math500", "MATH-500"),
    Benchmark("amc23", "AMC23"),
    Benchmark("gsm8k", "GSM8K"),
)}


def parse_benchmark_names(text: str) -> list[str]:
    """"aime24,math500" (or "all") -> the names in the given order, duplicates dropped (SPEC 7's sets).

    Raises ValueError naming the unknown names and the known ones, so a typo stops a run before any work.
    """
    if text.strip().lower() == "all":
        return list(BENCHMARKS)
    names = list(dict.fromkeys(part.strip().lower() for part in text.split(",") if part.strip()))
    unknown = [name for name in names if name not in BENCHMARKS]
    if unknown or not names:
        raise ValueError(f"unknown benchmark(s) {unknown or [text]}; choose from {', '.join(BENCHMARKS)} (or 'all')")
    return names


def load_benchmark(name: str, limit: int | None = None) -> list[Problem]:
    """The problems of benchmark `name` in file order (the first `limit` of them when given; SPEC 7's sets).

    A set whose file has rows that cannot be used raises ValueError: a benchmark score must cover the whole set.
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(BENCHMARKS)}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    loaded = load_problems(name)
    if loaded.skipped.total:
        raise ValueError(f"benchmark {name}: {loaded.skipped.total} rows could not be read "
                         f"({dict(loaded.skipped.by_reason)}); a score would not cover the set")
    problems = list(loaded.problems)
    return problems if limit is None else problems[:limit]
