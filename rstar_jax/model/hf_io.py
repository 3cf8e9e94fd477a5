"""Hugging Face checkpoints in and out: a folder with config.json and safetensors (one file or an index of shards).

Loading reads each device's slice of each parameter on its own (safetensors `get_slice`, numpy framework) and
places it (`jax.make_array_from_callback`), so host memory holds one shard at a time; saving slices one layer's
tensor at a time into shards of bounded size. HF Linear weights are [out, in]; ours are kernels [in, out], hence the transposes.
bfloat16 travels as ml_dtypes.bfloat16, which safetensors' numpy API reads and writes as BF16.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import gin
import jax
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from safetensors import safe_open
from safetensors.numpy import save_file

from rstar_jax.model.causal_lm import CausalLM
from rstar_jax.model.config import ModelConfig
from rstar_jax.model.lm import Params, init_params
from rstar_jax.parallel.params import param_shardings

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_TOP_MODULES = {"embed": "model.embed_tokens", "final_norm": "model.norm", "lm_head": "lm_head"}
_LAYER_MODULES = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                  "attn": "self_attn", "mlp": "mlp"}
_LEAVES = {"kernel": "weight", "embedding": "weight", "scale": "weight", "bias": "bias"}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One HF tensor: where it lives in our tree (path, layer index for stacked leaves) and its HF shape."""

    path: tuple[str, ...]
    layer: int | None
    hf_name: str
    hf_shape: tuple[int, ...]

    @property
    def transposed(self) -> bool:
        """Kernels are stored transposed relative to HF Linear weights."""
        return self.path[-1] == "kernel"


def tensor_specs(config: ModelConfig) -> list[TensorSpec]:
    """Every HF tensor name of this config, in checkpoint order (embeddings, layer by layer, norm, head)."""
    shapes = jax.eval_shape(init_params, config, jax.random.key(0))
    leaves = [(tuple(k.key for k in key_path), leaf.shape)
              for key_path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    layer_specs = [
        TensorSpec(path, layer, ".".join([f"model.layers.{layer}", _LAYER_MODULES[path[1]], *path[2:-1],
                                          _LEAVES[path[-1]]]), _hf_shape(path, shape[1:]))
        for layer in range(config.num_layers) for path, shape in leaves if path[0] == "layers"
    ]
    top_specs = {path[0]: TensorSpec(path, None, f"{_TOP_MODULES[path[0]]}.{_LEAVES[path[-1]]}",
                                     _hf_shape(path, shape))
                 for path, shape in leaves if path[0] != "layers"}
    ordered_top = [top_specs[name] for name in ("final_norm", "lm_head") if name in top_specs]
    return [top_specs["embed"], *layer_specs, *ordered_top]


def hf_model_config(path: str | os.PathLike, *, dtype: str | None = None,
                    param_dtype: str | None = None) -> ModelConfig:
    """The ModelConfig `load_hf` builds for the folder at `path` (its config.json, precision by
    `config.model_precision`), without reading any weights: what the dry run plans from (issue 22 item 1)."""
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE}; expected a Hugging Face model folder")
    return ModelConfig.from_hf_dict(json.loads(config_path.read_text()), dtype=dtype, param_dtype=param_dtype)


def load_hf(path: str | os.PathLike, *, dtype: str | None = None, param_dtype: str | None = None,
            mesh: Mesh | None = None) -> CausalLM:
    """Read a Hugging Face Qwen2/Qwen3 folder into a CausalLM (issue 2 item 3; issue 22 items 1-2).

    dtype / param_dtype: `ModelConfig.from_hf_dict` decides them (`config.model_precision`: explicit, else gin's
    ModelConfig bindings, else the checkpoint's). With `mesh`, every parameter goes from the safetensors straight
    into its shards by the partition rules of `rstar_jax.parallel` (`jax.make_array_from_callback`: each device's
    slice is read from the file on its own, cast on the host, and placed), so no device ever holds a whole
    unsharded weight and the host holds one shard at a time; without one, everything lands on the default device.
    Errors name the unsupported architecture or feature, the missing tensors, or the tensor whose shape disagrees
    with config.json.
    """
    folder = Path(path)
    config = hf_model_config(folder, dtype=dtype, param_dtype=param_dtype)
    specs = tensor_specs(config)
    locations = _tensor_locations(folder)
    missing = [spec.hf_name for spec in specs if spec.hf_name not in locations]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{folder} is missing tensor(s) {missing[:5]}{more} required by its config.json")

    shapes = jax.eval_shape(init_params, config, jax.random.key(0))
    shardings = (param_shardings(shapes, mesh) if mesh is not None
                 else jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), shapes))
    by_leaf: dict[tuple[str, ...], dict[int | None, TensorSpec]] = defaultdict(dict)
    for spec in specs:
        by_leaf[spec.path][spec.layer] = spec
    host_dtype = np.dtype(config.jnp_param_dtype)
    with contextlib.ExitStack() as stack:
        readers = {file: stack.enter_context(safe_open(file, framework="np")) for file in set(locations.values())}
        for spec in specs:
            shape = tuple(readers[locations[spec.hf_name]].get_slice(spec.hf_name).get_shape())
            if shape != spec.hf_shape:
                raise ValueError(f"tensor {spec.hf_name} in {locations[spec.hf_name].name} has shape {shape}, "
                                 f"but config.json implies {spec.hf_shape}")

        def read(spec: TensorSpec, index: tuple[slice, ...]) -> np.ndarray:
            """Our-layout slice `index` of one HF tensor (kernels are read transposed), in the param dtype."""
            tensor = readers[locations[spec.hf_name]].get_slice(spec.hf_name)
            part = tensor[index[::-1]].T if spec.transposed else tensor[index]
            return np.asarray(part).astype(host_dtype, copy=False)

        def place(keypath: tuple[Any, ...], leaf: jax.ShapeDtypeStruct, sharding: Any) -> jax.Array:
            layers = by_leaf[tuple(key.key for key in keypath)]

            def shard(index: tuple[slice, ...]) -> np.ndarray:
                if None in layers:
                    return read(layers[None], index)
                return np.stack([read(layers[layer], index[1:]) for layer in range(*index[0].indices(leaf.shape[0]))])

            return jax.make_array_from_callback(leaf.shape, sharding, shard, dtype=host_dtype)

        params = jax.tree_util.tree_map_with_path(place, shapes, shardings)
    return CausalLM(config, params)


