"""Device mesh and partitioning rules (DESIGN: "Functional learner", named mesh over data / fsdp / tensor)."""

from rstar_jax.parallel.mesh import make_mesh, resolve_axis_sizes
from rstar_jax.parallel.params import (
    abstract_placed,
    cache_shardings,
    cache_spec,
    param_logical_axes,
    param_path,
    param_shardings,
    param_specs,
    shard_params,
    shardings_like_params,
)
from rstar_jax.parallel.sharding import (
    ACTIVATION_RULES,
    CACHE_AXES,
    CACHE_LENGTHS_AXES,
    MESH_AXES,
    PARAM_AXIS_RULES,
    PARAM_RULES,
    activation_sharding,
    active_mesh,
    constrain,
    fit_spec,
    logical_to_spec,
    use_mesh,
)

__all__ = [
    "ACTIVATION_RULES",
    "CACHE_AXES",
    "CACHE_LENGTHS_AXES",
    "MESH_AXES",
    "PARAM_AXIS_RULES",
    "PARAM_RULES",
    "abstract_placed",
    "activation_sharding",
    "active_mesh",
    "cache_shardings",
    "cache_spec",
    "constrain",
    "fit_spec",
    "logical_to_spec",
    "make_mesh",
    "param_logical_axes",
    "param_path",
    "param_shardings",
    "param_specs",
    "resolve_axis_sizes",
    "shard_params",
    "shardings_like_params",
    "use_mesh",
]
