"""The GRPO-RoC policy loss against numbers worked out by hand (SPEC section 4, step 6)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar_jax.rl import loss_weights, policy_loss
from rstar_jax.rl.losses import kl_penalty

# Two sequences of three tokens. Row 0 has advantage +1, row 1 advantage -2.
# log ratios (logprobs - old): row 0: 0.5, -0.5, 0.0; row 1: 0.0, -1.0, 2.0.
LOGPROBS = jnp.array([[-0.7, -2.0, -0.5], [-0.3, -1.2, -1.0]])
OLD = jnp.array([[-1.2, -1.5, -0.5], [-0.3, -0.2, -3.0]])
ADVANTAGES = jnp.array([1.0, -2.0])
# Per-token surrogate, max(-r A, -clip(r, 0.8, 1.28) A):
#   row 0: r = e^0.5 = 1.6487 -> clipped to 1.28: -1.28;  r = e^-0.5 = 0.6065 (A > 0: no low clip): -0.60653;
#          r = 1: -1
#   row 1: r = 1: 2;  r = e^-1 = 0.3679 -> clipped up to 0.8: 1.6;  r = e^2 = 7.389: 14.77811 (dual clip 3: 6)
ROW0 = [-1.28, -math.exp(-0.5), -1.0]
ROW1 = [2.0, 1.6, 2.0 * math.exp(2.0)]


def test_token_mean_over_every_unmasked_token_of_the_batch() -> None:
    mask = jnp.ones((2, 3))
    assert float(policy_loss(LOGPROBS, OLD, ADVANTAGES, mask)) == pytest.approx(2.5819302563581115, abs=1e-6)
    assert float(policy_loss(LOGPROBS, OLD, ADVANTAGES, mask)) == pytest.approx((sum(ROW0) + sum(ROW1)) / 6, abs=1e-6)


def test_masked_tokens_count_for_nothing() -> None:
    mask = jnp.array([[1, 1, 0], [1, 1, 1]])
    expected = (ROW0[0] + ROW0[1] + sum(ROW1)) / 5
    assert expected == pytest.approx(3.298316307629734)
    assert float(policy_loss(LOGPROBS, OLD, ADVANTAGES, mask)) == pytest.approx(expected, abs=1e-6)
    garbage = LOGPROBS.at[0, 2].set(50.0)  # a masked position's values never matter
    assert float(policy_loss(garbage, OLD, ADVANTAGES, mask)) == pytest.approx(expected, abs=1e-6)


def test_sequence_mean_option_averages_each_sequence_first() -> None:
    mask = jnp.array([[1, 1, 0], [1, 1, 1]])
    expected = ((ROW0[0] + ROW0[1]) / 2 + sum(ROW1) / 3) / 2
    assert expected == pytest.approx(2.591386034715392)
    loss = policy_loss(LOGPROBS, OLD, ADVANTAGES, mask, normalization="sequence_mean")
    assert float(loss) == pytest.approx(expected, abs=1e-6)


def test_packed_sequences_keep_their_advantages_and_sequence_means() -> None:
    """The same two sequences packed into one row of six tokens (segments 1 and 2; row 0's last token masked):
    per-token advantages give the same surrogate, and segment ids give sequence_mean the same per-sequence means."""
    packed = [jnp.concatenate([rows[0], rows[1]])[None] for rows in (LOGPROBS, OLD)]
    advantages = jnp.array([[1.0, 1.0, 1.0, -2.0, -2.0, -2.0]])
    mask = jnp.array([[1, 1, 0, 1, 1, 1]])
    segments = jnp.array([[1, 1, 1, 2, 2, 2]])
    token_mean = (ROW0[0] + ROW0[1] + sum(ROW1)) / 5
    assert float(policy_loss(*packed, advantages, mask)) == pytest.approx(token_mean, abs=1e-6)
    sequence_mean = ((ROW0[0] + ROW0[1]) / 2 + sum(ROW1) / 3) / 2
    loss = policy_loss(*packed, advantages, mask, normalization="sequence_mean", segment_ids=segments)
    assert float(loss) == pytest.approx(sequence_mean, abs=1e-6)
    whole_row = policy_loss(*packed, advantages, mask, normalization="sequence_mean")  # one sequence of 5 tokens
    assert float(whole_row) == pytest.approx(token_mean, abs=1e-6)


def test_dual_clip_caps_a_negative_advantage_tokens_loss() -> None:
    loss, metrics = policy_loss(LOGPROBS, OLD, ADVANTAGES, jnp.ones((2, 3)), dual_clip=3.0, with_metrics=True)
    assert float(loss) == pytest.approx((sum(ROW0) + 2.0 + 1.6 + 6.0) / 6, abs=1e-6)
    assert float(metrics["dual_clipped_fraction"]) == pytest.approx(1 / 6)
    # Clip-Higher's range won for the e^0.5 token (row 0) and the e^-1 token (row 1); for the e^2 token the
    # unclipped term is larger (A < 0), so only the dual clip bounds it.
    assert float(metrics["clipped_fraction"]) == pytest.approx(2 / 6)


def test_clip_higher_is_asymmetric() -> None:
    """A ratio of 1.25 is inside (0.8, 1.28) but outside the symmetric (0.8, 1.2)."""
    logprobs, old = jnp.array([[math.log(1.25)]]), jnp.zeros((1, 1))
    mask, advantage = jnp.ones((1, 1)), jnp.array([1.0])
    assert float(policy_loss(logprobs, old, advantage, mask)) == pytest.approx(-1.25, abs=1e-6)
    assert float(policy_loss(logprobs, old, advantage, mask, eps_high=0.2)) == pytest.approx(-1.2, abs=1e-6)


def test_gradient_flows_only_through_unclipped_tokens() -> None:
    mask = jnp.ones((2, 3))
    grad = jax.grad(lambda lp: policy_loss(lp, OLD, ADVANTAGES, mask))(LOGPROBS)
    ratio = jnp.exp(LOGPROBS - OLD)
    # d/dlp of -r A / 6 is -r A / 6 where unclipped; 0 where the clipped branch won.
    expected = np.array([[0.0, -float(ratio[0, 1]) / 6, -1 / 6], [2 / 6, 0.0, 2 * float(ratio[1, 2]) / 6]])
    np.testing.assert_allclose(np.asarray(grad), expected, atol=1e-6)


def test_at_ratio_one_the_gradient_is_the_advantage_weighted_policy_gradient() -> None:
    logprobs = jnp.array([[-1.0, -2.0], [-0.5, -0.1]])
    grad = jax.grad(lambda lp: policy_loss(lp, jax.lax.stop_gradient(lp), ADVANTAGES, jnp.ones((2, 2))))(logprobs)
    np.testing.assert_allclose(np.asarray(grad), [[-0.25, -0.25], [0.5, 0.5]], atol=1e-7)


def test_kl_estimators_and_the_kl_term() -> None:
    logprobs, ref = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -1.0]])
    # k1 = logp - logq; k3 = e^(q - p) - (q - p) - 1
    np.testing.assert_allclose(np.asarray(kl_penalty(logprobs, ref, "k1")), [[0.5, -1.0]], atol=1e-7)
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    np.testing.assert_allclose(np.asarray(kl_penalty(logprobs, ref, "k3")), [k3], atol=1e-6)
    base = float(policy_loss(logprobs, logprobs, jnp.array([1.0]), jnp.ones((1, 2))))
    with_kl = policy_loss(logprobs, logprobs, jnp.array([1.0]), jnp.ones((1, 2)), kl_coef=0.1, ref_logprobs=ref)
    assert float(with_kl) == pytest.approx(base + 0.1 * sum(k3) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, logprobs, jnp.array([1.0]), jnp.ones((1, 2)), kl_coef=0.1)


def test_entropy_bonus_is_subtracted() -> None:
    logprobs, entropy = jnp.array([[-1.0, -2.0]]), jnp.array([[0.4, 1.0]])
    base = float(policy_loss(logprobs, logprobs, jnp.array([1.0]), jnp.ones((1, 2))))
    bonus = policy_loss(logprobs, logprobs, jnp.array([1.0]), jnp.ones((1, 2)), entropy_coef=0.01, entropy=entropy)
    assert float(bonus) == pytest.approx(base - 0.01 * 0.7, abs=1e-7)


def test_micro_batches_weighted_by_the_whole_batchs_counts_add_up_to_it() -> None:
    mask = jnp.array([[1, 1, 0], [1, 1, 1]])
    for normalization, totals in (("token_mean", {"total_tokens": 5}), ("sequence_mean", {"total_sequences": 2})):
        whole = policy_loss(LOGPROBS, OLD, ADVANTAGES, mask, normalization=normalization)
        parts = sum(policy_loss(LOGPROBS[i:i + 1], OLD[i:i + 1], ADVANTAGES[i:i + 1], mask[i:i + 1],
                                normalization=normalization, **totals) for i in range(2))
        assert float(parts) == pytest.approx(float(whole), abs=1e-6)


def test_loss_weights() -> None:
    mask = jnp.array([[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(np.asarray(loss_weights(mask)), np.asarray(mask) / 3)
    np.testing.assert_allclose(np.asarray(loss_weights(mask, "sequence_mean")),
                               [[0.25, 0.25, 0, 0], [0.5, 0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="normalization"):
        loss_weights(mask, "sum")


def test_bad_shapes_and_clip_values_are_named() -> None:
    mask = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(LOGPROBS, OLD, jnp.ones((3,)), mask)
    with pytest.raises(ValueError, match="share one"):
        policy_loss(LOGPROBS, OLD[:, :2], ADVANTAGES, mask)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(LOGPROBS, OLD, ADVANTAGES, mask, dual_clip=0.5)
