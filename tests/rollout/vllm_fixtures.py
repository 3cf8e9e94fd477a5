"""Shared pieces of the vLLM tests: the tiny demo model folders and the server flags that keep CPU servers small."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np

from experiments.make_tiny_model import TINY_MODEL_GIN, make_tiny_model
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import CausalLM, ModelConfig, positions_from_mask, token_logprobs
from rstar_jax.model.lm import Params

# float32 for 1e-4 parity; eager mode skips minutes of torch.compile warm-up on a shared 2-core box. MAX_MODEL_LEN is
# the tiny model's max_position_embeddings: a turn that must still be running when a test acts on it is that long
# (about 20 s of decoding here), because the CI machine has twice lost a race against shorter turns.
MAX_MODEL_LEN = 4096
TEST_SERVER_ARGS = ("--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
                    "--enforce-eager")
# 1 GiB of KV cache per server.
TEST_SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
KV_CACHE_BYTES = 2**30


def server_cpus(index: int = 0) -> tuple[int]:
    """The one CPU every process of a module's server `index` runs on (start_server's `cpus`): the CPUs this process
    may use, taken in turn. Unpinned, vLLM's spinning engine core takes the second core while a turn decodes, and
    requests sent to the server mid-turn were answered seconds late (CI lost three races that way; see
    vllm_server.start_server). A core each, two servers start side by side instead of one after the other."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[index % len(cpus)],)


def write_tiny_model(out: Path, seed: int, tied: bool) -> CausalLM:
    """The CPU demo model (make_tiny_model, tied or untied head) written to `out`; gin is left cleared."""
    try:
        parse_gin([TINY_MODEL_GIN], [f"ModelConfig.tie_word_embeddings = {tied}"])
        return make_tiny_model(out, seed)
    finally:
        gin.clear_config()


def sharpened(params: Params, factor: float) -> Params:
    """Matrices scaled by `factor`, so next-token distributions are far from uniform and a stale tensor shows."""
    return jax.tree_util.tree_map(lambda x: x * factor if x.ndim > 1 else x, params)


def jax_scores(config: ModelConfig, params: Params, token_ids: Sequence[int]) -> np.ndarray:
    """log p(token_ids[t] | token_ids[:t]) for t >= 1 from the JAX model (the reference for the server)."""
    ids = jnp.asarray([list(token_ids[:-1])], jnp.int32)
    mask = jnp.ones_like(ids)
    targets = jnp.asarray([list(token_ids[1:])], jnp.int32)
    return np.asarray(token_logprobs(params, config, ids, positions_from_mask(mask), mask, targets))[0]
