"""The RL learner step: exact gradient accumulation, agreement with the loss, KL and entropy terms worked out in
numpy from the model's logits, and the same step on 8 simulated devices as on one (SPEC section 4, step 6)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rstar_jax.model import ModelConfig, forward, init_params, positions_from_mask
from rstar_jax.parallel import make_mesh
from rstar_jax.rl import PolicyLossOptions
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
    return jax.device_put(state, shardings), RLLearner(CONFIG, optimizer, schedule, mesh, shardings, rows,
                                                       options or PolicyLossOptions())


def _perturbed(batches, scale: float = 0.3):
    """Old log-probs off the current policy by a function of each row's own tokens and positions (so a row gets the
    same perturbation in any micro-batch), making the ratio clip on some tokens (and, at scale 1.5, exceed the dual
    clip's 3 on others)."""
    def shifted(batch):
        ids = np.asarray(batch.tokens.input_ids)
        offsets = scale * np.sin(7.0 * ids + np.arange(ids.shape[1])[None, :]).astype(np.float32)
        return batch.replace(old_logprobs=np.asarray(batch.old_logprobs) + offsets)
    return [shifted(batch) for batch in batches]


# ---- the step's terms by hand, in numpy (float64) from the model's logits: nothing from rstar_jax.rl ----

def _logits(params, batch) -> np.ndarray:
    """The model's logits [B, T, V] of a micro-batch (the plain forward pass, not the fused log-prob head)."""
    mask = jnp.asarray(batch.tokens.attention_mask)
    return np.asarray(forward(params, CONFIG, jnp.asarray(batch.tokens.input_ids), positions_from_mask(mask), mask),
                      np.float64)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _target_logprobs_and_entropy(params, batch) -> tuple[np.ndarray, np.ndarray]:
    """log p(target) [B, T] and the entropy [B, T] of the full next-token softmax."""
    log_p = _log_softmax(_logits(params, batch))
    targets = np.asarray(batch.tokens.targets)
    return np.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0], -(np.exp(log_p) * log_p).sum(axis=-1)


def _weights(masks: list[np.ndarray], normalization: str) -> list[np.ndarray]:
    """Per-token weights over ALL micro-batches: token mean (every trained token of the step counts once) or
    sequence mean (each sequence's token mean, averaged over the sequences with a trained token)."""
    masks = [np.asarray(mask, np.float64) for mask in masks]
    if normalization == "token_mean":
        count = sum(mask.sum() for mask in masks)
        return [mask / count for mask in masks]
    sequences = sum(int((mask.sum(axis=1) > 0).sum()) for mask in masks)
    return [mask / np.maximum(mask.sum(axis=1, keepdims=True), 1.0) / sequences for mask in masks]


