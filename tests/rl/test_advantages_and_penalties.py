"""Group advantages and the RoC quality penalty against hand-computed values (SPEC section 4, steps 4-5)."""

from __future__ import annotations

import numpy as np
import pytest

from rstar_jax.rl import format_penalty, group_advantages, has_signal, roc_penalty, tool_error_penalty


def test_group_advantages_standardise_each_row() -> None:
    rewards = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    advantages = group_advantages(rewards)
    # row 0: mean 0.25, sample std sqrt(0.25) = 0.5 -> 1.5, -0.5; row 1: mean 0.5, std sqrt(1/3) = 0.57735
    np.testing.assert_allclose(advantages[0], np.array([1.5, -0.5, -0.5, -0.5]) * 0.5 / (0.5 + 1e-6))
    np.testing.assert_allclose(advantages[1], np.array([0.5, 0.5, -0.5, -0.5]) / (np.sqrt(1 / 3) + 1e-6))
    np.testing.assert_array_equal(advantages[2], 0.0)
    population = group_advantages(np.array([[1.0, 0.0]]), ddof=0)  # std 0.5
    np.testing.assert_allclose(population, [[0.5 / 0.500001, -0.5 / 0.500001]])
    np.testing.assert_allclose(group_advantages(np.array([[0.8, 0.0, 0.0, 1.0]])).sum(), 0.0, atol=1e-12)


def test_group_advantages_refuse_other_shapes() -> None:
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(np.array([1.0, 0.0]))
    np.testing.assert_array_equal(group_advantages(np.array([[1.0]])), [[0.0]])


def test_has_signal() -> None:
    assert has_signal([1, 0, 0]) and has_signal([0.5, 1.0])
    assert not has_signal([1, 1, 1]) and not has_signal([0, 0]) and not has_signal([1])


def test_tool_error_penalty() -> None:
    np.testing.assert_allclose(tool_error_penalty([4, 2, 0, 3], [1, 2, 0, 0]), [0.25, 1.0, 0.5, 0.0])
    with pytest.raises(ValueError, match="more failed"):
        tool_error_penalty(1, 2)


def test_format_penalty() -> None:
    # no tag -> 1; one tag -> 0; 3 tags in 4 turns -> 0.5; 5 tags in 2 turns -> capped at 1
    np.testing.assert_allclose(format_penalty([0, 1, 3, 5], [3, 2, 4, 2]), [1.0, 0.0, 0.5, 1.0])


def test_roc_penalty_is_the_sum() -> None:
    # 2 calls, 1 failed, one answer tag, 3 turns: 0.5 + 0; no call, no tag: 0.5 + 1; clean: 0
    np.testing.assert_allclose(roc_penalty([2, 0, 1], [1, 0, 0], [1, 0, 1], [3, 1, 2]), [0.5, 1.5, 0.0])
    assert float(roc_penalty(1, 0, 1, 2)) == 0.0
    with pytest.raises(ValueError, match="non-negative"):
        roc_penalty(-1, 0, 1, 1)
