"""The RL learner step (SPEC section 4, step 6; DESIGN "Functional learner"): old log-probs, then one optimiser
update from micro-batches with exact gradient accumulation (or, for the step's only update, both in one pass: the
update's forward under the sampling parameters gives the old log-probs).

The policy loss is a weighted sum over tokens whose weights are normalised by the WHOLE batch's token (or
sequence) count, so summing the micro-batches' gradients gives exactly the gradient of the big batch (up to float
rounding): there is no averaging of averages. Every function is jitted with explicit shardings over the mesh's
(data, fsdp, tensor) axes from `rstar_jax.parallel`, so the same code runs on one device or many.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar_jax.model import ModelConfig, positions_from_mask, token_logprobs, token_logprobs_and_entropy
from rstar_jax.model.lm import Params
from rstar_jax.parallel import activation_sharding, use_mesh
from rstar_jax.parallel.multihost import multi_process, place
from rstar_jax.rl.losses import PolicyLossOptions, policy_loss
from rstar_jax.train.rl_batch import RLBatch, batch_totals
from rstar_jax.train.sft import batch_shardings
from rstar_jax.train.state import TrainState

Metrics = dict[str, jax.Array]


def rl_batch_shardings(mesh: Mesh, rows: int) -> RLBatch:
    """Shardings of an RLBatch of `rows` rows: rows over the data axes (when they divide), sequence whole."""
    per_token = activation_sharding(mesh, (rows, 1), "batch", "seq")
    return RLBatch(batch_shardings(mesh, rows), per_token, per_token, per_token, per_token)


def _logprobs_and_entropy(params: Params, config: ModelConfig, batch: RLBatch, with_entropy: bool,
                          chunk_size: int) -> tuple[jax.Array, jax.Array | None]:
    tokens = batch.tokens
    mask = jnp.asarray(tokens.attention_mask)
    args = (params, config, jnp.asarray(tokens.input_ids), positions_from_mask(mask), mask,
            jnp.asarray(tokens.targets))
    if with_entropy:
        return token_logprobs_and_entropy(*args, chunk_size=chunk_size)
    return token_logprobs(*args, chunk_size=chunk_size), None


class RLLearner:
    """Jitted pieces of an RL update for micro-batches of `rows` rows on `mesh`, with the policy loss of `loss`;
    log-probs come `logprob_chunk` positions at a time (`token_logprobs`' chunk_size: memory, not maths).

    `with_policy_logprobs(params, batches)` fills each micro-batch's old (or reference) log-probs; `update(state,
    batches)` makes ONE optimiser step from all of them (a mini-batch) and returns the new state and metrics. The
    input state is donated: its buffers become the new state's.
    """

    def __init__(self, config: ModelConfig, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                 mesh: Mesh, state_shardings: TrainState, rows: int, loss: PolicyLossOptions,
                 logprob_chunk: int = 512) -> None:
        if logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1, got {logprob_chunk}")
        self.config, self.mesh, self.rows, self.loss, self.chunk = config, mesh, rows, loss, logprob_chunk
        params_sharding = state_shardings.params
        batch_sharding = self._batch_sharding = rl_batch_shardings(mesh, rows)
        replicated = self._replicated = NamedSharding(mesh, PartitionSpec())
        self._logprobs = jax.jit(self._policy_logprobs, in_shardings=(params_sharding, batch_sharding),
                                 out_shardings=batch_sharding.old_logprobs)
        # Per `on_policy` (static): the first micro-batch's gradient, and one more added to the running sums.
        self._first = {on_policy: jax.jit(functools.partial(self._micro_gradients, on_policy=on_policy),
                                          in_shardings=(params_sharding, batch_sharding, replicated),
                                          out_shardings=(params_sharding, replicated))
                       for on_policy in (False, True)}
        self._accumulate = {on_policy: jax.jit(functools.partial(self._accumulate_gradients, on_policy=on_policy),
                                               donate_argnums=1,
                                               in_shardings=(params_sharding, (params_sharding, replicated),
                                                             batch_sharding, replicated),
                                               out_shardings=(params_sharding, replicated))
                            for on_policy in (False, True)}

        def apply(state: TrainState, grads: Params) -> tuple[TrainState, Metrics]:
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            metrics = {"grad_norm": optax.tree.norm(grads),
                       "learning_rate": jnp.asarray(schedule(state.step), jnp.float32)}
            return TrainState(optax.apply_updates(state.params, updates), opt_state, state.step + 1), metrics

        self._apply = jax.jit(apply, donate_argnums=0, in_shardings=(state_shardings, params_sharding),
                              out_shardings=(state_shardings, replicated))

    def _policy_logprobs(self, params: Params, batch: RLBatch) -> jax.Array:
        with use_mesh(self.mesh):
            return _logprobs_and_entropy(params, self.config, batch, False, self.chunk)[0]

    def _micro_loss(self, params: Params, batch: RLBatch, totals: jax.Array,
                    on_policy: bool) -> tuple[jax.Array, Metrics]:
        logprobs, entropy = _logprobs_and_entropy(params, self.config, batch, self.loss.needs_entropy, self.chunk)
        options = self.loss
        extra = {}
        if on_policy:  # the parameters ARE the sampling policy: old log-probs are this forward's, held constant
            old_logprobs = jax.lax.stop_gradient(logprobs)
            extra["gap_sum"] = jnp.sum(jnp.abs(jnp.asarray(batch.rollout_logprobs) - old_logprobs)
                                       * jnp.asarray(batch.loss_mask))
        else:
            old_logprobs = jnp.asarray(batch.old_logprobs)
        loss, metrics = policy_loss(
            logprobs, old_logprobs, jnp.asarray(batch.advantages), jnp.asarray(batch.loss_mask),
            eps_low=options.eps_low, eps_high=options.eps_high, dual_clip=options.dual_clip,
            normalization=options.normalization, kl_coef=options.kl_coef, kl_estimator=options.kl_estimator,
            ref_logprobs=jnp.asarray(batch.ref_logprobs) if options.needs_reference else None,
            entropy_coef=options.entropy_coef, entropy=entropy, total_tokens=totals[0], total_sequences=totals[1],
            segment_ids=jnp.asarray(batch.tokens.attention_mask), with_metrics=True)
        return loss, {"loss": loss, **metrics, **extra}

    def _micro_gradients(self, params: Params, batch: RLBatch, totals: jax.Array,
                         on_policy: bool) -> tuple[Params, Metrics]:
        """One micro-batch's gradient and metrics: the first micro-batch's start the sums (issue 12: no zeros to
        allocate and add, no trace of the loss per update to learn the metrics' names)."""
        with use_mesh(self.mesh):
            (_, metrics), grads = jax.value_and_grad(self._micro_loss, has_aux=True)(params, batch, totals,
                                                                                     on_policy)
        return grads, metrics

    def _accumulate_gradients(self, params: Params, accumulated: tuple[Params, Metrics], batch: RLBatch,
                              totals: jax.Array, on_policy: bool) -> tuple[Params, Metrics]:
        grads, metrics = self._micro_gradients(params, batch, totals, on_policy)
        grads_sum, metrics_sum = accumulated
        return jax.tree.map(jnp.add, grads_sum, grads), jax.tree.map(jnp.add, metrics_sum, metrics)

    def _on_mesh(self, batch: RLBatch) -> RLBatch:
        """`batch` with its numpy leaves as global arrays when the learner spans several processes (jit takes numpy
        input only when every device is this process's; each process places its own shards of the whole batch)."""
        if not multi_process():
            return batch
        return jax.tree.map(lambda leaf, sharding: place(leaf, sharding) if isinstance(leaf, np.ndarray) else leaf,
                            batch, self._batch_sharding)

    def _check(self, batches: Sequence[RLBatch]) -> None:
        if not batches:
            raise ValueError("an RL update needs at least one micro-batch")
        for batch in batches:
            if batch.shape[0] != self.rows:
                raise ValueError(f"micro-batches must have {self.rows} rows, got {batch.shape[0]}")

    def policy_logprobs(self, params: Params, batches: Sequence[RLBatch]) -> list[jax.Array]:
        """log p of every target token of each micro-batch under `params` (the learner's own forward)."""
        self._check(batches)
        return [self._logprobs(params, self._on_mesh(batch)) for batch in batches]

    def with_policy_logprobs(self, params: Params, batches: Sequence[RLBatch],
                             reference: Params | None = None) -> list[RLBatch]:
        """The micro-batches with `old_logprobs` under `params` (the policy that sampled them, SPEC 4.6's ratio
        denominator) and, when `reference` is given, `ref_logprobs` under it (for a KL term)."""
        olds = self.policy_logprobs(params, batches)
        refs = self.policy_logprobs(reference, batches) if reference is not None else [b.ref_logprobs for b in batches]
        return [batch.replace(old_logprobs=old, ref_logprobs=ref) for batch, old, ref in zip(batches, olds, refs)]

    def update(self, state: TrainState, batches: Sequence[RLBatch],
               on_policy: bool = False) -> tuple[TrainState, dict[str, float]]:
        """One optimiser step on the summed gradient of `batches`.

        Their old log-probs must be filled in (`with_policy_logprobs`), unless `on_policy`: `state.params` are then
        the parameters the rollouts were sampled with (the step's first and only update), so SPEC 4.6's ratio
        denominator is this very forward's log-probs held constant: the same loss and gradient without a second
        forward pass over the batch (issue 12), and the metrics gain `logprob_gap` (as `rl_batch.logprob_gap`).
        Metrics: loss and the policy-loss metrics (weighted over the trained tokens of all micro-batches),
        grad_norm (before clipping), learning_rate, trained_tokens and sequences.
        """
        self._check(batches)
        if on_policy and self.loss.needs_reference:
            raise ValueError("a KL term needs the reference log-probs: fill them in with with_policy_logprobs")
        tokens, sequences = batch_totals(batches)
        totals = np.asarray([tokens, sequences], np.float32)
        if multi_process():
            totals = place(totals, self._replicated)
        batches = [self._on_mesh(batch) for batch in batches]
        accumulated = self._first[on_policy](state.params, batches[0], totals)
        for batch in batches[1:]:
            accumulated = self._accumulate[on_policy](state.params, accumulated, batch, totals)
        grads, metrics = accumulated
        state, apply_metrics = self._apply(state, grads)
        values = {name: float(value) for name, value in jax.device_get({**metrics, **apply_metrics}).items()}
        if on_policy:
            values["logprob_gap"] = values.pop("gap_sum") / max(tokens, 1.0)
        return state, {**values, "trained_tokens": tokens, "sequences": sequences}
