"""Model folders (rstar_jax/model/folder.py): a folder written from new weights holds those weights, even when its
tokenizer is named by another model's folder (the usual case: RL starts from the SFT folder)."""

import jax
import numpy as np

from rstar_jax.model import ModelConfig, init_params, load_hf
from rstar_jax.model.folder import save_model_folder

CONFIG = ModelConfig(vocab_size=2048, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=2,
                     num_kv_heads=2, head_dim=32, eos_token_id=2, pad_token_id=0)


def test_a_tokenizer_named_by_a_model_folder_brings_only_its_tokenizer_files(tmp_path):
    start = save_model_folder(CONFIG, init_params(CONFIG, jax.random.key(0)), tmp_path / "start", "tiny")
    trained = init_params(CONFIG, jax.random.key(1))
    out = save_model_folder(CONFIG, trained, tmp_path / "trained", str(start))

    reloaded = load_hf(out).params
    for got, want in zip(jax.tree.leaves(reloaded), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert sorted(path.name for path in out.iterdir()) == sorted(path.name for path in start.iterdir())
    assert (out / "tokenizer.json").read_bytes() == (start / "tokenizer.json").read_bytes()
