"""Device mesh and partitioning rules (DESIGN: "Functional learner", named mesh over data / fsdp / tensor)."""

from rstar_jax.parallel.sharding import (
    ACTIVATION_RULES,
    MESH_AXES,
    active_mesh,
    constrain,
    logical_to_spec,
    use_mesh,
)

__all__ = ["ACTIVATION_RULES", "MESH_AXES", "active_mesh", "constrain", "logical_to_spec", "use_mesh"]
