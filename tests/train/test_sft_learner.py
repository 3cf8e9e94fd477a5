"""The SFT learner core: masked NLL by hand, batching, the schedule, and the jitted step against transformers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import transformers

from rstar_jax.model import ModelConfig, init_params, load_hf, save_hf
from rstar_jax.parallel import make_mesh
from rstar_jax.train.batching import TokenBatch, batch_indices, bucket_length, make_batch
from rstar_jax.rl.losses import masked_nll
from rstar_jax.train.optim import adamw_optimizer, rl_optimizer, sft_optimizer
from rstar_jax.train.sft import make_sft_step
from rstar_jax.train.state import init_train_state, train_state_shardings

CONFIG = ModelConfig(family="qwen3", vocab_size=96, hidden_size=32, intermediate_size=40, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)


@dataclasses.dataclass(frozen=True)
class Seq:
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]


def _sequences(count: int, seed: int) -> list[Seq]:
    """Rows of varied length: a prompt (mask 0), a trained reply, a context span (mask 0), a trained tail."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        parts = [(rng.integers(3, 9), 0), (rng.integers(2, 7), 1), (rng.integers(0, 5), 0), (rng.integers(1, 6), 1)]
        mask = [m for length, m in parts for _ in range(length)]
        rows.append(Seq(tuple(int(t) for t in rng.integers(1, CONFIG.vocab_size, len(mask))), tuple(mask)))
    return rows


def test_masked_nll_is_the_token_level_mean_over_masked_tokens() -> None:
    logprobs = np.log(np.array([[0.5, 0.25, 0.9], [0.1, 0.2, 1.0]], np.float32))
    mask = np.array([[1, 1, 0], [0, 1, 0]], np.int32)
    expected = -(np.log(0.5) + np.log(0.25) + np.log(0.2)) / 3
    assert float(masked_nll(logprobs, mask)) == pytest.approx(expected, rel=1e-6)
    assert float(masked_nll(logprobs, np.zeros_like(mask))) == 0.0
    with pytest.raises(ValueError, match="loss_mask shape"):
        masked_nll(logprobs, mask[:, :2])


def test_bucket_length_powers_of_two_or_multiples() -> None:
    assert [bucket_length(n) for n in (1, 16, 17, 100, 128, 129)] == [16, 16, 32, 128, 128, 256]
    assert [bucket_length(n, multiple=64) for n in (1, 64, 65, 300)] == [64, 64, 128, 320]
    with pytest.raises(ValueError, match="positive length"):
        bucket_length(0)
    with pytest.raises(ValueError, match="multiple"):
        bucket_length(5, multiple=0)


def test_make_batch_shifts_targets_and_aligns_the_loss_mask() -> None:
    rows = [Seq((5, 6, 7, 8), (0, 0, 1, 1)), Seq((9, 10, 11), (0, 1, 0))]
    batch = make_batch(rows, pad_id=0)
    assert batch.shape == (2, 16)
    np.testing.assert_array_equal(batch.input_ids[:, :4], [[5, 6, 7, 0], [9, 10, 0, 0]])
    np.testing.assert_array_equal(batch.targets[:, :4], [[6, 7, 8, 0], [10, 11, 0, 0]])
    np.testing.assert_array_equal(batch.attention_mask[:, :4], [[1, 1, 1, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.loss_mask[:, :4], [[0, 1, 1, 0], [1, 0, 0, 0]])
    assert not batch.attention_mask[:, 4:].any() and not batch.loss_mask[:, 4:].any()
    with pytest.raises(ValueError, match="sequence 1 has 2 token ids but a loss mask of 1"):
        make_batch([rows[0], Seq((1, 2), (1,))])
    with pytest.raises(ValueError, match="at least 2"):
        make_batch([Seq((1,), (1,))])
    with pytest.raises(ValueError, match="other than 0 and 1"):
        make_batch([Seq((1, 2), (0, 2))])


def test_batch_indices_are_seeded_epoch_shuffles() -> None:
    first_epoch = np.concatenate([batch_indices(step, 10, 5, seed=3) for step in range(2)])
    assert sorted(first_epoch) == list(range(10))
    np.testing.assert_array_equal(batch_indices(1, 10, 5, seed=3), batch_indices(1, 10, 5, seed=3))
    straddling = batch_indices(1, 7, 4, seed=3)  # positions 4..7: three of epoch 0, one of epoch 1
    np.testing.assert_array_equal(straddling[:3], np.concatenate([batch_indices(0, 7, 4, 3), straddling])[4:7])
    assert not np.array_equal(batch_indices(0, 10, 10, seed=3), batch_indices(0, 10, 10, seed=4))


def test_warmup_cosine_schedule_values() -> None:
    _, schedule = adamw_optimizer(100, learning_rate=1e-3, warmup_fraction=0.1, end_fraction=0.1)
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(5e-4)
    assert float(schedule(10)) == pytest.approx(1e-3)
    assert float(schedule(55)) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-5)
    assert float(schedule(100)) == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="warmup_fraction"):
        adamw_optimizer(100, 1e-3, warmup_fraction=1.5)


