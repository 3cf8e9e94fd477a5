"""The RL learner step: exact gradient accumulation, agreement with the loss computed by hand on the full batch,
and the same step on 8 simulated devices as on one (SPEC section 4, step 6)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rstar_jax.model import ModelConfig, init_params, positions_from_mask, token_logprobs
from rstar_jax.parallel import make_mesh
from rstar_jax.rl import PolicyLossOptions, policy_loss
from rstar_jax.train.rl_batch import batch_totals, logprob_gap, rl_micro_batches
from rstar_jax.train.rl_step import RLLearner
from rstar_jax.train.state import init_train_state, train_state_shardings

CONFIG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=40, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)


@dataclasses.dataclass(frozen=True)
class Rollout:
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]


def _rollouts(count: int, seed: int) -> list[Rollout]:
    """Trajectories of varied length: prompt (mask 0), a sampled turn, a tool response (mask 0), a sampled turn."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        parts = [(rng.integers(4, 9), 0), (rng.integers(2, 20), 1), (rng.integers(0, 6), 0), (rng.integers(1, 30), 1)]
        mask = [m for length, m in parts for _ in range(length)]
        logprobs = [float(-rng.exponential()) if m else 0.0 for m in mask]
        rows.append(Rollout(tuple(int(t) for t in rng.integers(1, CONFIG.vocab_size, len(mask))), tuple(mask),
                            tuple(logprobs)))
    return rows


def _learner(mesh, rows: int, options: PolicyLossOptions | None = None):
    # Plain SGD: the update is linear in the gradient, so equal parameters mean equal gradients. (Adam's first step
    # is about lr * sign(g), which turns float noise in a near-zero gradient entry into a full-size difference.)
    schedule = optax.constant_schedule(1e-2)
    optimizer = optax.sgd(schedule)
    params = jax.tree.map(np.asarray, init_params(CONFIG, jax.random.key(0)))
    state = init_train_state(params, optimizer)
    shardings = train_state_shardings(state, mesh)
    return jax.device_put(state, shardings), RLLearner(CONFIG, optimizer, schedule, mesh, shardings, rows, options)


def _perturbed(batches):
    """Old log-probs off the current policy by a function of each row's own tokens and positions (so a row gets the
    same perturbation in any micro-batch), making the ratio clip on some tokens."""
    def shifted(batch):
        ids = np.asarray(batch.tokens.input_ids)
        offsets = 0.3 * np.sin(7.0 * ids + np.arange(ids.shape[1])[None, :]).astype(np.float32)
        return batch.replace(old_logprobs=np.asarray(batch.old_logprobs) + offsets)
    return [shifted(batch) for batch in batches]


ROLLOUTS = _rollouts(12, seed=1)
ADVANTAGES = np.random.default_rng(2).normal(size=12)


def test_micro_batches_hold_every_rollout_once_sorted_and_bucketed() -> None:
    batches = rl_micro_batches(ROLLOUTS, ADVANTAGES, rows=5)
    assert [b.shape[0] for b in batches] == [5, 5, 5]
    assert batch_totals(batches) == (sum(sum(r.loss_mask[1:]) for r in ROLLOUTS), 12)
    lengths = [int(np.asarray(b.tokens.attention_mask).sum(1).max()) for b in batches]
    assert lengths == sorted(lengths, reverse=True)
    assert np.isclose(sum(np.asarray(b.advantages).sum() for b in batches), ADVANTAGES.sum(), atol=1e-5)
    empty = batches[-1]
    assert np.asarray(empty.loss_mask)[2:].sum() == 0 and np.all(np.asarray(empty.tokens.attention_mask)[2:, 0] == 1)
    longest = max(range(12), key=lambda i: len(ROLLOUTS[i].token_ids))  # row 0 of the first micro-batch
    assert np.asarray(batches[0].advantages)[0] == np.float32(ADVANTAGES[longest])
    # targets carry the rollout log-prob of the token they predict
    np.testing.assert_allclose(np.asarray(batches[0].rollout_logprobs)[0, :len(ROLLOUTS[longest].token_ids) - 1],
                               ROLLOUTS[longest].rollout_logprobs[1:], rtol=1e-6)
    with pytest.raises(ValueError, match="advantages"):
        rl_micro_batches(ROLLOUTS, ADVANTAGES[:3], rows=4)


def test_update_loss_equals_the_policy_loss_of_the_full_batch_by_hand() -> None:
    mesh = make_mesh(devices=jax.devices()[:1])
    state, learner = _learner(mesh, rows=12)
    batches = _perturbed(learner.with_policy_logprobs(state.params, rl_micro_batches(ROLLOUTS, ADVANTAGES, 12)))
    (batch,) = batches
    tokens = batch.tokens
    mask = jnp.asarray(tokens.attention_mask)
    logprobs = token_logprobs(state.params, CONFIG, jnp.asarray(tokens.input_ids), positions_from_mask(mask), mask,
                              jnp.asarray(tokens.targets))
    expected = policy_loss(logprobs, jnp.asarray(batch.old_logprobs), jnp.asarray(batch.advantages),
                           jnp.asarray(batch.loss_mask))
    _, metrics = learner.update(state, batches)
    assert metrics["loss"] == pytest.approx(float(expected), abs=1e-6)
    assert 0.0 < metrics["clipped_fraction"] < 1.0


