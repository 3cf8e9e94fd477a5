"""The evaluated model from an HF folder or an RL run's orbax checkpoint (rstar_jax.train.rl_checkpoint's layout):
the parameters read back are exactly the ones saved."""

from __future__ import annotations

from pathlib import Path

import gin
import jax
import numpy as np
import optax
import pytest

from rstar_jax.data.pipeline import prompt_batches
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.eval.model_source import load_model, resolve_model_source
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model.folder import seeded_model
from rstar_jax.train.rl_checkpoint import TrainerRecord, rl_checkpoint_manager, save_rl_checkpoint
from rstar_jax.train.state import init_train_state

SMALL = ("ModelConfig.num_layers = 1", "ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 128",
         "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 2")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict]:
    """An RL run folder with model/ (the base) and checkpoints of steps 1 and 2 holding base + step."""
    root = tmp_path_factory.mktemp("rl_run")
    parse_gin(["model/tiny.gin"], SMALL)
    try:
        base = seeded_model(root / "model", seed=3)
    finally:
        gin.clear_config()
    manager = rl_checkpoint_manager(root / "checkpoints")
    iterator = iter(prompt_batches(synthetic_problems(8, seed=0), batch_size=4, num_epochs=None))
    saved = {}
    for step in (1, 2):
        saved[step] = jax.tree.map(lambda leaf: leaf + step, base.params)
        state = init_train_state(saved[step], optax.sgd(0.1))
        save_rl_checkpoint(manager, state, iterator, TrainerRecord(step=step, stage=0, seed=0))
    manager.close()
    return root, base.params, saved


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_hf_folder(run) -> None:
    root, base, _ = run
    source = resolve_model_source(root / "model")
    assert not source.is_checkpoint and source.base == root / "model"
    config, params = load_model(source)
    assert config.num_layers == 1 and _same(params, base)


def test_run_folder_latest_and_chosen_step(run) -> None:
    root, base, saved = run
    latest = resolve_model_source(root)
    assert latest.step == 2 and latest.base == root / "model" and latest.folder == root / "checkpoints"
    config, params = load_model(latest)
    assert _same(params, saved[2]) and not _same(params, base)
    assert jax.tree.structure(params) == jax.tree.structure(base)
    for path, step in ((root, 1), (root / "checkpoints", 1), (root / "checkpoints" / "1", None)):
        source = resolve_model_source(path, step=step)
        assert source.step == 1 and _same(load_model(source)[1], saved[1])


def test_bad_sources(run, tmp_path: Path) -> None:
    root, _, _ = run
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_source(tmp_path / "nothing")
    with pytest.raises(ValueError, match="neither an HF model folder"):
        resolve_model_source(tmp_path)
    with pytest.raises(ValueError, match="no complete checkpoint of step 7"):
        resolve_model_source(root, step=7)
    with pytest.raises(FileNotFoundError, match="not an HF model folder"):
        resolve_model_source(root, base=tmp_path)
    bare = tmp_path / "run"
    bare.mkdir()
    (bare / "checkpoints").symlink_to(root / "checkpoints")
    with pytest.raises(FileNotFoundError, match="--base_model"):
        resolve_model_source(bare)
    assert resolve_model_source(bare, base=root / "model").step == 2
