"""experiments/bench/learner.py: the analytic FLOP count against hand-computed numbers and the parameter tree, the
synthetic rollouts and the torch policy loss against the JAX one, the per-op categories, and a real end-to-end run
(JAX and transformers on the same weights, both steps) that writes every figure to JSON."""

import json

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from experiments.bench import learner
from experiments.bench.op_profile import categorise, hlo_ops
from rstar_jax.model import ModelConfig, init_params
from rstar_jax.rl.losses import policy_loss

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


def test_step_flops_are_dense_plus_causal_attention():
    flops = learner.train_step_flops(SMALL, batch=3, seq=5)
    assert flops.dense == 6 * 280 * 15
    assert flops.attention == 6 * 2 * 3 * 25 * 2 * 2  # half of the full 5 x 5 scores' 12 * L * B * T^2 * H * D
    assert flops.total == 25200 + 3600


def test_synthetic_rollouts_fill_the_row_and_mask_prompt_and_tool_response():
    rollouts, advantages = learner.synthetic_rollouts(rows=3, seq=16, vocab_size=10, seed=0)
    assert len(rollouts) == 3 and advantages.shape == (3,)
    for rollout in rollouts:
        assert len(rollout.token_ids) == len(rollout.loss_mask) == len(rollout.rollout_logprobs) == 17
        assert rollout.loss_mask == (0, 0) + (1,) * 6 + (0, 0) + (1,) * 7
        assert all(0 < token < 10 for token in rollout.token_ids)
        assert all((logprob < 0) == bool(m) for logprob, m in zip(rollout.rollout_logprobs, rollout.loss_mask))


def test_torch_policy_loss_is_the_jax_policy_loss():
    rng = np.random.default_rng(0)
    logprobs, old = (rng.normal(size=(3, 7)).astype(np.float32) * 0.5 - 1 for _ in range(2))
    advantages = rng.normal(size=3).astype(np.float32)
    mask = (rng.random((3, 7)) > 0.3).astype(np.float32)
    expected = policy_loss(jnp.asarray(logprobs), jnp.asarray(old), jnp.asarray(advantages), jnp.asarray(mask),
                           total_tokens=40.0)
    actual = learner.torch_policy_loss(*(torch.from_numpy(x) for x in (logprobs, old, advantages, mask)), 40.0)
    assert float(actual) == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("op,op_name,category", [
    ("ynn_fusion", "jit(f)/jvp(_token_logprobs)/Backbone/DecoderLayer/mlp/up_proj/dot_general",
     "matmul: layer projections and MLP"),
    ("ynn_fusion", "jit(f)/Backbone/layers/attn/nbhgqd,nbhkd->nbhgqk/dot_general",
     "matmul: attention scores and values"),
    ("ynn_fusion", "jit(f)/Backbone/layers/attn/k_proj/dot_general", "matmul: layer projections and MLP"),
    ("ynn_fusion", "jit(f)/jvp(_token_logprobs)/while/body/bte,ve->btv/dot_general", "matmul: output head"),
    ("subtract_exponential", "jit(f)/Backbone/layers/attn/exp", "attention softmax and masks"),
    ("fusion", "jit(f)/Backbone/while/body/jit(dynamic_update_index_in_dim)/dynamic_update_slice",
     "layer-stack residuals (scan slices, stacking)"),
    ("wrapped_broadcast", "jit(f)/jvp(_token_logprobs)", "layer-stack residuals (scan slices, stacking)"),
    ("copy", "jit(f)/Backbone/transpose", "layout copies and transposes"),
    ("fusion", "jit(f)/Backbone/DecoderLayer/mlp/jit(silu)/mul", "norms, RoPE, SwiGLU, residual adds"),
])
def test_ops_are_categorised_by_what_made_them(op, op_name, category):
    assert categorise(op, op_name) == category


def test_hlo_instructions_are_read_with_their_fusion_kind_and_op_name():
    hlo = ('  %ynn_fusion.3 = f32[8,4]{1,0} fusion(%a, %b), kind=kCustom, calls=%c, metadata={op_name="jit(f)/'
           'mlp/dot_general" stack_frame_id=3}, backend_config={"fusion_config":{"kind":"__ynn_fusion"}}\n'
           '  ROOT %copy.1 = (f32[2]{0}, s32[]) copy(%x), metadata={op_name="jit(f)/transpose"}\n'
           '  %wrapped_broadcast.2 = f32[4]{0} fusion(%c), kind=kLoop, calls=%w\n')
    assert hlo_ops(hlo) == {"ynn_fusion.3": ("ynn_fusion", "jit(f)/mlp/dot_general"),
                            "copy.1": ("copy", "jit(f)/transpose"), "wrapped_broadcast.2": ("wrapped_broadcast", "")}


