"""The learner as a one-node GPU run builds it (issue 22 items 1-2): precision from gin, not from the folder, and a
build that never holds a whole weight matrix on one device.

Measured on 8 simulated CPU devices (tests/conftest.py). CPU devices report no allocator statistics, so the build is
watched through `jax.live_arrays()`, sampled at every return of an rstar_jax function while it runs (the placement
of each parameter, the optimiser init, ...): what a sample cannot see is the inside of one jitted call, and the only
jitted call of the build (the optimiser init) writes zeros straight into its outputs.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any, Callable

import gin
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import rstar_jax
from rstar_jax.model import ModelConfig, init_params, load_hf
from rstar_jax.model.hf_io import save_hf
from rstar_jax.parallel import make_mesh, param_specs
from rstar_jax.train.memory_plan import abstract_params
from rstar_jax.train.rl_batch import rl_micro_batches
from rstar_jax.train.rl_setup import RLSettings, rl_setup
from rstar_jax.train.rl_trainer import RLTrainer
from rstar_jax.train.stages import Stage
from rstar_jax.data.problem_source import ProblemSource
from rstar_jax.gin_setup import parse_gin
from rstar_jax.paths import REPO_ROOT
from experiments.train import dry_run_plan

RECIPE_PRECISION = ["ModelConfig.param_dtype = 'float32'", "ModelConfig.dtype = 'bfloat16'"]
SETTINGS = RLSettings(stages=(Stage(steps=1, max_response_tokens=64, max_turns=1,
                                    data=ProblemSource(source="synthetic", count=4, split="train")),),
                      prompts_per_step=2, group_size=2, micro_batch_rows=2)
RUNS_ROOT = Path(rstar_jax.__file__).resolve().parent


@pytest.fixture
def gin_bindings():
    """Parse gin bindings for one test, cleared afterwards."""
    gin.clear_config()
    yield lambda bindings: gin.parse_config(bindings)
    gin.clear_config()


def _bf16_folder(config: ModelConfig, out: Path) -> Path:
    """An HF folder of `config`'s architecture with bfloat16 weights, as Qwen3 ships."""
    bf16 = ModelConfig(**{**config.__dict__, "param_dtype": "bfloat16", "dtype": "bfloat16"})
    save_hf((bf16, init_params(bf16, jax.random.key(0))), out)
    return out


@pytest.mark.parametrize("bindings, master, moves", [(RECIPE_PRECISION, "float32", True), ([], "bfloat16", False)],
                         ids=["recipe-precision", "folder-precision"])
def test_recipe_precision_applies_to_a_bfloat16_folder_and_a_1e6_step_moves_the_weights(
        tmp_path: Path, gin_bindings: Callable, bindings: list[str], master: str, moves: bool) -> None:
    """Under the recipe's bindings a bfloat16 folder trains float32 master weights that a 1e-6 AdamW step changes;
    with the folder's precision (no binding) the masters are bfloat16 and the same step rounds away entirely,
    the silent non-training bug of issue 22 item 1."""
    config = ModelConfig(family="qwen3", vocab_size=2048, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True, pad_token_id=0)
    folder = _bf16_folder(config, tmp_path / "bf16")
    gin_bindings(bindings + ["rl_optimizer.warmup_steps = 0",
                                                     "rl_optimizer.learning_rate = 1e-6"])
    model = load_hf(folder, mesh=make_mesh())
    assert (model.config.param_dtype, model.config.dtype) == (master, "bfloat16")
    trainer = RLTrainer(tmp_path / "run", model.config, model.params, "tiny", rl_setup(SETTINGS))
    state, _ = trainer.start_state()
    assert {leaf.dtype.name for leaf in jax.tree.leaves(state.params)} == {master}
    before = jax.device_get(state.params)

    rng = np.random.default_rng(0)
    rows = [_Row(tuple(int(t) for t in rng.integers(1, 2048, 24)), (0,) * 8 + (1,) * 16) for _ in range(2)]
    batches = rl_micro_batches(rows, np.array([1.0, -1.0]), 2, 0)
    state, metrics = trainer.learner.update(state, batches, on_policy=True)
    assert float(metrics["learning_rate"]) == pytest.approx(1e-6) and float(metrics["grad_norm"]) > 0
    after = jax.device_get(state.params)
    # Every entry of a layer kernel gets a gradient; Adam's first step moves it by lr x sign(gradient).
    kernels = [(a, b) for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(before), jax.tree.leaves(after))
               if path[0].key == "layers" and path[-1].key == "kernel"]
    changed = sum(int(np.sum(a != b)) for a, b in kernels) / sum(a.size for a, _ in kernels)
    if moves:
        assert changed > 0.99
        largest = max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
                      for a, b in kernels)
        assert largest == pytest.approx(1e-6, rel=0.05)
    else:  # only entries within ~5e-4 of zero have a bfloat16 step (ulp) small enough for 1e-6 to reach
        assert changed < 0.05