def test_warm_restarts_leave_the_schedule_alone_then_warm_up_again_each_cycle() -> None:
    _, plain = adamw_optimizer(100, learning_rate=1e-3, warmup_fraction=0.1, end_fraction=0.1)
    _, restarted = adamw_optimizer(100, 1e-3, warmup_fraction=0.1, end_fraction=0.1, restarts=(2, 20, 0.5))
    assert [float(restarted(step)) for step in range(100)] == [float(plain(step)) for step in range(100)]
    for start in (100, 120):  # each cycle: 2 warm-up steps to 5e-4, then cosine to 5e-5 at its end
        assert [float(restarted(start + step)) for step in (0, 1, 2, 11)] == pytest.approx(
            [0.0, 2.5e-4, 5e-4, 5e-5 + 0.5 * 4.5e-4], rel=1e-5)
    assert float(restarted(140)) == pytest.approx(5e-5)


def test_constant_and_linear_schedules_and_the_rl_defaults() -> None:
    _, constant = rl_optimizer(100)  # SPEC 5: 1e-6 after 20 warm-up steps
    assert [float(constant(step)) for step in (0, 10, 20, 60, 99)] == pytest.approx([0, 5e-7, 1e-6, 1e-6, 1e-6])
    _, linear = adamw_optimizer(30, 1e-3, warmup_steps=10, schedule="linear", end_fraction=0.0)
    assert [float(linear(step)) for step in (5, 10, 20, 30)] == pytest.approx([5e-4, 1e-3, 5e-4, 0.0], abs=1e-9)
    _, at_once = adamw_optimizer(10, 1e-3, warmup_steps=0, schedule="cosine")  # no warm-up: peak from step 0
    assert [float(at_once(step)) for step in (0, 5, 10)] == pytest.approx([1e-3, 5e-4, 0.0], abs=1e-9)
    _, sft = sft_optimizer(100)  # SPEC 5: 5e-6, 4% warm-up, cosine to 0
    assert float(sft(4)) == pytest.approx(5e-6) and float(sft(100)) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="schedule"):
        adamw_optimizer(10, 1e-3, schedule="step")
    with pytest.raises(ValueError, match="warm-up of 50 steps"):
        rl_optimizer(10, warmup_steps=50)


def _step_fn(mesh, params, batch_size: int, learning_rate: float = 5e-6, target_weights=None, **optimizer_args):
    optimizer, schedule = adamw_optimizer(50, learning_rate, **optimizer_args)
    state = init_train_state(params, optimizer)
    shardings = train_state_shardings(state, mesh)
    step = make_sft_step(CONFIG, optimizer, schedule, mesh, shardings, batch_size, target_weights)
    return jax.device_put(state, shardings), step


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "number_tokens_weighted"])
def test_step_loss_equals_torch_cross_entropy_of_the_transformers_model(tmp_path: Path, weighted: bool) -> None:
    """The step's loss is the mean NLL over trained targets; with target weights (ids below 40 count 3 times) the
    weighted mean, the same weights in its sum and its count."""
    save_hf((CONFIG, init_params(CONFIG, jax.random.key(1))), tmp_path)
    params = load_hf(tmp_path).params
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    rows = _sequences(4, seed=0)
    batch = make_batch(rows)
    target_weights = np.where(np.arange(CONFIG.vocab_size) < 40, 3.0, 1.0) if weighted else None

    total, count = 0.0, 0.0
    for row in rows:  # one unpadded row at a time: no padding convention shared with the code under test
        ids = torch.tensor([row.token_ids])
        with torch.no_grad():
            logits = reference(ids).logits[0, :-1].double()
        nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none").numpy()
        mask = np.asarray(row.loss_mask[1:], float)
        if weighted:
            mask = mask * target_weights[np.asarray(row.token_ids[1:])]
        total, count = total + (nll * mask).sum(), count + mask.sum()

    state, step = _step_fn(make_mesh(devices=jax.devices()[:1]), params, 4, target_weights=target_weights)
    _, metrics = step(state, batch)
    assert float(metrics["loss"]) == pytest.approx(total / count, abs=1e-5)
    assert int(metrics["trained_tokens"]) == sum(sum(row.loss_mask[1:]) for row in rows)


def test_overfitting_one_batch_drives_the_loss_down() -> None:
    batch = make_batch(_sequences(4, seed=1))
    state, step = _step_fn(make_mesh(devices=jax.devices()[:1]), init_params(CONFIG, jax.random.key(0)), 4,
                           learning_rate=1e-2, warmup_fraction=0.0, end_fraction=1.0)
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert int(state.step) == 30
    assert losses[-1] < 0.2 * losses[0], losses
    assert losses[0] == pytest.approx(np.log(CONFIG.vocab_size), rel=0.1)  # random init: about uniform


def test_sharded_step_equals_single_device_step() -> None:
    assert jax.device_count() == 8
    params = init_params(CONFIG, jax.random.key(2))
    batches = [make_batch(rows) for rows in (_sequences(8, seed=2), _sequences(8, seed=3))]
    results = {}
    for name, mesh in {"one": make_mesh(devices=jax.devices()[:1]),
                       "eight": make_mesh(data=2, fsdp=2, tensor=2)}.items():
        state, step = _step_fn(mesh, jax.tree_util.tree_map(np.asarray, params), 8, learning_rate=1e-3)
        losses = []
        for batch in batches:
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        results[name] = (losses, state)
    (one_losses, one_state), (eight_losses, eight_state) = results["one"], results["eight"]
    np.testing.assert_allclose(eight_losses, one_losses, atol=1e-5)
    embedding = eight_state.params["embed"]["embedding"]
    assert len(embedding.sharding.device_set) == 8 and embedding.addressable_shards[0].data.size < embedding.size
    for a, b in zip(jax.tree_util.tree_leaves(one_state.params), jax.tree_util.tree_leaves(eight_state.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
