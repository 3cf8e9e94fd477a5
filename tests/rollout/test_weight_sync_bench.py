"""experiments/bench/weight_sync.py's pieces that run without a server: the Qwen3-0.6B shape it syncs, its random
parameters (the init's tree without running it), their perturbation, and the previous code's writer it measures as a
baseline, which must write the same checkpoint as `save_hf` does in float32."""

from __future__ import annotations

import json

import gin
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from experiments.bench import weight_sync
from rstar_jax.model import ModelConfig, init_params, load_hf

SMALL = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def test_the_model_is_qwen3_0_6b_with_float32_masters_and_bfloat16_compute():
    config = weight_sync.model_config()
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.tie_word_embeddings) == (
        151936, 1024, 28, 16, 8, 128, 3072, True)
    assert (config.param_dtype, config.dtype) == ("float32", "bfloat16")
    assert not gin.config_str().strip(), "gin is left cleared"


def test_random_params_have_the_init_tree_and_perturbation_moves_only_matrices():
    params = weight_sync.random_params(SMALL, seed=0)
    shapes = jax.eval_shape(init_params, SMALL, jax.random.key(0))
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(shapes)
    assert all(a.shape == b.shape and a.dtype == b.dtype
               for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(shapes)))
    assert np.all(np.asarray(params["final_norm"]["scale"]) == 1.0)
    assert 0.015 < float(jnp.std(params["embed"]["embedding"])) < 0.025
    moved = weight_sync.perturbed(params, jax.random.key(1))
    for before, after in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(moved)):
        assert np.array_equal(before, after) == (before.ndim == 1)


def test_the_previous_writer_writes_what_save_hf_writes_in_float32(tmp_path):
    params = weight_sync.random_params(SMALL, seed=2)
    nbytes = weight_sync.previous_write(SMALL, params, tmp_path / "previous", shard_size_mb=0.01)
    assert nbytes == sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
    assert len(list((tmp_path / "previous").glob("*.safetensors"))) > 2
    # load_hf reads an index or model.safetensors; the shards get an index (the worker extension needs none)
    weight_map = {}
    for shard in (tmp_path / "previous").glob("*.safetensors"):
        with safe_open(shard, "np") as reader:
            weight_map.update({name: shard.name for name in reader.keys()})
    (tmp_path / "previous" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    reloaded = load_hf(tmp_path / "previous")
    for got, want in zip(jax.tree_util.tree_leaves(reloaded.params), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(got, want)
