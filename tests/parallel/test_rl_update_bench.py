"""The RL-update benchmark (experiments/bench/rl_update.py) on a small model: the demo-shaped trajectories it
builds, and that every layout trains on the same tokens while packing computes fewer positions."""

from __future__ import annotations

import pytest

from experiments.bench import rl_update
from rstar_jax.model import ModelConfig
from rstar_jax.tokenizers import load_tokenizer

SMALL = ModelConfig(family="qwen3", vocab_size=2048, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=2048)


def test_kept_trajectories_have_the_demos_shape() -> None:
    rows = rl_update.kept_trajectories(load_tokenizer("tiny"), step=0, kept=10, seed=0)
    assert len(rows) == 10
    for row in rows:
        assert len(row.token_ids) == len(row.loss_mask) == len(row.rollout_logprobs)
        sampled = sum(row.loss_mask)
        assert 20 <= sampled <= 3 * 95 and row.loss_mask[0] == 0  # 1-3 turns of 20-95 tokens after the prompt
        assert all((lp < 0) == bool(m) for lp, m in zip(row.rollout_logprobs, row.loss_mask))
    prompts = {row.token_ids[:row.loss_mask.index(1)] for row in rows}
    assert len(prompts) == 3  # 4 a prompt (RoC keeps G = 4): 10 rows hold 3 prompts


@pytest.mark.slow
def test_every_layout_trains_the_same_tokens_and_packing_computes_fewer_positions() -> None:
    result = rl_update.run(SMALL, load_tokenizer("tiny"), seed=0, pad_multiple=256, kept=(12, 20))
    layouts = result["layouts"]
    assert set(layouts) == set(rl_update.LAYOUTS) and layouts[rl_update.BASELINE]["time_vs_baseline"] == 1.0
    for figures in layouts.values():
        assert figures["positions"] * figures["tokens_share"] == pytest.approx(result["tokens"])
        assert figures["first_pass_s"] > 0 and figures["second_pass_s"] > 0
    assert layouts["packed_2x1024"]["positions"] < layouts["rows"]["positions"]
