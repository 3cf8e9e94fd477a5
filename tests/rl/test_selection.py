"""RoC selection and the baselines' rewards (SPEC section 4, steps 1-4)."""

from __future__ import annotations

import gin
import numpy as np
import pytest

from rstar_jax.rl import (GroupOutcome, PenaltySelector, PlainGrpoSelector, RocSelector, make_selector,
                          roc_class_sizes, select_roc)


@pytest.mark.parametrize("positive, negative, keep, expected", [
    (8, 8, 8, (4, 4)),   # about half of each class
    (2, 14, 8, (2, 6)),  # round(2 * 8 / 16) = 1, raised to the minimum of 2 positives
    (14, 2, 8, (6, 2)),  # and the same for negatives
    (1, 15, 8, (1, 7)),  # a lone positive is kept
    (15, 1, 8, (7, 1)),
    (5, 11, 8, (3, 5)),  # 2.5 rounds half up to 3
    (16, 0, 8, (8, 0)),
    (0, 16, 8, (0, 8)),
    (3, 5, 2, (1, 1)),   # keep too small for 2 + 2: one of each
    (6, 2, 4, (2, 2)),
])
def test_roc_class_sizes(positive: int, negative: int, keep: int, expected: tuple[int, int]) -> None:
    assert roc_class_sizes(positive, negative, keep) == expected


def test_roc_class_sizes_refuse_impossible_keeps() -> None:
    with pytest.raises(ValueError, match="cannot keep"):
        roc_class_sizes(2, 2, 5)
    with pytest.raises(ValueError, match="cannot keep"):
        roc_class_sizes(2, 2, 0)


REWARDS = np.array([1, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 1, 0, 0])  # 7 positives, 9 negatives
PENALTIES = np.array([0.5, 9, 0.0, 1.0, 9, 9, 0.25, 9, 1.5, 0.0, 9, 9, 9, 0.75, 9, 9])


def test_release_mode_keeps_the_lowest_penalty_positives() -> None:
    kept = select_roc(REWARDS, PENALTIES, 8, mode="release", seed=3)
    positives, negatives = kept[REWARDS[kept] == 1], kept[REWARDS[kept] == 0]
    assert len(positives) == 4 and len(negatives) == 4  # round(7 * 8 / 16) = 4 (3.5 half up)
    assert sorted(positives) == [0, 2, 6, 9]  # penalties 0.0, 0.0, 0.25, 0.5
    assert list(kept) == sorted(kept) and len(set(kept)) == 8


def test_selection_is_a_pure_function_of_its_seed() -> None:
    runs = {tuple(select_roc(REWARDS, PENALTIES, 8, seed=seed)) for seed in (5, 5, 5)}
    assert len(runs) == 1
    assert len({tuple(select_roc(REWARDS, PENALTIES, 8, seed=seed)) for seed in range(20)}) > 1


def test_negatives_are_uniform() -> None:
    negatives = np.flatnonzero(REWARDS == 0)
    counts = np.zeros(len(REWARDS))
    for seed in range(20_000):
        counts[select_roc(REWARDS, PENALTIES, 8, mode="release", seed=seed)] += 1
    share = counts[negatives] / 20_000  # 4 of 9 negatives each time; binomial sd 0.0035
    np.testing.assert_allclose(share, 4 / 9, atol=0.02)


def test_paper_mode_samples_positives_by_inverse_penalty() -> None:
    rewards = np.array([1, 1, 1, 0, 0, 0])
    penalties = np.array([0.0, 0.5, 1.0, 0.0, 0.0, 0.0])
    # keep 2 of 6: one positive, drawn with weights 1/max(p, 0.05) = 20, 2, 1
    counts = np.zeros(3)
    for seed in range(4000):
        kept = select_roc(rewards, penalties, 2, mode="paper", seed=seed)
        counts[kept[kept < 3]] += 1
    np.testing.assert_allclose(counts / 4000, np.array([20, 2, 1]) / 23, atol=0.02)


@pytest.mark.parametrize("mode", ["paper", "release"])
def test_groups_of_one_class_keep_keep_rollouts_of_it(mode: str) -> None:
    for rewards in (np.zeros(8), np.ones(8)):
        kept = select_roc(rewards, np.linspace(0, 1.5, 8), 4, mode=mode, seed=1)
        assert len(kept) == 4 and len(set(kept)) == 4


def test_select_roc_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="binary"):
        select_roc(np.array([0.5, 1.0]), np.zeros(2), 1)
    with pytest.raises(ValueError, match="mode"):
        select_roc(REWARDS, PENALTIES, 8, mode="best")


def _group(rewards: list[int], calls: list[int], failed: list[int]) -> GroupOutcome:
    n = len(rewards)
    return GroupOutcome(np.array(rewards), np.array(calls), np.array(failed), np.ones(n), np.full(n, 2))


def test_roc_selector_oversamples_and_keeps_half() -> None:
    selector = RocSelector(mode="release")
    assert selector.rollouts_per_prompt(4) == 8
    group = _group([1, 1, 1, 1, 0, 0, 0, 0], [2, 2, 1, 1, 1, 1, 1, 1], [1, 0, 0, 1, 0, 0, 0, 0])
    selection = selector.select(group, 4, seed=0)
    assert len(selection.indices) == 4
    assert set(selection.indices[selection.rewards == 1]) == {1, 2}  # the two positives without tool errors
    with pytest.raises(ValueError, match="expected a group of 8"):
        selector.select(_group([1, 0], [1, 1], [0, 0]), 4, seed=0)


def test_penalty_selector_lowers_correct_rewards_by_tool_errors() -> None:
    selection = PenaltySelector(penalty_lambda=0.4).select(_group([1, 1, 1, 0], [2, 0, 4, 3], [1, 0, 0, 3]), 4, 0)
    np.testing.assert_array_equal(selection.indices, [0, 1, 2, 3])
    # p_err 0.5 (1 of 2 failed), 0.5 (no call), 0.0; the wrong answer stays 0
    np.testing.assert_allclose(selection.rewards, [0.8, 0.8, 1.0, 0.0])


def test_plain_grpo_keeps_everything() -> None:
    selection = PlainGrpoSelector().select(_group([1, 0, 1], [1, 1, 1], [1, 1, 1]), 3, 0)
    np.testing.assert_array_equal(selection.indices, [0, 1, 2])
    np.testing.assert_array_equal(selection.rewards, [1, 0, 1])


def test_one_gin_switch_picks_the_algorithm() -> None:
    try:
        gin.parse_config(["make_selector.algorithm = 'penalty'", "PenaltySelector.penalty_lambda = 0.2"])
        selector = make_selector()
        assert isinstance(selector, PenaltySelector) and selector.penalty_lambda == 0.2
    finally:
        gin.clear_config()
    assert isinstance(make_selector(), RocSelector)
    with pytest.raises(ValueError, match="unknown RL algorithm"):
        make_selector("ppo")