def _surrogate(log_ratio: np.ndarray, advantages: np.ndarray, eps_low: float, eps_high: float,
               dual_clip: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PPO's per-token loss with Clip-Higher and the dual clip (verl's compute_policy_loss), with 0/1 indicators of
    the clip range winning and of the dual clip capping."""
    ratio, a = np.exp(log_ratio), advantages  # [B, T]: each token's sequence's
    plain, clipped = -ratio * a, -np.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * a
    loss = np.maximum(plain, clipped)
    clip_won = (clipped > plain).astype(np.float64)
    dual = np.zeros_like(loss)
    if dual_clip is not None:
        dual = ((a < 0) & (loss > -dual_clip * a)).astype(np.float64)
        loss = np.where(dual == 1, -dual_clip * a, loss)
    return loss, clip_won, dual


def _step_by_hand(params, batches, options: PolicyLossOptions, reference=None) -> dict[str, float]:
    """The step's loss and metrics over its micro-batches, by hand: surrogate on the ratio to the batches' old
    log-probs, plus kl_coef * KL(policy || reference) by the named estimator, minus entropy_coef * entropy."""
    weights = _weights([batch.loss_mask for batch in batches], options.normalization)
    totals = {"loss": 0.0, "policy_loss": 0.0, "clipped_fraction": 0.0, "dual_clipped_fraction": 0.0, "kl": 0.0,
              "entropy": 0.0}
    for batch, weight in zip(batches, weights):
        logprobs, entropy = _target_logprobs_and_entropy(params, batch)
        surrogate, clip_won, dual = _surrogate(logprobs - np.asarray(batch.old_logprobs, np.float64),
                                               np.asarray(batch.advantages, np.float64), options.eps_low,
                                               options.eps_high, options.dual_clip)
        per_token = surrogate.copy()
        if reference is not None:
            ref_logprobs, _ = _target_logprobs_and_entropy(reference, batch)
            log_q_over_p = ref_logprobs - logprobs
            kl = -log_q_over_p if options.kl_estimator == "k1" else np.exp(log_q_over_p) - log_q_over_p - 1.0
            per_token += options.kl_coef * kl
            totals["kl"] += float((kl * weight).sum())
        per_token -= options.entropy_coef * entropy
        for name, values in (("loss", per_token), ("policy_loss", surrogate), ("clipped_fraction", clip_won),
                             ("dual_clipped_fraction", dual), ("entropy", entropy)):
            totals[name] += float((values * weight).sum())
    return totals


ROLLOUTS = _rollouts(12, seed=1)
ADVANTAGES = np.random.default_rng(2).normal(size=12)


def test_micro_batches_hold_every_rollout_once_sorted_and_bucketed() -> None:
    batches = rl_micro_batches(ROLLOUTS, ADVANTAGES, rows=5)
    assert [b.shape[0] for b in batches] == [5, 5, 5]
    assert batch_totals(batches) == (sum(sum(r.loss_mask[1:]) for r in ROLLOUTS), 12)
    lengths = [int(np.asarray(b.tokens.attention_mask).sum(1).max()) for b in batches]
    assert lengths == sorted(lengths, reverse=True)
    empty = batches[-1]
    assert np.asarray(empty.loss_mask)[2:].sum() == 0 and np.all(np.asarray(empty.tokens.attention_mask)[2:, 0] == 1)
    longest = max(range(12), key=lambda i: len(ROLLOUTS[i].token_ids))  # row 0 of the first micro-batch
    advantages = np.asarray(batches[0].advantages)[0]
    assert np.all(advantages[:len(ROLLOUTS[longest].token_ids) - 1] == np.float32(ADVANTAGES[longest]))
    assert np.all(advantages[len(ROLLOUTS[longest].token_ids) - 1:] == 0.0)  # padding carries none
    # targets carry the rollout log-prob of the token they predict
    np.testing.assert_allclose(np.asarray(batches[0].rollout_logprobs)[0, :len(ROLLOUTS[longest].token_ids) - 1],
                               ROLLOUTS[longest].rollout_logprobs[1:], rtol=1e-6)
    with pytest.raises(ValueError, match="advantages"):
        rl_micro_batches(ROLLOUTS, ADVANTAGES[:3], rows=4)


@pytest.mark.parametrize("rows, options, scale", [
    (12, PolicyLossOptions(), 0.3),                # SPEC 4.6: Clip-Higher 0.2 / 0.28, token mean, one micro-batch
    (5, PolicyLossOptions(dual_clip=3.0), 1.5),    # the release's dual clip, over three micro-batches
], ids=["clip-higher", "dual-clip"])
def test_update_loss_equals_the_policy_loss_worked_out_in_numpy(rows: int, options: PolicyLossOptions,
                                                                scale: float) -> None:
    """The learner's loss and clip statistics against the surrogate written out in numpy from the model's logits:
    Clip-Higher's asymmetric range, the dual clip and token-mean normalisation over every micro-batch's tokens."""
    mesh = make_mesh(devices=jax.devices()[:1])
    state, learner = _learner(mesh, rows=rows, options=options)
    batches = _perturbed(learner.with_policy_logprobs(state.params, rl_micro_batches(ROLLOUTS, ADVANTAGES, rows)),
                         scale)
    params = jax.device_get(state.params)
    expected = _step_by_hand(params, batches, options)
    _, metrics = learner.update(state, batches)  # donates the state
    for name in ("loss", "policy_loss", "clipped_fraction"):
        assert metrics[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    assert 0.0 < metrics["clipped_fraction"] < 1.0
    symmetric = _step_by_hand(params, batches, dataclasses.replace(options, eps_high=options.eps_low))
    assert abs(symmetric["loss"] - expected["loss"]) > 1e-4  # ratios in (1.2, 1.28]: Clip-Higher's range matters
    if options.dual_clip is None:
        assert "dual_clipped_fraction" not in metrics
    else:
        assert metrics["dual_clipped_fraction"] == pytest.approx(expected["dual_clipped_fraction"], abs=1e-6)
        assert metrics["dual_clipped_fraction"] > 0.01  # the cap is really exercised
        without_cap = _step_by_hand(params, batches, PolicyLossOptions())
        assert without_cap["loss"] > expected["loss"] + 0.01  # and it changes the loss


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


def test_packed_micro_batches_hold_every_rollout_once_in_its_own_segment() -> None:
    """Packed rows: each rollout's tokens, targets, loss mask, rollout log-probs and advantage appear once, laid out
    as its own segment (attention-mask id 1, 2, ... within a row); fewer rows than rollouts; the same totals."""
    batches = rl_micro_batches(ROLLOUTS, ADVANTAGES, rows=2, pack_length=128)
    assert {b.shape for b in batches} == {(2, 128)}
    assert batch_totals(batches) == batch_totals(rl_micro_batches(ROLLOUTS, ADVANTAGES, rows=5))
    found = []
    for batch in batches:
        segments = np.asarray(batch.tokens.attention_mask)
        for row in range(2):
            if not np.asarray(batch.loss_mask)[row].any():
                continue  # the last micro-batch's filler row
            ids = [k for k in np.unique(segments[row]) if k > 0]
            assert ids == list(range(1, len(ids) + 1))
            for k in ids:
                where = segments[row] == k
                assert np.all(np.diff(np.flatnonzero(where)) == 1)  # contiguous
                tokens = np.asarray(batch.tokens.input_ids)[row][where]
                target = np.asarray(batch.tokens.targets)[row][where]
                found.append((tuple(tokens) + (int(target[-1]),), np.asarray(batch.loss_mask)[row][where],
                              np.asarray(batch.rollout_logprobs)[row][where], np.asarray(batch.advantages)[row][where]))
    assert len(found) == 12 and sum(b.shape[0] for b in batches) < 12  # rows shared
    by_tokens = {f[0]: f for f in found}
    for rollout, advantage in zip(ROLLOUTS, ADVANTAGES):
        _, mask, logprobs, advantages = by_tokens[rollout.token_ids]
        np.testing.assert_array_equal(mask, rollout.loss_mask[1:])
        np.testing.assert_allclose(logprobs, rollout.rollout_logprobs[1:], rtol=1e-6)
        assert np.all(advantages == np.float32(advantage))
    with pytest.raises(ValueError, match="pack length"):
        rl_micro_batches(ROLLOUTS, ADVANTAGES, rows=2, pack_length=1)


def _position_free(batches, scale: float = 1.5):
    """Old log-probs off the current policy by a function of each token and its target only, so a rollout gets the
    same perturbation wherever packing puts it."""
    def shifted(batch):
        ids, targets = np.asarray(batch.tokens.input_ids), np.asarray(batch.tokens.targets)
        offsets = scale * np.sin(7.0 * ids + 3.0 * targets).astype(np.float32)
        return batch.replace(old_logprobs=np.asarray(batch.old_logprobs) + offsets)
    return [shifted(batch) for batch in batches]


PACKED_LOSSES = [PolicyLossOptions(dual_clip=3.0), PolicyLossOptions(normalization="sequence_mean")]


@pytest.mark.parametrize("options", PACKED_LOSSES, ids=["token-mean", "sequence-mean"])
def test_a_packed_update_equals_the_update_with_a_row_per_rollout(options: PolicyLossOptions) -> None:
    """Packing changes where a rollout's tokens sit, not the loss: attention stays within each rollout, RoPE restarts,
    each token keeps its advantage and the normalisers count the same tokens and sequences, so the loss, every
    metric and the new parameters equal those of one rollout a row."""
    mesh = make_mesh(devices=jax.devices()[:1])
    outcomes = {}
    for packed in (False, True):
        state, learner = _learner(mesh, rows=2 if packed else 5, options=options)
        micro = rl_micro_batches(ROLLOUTS, ADVANTAGES, 2, pack_length=128) if packed else \
            rl_micro_batches(ROLLOUTS, ADVANTAGES, 5)
        batches = _position_free(learner.with_policy_logprobs(state.params, micro))
        new_state, metrics = learner.update(state, batches)
        outcomes[packed] = (jax.device_get(new_state.params), metrics)
    (rows_params, rows_metrics), (packed_params, packed_metrics) = outcomes[False], outcomes[True]
    assert rows_metrics["clipped_fraction"] > 0.05
    for name in ("loss", "policy_loss", "grad_norm", "trained_tokens", "sequences", "clipped_fraction", "approx_kl"):
        assert packed_metrics[name] == pytest.approx(rows_metrics[name], rel=1e-5, abs=1e-7), name
    for a, b in zip(jax.tree.leaves(packed_params), jax.tree.leaves(rows_params)):
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


@pytest.mark.parametrize("estimator", ["k3", "k1"])
def test_kl_and_entropy_terms_equal_the_numbers_worked_out_by_hand(estimator: str) -> None:
    """kl, entropy and the loss they enter against numpy from the logits of the policy and of the reference (another
    random model): token log-probs, the named KL estimator, the entropy of the full softmax, sequence-mean weights
    over two micro-batches, and loss = surrogate + kl_coef * kl - entropy_coef * entropy."""
    mesh = make_mesh(devices=jax.devices()[:1])
    options = PolicyLossOptions(kl_coef=0.1, entropy_coef=0.01, kl_estimator=estimator, dual_clip=3.0,
                                normalization="sequence_mean")
    state, learner = _learner(mesh, rows=6, options=options)
    # Another random model with three times the weights: sharper logits, so the KL to it is far from 0.
    reference = jax.tree.map(lambda leaf: 3.0 * np.asarray(leaf), init_params(CONFIG, jax.random.key(1)))
    batches = _perturbed(learner.with_policy_logprobs(state.params, rl_micro_batches(ROLLOUTS, ADVANTAGES, 6),
                                                      reference), 1.5)
    params = jax.device_get(state.params)
    expected = _step_by_hand(params, batches, options, reference)
    _, metrics = learner.update(state, batches)
    for name in ("kl", "entropy", "policy_loss", "loss"):
        assert metrics[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-6), name
    assert expected["entropy"] == pytest.approx(np.log(CONFIG.vocab_size), rel=0.01)  # a near-uniform random model
    # Both terms move the loss by far more than the tolerance, so a dropped term, a flipped sign or a swapped
    # coefficient fails the comparison above.
    assert abs(options.kl_coef * expected["kl"]) > 1e-3 and options.entropy_coef * expected["entropy"] > 1e-2
    assert expected["loss"] == pytest.approx(expected["policy_loss"] + options.kl_coef * expected["kl"]
                                             - options.entropy_coef * expected["entropy"], abs=1e-9)


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
