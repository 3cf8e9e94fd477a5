"""rstar-jax's code-execution service: isolated warm-pool Python execution over HTTP, and its client (SPEC 2, 6)."""
