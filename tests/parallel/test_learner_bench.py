"""experiments/bench/learner.py: the analytic FLOP count against hand-computed numbers and the parameter tree, and
a real end-to-end run (JAX and transformers on the same weights) that writes every figure to JSON."""

import json

import gin
import jax
import pytest

from experiments.bench import learner
from rstar_jax.model import ModelConfig, init_params

SMALL = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1,
                    head_dim=2, family="qwen3")


@pytest.fixture
def clean_gin():
    yield
    gin.clear_config()


def test_matmul_params_are_counted_by_hand():
    # per layer: q 4*4 + k,v 2*4*2 + o 4*4 + mlp 3*4*6 = 120; two layers + head 4*10
    assert learner.matmul_param_count(SMALL) == 2 * 120 + 40


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_params_equal_the_projection_weights_of_the_real_tree(tied):
    config = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=40, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=16, family="qwen2", tie_word_embeddings=tied)
    shapes = jax.eval_shape(init_params, config, jax.random.key(0))
    kernels = sum(leaf.size for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
                  if jax.tree_util.keystr(path[-1:], simple=True) == "kernel")
    head = shapes["embed"]["embedding"].size if tied else 0
    assert learner.matmul_param_count(config) == kernels + head


def test_step_flops_are_dense_plus_attention():
    flops = learner.train_step_flops(SMALL, batch=3, seq=5)
    assert flops.dense == 6 * 280 * 15
    assert flops.attention == 12 * 2 * 3 * 25 * 2 * 2
    assert flops.total == 25200 + 7200


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match=r"too small: seq=1 \(needs >= 2\)"):
        learner.run_benchmark(SMALL, batch=2, seq=1, warmup=0, iters=1, matmul_size=8)


@pytest.mark.slow
def test_end_to_end_run_writes_every_figure(tmp_path, capsys, clean_gin):
    out = tmp_path / "learner.json"
    bindings = ["ModelConfig.num_layers = 1", "ModelConfig.hidden_size = 64", "ModelConfig.vocab_size = 128",
                "ModelConfig.intermediate_size = 96"]
    result = learner.main(["--batch", "2", "--seq", "16", "--warmup", "1", "--iters", "2", "--matmul_size", "128",
                           *[arg for binding in bindings for arg in ("--gin_param", binding)], "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["model"]["num_hidden_layers"] == 1 and written["model"]["hidden_size"] == 64
    assert written["model"]["num_attention_heads"] == 8  # the tiny demo default, not overridden
    assert written["tokens_per_step"] == 32
    for side in ("jax", "torch"):
        assert len(written[side]["step_s"]) == 2
        assert written[side]["tokens_per_s"] == pytest.approx(32 / written[side]["median_step_s"])
    # Same weights and batch: the two implementations' losses agree (about ln(128) = 4.85 for a fresh model).
    assert written["loss_abs_difference"] < 1e-4
    assert abs(written["jax"]["loss"] - 4.85) < 0.1
    assert written["jax_over_torch_tokens_per_s"] == pytest.approx(
        written["jax"]["tokens_per_s"] / written["torch"]["tokens_per_s"])
    assert result["flops_per_step"] == written["flops_per_step"]
    assert "| jax (jit value_and_grad) |" in capsys.readouterr().out
