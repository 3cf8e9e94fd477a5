"""The model an evaluation scores: a Hugging Face folder, or an RL run's orbax checkpoint (SPEC section 7).

`resolve_model_source` only looks at the file system (so a wrong path stops a command before any work);
`load_model` reads the weights. An RL checkpoint (`rstar_jax.train.rl_checkpoint`: DIR/checkpoints/<step>/ with the
TrainState under item "state") holds parameters but no config.json or tokenizer; those come from an HF folder of
the same architecture: `base` if given, else the run's model/ (written when RL finishes), else its serving_model/
(written for a vLLM fleet).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from rstar_jax.model import ModelConfig, init_params, load_hf
from rstar_jax.model.hf_io import CONFIG_FILE
from rstar_jax.model.lm import Params
from rstar_jax.parallel import abstract_placed

CHECKPOINTS = "checkpoints"
STATE_ITEM = "state"  # the TrainState item of an RL checkpoint (rl_checkpoint.save_rl_checkpoint)
RUN_MODEL_FOLDERS = ("model", "serving_model")  # HF folders an RL run writes, in the order they are looked for


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where parameters come from: `folder` (an HF folder, or an orbax checkpoints/ directory when `step` is not
    None) and `base`, the HF folder giving config.json and the tokenizer (the folder itself for an HF model)."""

    folder: Path
    base: Path
    step: int | None = None

    @property
    def is_checkpoint(self) -> bool:
        """Whether the parameters come from an RL checkpoint."""
        return self.step is not None

    def describe(self) -> str:
        """One line for logs and reports."""
        if self.step is None:
            return f"HF folder {self.folder}"
        return f"RL checkpoint {self.folder} step {self.step} (config and tokenizer from {self.base})"


def _is_hf_folder(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file()


def checkpoint_steps(checkpoints: Path) -> list[int]:
    """The complete checkpoints' steps under an orbax checkpoints/ directory, ascending (orbax writes a step's
    commit_success.txt once every item is on disk); SPEC 7 scores any of them."""
    if not checkpoints.is_dir():
        return []
    return sorted(int(d.name) for d in checkpoints.iterdir()
                  if d.is_dir() and d.name.isdigit() and (d / "commit_success.txt").is_file())


def resolve_model_source(path: str | Path, base: str | Path | None = None, step: int | None = None) -> ModelSource:
    """`path`: an HF folder (has config.json), an RL run folder (has checkpoints/), its checkpoints/ directory, or
    one checkpoints/<step> directory (SPEC 7 evaluates the trained model). `step` picks a checkpoint (default: the
    latest); `base` the HF folder giving config and tokenizer for a checkpoint. Raises FileNotFoundError /
    ValueError with what is missing."""
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if _is_hf_folder(folder):
        if step is not None or base is not None:
            raise ValueError(f"{folder} is an HF model folder; --step and --base_model apply to RL run folders only")
        return ModelSource(folder, folder)
    if folder.name.isdigit() and folder.parent.name == CHECKPOINTS:
        if step is not None and step != int(folder.name):
            raise ValueError(f"{folder} is the checkpoint of step {folder.name}, but step {step} was asked for")
        folder, step = folder.parent, int(folder.name)
    checkpoints = folder if folder.name == CHECKPOINTS else folder / CHECKPOINTS
    steps = checkpoint_steps(checkpoints)
    if not steps:
        raise ValueError(f"{path} is neither an HF model folder (no {CONFIG_FILE}) nor an RL run folder with a "
                         f"complete orbax checkpoint under {CHECKPOINTS}/")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(f"{checkpoints} has no complete checkpoint of step {step} (it has steps {steps})")
    return ModelSource(checkpoints, _base_folder(checkpoints.parent, base), step)


def _base_folder(run: Path, base: str | Path | None) -> Path:
    if base is not None:
        if not _is_hf_folder(Path(base)):
            raise FileNotFoundError(f"base model {base} is not an HF model folder (no {CONFIG_FILE})")
        return Path(base)
    for name in RUN_MODEL_FOLDERS:
        if _is_hf_folder(run / name):
            return run / name
    raise FileNotFoundError(f"{run} holds checkpoints but no HF folder ({' or '.join(RUN_MODEL_FOLDERS)}/) to take "
                            f"the config and tokenizer from; name the model training started from with --base_model")


def restore_rl_params(checkpoints: Path, step: int, config: ModelConfig) -> Params:
    """The model parameters of an RL checkpoint for evaluation (SPEC 7; only the TrainState's params are read, not
    the optimiser state), on this process's first device."""
    import orbax.checkpoint as ocp  # only checkpoints need orbax; HF folders load without it

    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shapes = jax.eval_shape(init_params, config, jax.random.key(0))
    abstract = abstract_placed(shapes, device)
    manager = ocp.CheckpointManager(checkpoints.absolute())
    try:
        item = {"params": abstract}
        restored = manager.restore(step, args=ocp.args.Composite(**{STATE_ITEM: ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)}))
    finally:
        manager.close()
    return restored[STATE_ITEM]["params"]


def load_model(source: ModelSource) -> tuple[ModelConfig, Params]:
    """The config and parameters `source` names (SPEC 7 evaluates a trained model's parameters). For a checkpoint
    only the base folder's config.json is read, not its weights."""
    if source.step is None:
        model = load_hf(source.base)
        return model.config, model.params
    config = ModelConfig.from_hf_dict(json.loads((source.base / CONFIG_FILE).read_text()))
    return config, restore_rl_params(source.folder, source.step, config)
