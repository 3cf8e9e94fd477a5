"""The one place that maps array axes to mesh axes: activations, parameters and the KV cache.

Arrays are described by logical axis names ("batch", "heads", "embed_fsdp", ...). Two tables decide everything:
`PARAM_RULES` names the logical axes of every model parameter (regex on its '/'-joined path), and the axis-rule
tables map each logical axis to mesh axes. Model code names the axes of its activations and calls `constrain`;
with no active mesh (`use_mesh`) that is the identity, so the same model code runs unsharded on one device.
A dimension the mesh axes do not divide evenly stays replicated (`fit_spec`), so odd tiny configs still run.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Iterator

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor")

MeshAxes = str | tuple[str, ...] | None

# logical axis -> mesh axis (or tuple of mesh axes, or None for replicated).
ACTIVATION_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "embed": None,
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "vocab": "tensor",
}

# Parameters share the activations' axes (a head, MLP or vocabulary split lines up with the activations it
# produces) plus two of their own: FSDP splits each weight's big non-tensor dimension, and the stacked-layer axis
# of the scanned layers stays whole (each scan step needs one full layer slice on every device).
PARAM_AXIS_RULES: dict[str, MeshAxes] = {
    **ACTIVATION_RULES,
    "embed_fsdp": "fsdp",
    "layers": None,
}

# '/'-joined parameter path (full match) -> logical axes of that parameter. Every parameter of the model must match
# exactly one pattern; `rstar_jax.parallel.params` enforces that.
PARAM_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"embed/embedding", ("vocab", "embed_fsdp")),
    (r"layers/(input_norm|post_attn_norm)/scale", ("layers", "embed")),
    (r"layers/attn/q_proj/kernel", ("layers", "embed_fsdp", "heads")),
    (r"layers/attn/q_proj/bias", ("layers", "heads")),
    (r"layers/attn/(k_proj|v_proj)/kernel", ("layers", "embed_fsdp", "kv_heads")),
    (r"layers/attn/(k_proj|v_proj)/bias", ("layers", "kv_heads")),
    (r"layers/attn/o_proj/kernel", ("layers", "heads", "embed_fsdp")),
    (r"layers/attn/o_proj/bias", ("layers", "embed")),
    (r"layers/attn/(q_norm|k_norm)/scale", ("layers", "head_dim")),
    (r"layers/mlp/(gate_proj|up_proj)/kernel", ("layers", "embed_fsdp", "mlp")),
    (r"layers/mlp/down_proj/kernel", ("layers", "mlp", "embed_fsdp")),
    (r"final_norm/scale", ("embed",)),
    (r"lm_head/kernel", ("embed_fsdp", "vocab")),
)

# Stacked KV cache k / v: [layers, batch, kv_heads, max_len, head_dim] (head-major); its per-slot lengths: [batch].
CACHE_AXES: tuple[str, ...] = ("layers", "batch", "kv_heads", "seq", "head_dim")
CACHE_LENGTHS_AXES: tuple[str, ...] = ("batch",)

_ACTIVE_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("rstar_jax_mesh", default=None)


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None) -> Iterator[Mesh | None]:
    """Make `mesh` the one `constrain` shards activations over while tracing inside this block.

    The mesh also enters JAX's own abstract-mesh context, which is part of every jit cache key: a function jitted
    on its own (the model's `forward`) and traced once without a mesh is then traced again under one, instead of
    silently reusing the unconstrained trace. Works inside and outside `jax.jit`.
    """
    token = _ACTIVE_MESH.set(mesh)
    try:
        if mesh is None:
            yield mesh
        else:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                yield mesh
    finally:
        _ACTIVE_MESH.reset(token)


def active_mesh() -> Mesh | None:
    """The mesh set by the innermost `use_mesh`, or None."""
    return _ACTIVE_MESH.get()


def logical_to_spec(
    logical_axes: tuple[str | None, ...],
    rules: dict[str, MeshAxes] = ACTIVATION_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array whose axes have the given logical names (None: replicated axis)."""
    unknown = [name for name in logical_axes if name is not None and name not in rules]
    if unknown:
        raise ValueError(f"unknown logical axis names {unknown}; known: {sorted(rules)}")
    return PartitionSpec(*(None if name is None else rules[name] for name in logical_axes))


def _divisible_prefix(mesh_axes: MeshAxes, dim: int, mesh: Mesh) -> MeshAxes:
    """The longest leading part of `mesh_axes` whose device count divides `dim` (None when not even the first)."""
    if mesh_axes is None:
        return None
    axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes)
    kept: tuple[str, ...] = ()
    for axis in axes:
        if dim % (math.prod(mesh.shape[name] for name in kept) * mesh.shape[axis]):
            break
        kept += (axis,)
    if not kept:
        return None
    return kept[0] if isinstance(mesh_axes, str) else kept


def fit_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """`spec` with every split the mesh cannot make evenly dropped, so that dimension is replicated instead.

    Tiny configs (2 kv heads on a tensor axis of 4, a batch of 1 on data x fsdp = 8) then still run, at the cost
    of duplicating that dimension; for a tuple of mesh axes the longest leading part that divides is kept.
    """
    if len(spec) > len(shape):
        raise ValueError(f"partition spec {spec} has more entries than the array has dimensions {shape}")
    return PartitionSpec(*(_divisible_prefix(axes, dim, mesh) for axes, dim in zip(spec, shape)))


def activation_sharding(mesh: Mesh, shape: tuple[int, ...], *logical_axes: str | None) -> NamedSharding:
    """NamedSharding of an activation (or batch input) with these logical axes, uneven splits replicated.

    For jit in_shardings / out_shardings of batches and outputs, so they agree with what `constrain` asks for.
    """
    if len(logical_axes) != len(shape):
        raise ValueError(f"got {len(logical_axes)} axis names {logical_axes} for an array of shape {tuple(shape)}")
    return NamedSharding(mesh, fit_spec(logical_to_spec(logical_axes), tuple(shape), mesh))


def constrain(x: jax.Array, *logical_axes: str | None) -> jax.Array:
    """Sharding constraint on an activation by logical axis names; identity when no mesh is active."""
    mesh = active_mesh()
    if mesh is None:
        return x
    if len(logical_axes) != x.ndim:
        raise ValueError(f"constrain got {len(logical_axes)} axis names for an array of rank {x.ndim}")
    return jax.lax.with_sharding_constraint(x, activation_sharding(mesh, x.shape, *logical_axes))
