"""The SFT learner step (SPEC section 5 "Non-reasoning SFT"; DESIGN "Functional learner").

`make_sft_step` returns `sft_step(state, batch) -> (state, metrics)`: the token-level masked NLL of the batch's
targets, its gradient, one optax update, jitted with explicit in/out shardings over a (data, fsdp, tensor) mesh.
The same code runs on one device or many; only the mesh changes.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar_jax.model import ModelConfig, positions_from_mask, token_logprobs
from rstar_jax.model.lm import Params
from rstar_jax.parallel import activation_sharding, use_mesh
from rstar_jax.train.batching import TokenBatch
from rstar_jax.rl.losses import masked_nll
from rstar_jax.train.state import TrainState

Metrics = dict[str, jax.Array]
SftStep = Callable[[TrainState, TokenBatch], tuple[TrainState, Metrics]]


def target_logprobs(params: Params, config: ModelConfig, batch: TokenBatch) -> jax.Array:
    """log p(target) [B, T] of every position of a right-padded batch (padding positions are junk, masked later)."""
    attention_mask = jnp.asarray(batch.attention_mask)
    return token_logprobs(params, config, jnp.asarray(batch.input_ids), positions_from_mask(attention_mask),
                          attention_mask, jnp.asarray(batch.targets))


def sft_loss(params: Params, config: ModelConfig, batch: TokenBatch,
             target_weights: jax.Array | None = None) -> jax.Array:
    """The SFT objective of one batch: masked NLL of the targets, normalised by the number of trained tokens.

    With `target_weights` [vocab] a trained target token t counts `target_weights[t]` times, in the sum and in the
    normalising count (e.g. number tokens weighted up, so their copies sharpen sooner).
    """
    loss_mask = jnp.asarray(batch.loss_mask)
    if target_weights is not None:
        loss_mask = loss_mask * target_weights[jnp.asarray(batch.targets)]
    return masked_nll(target_logprobs(params, config, batch), loss_mask)


def batch_shardings(mesh: Mesh, batch_size: int) -> TokenBatch:
    """Shardings of a TokenBatch's arrays: rows split over the data axes (when they divide the batch size),
    sequence whole. The sequence axis is never split, so one sharding fits every bucketed length."""
    row_sharding = activation_sharding(mesh, (batch_size, 1), "batch", "seq")
    return TokenBatch(row_sharding, row_sharding, row_sharding, row_sharding)


def make_sft_step(config: ModelConfig, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                  mesh: Mesh, state_shardings: TrainState, batch_size: int,
                  target_weights: np.ndarray | None = None) -> SftStep:
    """The jitted `sft_step(state, batch) -> (state, metrics)` for batches of `batch_size` rows on `mesh`.

    metrics (replicated scalars): loss, grad_norm (before clipping), learning_rate (of this update) and
    trained_tokens. The input state is donated: its buffers become the output state's. `target_weights` [vocab]
    weights each trained target token by its id (`sft_loss`).
    """
    weights = None if target_weights is None else jnp.asarray(target_weights, jnp.float32)

    def sft_step(state: TrainState, batch: TokenBatch) -> tuple[TrainState, Metrics]:
        with use_mesh(mesh):
            loss, grads = jax.value_and_grad(sft_loss)(state.params, config, batch, weights)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": jnp.asarray(schedule(state.step), jnp.float32),
            "trained_tokens": jnp.sum(jnp.asarray(batch.loss_mask)),
        }
        return TrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(sft_step, in_shardings=(state_shardings, batch_shardings(mesh, batch_size)),
                   out_shardings=(state_shardings, replicated), donate_argnums=0)