def test_the_dry_run_plans_the_folders_model_with_the_trainers_precision(tmp_path: Path,
                                                                         gin_bindings: Callable) -> None:
    """`--dry_run --model DIR` under the paper recipe plans exactly the ModelConfig `load_hf` builds for the trainer:
    the folder's architecture, the recipe's float32 masters and bfloat16 compute (not the folder's bfloat16)."""
    config = ModelConfig(family="qwen3", vocab_size=2048, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True, pad_token_id=0)
    folder = _bf16_folder(config, tmp_path / "bf16")
    gin_bindings([])
    gin.add_config_file_search_path(str(REPO_ROOT))
    parse_gin(["paper/qwen3_0_6b.gin"], [])
    plan = dry_run_plan(rl_setup(), 8, str(folder))
    assert plan.config == load_hf(folder).config
    assert (plan.config.param_dtype, plan.config.dtype, plan.config.hidden_size) == ("float32", "bfloat16", 64)
    assert plan.state.param_bytes_total == 4 * plan.state.param_count
    assert plan.state.build_peak == plan.state.params + plan.state.optimizer < plan.state.total


class _Row:
    """A trajectory as `rl_micro_batches` reads it."""

    def __init__(self, token_ids: tuple[int, ...], loss_mask: tuple[int, ...]) -> None:
        self.token_ids, self.loss_mask = token_ids, loss_mask
        self.rollout_logprobs = tuple(-1.0 * m for m in loss_mask)


# ---- the sharded build -------------------------------------------------------------------------------------------

BIG = ModelConfig(family="qwen3", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8,
                  num_heads=16, num_kv_heads=8, head_dim=64, tie_word_embeddings=True, pad_token_id=0)


def _matrix_shapes(config: ModelConfig) -> set[tuple[int, ...]]:
    """Shapes of every whole weight matrix: each split parameter of rank >= 2 per layer, stacked and one layer."""
    params = abstract_params(config)
    shapes = set()
    for (keypath, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                                     jax.tree.leaves(param_specs(params),
                                                     is_leaf=lambda x: isinstance(x, PartitionSpec))):
        stacked = keypath[0].key == "layers"
        if leaf.ndim - stacked >= 2 and any(axis is not None for axis in spec):
            shapes.add(tuple(leaf.shape))
            if stacked:
                shapes.add(tuple(leaf.shape[1:]))
    return shapes


class LiveBytes:
    """Samples live arrays per device at every return of an rstar_jax function while active (see the docstring)."""

    def __init__(self, matrix_shapes: set[tuple[int, ...]]) -> None:
        self.matrix_shapes = matrix_shapes
        self.baseline = self.per_device()
        self.peak: collections.Counter = collections.Counter()
        self.whole_matrices: list[str] = []

    @staticmethod
    def per_device() -> collections.Counter:
        counts: collections.Counter = collections.Counter()
        for array in jax.live_arrays():  # from the sharding alone: `shard.data` would make more live arrays
            shard_bytes = int(np.prod(array.sharding.shard_shape(array.shape))) * array.dtype.itemsize
            for device in array.sharding.device_set:
                counts[device.id] += shard_bytes
        return counts

    def sample(self) -> None:
        now = self.per_device()
        for device, nbytes in now.items():
            self.peak[device] = max(self.peak[device], nbytes - self.baseline[device])
        for array in jax.live_arrays():
            if tuple(array.shape) in self.matrix_shapes and \
                    tuple(array.sharding.shard_shape(array.shape)) == tuple(array.shape):
                self.whole_matrices.append(f"{array.shape} {array.dtype} on {array.sharding}")

    def __enter__(self) -> "LiveBytes":
        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "return" and frame.f_code.co_filename.startswith(str(RUNS_ROOT)):
                self.sample()
        sys.setprofile(profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)
        self.sample()


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 126 M-parameter Qwen3-shaped folder in bfloat16 (written once for the module)."""
    return _bf16_folder(BIG, tmp_path_factory.mktemp("big") / "model")


@pytest.mark.slow
def test_sharded_build_holds_no_whole_matrix_and_peaks_at_the_steady_state(
        big_folder: Path, tmp_path: Path, gin_bindings: Callable) -> None:
    """From safetensors to a ready TrainState on 8 devices (fsdp 8): no whole matrix on one device at any sample,
    and the per-device peak at most 1.25x that device's steady-state bytes (params + AdamW moments)."""
    gin_bindings(RECIPE_PRECISION + ["make_mesh.fsdp = 8", "rl_optimizer.warmup_steps = 0"])
    param_count = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(abstract_params(BIG)))
    assert param_count >= 100_000_000
    with LiveBytes(_matrix_shapes(BIG)) as watch:
        mesh = make_mesh()
        model = load_hf(big_folder, mesh=mesh)
        trainer = RLTrainer(tmp_path / "run", model.config, model.params, "tiny", rl_setup(SETTINGS), mesh)
        del model
        state, reference = trainer.start_state()
    assert reference is None
    assert not watch.whole_matrices, watch.whole_matrices[:5]
    steady = LiveBytes.per_device()
    for device in mesh.devices.flat:
        steady_bytes = steady[device.id] - watch.baseline[device.id]
        # params + 2 moments, float32, split 8 ways (norm scales replicated): about 3 x 4 x 126 M / 8 = 189 MB
        assert steady_bytes == pytest.approx(3 * 4 * param_count / 8, rel=0.02)
        assert watch.peak[device.id] <= 1.25 * steady_bytes, (device, watch.peak[device.id], steady_bytes)
    del state


@pytest.mark.slow
def test_the_watch_sees_an_unsharded_load(big_folder: Path, gin_bindings: Callable) -> None:
    """The measurement can fail: loading without a mesh puts whole matrices on device 0."""
    gin_bindings(RECIPE_PRECISION)
    with LiveBytes(_matrix_shapes(BIG)) as watch:
        model = load_hf(big_folder)
    assert watch.whole_matrices and watch.peak[0] >= 4 * 100_000_000
    del model
