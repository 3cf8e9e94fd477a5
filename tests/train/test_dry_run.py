"""`--dry_run` (issue 11 item 4): the paper-scale configs' numbers against hand computations from the architectures."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Callable, Iterator

import gin
import jax
import pytest

from experiments.demo import DEMO_GIN
from experiments.make_tiny_model import TINY_MODEL_GIN
from experiments.sft import DEFAULT_GIN as SFT_GIN
from experiments.train import dry_run_plan, main as train_main
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import init_params
from rstar_jax.model.config import ModelConfig
from rstar_jax.paths import REPO_ROOT
from rstar_jax.rollout.kv_budget import (ServerShape, concurrent_sequences, flag_value, kv_budget_bytes,
                                         kv_bytes_per_token, server_shape)
from rstar_jax.train.dry_run import GIB, DryRun, DryRunError
from rstar_jax.train.rl_batch import rl_micro_batches
from rstar_jax.train.rl_setup import rl_setup
from rstar_jax.train.rl_trainer import RLTrainer
from rstar_jax.parallel.plan import abstract_mesh
from rstar_jax.train.memory_plan import abstract_params, activation_parts, local_dims

PAPER = {  # gin file: (hidden, intermediate, layers, heads, tied); all: vocab 151936, 8 KV heads of 128
    "paper/qwen3_0_6b.gin": (1024, 3072, 28, 16, True),
    "paper/qwen3_1_7b.gin": (2048, 6144, 28, 16, True),
    "paper/qwen3_4b.gin": (2560, 9728, 36, 32, True),
    "paper/qwen3_14b.gin": (5120, 17408, 40, 40, False),
}
VOCAB, KV_HEADS, HEAD_DIM = 151936, 8, 128


def _plan(devices: int) -> DryRun:
    """The plan `experiments.train --dry_run --devices N` prints, from the parsed gin config."""
    return dry_run_plan(rl_setup(), devices)


def hand_count(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> tuple[int, int]:
    """(all parameters, the norm scales among them) of a Qwen3 decoder, from its architecture."""
    attention = hidden * heads * HEAD_DIM * 2 + hidden * KV_HEADS * HEAD_DIM * 2  # q, o; k, v
    mlp = 3 * hidden * intermediate
    norms = layers * (2 * hidden + 2 * HEAD_DIM) + hidden  # input / post-attn, q / k norms; final norm
    embeddings = VOCAB * hidden * (1 if tied else 2)
    return layers * (attention + mlp) + norms + embeddings, norms


@pytest.fixture
def paper_gin() -> Iterator[Callable[..., None]]:
    gin.add_config_file_search_path(str(REPO_ROOT))

    def parse(name: str, *bindings: str) -> None:
        parse_gin([name], bindings)

    yield parse
    gin.clear_config()


def test_hand_counts_are_the_published_sizes() -> None:
    assert hand_count(*PAPER["paper/qwen3_0_6b.gin"])[0] == 596_049_920        # "0.6B", 0.44B non-embedding
    assert hand_count(*PAPER["paper/qwen3_14b.gin"])[0] == 14_768_307_200      # "14.8B"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_each_paper_config_has_its_models_parameter_count(paper_gin, name: str) -> None:
    paper_gin(name)
    config = ModelConfig()
    assert (config.num_kv_heads, config.head_dim, config.vocab_size, config.rope_theta) == (8, 128, VOCAB, 1e6)
    params = abstract_params(config)
    count = sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(params))
    assert count == hand_count(*PAPER[name])[0]


def test_14b_per_device_state_on_64_devices_matches_the_hand_computation(paper_gin) -> None:
    paper_gin("paper/qwen3_14b.gin")
    plan = _plan(64)
    assert plan.mesh_shape == {"data": 1, "fsdp": 8, "tensor": 8}
    total, norms = hand_count(*PAPER["paper/qwen3_14b.gin"])
    # every matrix splits 64 ways (fsdp x tensor), the norm scales stay whole on every device; float32
    per_device = ((total - norms) // 64 + norms) * 4
    assert (total - norms) % 64 == 0
    assert plan.state.param_count == total
    assert plan.state.params == per_device == 924_692_480
    assert plan.state.optimizer == 2 * per_device + 2 * 4  # AdamW mu and nu, plus two int32 step counters
    assert plan.state.gradients == 2 * per_device and plan.state.reference == 0
    by_path = {p.path: p for p in plan.placements}
    assert by_path["layers/mlp/gate_proj/kernel"].local_shape == (40, 5120 // 8, 17408 // 8)
    assert by_path["embed/embedding"].local_shape == (VOCAB // 8, 5120 // 8)
    assert by_path["layers/input_norm/scale"].local_shape == (40, 5120)
    assert not plan.problems


def test_14b_activation_terms_follow_the_formula(paper_gin) -> None:
    paper_gin("paper/qwen3_14b.gin")
    plan = _plan(64)
    stage2 = plan.stages[1]
    b, t = 32 // 8, 13_312  # 32-row micro-batch over fsdp 8; 1,024 + 12,288 tokens in 1,024-token buckets
    assert (stage2.dims.rows, stage2.padded) == (b, t)
    heads, kv, mlp, vocab, e = 40 // 8, 8 // 8, 17408 // 8, VOCAB // 8, 5120
    assert stage2.activations == {
        "saved": 40 * b * t * e * 2,                                          # remat 'full': each layer's input
        "layer": b * t * (5 * e + 3 * heads * 128 + 3 * kv * 128 + 3 * mlp) * 2,
        "attention": 2 * b * heads * t * 1 * 4,                               # 'auto' = pallas: lse + row term
        "head": 3 * b * 512 * vocab * 4,
        "residual": 2 * b * t * e * 4,
    }


def test_kv_bytes_per_token_and_the_fleets_concurrent_sequences(paper_gin) -> None:
    paper_gin("paper/qwen3_14b.gin")
    plan = _plan(64)
    assert plan.fleet.bytes_per_token == 2 * 40 * 8 * 128 * 2 == 163_840
    budget = int(192 * GIB * 0.85 - 14_768_307_200 * 2)
    assert plan.fleet.budget_bytes == budget
    for stage, context in zip(plan.stages, (1024 + 8192, 1024 + 12288, 1024 + 12288)):
        assert stage.sequences_per_server == budget // (context * 163_840)  # contexts are whole 16-token blocks
    assert [s.sequences_per_server for s in plan.stages] == [96, 66, 66]
    assert plan.total_rollouts == 512 * 32 and plan.fleet.servers == 64
    config = ModelConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                         num_kv_heads=8, head_dim=128)
    assert kv_bytes_per_token(config, 2) == 114_688


def test_server_flags_and_block_rounding() -> None:
    args = ["--tensor-parallel-size", "2", "--gpu-memory-utilization=0.5", "--kv-cache-dtype", "fp8",
            "--max-num-seqs", "8"]
    shape = server_shape(args, "bfloat16")
    assert shape == ServerShape(tensor_parallel=2, gpu_memory_utilization=0.5, block_size=16, weight_bytes=2,
                                kv_dtype_bytes=1, max_num_seqs=8)
    assert flag_value(["--a", "1", "--a=2"], "--a") == "2" and flag_value([], "--a") is None
    assert kv_budget_bytes(shape, 100, 10) == 2 * 100 * 0.5 - 20
    # 17 tokens take two 16-token blocks; the cap applies last
    assert concurrent_sequences(10_000, 17, 10, 16) == 10_000 // 320
    assert concurrent_sequences(10_000, 17, 10, 16, max_num_seqs=8) == 8


def test_a_mesh_that_does_not_divide_the_devices_is_refused(paper_gin) -> None:
    paper_gin("paper/qwen3_14b.gin")
    with pytest.raises(DryRunError, match="60 devices are not divisible by 8"):
        _plan(60)


def test_a_model_that_does_not_fit_is_named(paper_gin) -> None:
    paper_gin("paper/qwen3_14b.gin", "ClusterSpec.device_memory_gib = 16.0",
              "ClusterSpec.fleet_gpu_memory_gib = 24.0")
    plan = _plan(64)
    assert any("stage 'stage2': the learner needs" in p for p in plan.problems)
    assert any("leave no KV cache" in p for p in plan.problems)


def test_remat_policies_order_the_saved_activations() -> None:
    config = ModelConfig(vocab_size=VOCAB, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                         num_kv_heads=8, head_dim=128, remat_policy="full")
    dims = local_dims(config, abstract_mesh({"data": 1, "fsdp": -1, "tensor": 1}, 4), 8, 1024)
    assert dims.rows == 2
    saved = [activation_parts(dataclasses.replace(config, remat_policy=policy), dims, 512)["saved"]
             for policy in ("full", "dots_saveable", "none")]
    assert saved[0] < saved[1] < saved[2]


def test_the_command_prints_the_plan_and_exits_by_the_outcome(paper_gin, capsys: pytest.CaptureFixture) -> None:
    gin.clear_config()
    assert train_main(["--gin_file", "paper/qwen3_14b.gin", "--dry_run", "--devices", "64"]) == 0
    out = capsys.readouterr().out
    assert "64 devices = data 1 x fsdp 8 x tensor 8" in out and out.rstrip().endswith("and its rollout fleet")
    gin.clear_config()
    assert train_main(["--gin_file", "paper/qwen3_0_6b.gin", "--dry_run", "--devices", "12"]) == 1
    assert "not divisible by 8" in capsys.readouterr().err


ONE_NODE = {"1.7B": "paper/one_node_qwen3_1_7b.gin", "14B": "paper/one_node_qwen3_14b.gin"}


def test_one_node_launches_four_servers_beside_a_four_gpu_learner(paper_gin) -> None:
    paper_gin(ONE_NODE["1.7B"])
    plan = _plan(4)
    assert plan.mesh_shape == {"data": 1, "fsdp": 4, "tensor": 1}
    assert (plan.fleet.servers, plan.fleet.attached, plan.fleet.gpus) == (4, False, ((4,), (5,), (6,), (7,)))
    assert plan.fleet.shape.tensor_parallel == 1 and plan.fleet.shape.gpu_memory_utilization == 0.85
    # a launched server's KV cache: its GPU (ClusterSpec.fleet_gpu_memory_gib, an H200) x utilization - weights
    assert plan.fleet.budget_bytes == int(140 * GIB * 0.85 - 1_720_574_976 * 2)
    assert plan.total_rollouts == 32 * 32                                   # prompts per step scaled down from 512
    assert [s.sequences_per_server for s in plan.stages] == [117, 81, 81]
    assert plan.usable_bytes == int(140 * GIB * 0.9)


def test_one_node_fits_qwen3_1_7b(paper_gin) -> None:
    paper_gin(ONE_NODE["1.7B"])
    plan = _plan(4)
    assert not plan.problems and not plan.notes
    assert plan.state.total < 9 * GIB


def test_one_node_fits_qwen3_14b_on_h200s_but_not_on_h100s(paper_gin) -> None:
    paper_gin(ONE_NODE["14B"])
    plan = _plan(4)
    # float32 weights 4 B, AdamW moments 8 B, gradients (running sum + micro-batch) 8 B per parameter, over fsdp 4
    total, norms = hand_count(*PAPER["paper/qwen3_14b.gin"])
    assert plan.state.total == pytest.approx(20 * total / 4, rel=1e-3)     # 68.8 GiB a device
    assert not plan.problems                                                # 112.3 GiB of 126 GiB at 13K tokens
    gin.clear_config()
    paper_gin(ONE_NODE["14B"], "ClusterSpec.device_memory_gib = 80.0", "ClusterSpec.fleet_gpu_memory_gib = 80.0")
    problems = _plan(4).problems
    assert problems and all("the learner needs" in p for p in problems)


def test_one_node_placement_errors_are_problems(paper_gin) -> None:
    paper_gin(ONE_NODE["1.7B"], "learner_devices.gpus = (0, 1, 2, 4)")
    assert any(p.startswith("GPU placement: GPU 4 is given to both the learner") for p in _plan(4).problems)
    gin.clear_config()
    paper_gin(ONE_NODE["1.7B"], "make_mesh.fsdp = 8")
    assert any("learner_devices.gpus names 4 GPUs (0, 1, 2, 3) but the plan is for 8" in p
               for p in _plan(8).problems)
    gin.clear_config()
    paper_gin(ONE_NODE["1.7B"], "learner_devices.node_gpus = 6")
    assert any("placed on GPU 6, but the node has 6 GPUs" in p for p in _plan(4).problems)


def test_the_dry_run_plans_the_trainers_own_setup(tmp_path) -> None:
    """Issue 25 item 3: one `RLSetup`, built from the demo's gin, feeds the trainer and the dry run. The plan's
    per-device parameter and optimiser bytes are what the trainer's started state holds on each of 8 devices, its
    log-prob chunk and padded lengths are the learner's, its rollouts a step the selector's."""
    try:
        parse_gin([TINY_MODEL_GIN, SFT_GIN, DEMO_GIN], ["RLSettings.logprob_chunk = 128", "make_mesh.fsdp = -1"])
        setup = rl_setup()
        plan = dry_run_plan(setup, 8)
        config = ModelConfig()
    finally:
        gin.clear_config()
    trainer = RLTrainer(tmp_path, config, init_params(config, jax.random.key(0)), "tiny", setup)
    state, _ = trainer.start_state()
    device = jax.devices()[0]

    def bytes_on(tree) -> int:
        return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
                   if shard.device == device)

    assert trainer.mesh.shape == plan.mesh_shape == {"data": 1, "fsdp": 8, "tensor": 1}
    assert (plan.state.params, plan.state.optimizer) == (bytes_on(state.params), bytes_on(state.opt_state))
    assert plan.chunk == trainer.learner.chunk == 128
    settings = trainer.settings
    for stage, planned in zip(setup.settings.stages, plan.stages):
        tokens = planned.context + 1  # the longest trajectory the stage allows, as the trainer would batch it
        longest = SimpleNamespace(token_ids=(1,) * tokens, loss_mask=(1,) * tokens, rollout_logprobs=(0.0,) * tokens)
        rows = rl_micro_batches([longest], [1.0], settings.micro_batch_rows, 0, settings.pad_multiple,
                                settings.pack_length)
        assert (planned.dims.rows, planned.padded) == rows[0].shape == (2, 1024)  # the demo's packed rows
    assert plan.total_rollouts == setup.settings.prompts_per_step * trainer.selector.rollouts_per_prompt(
        setup.settings.group_size)