def test_gradient_accumulation_equals_one_big_batch() -> None:
    mesh = make_mesh(devices=jax.devices()[:1])
    outcomes = {}
    for rows in (12, 5, 2):
        state, learner = _learner(mesh, rows)
        batches = _perturbed(learner.with_policy_logprobs(state.params, rl_micro_batches(ROLLOUTS, ADVANTAGES, rows)))
        new_state, metrics = learner.update(state, batches)
        outcomes[rows] = (jax.device_get(new_state.params), metrics)
    reference_params, reference_metrics = outcomes[12]
    assert reference_metrics["clipped_fraction"] > 0.05
    for rows in (5, 2):
        params, metrics = outcomes[rows]
        for name in ("loss", "grad_norm", "trained_tokens", "clipped_fraction", "approx_kl"):
            assert metrics[name] == pytest.approx(reference_metrics[name], rel=1e-5, abs=1e-7), name
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference_params)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_rollout_vs_learner_gap_is_zero_for_the_learners_own_logprobs() -> None:
    mesh = make_mesh(devices=jax.devices()[:1])
    state, learner = _learner(mesh, rows=4)
    batches = learner.with_policy_logprobs(state.params, rl_micro_batches(ROLLOUTS, ADVANTAGES, 4))
    own = [b.replace(rollout_logprobs=np.asarray(b.old_logprobs)) for b in batches]
    assert logprob_gap(own) == 0.0
    shifted = [b.replace(rollout_logprobs=np.asarray(b.old_logprobs) - 0.25) for b in batches]
    assert logprob_gap(shifted) == pytest.approx(0.25, abs=1e-6)


def test_the_on_policy_update_equals_old_logprobs_from_a_pass_of_their_own() -> None:
    """The step's only update needs no separate old-log-prob pass: the same loss, metrics, gradient and gap."""
    mesh = make_mesh(devices=jax.devices()[:1])
    outcomes = {}
    for on_policy in (False, True):
        state, learner = _learner(mesh, rows=5)
        batches = [b.replace(rollout_logprobs=np.asarray(b.rollout_logprobs) * 0 - 2.0)
                   for b in rl_micro_batches(ROLLOUTS, ADVANTAGES, 5)]
        if not on_policy:
            batches = learner.with_policy_logprobs(state.params, batches)
            gap = logprob_gap(batches)
        new_state, metrics = learner.update(state, batches, on_policy=on_policy)
        outcomes[on_policy] = (jax.device_get(new_state.params), metrics)
    (two_pass, two_pass_metrics), (fused, fused_metrics) = outcomes[False], outcomes[True]
    assert "logprob_gap" not in two_pass_metrics and fused_metrics["logprob_gap"] == pytest.approx(gap, rel=1e-6)
    for name in ("loss", "grad_norm", "trained_tokens", "clipped_fraction", "approx_kl"):
        assert fused_metrics[name] == pytest.approx(two_pass_metrics[name], rel=1e-5, abs=1e-7), name
    assert fused_metrics["clipped_fraction"] == 0.0  # the ratio is exactly 1 on the sampling policy
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(two_pass)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    state, learner = _learner(mesh, rows=5, options=PolicyLossOptions(kl_coef=0.1))
    with pytest.raises(ValueError, match="KL term needs the reference"):
        learner.update(state, rl_micro_batches(ROLLOUTS, ADVANTAGES, 5), on_policy=True)


def test_kl_and_entropy_options_reach_the_loss() -> None:
    mesh = make_mesh(devices=jax.devices()[:1])
    options = PolicyLossOptions(kl_coef=0.1, entropy_coef=0.01, dual_clip=3.0, normalization="sequence_mean")
    state, learner = _learner(mesh, rows=6, options=options)
    reference = jax.tree.map(lambda leaf: leaf * 1.01, jax.device_get(state.params))
    batches = learner.with_policy_logprobs(state.params, rl_micro_batches(ROLLOUTS, ADVANTAGES, 6), reference)
    _, metrics = learner.update(state, batches)
    assert metrics["kl"] > 0 and metrics["entropy"] > 3.0  # near-uniform over 96 tokens: log 96 = 4.56
    assert {"dual_clipped_fraction", "clipped_fraction", "approx_kl"} <= set(metrics)


def test_sharded_rl_step_equals_single_device_step() -> None:
    assert jax.device_count() == 8
    outcomes = {}
    for name, mesh in {"one": make_mesh(devices=jax.devices()[:1]), "eight": make_mesh(fsdp=8),
                       "3d": make_mesh(data=2, fsdp=2, tensor=2)}.items():
        state, learner = _learner(mesh, rows=8)
        losses = []
        for step in range(2):
            rollouts = rl_micro_batches(_rollouts(16, 10 + step), np.linspace(-1, 1, 16), 8)
            batches = _perturbed(learner.with_policy_logprobs(state.params, rollouts))
            state, metrics = learner.update(state, batches)
            losses.append(metrics["loss"])
        outcomes[name] = (losses, state)
    one_losses, one_state = outcomes["one"]
    for name in ("eight", "3d"):
        losses, state = outcomes[name]
        np.testing.assert_allclose(losses, one_losses, atol=1e-5)
        for a, b in zip(jax.tree.leaves(one_state.params), jax.tree.leaves(state.params)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    embedding = outcomes["eight"][1].params["embed"]["embedding"]
    assert len(embedding.sharding.device_set) == 8