def test_variants_are_read_as_a_name_and_bindings():
    assert learner.parse_variant("dense=ModelConfig.attention_impl = 'dense'") == (
        "dense", ["ModelConfig.attention_impl = 'dense'"])
    assert learner.parse_variant(" both = A.x = 1; B.y = 2 ;") == ("both", ["A.x = 1", "B.y = 2"])
    for text in ("no bindings=", "=A.x = 1", "A.x"):
        with pytest.raises(ValueError, match="NAME=BINDING"):
            learner.parse_variant(text)


def test_bad_sizes_and_names_are_refused():
    with pytest.raises(ValueError, match=r"too small: iters=0 \(needs >= 1\)"):
        learner.run_benchmark(["tiny_256"], warmup=0, iters=0, matmul_size=8)
    with pytest.raises(ValueError, match=r"unknown configuration\(s\) \['huge'\]"):
        learner.run_benchmark(["huge"], warmup=0, iters=1, matmul_size=8)


@pytest.mark.slow
def test_end_to_end_run_writes_every_figure(tmp_path, capsys, clean_gin):
    out = tmp_path / "learner.json"
    bindings = ["ModelConfig.num_layers = 1", "ModelConfig.hidden_size = 64", "ModelConfig.vocab_size = 128",
                "ModelConfig.intermediate_size = 96"]
    result = learner.main(["--configs", "tiny_256", "--rows", "2", "--seq", "16", "--warmup", "1", "--iters", "2",
                           "--matmul_size", "128", "--profile",
                           "--variant", "dense=ModelConfig.attention_impl = 'dense'",
                           *[arg for binding in bindings for arg in ("--gin_param", binding)], "--json", str(out)])
    written = json.loads(out.read_text())
    config = written["configurations"]["tiny_256"]
    assert config["model"]["num_hidden_layers"] == 1 and config["model"]["hidden_size"] == 64
    assert config["model"]["num_attention_heads"] == 8  # the tiny demo default, not overridden
    assert config["tokens_per_step"] == 32 and config["micro_batches"] == 2
    for side in ("jax loss", "torch loss", "jax grpo", "torch grpo"):
        assert len(config["steps"][side]["step_s"]) == 2
        assert config["steps"][side]["tokens_per_s"] == pytest.approx(32 / config["steps"][side]["median_step_s"])
    # Same weights and batch: the two implementations' losses agree (about ln(128) = 4.85 for a fresh model).
    assert config["loss_abs_difference"]["loss"] < 1e-4 and config["loss_abs_difference"]["grpo"] < 1e-5
    assert abs(config["steps"]["jax loss"]["loss"] - 4.85) < 0.1
    for step in ("loss", "grpo"):
        assert config["jax_over_torch"][step] == pytest.approx(
            config["steps"][f"jax {step}"]["tokens_per_s"] / config["steps"][f"torch {step}"]["tokens_per_s"])
    assert set(config["jax_loss_profile_ms"]) >= {"matmul: layer projections and MLP"}
    dense = config["variants"]["dense"]
    assert dense["model"]["attention_impl"] == "dense" and config["model"]["attention_impl"] == "cpu_fused"
    assert abs(config["steps"]["jax loss [dense]"]["loss"] - config["steps"]["jax loss"]["loss"]) < 1e-5
    assert dense["step_time_vs_default"] == pytest.approx(
        config["steps"]["jax loss [dense]"]["median_step_s"] / config["steps"]["jax loss"]["median_step_s"])
    assert written["environment"]["reuse_freed_memory"] is False
    assert result["configurations"]["tiny_256"]["flops_per_step"] == config["flops_per_step"]
    printed = capsys.readouterr().out
    assert "| tiny_256 [2 x 16] | grpo |" in printed and "| tiny_256 [2 x 16] | loss [dense] |" in printed


def test_a_variant_may_not_change_the_parameters(clean_gin):
    with pytest.raises(ValueError, match="variant 'wider' changes the parameters' shapes"):
        learner.run_benchmark(["tiny_256"], warmup=0, iters=1, matmul_size=8, overrides={"rows": 2, "seq": 16},
                              variants={"wider": ["ModelConfig.hidden_size = 512"]})
