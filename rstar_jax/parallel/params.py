"""Partition specs and shardings of the model parameters and the KV cache, from the tables in `sharding`.

The learner and the in-process engine place parameters with `shard_params` and give `param_shardings` to
`jax.jit(in_shardings=..., out_shardings=...)`; a new parameter that no rule names fails loudly here instead of
silently ending up replicated.
"""

from __future__ import annotations

import re
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar_jax.parallel.sharding import (
    CACHE_AXES,
    CACHE_LENGTHS_AXES,
    PARAM_AXIS_RULES,
    PARAM_RULES,
    MeshAxes,
    fit_spec,
    logical_to_spec,
)

PyTree = Any


def param_path(keypath: tuple[Any, ...]) -> str:
    """The '/'-joined path of a pytree leaf ('layers/attn/q_proj/kernel'), as PARAM_RULES patterns match it."""
    return jax.tree_util.keystr(keypath, simple=True, separator="/")


def param_logical_axes(
    path: str,
    ndim: int,
    rules: tuple[tuple[str, tuple[str, ...]], ...] = PARAM_RULES,
) -> tuple[str, ...]:
    """Logical axes of the parameter at `path`: the axes of the one rule whose pattern fully matches it."""
    matches = [(pattern, axes) for pattern, axes in rules if re.fullmatch(pattern, path)]
    if not matches:
        raise ValueError(f"no partition rule matches parameter {path!r}; add one to PARAM_RULES")
    if len(matches) > 1:
        raise ValueError(f"parameter {path!r} matches several partition rules: {[p for p, _ in matches]}")
    pattern, axes = matches[0]
    if len(axes) != ndim:
        raise ValueError(f"parameter {path!r} has rank {ndim} but rule {pattern!r} names {len(axes)} axes {axes}")
    return axes


def param_specs(
    params: PyTree,
    mesh: Mesh | None = None,
    rules: tuple[tuple[str, tuple[str, ...]], ...] = PARAM_RULES,
    axis_rules: dict[str, MeshAxes] = PARAM_AXIS_RULES,
) -> PyTree:
    """PartitionSpec of every parameter (same tree structure); with a mesh, uneven splits fall back to replication.

    `params` may hold arrays or anything with `.shape` and `.ndim` (e.g. `jax.ShapeDtypeStruct` from
    `jax.eval_shape`), so specs can be computed before the parameters exist.
    """

    def spec_of(keypath: tuple[Any, ...], leaf: Any) -> PartitionSpec:
        spec = logical_to_spec(param_logical_axes(param_path(keypath), leaf.ndim, rules), axis_rules)
        return spec if mesh is None else fit_spec(spec, tuple(leaf.shape), mesh)

    return jax.tree_util.tree_map_with_path(spec_of, params)


def param_shardings(params: PyTree, mesh: Mesh) -> PyTree:
    """NamedSharding of every parameter on `mesh` (for jit in_shardings / out_shardings and device_put)."""
    specs = param_specs(params, mesh)
    return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs,
                                  is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard_params(params: PyTree, mesh: Mesh) -> PyTree:
    """The parameters placed on `mesh` by the partition rules (each device then holds only its slices)."""
    return jax.device_put(params, param_shardings(params, mesh))


def shardings_like_params(tree: PyTree, params: PyTree, mesh: Mesh) -> PyTree:
    """Shardings for a tree that mirrors the parameters somewhere inside it (optimizer state: Adam's mu / nu).

    A leaf whose path ends with a parameter's path and has that parameter's shape gets the parameter's sharding,
    so optimizer moments are split exactly like their weights; every other leaf (step counters, scalars) is
    replicated. Lets the train step's in_shardings / out_shardings come from the same rules.
    """
    by_path = {
        param_path(keypath): (tuple(leaf.shape), sharding)
        for (keypath, leaf), sharding in zip(jax.tree_util.tree_leaves_with_path(params),
                                             jax.tree_util.tree_leaves(param_shardings(params, mesh)))
    }
    replicated = NamedSharding(mesh, PartitionSpec())

    def sharding_of(keypath: tuple[Any, ...], leaf: Any) -> NamedSharding:
        parts = param_path(keypath).split("/")
        for start in range(len(parts)):
            shape_and_sharding = by_path.get("/".join(parts[start:]))
            if shape_and_sharding is not None and shape_and_sharding[0] == tuple(leaf.shape):
                return shape_and_sharding[1]
        return replicated

    return jax.tree_util.tree_map_with_path(sharding_of, tree)


def abstract_placed(tree: PyTree, shardings: PyTree | jax.sharding.Sharding) -> PyTree:
    """`tree`'s shapes and dtypes (arrays or ShapeDtypeStructs) as `jax.ShapeDtypeStruct`s placed by `shardings` (a
    matching tree, or one sharding for every leaf): the target an orbax restore fills, so each array arrives where
    the step expects it and nothing is allocated before."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
                        tree, shardings)


def cache_spec(shape: tuple[int, ...], mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec of a KV cache array: stacked k or v [layers, batch, kv_heads, max_len, head_dim] (CACHE_AXES)
    or the per-slot lengths [batch] (CACHE_LENGTHS_AXES); told apart by rank."""
    axes_by_rank = {len(CACHE_AXES): CACHE_AXES, len(CACHE_LENGTHS_AXES): CACHE_LENGTHS_AXES}
    if len(shape) not in axes_by_rank:
        raise ValueError(f"a KV cache array has axes {CACHE_AXES} or {CACHE_LENGTHS_AXES}, "
                         f"got rank {len(shape)} shape {tuple(shape)}")
    spec = logical_to_spec(axes_by_rank[len(shape)], PARAM_AXIS_RULES)
    return spec if mesh is None else fit_spec(spec, tuple(shape), mesh)


def cache_shardings(cache: PyTree, mesh: Mesh) -> PyTree:
    """NamedSharding of every array of a KV cache pytree (the model's KVCache: keys, values, lengths)."""
    return jax.tree_util.tree_map(lambda leaf: NamedSharding(mesh, cache_spec(tuple(leaf.shape), mesh)), cache)
