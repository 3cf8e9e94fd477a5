"""Float32 logits of load_hf(folder) equal transformers' on the same checkpoint (issue 2 item 4).

Tolerance: rtol 1e-4 plus atol = 1e-5 x max |logit|. A purely relative test is meaningless for logits near zero,
whose float32 error is set by the magnitude of the sums that produced them, not by their own value. Measured
differences are about 4e-7 of the logit scale; a 1% change of rope_theta moves logits by 7e-5 to 5e-4 of the scale,
so the tolerance sits between rounding noise and a real discrepancy. The same token rows are padded on the left and
on the right, so the two sides also check that padding does not change a row's logits.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from hf_reference import assert_logits_close, hf_logits, mask_positions, padded_batch

from rstar_jax.model import load_hf

CASES = {
    # name: (family, transformers config overrides)
    "qwen2_gqa1_untied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=4)),
    "qwen2_gqa2_tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      rope_theta=1e6, rms_norm_eps=1e-5)),
    "qwen2_gqa4_untied": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=500.0)),
    "qwen3_headdim12_gqa2_untied": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                                  attention_bias=False)),
    "qwen3_headdim16_gqa4_tied_bias": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                                     attention_bias=True, tie_word_embeddings=True,
                                                     rope_theta=1e6, rms_norm_eps=1e-5)),
}
LENGTHS = [9, 5, 1, 7]
WIDTH = 9


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_padded_batch_logits_match_transformers(hf_checkpoint, case, side):
    family, overrides = CASES[case]
    folder, reference = hf_checkpoint(family, **overrides)
    model = load_hf(folder)
    ids, mask = padded_batch(model.config.vocab_size, LENGTHS, WIDTH, side)

    # transformers 5 builds position_ids as arange(seq) when none are given, whatever the mask; generate() uses
    # cumsum(mask) - 1 for left padding. Positions are passed explicitly so both use the latter.
    expected = hf_logits(reference, ids, mask, mask_positions(mask))
    actual = model(ids, mask)

    assert actual.dtype == jnp.float32 and actual.shape == (len(LENGTHS), WIDTH, model.config.vocab_size)
    assert_logits_close(actual, expected, mask)


def test_default_positions_match_transformers_without_padding(hf_checkpoint):
    """With no mask both sides use positions 0..T-1; int32 jax input works like int64 numpy."""
    folder, reference = hf_checkpoint("qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    model = load_hf(folder)
    ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 11))
    expected = hf_logits(reference, ids)
    ones = np.ones(ids.shape, np.int64)
    assert_logits_close(model(ids), expected, ones)
    assert_logits_close(model(jnp.asarray(ids, jnp.int32)), expected, ones)


def test_sharded_checkpoint_loads(hf_checkpoint):
    folder, reference = hf_checkpoint("qwen2", max_shard_size="20KB", num_attention_heads=4, num_key_value_heads=2)
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (folder / "model.safetensors.index.json").is_file()
    model = load_hf(folder)
    ids, mask = padded_batch(model.config.vocab_size, [6, 4], 6, "right", seed=3)
    assert_logits_close(model(ids, mask), hf_logits(reference, ids, mask), mask)


def test_transformers4_style_config_json_gives_the_same_model(hf_checkpoint):
    """A Qwen2.5-era config.json (top-level rope_theta, torch_dtype, no head_dim/layer_types, sliding window
    declared but off) is read the way transformers reads it."""
    folder, reference = hf_checkpoint("qwen2", num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
                                      rms_norm_eps=1e-5, tie_word_embeddings=True)
    config = json.loads((folder / "config.json").read_text())
    for key in ("rope_parameters", "dtype", "layer_types"):
        config.pop(key)
    config.update(rope_theta=1e6, rope_scaling=None, torch_dtype="float32", sliding_window=4096,
                  use_sliding_window=False, max_window_layers=21, transformers_version="4.43.1")
    (folder / "config.json").write_text(json.dumps(config))

    model = load_hf(folder)
    assert model.config.rope_theta == 1e6 and model.config.rms_norm_eps == 1e-5 and model.config.head_dim == 8
    ids, mask = padded_batch(model.config.vocab_size, [8, 6], 8, "left", seed=5)
    expected = hf_logits(reference, ids, mask, mask_positions(mask))
    reread = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    np.testing.assert_array_equal(hf_logits(reread, ids, mask, mask_positions(mask)), expected)
    assert_logits_close(model(ids, mask), expected, mask)
