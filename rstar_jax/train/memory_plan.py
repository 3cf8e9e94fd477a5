"""Per-device learner memory of the RL step, from abstract shapes only (issue 11 item 4: `--dry_run`; SPEC section
5's optimiser: AdamW; DESIGN "Functional learner").

State: the TrainState's parameters and AdamW moments, sized by `jax.eval_shape` of the real optimiser's init and
placed by `train_state_shardings` (the partition rules) on an AbstractMesh, plus the gradients `RLLearner.update`
holds while it accumulates micro-batches (the running sum and the new micro-batch's, both shaped and split like the
parameters). Activations: an estimate by formula (`ACTIVATION_FORMULA`) of one micro-batch's backward pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh

from rstar_jax.model.config import ModelConfig
from rstar_jax.model.lm import init_params
from rstar_jax.parallel import activation_sharding
from rstar_jax.parallel.plan import tree_bytes, tree_bytes_per_device
from rstar_jax.train.state import abstract_train_state, train_state_shardings

ACTIVATION_FORMULA = """\
activations per device, one micro-batch's backward pass (an estimate; N = b x T tokens on the device: b rows of
the micro-batch after the batch split over data x fsdp, T the padded length = bucket_length(prompt allowance +
max_response_tokens); E embed; H, K, I, V the heads, KV heads, MLP and vocabulary on the device after the tensor
split; D head_dim; L layers; c compute-dtype bytes; B the attention block; C token_logprobs' chunk):
  saved across layers  L x N x s x c, with s by ModelConfig.remat_policy:
      full           s = E                                  (only each layer's input; the layer is recomputed)
      dots_saveable  s = 3E + (2H + 2K)D + 2I               (matmul outputs: q, k, v, attention, o, gate, up, down)
      dots_attention_saveable                               (the same: the fused attention's output kept too)
      none           s = 5E + (3H + 3K)D + 3I               (everything a layer makes)
  one layer        N x (5E + (3H + 3K)D + 3I) x c        (the layer being recomputed and differentiated)
  attention        2 x b x H x T x B x 4                 (a block's f32 scores and probabilities; causal_blockwise,
                                                          or dense with attention_block_size B; B = T when dense
                                                          without blocks and for dot_product's XLA path; B = 1
                                                          for pallas and auto, a GPU plan's pallas: its tiles are
                                                          on chip, the log-sum-exp and row term [b, H, T] remain)
  output head      3 x b x C x V x 4                     (a chunk's f32 logits, softmax and their gradient)
  residual stream  2 x N x E x 4                         (its f32 gradient and the final hidden states)
checked against XLA's buffer assignment (jax.jit(jax.grad(...)).lower(...).compile().memory_analysis(), on CPU:
8 layers, hidden 512, 4 x 2,048 tokens, float32): XLA's temporaries were 1.5x this estimate under 'full', 2.4x
under 'dots_saveable' (it also keeps the attention blocks' and the output head's matmul outputs), 1.8x under
'none'; hence ClusterSpec.activation_factor (2 by default) in the fits check."""


@dataclasses.dataclass(frozen=True)
class LocalDims:
    """One device's share of a micro-batch's activations: rows, padded length, and the per-device widths after the
    tensor split (heads, kv_heads, mlp, vocab; embed and head_dim are never split by ACTIVATION_RULES)."""

    rows: int
    length: int
    embed: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int

    @property
    def tokens(self) -> int:
        """N: tokens of the micro-batch on one device."""
        return self.rows * self.length


def local_dims(config: ModelConfig, mesh: AbstractMesh, rows: int, length: int) -> LocalDims:
    """Per-device activation sizes of a micro-batch of `rows` x `length` tokens, by the activation rules (an uneven
    split stays whole, as `constrain` leaves it)."""

    def local(shape: tuple[int, ...], *axes: str) -> tuple[int, ...]:
        return tuple(activation_sharding(mesh, shape, *axes).shard_shape(shape))

    batch = local((rows, length), "batch", "seq")
    heads = local((rows, length, config.num_heads, config.head_dim), "batch", "seq", "heads", "head_dim")
    kv_heads = local((rows, length, config.num_kv_heads, config.head_dim), "batch", "seq", "kv_heads", "head_dim")
    mlp = local((rows, length, config.intermediate_size), "batch", "seq", "mlp")
    vocab = local((rows, length, config.vocab_size), "batch", "seq", "vocab")
    return LocalDims(rows=batch[0], length=length, embed=config.hidden_size, heads=heads[2], kv_heads=kv_heads[2],
                     head_dim=config.head_dim, mlp=mlp[2], vocab=vocab[2])


def _per_token(d: LocalDims, policy: str) -> int:
    """Elements per token per layer: what `policy` keeps across layers ("layer": one layer's whole working set)."""
    e, hd, kd, i = d.embed, d.heads * d.head_dim, d.kv_heads * d.head_dim, d.mlp
    dots, everything = 3 * e + 2 * hd + 2 * kd + 2 * i, 5 * e + 3 * hd + 3 * kd + 3 * i
    return {"full": e, "dots_saveable": dots, "dots_attention_saveable": dots, "none": everything,
            "layer": everything}[policy]


def attention_block(config: ModelConfig, length: int) -> int:
    """The key block B of the training attention: `attention_block_size` for causal_blockwise (and for dense when
    positive), else the whole length; 1 for 'pallas', and for 'auto', which is 'pallas' on the GPUs a dry run plans
    (`attention.resolve_attention_impl`): its [block_q x block_k] tiles live in a program's registers and shared
    memory, and what it keeps in device memory is the f32 log-sum-exp and the backward pass's row term, b x H x T
    each (the formula's two terms with B = 1)."""
    if config.attention_impl in ("pallas", "auto"):
        return 1
    block = config.attention_block_size
    if config.attention_impl == "dot_product" or block <= 0:
        return length
    return min(block, length)


def activation_parts(config: ModelConfig, d: LocalDims, chunk: int) -> dict[str, int]:
    """Bytes per device of each term of ACTIVATION_FORMULA (keys: saved, layer, attention, head, residual)."""
    c = np.dtype(config.jnp_dtype).itemsize
    n = d.tokens
    return {
        "saved": config.num_layers * n * _per_token(d, config.remat_policy) * c,
        "layer": n * _per_token(d, "layer") * c,
        "attention": 2 * d.rows * d.heads * d.length * attention_block(config, d.length) * 4,
        "head": 3 * d.rows * min(chunk, d.length) * d.vocab * 4,
        "residual": 2 * n * d.embed * 4,
    }


@dataclasses.dataclass(frozen=True)
class StateMemory:
    """Per-device bytes of the learner's state: parameters, AdamW moments (and the step counters), the gradients
    held during accumulation (2 x parameters), and a frozen reference copy when the loss needs one (KL term);
    plus the global parameter count and bytes."""

    params: int
    optimizer: int
    gradients: int
    reference: int
    param_count: int
    param_bytes_total: int

    @property
    def total(self) -> int:
        """All state bytes on one device."""
        return self.params + self.optimizer + self.gradients + self.reference

    @property
    def build_peak(self) -> int:
        """Bytes on one device while the trainer is built (issue 22 item 2): parameters loaded straight into their
        shards, the AdamW moments created sharded by a jitted init, the reference (KL only) copied sharded; no
        gradients yet and no whole copy on any device, so the build peaks below the step's state total."""
        return self.params + self.optimizer + self.reference


def abstract_params(config: ModelConfig) -> Any:
    """The parameter tree as ShapeDtypeStructs (`jax.eval_shape` of `init_params`: nothing is allocated)."""
    return jax.eval_shape(init_params, config, jax.random.key(0))


def state_memory(config: ModelConfig, optimizer: optax.GradientTransformation, mesh: AbstractMesh,
                 with_reference: bool = False) -> StateMemory:
    """Per-device state bytes on `mesh` for the model and the run's optimiser (see StateMemory)."""
    params = abstract_params(config)
    state = abstract_train_state(params, optimizer)
    shardings = train_state_shardings(state, mesh)
    param_bytes = tree_bytes_per_device(state.params, shardings.params)
    return StateMemory(
        params=param_bytes,
        optimizer=tree_bytes_per_device(state.opt_state, shardings.opt_state),
        gradients=2 * param_bytes,
        reference=param_bytes if with_reference else 0,
        param_count=sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params)),
        param_bytes_total=tree_bytes(params),
    )