@gin.configurable
def save_hf(model: CausalLM | tuple[ModelConfig, Params], path: str | os.PathLike,
            shard_size_mb: float = 4096) -> None:
    """Write a Hugging Face folder (config.json + safetensors) that transformers and vLLM load (issue 2 item 3).

    Shards hold at most `shard_size_mb` MiB (a single larger tensor gets its own shard); more than one shard
    comes with model.safetensors.index.json. Weights keep their dtype (bfloat16 round-trips exactly).
    """
    config, params = (model.config, model.params) if isinstance(model, CausalLM) else model
    if shard_size_mb <= 0:
        raise ValueError(f"shard_size_mb must be positive, got {shard_size_mb}")
    hf_config = config.to_hf_dict()
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_previous_weights(folder)
    (folder / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")

    limit = shard_size_mb * 2**20
    shard_names: list[list[str]] = []
    shard: dict[str, np.ndarray] = {}
    shard_bytes = total_bytes = 0
    for name, tensor in _hf_tensors(config, params):
        if shard and shard_bytes + tensor.nbytes > limit:
            shard_names.append(_write_temp_shard(folder, len(shard_names), shard))
            shard, shard_bytes = {}, 0
        shard[name] = tensor
        shard_bytes += tensor.nbytes
        total_bytes += tensor.nbytes
    shard_names.append(_write_temp_shard(folder, len(shard_names), shard))

    count = len(shard_names)
    if count == 1:
        os.replace(_temp_shard_path(folder, 0), folder / SINGLE_FILE)
        return
    weight_map: dict[str, str] = {}
    for index, names in enumerate(shard_names):
        final = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        os.replace(_temp_shard_path(folder, index), folder / final)
        weight_map.update({name: final for name in names})
    index_doc = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index_doc, indent=2) + "\n")


def _hf_shape(path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """HF shape of one (per-layer) leaf: kernels are transposed."""
    return tuple(shape[::-1]) if path[-1] == "kernel" else tuple(shape)


def _leaf(tree: dict, path: tuple[str, ...]) -> Any:
    """tree[path[0]][path[1]]..."""
    for key in path:
        tree = tree[key]
    return tree


def _tensor_locations(folder: Path) -> dict[str, Path]:
    """HF tensor name -> safetensors file holding it, from the shard index or the single file."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no weight_map object")
        files = {name: folder / file for name, file in weight_map.items()}
        absent = sorted({str(file.name) for file in files.values() if not file.is_file()})
        if absent:
            raise FileNotFoundError(f"{index_path} names shard file(s) {absent} that are not in {folder}")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="np") as reader:
            return {name: single for name in reader.keys()}
    raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors are supported)")


def _hf_tensors(config: ModelConfig, params: Params) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, contiguous host tensor in the config's param dtype) one at a time; a stacked leaf is sliced per
    layer before leaving the device."""
    host_dtype = np.dtype(config.jnp_param_dtype)
    for spec in tensor_specs(config):
        leaf = _leaf(params, spec.path)
        tensor = np.asarray(leaf if spec.layer is None else leaf[spec.layer]).astype(host_dtype, copy=False)
        tensor = tensor.T if spec.transposed else tensor
        if tensor.shape != spec.hf_shape:
            raise ValueError(f"parameter {'/'.join(spec.path)} does not fit {spec.hf_name}: shape "
                             f"{tensor.shape} where this config implies {spec.hf_shape}")
        yield spec.hf_name, np.ascontiguousarray(tensor)


def _temp_shard_path(folder: Path, index: int) -> Path:
    return folder / f".shard-{index:05d}.safetensors.tmp"


def _write_temp_shard(folder: Path, index: int, tensors: dict[str, np.ndarray]) -> list[str]:
    """Write one shard under a temporary name (final names need the shard count); return its tensor names."""
    save_file(tensors, str(_temp_shard_path(folder, index)), metadata={"format": "pt"})
    return list(tensors)


def _remove_previous_weights(folder: Path) -> None:
    """Delete weights an earlier save left in this folder, so stale shards cannot shadow the new ones."""
    for file in [folder / SINGLE_FILE, folder / INDEX_FILE, *folder.glob("model-*-of-*.safetensors")]:
        file.unlink(missing_ok=True)
