"""The end-of-run text and figures (rstar_jax.eval.report): accuracy per problem kind, computed by hand."""

import math

from rstar_jax.eval.agentic import EvalResult
from rstar_jax.eval.report import accuracy_by_kind, kind_table, problem_kind


def result(solved: dict[str, int], samples: int = 4) -> EvalResult:
    problems = [{"id": problem_id, "answer": "1", "correct": count, "samples": samples}
                for problem_id, count in solved.items()]
    return EvalResult({"samples": samples}, problems, [], [])


def test_problem_kind_reads_synthetic_kinds_and_benchmark_sets():
    assert problem_kind("synthetic/multiply/d1/s7/0") == "multiply"
    assert problem_kind("synthetic/digit_count/d2/s3/11") == "digit_count"
    assert problem_kind("aime24/7") == "aime24"
    assert problem_kind("plain-id") == "plain-id"


def test_accuracy_by_kind_is_avg_at_k_within_each_kind():
    figures = accuracy_by_kind(result({"synthetic/multiply/d1/s7/0": 1, "synthetic/modpow/d1/s7/1": 4,
                                       "synthetic/multiply/d1/s7/2": 2, "synthetic/modpow/d1/s7/3": 0}))
    assert list(figures) == ["multiply", "modpow"]
    assert math.isclose(figures["multiply"], (1 / 4 + 2 / 4) / 2)
    assert math.isclose(figures["modpow"], (4 / 4 + 0 / 4) / 2)


def test_kind_table_puts_before_and_after_side_by_side():
    before = {"sampled": result({"synthetic/multiply/d1/s7/0": 1, "synthetic/modpow/d1/s7/1": 2}),
              "greedy": result({"synthetic/multiply/d1/s7/0": 0, "synthetic/modpow/d1/s7/1": 1}, samples=1)}
    after = {"sampled": result({"synthetic/multiply/d1/s7/0": 3, "synthetic/modpow/d1/s7/1": 2})}
    figures = [{mode: accuracy_by_kind(r) for mode, r in side.items()} for side in (before, after)]
    lines = kind_table(*figures).splitlines()
    assert len(lines) == 3  # header + two kinds; greedy was evaluated on one side only
    assert lines[1].split() == ["multiply,", "T=1", "25.0%", "75.0%"]
    assert lines[2].split() == ["modpow,", "T=1", "50.0%", "50.0%"]
