"""The paired change of held-out accuracy (rstar_jax.eval.metrics.paired_change) and its line in the demo's
comparison, against numbers computed by hand."""

import math

import pytest

from rstar_jax.eval.agentic import EvalResult
from rstar_jax.eval.metrics import PairedChange, paired_change, solved_shares
from rstar_jax.eval.report import change_text, paired_changes


def result(solved: dict[str, int], samples: int = 3) -> EvalResult:
    problems = [{"id": problem_id, "answer": "1", "correct": count, "samples": samples}
                for problem_id, count in solved.items()]
    return EvalResult({"samples": samples}, problems, [], [])


def test_the_change_is_the_mean_per_problem_difference_with_its_standard_error():
    before = {"a": 0 / 3, "b": 1 / 3, "c": 2 / 3, "d": 3 / 3}
    after = {"d": 2 / 3, "c": 3 / 3, "b": 1 / 3, "a": 1 / 3}  # matched by id, not by order
    # differences 1/3, 0, 1/3, -1/3: mean 1/12; deviations 1/4, -1/12, 1/4, -5/12 square to 44/144, over n - 1 = 3
    change = paired_change(before, after)
    assert change.problems == 4
    assert math.isclose(change.mean, 1 / 12)
    assert math.isclose(change.standard_error, math.sqrt(44 / 144 / 3) / math.sqrt(4))


def test_the_same_shift_on_every_problem_has_no_error():
    change = paired_change({"a": 0.0, "b": 1 / 3}, {"a": 1 / 3, "b": 2 / 3})
    assert math.isclose(change.mean, 1 / 3) and change.standard_error == pytest.approx(0.0, abs=1e-12)


def test_one_problem_has_a_change_but_no_standard_error():
    change = paired_change({"a": 0.0}, {"a": 1.0})
    assert change.mean == 1.0 and change.problems == 1 and math.isnan(change.standard_error)


def test_different_problems_on_the_two_sides_are_refused():
    with pytest.raises(ValueError, match=r"same problems.*only before: \['b'\] \(1\), only after: \['c'\] \(1\)"):
        paired_change({"a": 0.0, "b": 1.0}, {"a": 0.0, "c": 1.0})
    with pytest.raises(ValueError, match="at least one problem"):
        paired_change({}, {})


def test_solved_shares_read_evaluation_records_and_refuse_repeated_ids():
    assert solved_shares(result({"a": 2, "b": 0}).problems) == {"a": 2 / 3, "b": 0.0}
    with pytest.raises(ValueError, match="1 repeated problem ids"):
        solved_shares(result({"a": 1}).problems * 2)


def test_paired_changes_cover_the_modes_both_sides_evaluated_and_read_as_points():
    before = {"sampled": result({"a": 0, "b": 3}), "greedy": result({"a": 0, "b": 1}, samples=1)}
    after = {"sampled": result({"a": 3, "b": 3})}
    changes = paired_changes(before, after)
    assert list(changes) == ["sampled"]
    assert changes["sampled"] == PairedChange(0.5, 0.5, 2)  # differences 1 and 0: sd 0.707, over sqrt(2)
    text = change_text({"sampled": PairedChange(0.125, 0.031, 64), "greedy": PairedChange(-0.05, 0.02, 64)})
    assert text.splitlines() == ["T=1 accuracy change: +12.5 points (standard error 3.1, paired over 64 problems)",
                                 "greedy accuracy change: -5.0 points (standard error 2.0, paired over 64 problems)"]
