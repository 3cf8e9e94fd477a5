"""Release mode's class sizes are the rStar2-Agent release's for every positives count (issue 25 item 2), and
gin/rl/release.gin binds the release's selection and verl's dual clip in one include."""

from __future__ import annotations

import gin
import numpy as np
import pytest

from rstar_jax.gin_setup import parse_gin
from rstar_jax.rl import PolicyLossOptions, RocSelector, make_selector, roc_class_sizes, select_roc


def release_reference(positives: int, negatives: int, keep: int, minimum: int = 2) -> tuple[int, int] | None:
    """The class sizes of the release's `resample_of_correct` (recipe/rstar2_agent/src/down_sample/roc.py), step by
    step as it computes them: (positives, negatives), or None where it keeps the whole group."""
    total = positives + negatives
    zero = round(negatives * keep / total)  # Python's round: half to even
    non_zero = round(positives * keep / total)
    if zero < minimum and non_zero < minimum:
        return None
    if zero <= min(minimum, negatives):
        zero = min(minimum, negatives)
        non_zero = keep - zero
    if non_zero <= min(minimum, positives):
        non_zero = min(minimum, positives)
        zero = keep - non_zero
    return non_zero, zero  # the release then asserts that they sum to keep


# Positives kept for 0..32 positives of 32, keeping 16, worked out by hand from the release's rule: half of each class,
# x.5 rounded to even, at least 2 of each class where it has them.
RELEASE_32_TO_16 = [0, 1, 2, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7, 8, 8, 8, 9, 10, 10, 10, 11, 12, 12, 12, 13, 14, 14,
                    14, 14, 15, 16]


def test_the_hand_table_is_the_releases_rule() -> None:
    assert [release_reference(p, 32 - p, 16)[0] for p in range(33)] == RELEASE_32_TO_16


@pytest.mark.parametrize("total, keep", [(32, 16), (16, 8)])
def test_release_mode_keeps_the_releases_class_sizes_for_every_positives_count(total: int, keep: int) -> None:
    for positives in range(total + 1):
        expected = release_reference(positives, total - positives, keep)
        assert sum(expected) == keep  # the release's own assertion holds for G = 16 of 32 and G = 8 of 16
        assert roc_class_sizes(positives, total - positives, keep, mode="release") == expected, positives
        rewards = np.array([1] * positives + [0] * (total - positives))
        penalties = np.linspace(0.0, 1.0, total)
        kept = select_roc(rewards, penalties, keep, mode="release", seed=positives)
        assert len(kept) == keep and len(set(kept)) == keep
        assert (int(rewards[kept].sum()), int((rewards[kept] == 0).sum())) == expected, positives


def test_the_issues_example_and_the_paper_modes_own_rule() -> None:
    """5 of 32: the release keeps (2, 14); paper mode rounds the positives' 2.5 half up to 3 (its documented rule).
    The two differ exactly at 5, 9, 13, 17, 21 and 25 positives of 32."""
    assert roc_class_sizes(5, 27, 16, mode="release") == (2, 14)
    assert roc_class_sizes(5, 27, 16, mode="paper") == (3, 13)
    assert roc_class_sizes(5, 27, 16) == (3, 13)  # paper is the default
    differ = [p for p in range(33) if roc_class_sizes(p, 32 - p, 16, "release") != roc_class_sizes(p, 32 - p, 16)]
    assert differ == [5, 9, 13, 17, 21, 25]
    for p in differ:
        assert roc_class_sizes(p, 32 - p, 16, "paper")[0] == roc_class_sizes(p, 32 - p, 16, "release")[0] + 1


@pytest.mark.parametrize("total, keep", [(32, 16), (16, 8), (12, 6), (10, 5), (9, 4), (7, 3), (4, 2), (20, 7)])
@pytest.mark.parametrize("mode", ["paper", "release"])
def test_sizes_always_sum_to_keep_within_each_class(total: int, keep: int, mode: str) -> None:
    """Also where the release's two roundings would not sum to G (an odd G, keep != total / 2) or it would keep the
    whole group (keep < 4): the sizes still fill `keep`, never exceed a class, and keep 2 (or 1) of each class."""
    for positives in range(total + 1):
        negatives = total - positives
        kept_positive, kept_negative = roc_class_sizes(positives, negatives, keep, mode)
        assert kept_positive + kept_negative == keep
        assert 0 <= kept_positive <= positives and 0 <= kept_negative <= negatives
        least = 2 if keep >= 4 else 1
        assert kept_positive >= min(least, positives) and kept_negative >= min(least, negatives)
        reference = release_reference(positives, negatives, keep) if mode == "release" else None
        if reference is not None and sum(reference) == keep and keep >= 4:
            assert (kept_positive, kept_negative) == reference


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown RoC mode"):
        roc_class_sizes(2, 2, 2, mode="best")


def test_the_release_gin_file_binds_release_mode_and_the_dual_clip() -> None:
    try:
        parse_gin(["rl/release.gin"])
        selector, options = make_selector(), PolicyLossOptions()
    finally:
        gin.clear_config()
    assert selector == RocSelector(mode="release")
    assert options.dual_clip == 3.0 and (options.eps_low, options.eps_high) == (0.2, 0.28)
    assert PolicyLossOptions().dual_clip is None  # off unless bound
