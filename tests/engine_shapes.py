"""Gin bindings that keep a test's in-process JAX engines to a few compiled programs.

A JAX engine compiles every prefill bucket, turn bucket and decode window when it starts. With its defaults for
1,024-token slots (powers of two: 7 prefill buckets, 4 turn buckets, 4 decode windows) the first step of the trainer
test's 3-step run spent 49 s in its rollouts, whose later steps took ~4 s; with these bindings (2, 1 and 2 programs)
15 s (2026-12-08). Tests of the engine's own shapes set theirs; every other test that starts engines only needs them
to run.
"""

from __future__ import annotations


def few_engine_shapes(max_len: int = 1024) -> tuple[str, ...]:
    """Bindings for engines of `max_len`-token slots: prompts and decode windows of half a slot or a whole one, and
    one 128-token bucket for a later turn's new tokens."""
    half = max_len // 2
    return (f"JaxEngine.prefill_buckets = ({half}, {max_len})", f"JaxEngine.decode_windows = ({half}, {max_len})",
            "JaxEngine.turn_buckets = (128,)")
