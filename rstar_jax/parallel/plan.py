"""Where every parameter would live on a mesh of N devices, computed without devices or parameters (issue 11 item 4:
`--dry_run`; DESIGN "Functional learner", "Scale-out").

The plan is made on a `jax.sharding.AbstractMesh` (axis names and sizes, no devices) from abstract shapes
(`jax.eval_shape`), with the partition rules of `rstar_jax.parallel` (`param_specs`, `fit_spec`), so what it says
is what `make_mesh` + `shard_params` would do on a real cluster of that size. Pure functions: the gin-bound mesh
sizes come in as a dict.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from rstar_jax.parallel.mesh import resolve_axis_sizes
from rstar_jax.parallel.params import param_logical_axes, param_path, param_specs
from rstar_jax.parallel.sharding import MESH_AXES

PyTree = Any


def abstract_mesh(sizes: dict[str, int], device_count: int) -> AbstractMesh:
    """The (data, fsdp, tensor) mesh `make_mesh(**sizes)` would build on `device_count` devices, as an AbstractMesh.

    `sizes` are make_mesh's arguments (one may be -1, the rest); raises ValueError, from `resolve_axis_sizes`, when
    they do not divide `device_count`.
    """
    if device_count < 1:
        raise ValueError(f"a mesh needs at least one device, got {device_count}")
    resolved = resolve_axis_sizes({name: sizes[name] for name in MESH_AXES}, device_count)
    return AbstractMesh(tuple(resolved[name] for name in MESH_AXES), MESH_AXES,
                        axis_types=(AxisType.Auto,) * len(MESH_AXES))


def shard_shape(shape: tuple[int, ...], spec: PartitionSpec, mesh: AbstractMesh) -> tuple[int, ...]:
    """The shape of one device's slice of an array of `shape` laid out by `spec` on `mesh` (JAX's own arithmetic)."""
    return tuple(NamedSharding(mesh, spec).shard_shape(tuple(shape)))


def leaf_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes of an array of `shape` and `dtype`."""
    return math.prod(shape) * np.dtype(dtype).itemsize


@dataclasses.dataclass(frozen=True)
class ParamPlacement:
    """One parameter: its path, global shape, dtype, logical axes (PARAM_RULES), partition spec on the mesh (uneven
    splits replicated by `fit_spec`) and the shape of each device's slice."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str, ...]
    spec: PartitionSpec
    local_shape: tuple[int, ...]

    @property
    def count(self) -> int:
        """Elements of the whole parameter."""
        return math.prod(self.shape)

    @property
    def bytes_per_device(self) -> int:
        """Bytes of one device's slice."""
        return leaf_bytes(self.local_shape, self.dtype)


def param_placements(params: PyTree, mesh: AbstractMesh) -> list[ParamPlacement]:
    """Every parameter's placement on `mesh` by the partition rules (`params`: arrays or ShapeDtypeStructs)."""
    specs = param_specs(params, mesh)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    placements = []
    for (keypath, leaf), spec in zip(leaves, spec_leaves):
        path, shape = param_path(keypath), tuple(leaf.shape)
        placements.append(ParamPlacement(path, shape, np.dtype(leaf.dtype).name,
                                         param_logical_axes(path, len(shape)), spec, shard_shape(shape, spec, mesh)))
    return placements


def tree_bytes_per_device(tree: PyTree, shardings: PyTree) -> int:
    """Bytes one device holds of `tree` (arrays or ShapeDtypeStructs) placed by `shardings` (a matching tree of
    NamedShardings, e.g. `train_state_shardings` on an AbstractMesh). Replicated leaves count whole on every device.
    """
    leaves = jax.tree_util.tree_leaves(tree)
    sharding_leaves = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    if len(leaves) != len(sharding_leaves):
        raise ValueError(f"{len(leaves)} arrays but {len(sharding_leaves)} shardings")
    return sum(leaf_bytes(tuple(sharding.shard_shape(tuple(leaf.shape))), leaf.dtype)
               for leaf, sharding in zip(leaves, sharding_leaves))


def tree_bytes(tree: PyTree) -> int:
    """Bytes of the whole of `tree` (arrays or ShapeDtypeStructs), unsharded."""
    return sum(leaf_bytes(tuple(leaf.shape), leaf.dtype) for leaf in jax.tree_util.tree_leaves(tree))
