"""Qwen2/Qwen3 decoders in Flax with transformers parity, KV-cache decoding and HF import/export (issue 2).

Parameter tree (kernels are [in, out]; L = num_layers, stacked by nn.scan):
  embed/embedding [V, E]; layers/{input_norm,post_attn_norm}/scale [L, E];
  layers/attn/{q,k,v}_proj/kernel [L, E, H*D] (+ bias [L, H*D] when qkv_bias); layers/attn/o_proj/kernel
  [L, Hq*D, E] (+ bias [L, E] when o_bias, Qwen3's attention_bias); layers/attn/{q,k}_norm/scale [L, D] when
  qk_norm; layers/mlp/{gate,up}_proj/kernel [L, E, F], down_proj/kernel [L, F, E]; final_norm/scale [E];
  lm_head/kernel [E, V] unless tie_word_embeddings.
"""

from rstar_jax.model.causal_lm import CausalLM
from rstar_jax.model.config import ModelConfig
from rstar_jax.model.hf_io import load_hf, save_hf, tensor_specs
from rstar_jax.model.kv_cache import KVCache, decode_step, extend, init_cache, prefill, prefill_slot
from rstar_jax.model.lm import (
    causal_padding_mask,
    forward,
    hidden_states,
    init_params,
    logits_from_hidden,
    positions_from_mask,
    token_logprobs,
    token_logprobs_and_entropy,
)

__all__ = [
    "CausalLM",
    "KVCache",
    "ModelConfig",
    "causal_padding_mask",
    "decode_step",
    "extend",
    "forward",
    "hidden_states",
    "init_cache",
    "init_params",
    "load_hf",
    "logits_from_hidden",
    "positions_from_mask",
    "prefill",
    "prefill_slot",
    "save_hf",
    "tensor_specs",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
