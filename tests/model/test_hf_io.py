"""HF folders in and out (issue 2 item 3): save_hf output reloads in transformers with the same logits, bfloat16
round-trips bit for bit, and broken folders fail with errors that name the problem."""

import json
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_reference import assert_logits_close, hf_logits, mask_positions, padded_batch
from safetensors import safe_open
from safetensors.numpy import save_file

from rstar_jax.model import ModelConfig, forward, init_params, load_hf, positions_from_mask, save_hf

QWEN3_TIED_BIAS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12, attention_bias=True,
                       tie_word_embeddings=True)
QWEN2_UNTIED = dict(num_attention_heads=4, num_key_value_heads=2)


def read_tensors(path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file or of a folder's files, as numpy (bfloat16 as ml_dtypes)."""
    tensors = {}
    for file in sorted(path.glob("*.safetensors")) if path.is_dir() else [path]:
        with safe_open(file, framework="np") as reader:
            tensors.update({name: reader.get_tensor(name) for name in reader.keys()})
    return tensors


@pytest.mark.parametrize("family, overrides, shard_mb", [
    ("qwen2", QWEN2_UNTIED, 0.01),
    ("qwen3", QWEN3_TIED_BIAS, 4096),
], ids=["qwen2_untied_sharded", "qwen3_tied_bias_single_file"])
def test_save_hf_reloads_in_transformers_with_same_logits(hf_checkpoint, tmp_path, family, overrides, shard_mb):
    folder, reference = hf_checkpoint(family, **overrides)
    model = load_hf(folder)
    out = tmp_path / "exported"
    save_hf(model, out, shard_size_mb=shard_mb)

    shards = list(out.glob("model-*-of-*.safetensors"))
    if shard_mb < 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}
        for shard in shards:  # bounded, unless one tensor alone exceeds the bound
            sizes = [t.nbytes for t in read_tensors(shard).values()]
            assert len(sizes) == 1 or sum(sizes) <= shard_mb * 2**20, shard.name
    else:
        assert not shards and (out / "model.safetensors").is_file()
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == [reference.config.architectures[0]]
    assert written["model_type"] == family and written["torch_dtype"] == "float32"

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is type(reference)
    ids, mask = padded_batch(model.config.vocab_size, [7, 3], 7, "left", seed=2)
    expected = hf_logits(reference, ids, mask, mask_positions(mask))
    np.testing.assert_array_equal(hf_logits(reloaded, ids, mask, mask_positions(mask)), expected)
    assert_logits_close(model(ids, mask), expected, mask)


def test_params_from_init_export_to_transformers(tmp_path):
    """A model that never came from HF (init_params) exports to a folder transformers computes identically."""
    config = ModelConfig(family="qwen3", vocab_size=80, hidden_size=32, intermediate_size=48, num_layers=3,
                         num_heads=4, num_kv_heads=1, head_dim=16, rope_theta=1e6, eos_token_id=(1, 2))
    params = init_params(config, jax.random.key(7))
    save_hf((config, params), tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.head_dim == 16 and reloaded.config.num_key_value_heads == 1
    ids, mask = padded_batch(config.vocab_size, [5, 8], 8, "right", seed=4)
    ours = forward(params, config, ids, positions_from_mask(mask), mask)
    assert_logits_close(ours, hf_logits(reloaded, ids, mask), mask)


def test_bfloat16_round_trips_exactly(hf_checkpoint, tmp_path):
    folder, reference = hf_checkpoint("qwen3", **QWEN3_TIED_BIAS, dtype=torch.bfloat16)
    model = load_hf(folder)
    assert model.config.param_dtype == "bfloat16" and model.config.dtype == "bfloat16"
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree_util.tree_leaves(model.params))
    save_hf(model, tmp_path / "bf16")

    original, exported = read_tensors(folder), read_tensors(tmp_path / "bf16")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype == np.dtype(jnp.bfloat16), name
        np.testing.assert_array_equal(exported[name].view(np.uint16), tensor.view(np.uint16), err_msg=name)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert reloaded.dtype == torch.bfloat16


def test_bfloat16_logits_stay_near_float32(hf_checkpoint):
    """Compute in bfloat16 is a real option: logits stay within bf16 rounding of the float32 ones."""
    folder, _ = hf_checkpoint("qwen2", **QWEN2_UNTIED)
    exact, low = load_hf(folder), load_hf(folder, dtype="bfloat16", param_dtype="bfloat16")
    assert low.params["layers"]["mlp"]["up_proj"]["kernel"].dtype == jnp.bfloat16
    ids = np.random.default_rng(0).integers(0, exact.config.vocab_size, (2, 6))
    reference, approx = np.asarray(exact(ids)), np.asarray(low(ids))
    assert approx.dtype == np.float32
    assert np.abs(approx - reference).max() < 0.05 * np.abs(reference).max()


def rewrite_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["LlamaForCausalLM"]), r"unsupported architecture \['LlamaForCausalLM'\]"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "unsupported RoPE scaling"),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "unsupported RoPE scaling.*'linear'"),
    (dict(use_sliding_window=True, sliding_window=16), "sliding-window attention"),
    (dict(hidden_act="gelu"), "unsupported hidden_act 'gelu'"),
    (dict(torch_dtype="float8_e4m3fn", dtype=None), "unsupported checkpoint dtype"),
    (dict(intermediate_size=44), r"tensor model.layers.0.mlp.\w+_proj.weight .* has shape"),
])
def test_bad_folders_fail_with_a_clear_error(hf_checkpoint, changes, message):
    folder, _ = hf_checkpoint("qwen3", **QWEN3_TIED_BIAS)
    rewrite_config(folder, **changes)
    with pytest.raises(ValueError, match=message):
        load_hf(folder)


def test_missing_tensor_is_named(hf_checkpoint):
    folder, _ = hf_checkpoint("qwen2", **QWEN2_UNTIED)
    tensors = read_tensors(folder)
    del tensors["model.layers.1.self_attn.k_proj.bias"], tensors["lm_head.weight"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model.layers.1.self_attn.k_proj.bias', "
                                         r"'lm_head.weight'\]"):
        load_hf(folder)


def test_missing_files_are_named(tmp_path, hf_checkpoint):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_hf(tmp_path)
    folder, _ = hf_checkpoint("qwen2", **QWEN2_UNTIED)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        load_hf(folder)


def test_load_and_save_keep_one_host_copy_of_the_weights(tmp_path):
    """Host (numpy) allocations peak near one copy of the weights on load, and near one shard on save.

    tracemalloc sees numpy buffers, not XLA's: on load that is the preallocated stacked arrays plus the tensor being
    read (two copies would show as 2x), on save the shard being assembled plus the tensor being sliced.
    """
    config = ModelConfig(family="qwen2", vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=6,
                         num_heads=4, num_kv_heads=2)
    params = init_params(config, jax.random.key(0))
    total = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
    shard_mb = 2.0

    tracemalloc.start()
    try:
        save_hf((config, params), tmp_path, shard_size_mb=shard_mb)
        _, save_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        loaded = load_hf(tmp_path)
        _, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    largest = max(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
    assert save_peak < shard_mb * 2**20 + 2 * largest, (save_peak, total)
    assert load_peak < 1.5 * total, (load_peak, total)
    for a, b in zip(jax.tree_util.tree_leaves(loaded.params), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(a, b)
