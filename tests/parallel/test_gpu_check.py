"""experiments/bench/gpu_check.py (issue 22 item 6): its FLOP counts by hand, failures recorded instead of raised,
and the whole script at `--smoke` sizes on the CPU, so it still runs when a GPU machine is at hand."""

from __future__ import annotations

import json
from pathlib import Path

import gin
import jax.numpy as jnp
import pytest

from experiments.bench import gpu_check
from rstar_jax.model import ModelConfig

QWEN3_0_6B = ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=16,
                         num_kv_heads=8, head_dim=128, family="qwen3")


@pytest.fixture
def clean_gin():
    yield
    gin.clear_config()


def test_flop_counts_by_hand() -> None:
    # per layer: q 1024*2048, k and v 1024*1024 each, o 2048*1024, MLP 3*1024*3072; 28 layers plus the tied head
    assert gpu_check.matmul_param_count(QWEN3_0_6B) == 28 * (2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072) \
        + 1024 * 151936
    assert gpu_check.attention_flops(8192, 16, 128, rows=4, layers=28) == 6 * 28 * 4 * 8192 ** 2 * 16 * 128


def test_an_impl_this_checkout_lacks_is_recorded_not_raised() -> None:
    assert "not in this checkout" in gpu_check.unavailable_reason("no_such_impl")
    assert gpu_check.unavailable_reason("causal_blockwise") is None
    sizes = gpu_check.SMOKE
    q, k, v, ct, segments = gpu_check.attention_inputs(sizes, 32)
    entry = gpu_check.measure_attention("no_such_impl", sizes, (q, k, v, ct), segments, (q, (q, k, v)))
    assert entry["status"] == "unavailable" and "no_such_impl" in entry["error"]
    assert gpu_check.relative_error(jnp.ones(3) * 1.01, jnp.ones(3)) == pytest.approx(0.01, rel=1e-4)


@pytest.mark.slow
def test_the_smoke_run_writes_every_figure(tmp_path: Path, clean_gin, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "LEARNER_ATTENTION", ("no_such_impl", *gpu_check.LEARNER_ATTENTION))
    path = tmp_path / "gpu_check.json"
    gpu_check.main(["--smoke", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["peak_tflops"] == 989.0 and result["matmul_peak"]["tflops_per_s"] > 0
    assert list(result["attention"]) == ["128"]
    for part in result["attention"].values():
        impls = part["impls"]
        assert list(impls) == ["pallas", "causal_blockwise", "dot_product"]
        assert impls["pallas"]["status"] in ("ok", "unavailable")  # 'pallas' may not have landed in this checkout
        for name in ("causal_blockwise", "dot_product"):
            entry = impls[name]
            assert entry["status"] == "ok" and entry["parity_ok"], entry
            assert entry["tokens_per_s"] > 0 and set(entry["relative_error_vs_float32"]) == {"out", "dq", "dk",
                                                                                             "dv"}
        assert impls["dot_product"]["speed_vs_dot_product"] == 1.0
        assert not any(entry.get("cudnn_in_program") for entry in impls.values())  # a CPU has no cuDNN
    learner = result["learner"]
    assert learner["attempts"]["no_such_impl"]["status"] == "unavailable"
    ran = {impl: entry["median_step_s"] for impl, entry in learner["attempts"].items() if entry["status"] == "ok"}
    assert set(ran) == {"pallas", "dot_product", "causal_blockwise"}  # each attention, not only the first that runs
    assert learner["attention_impl"] == min(ran, key=ran.get) and learner["tokens_per_step"] == 2 * 128
    assert learner["compute_dtype"] == "bfloat16" and learner["param_dtype"] == "float32"
    assert 0 < learner["mfu"] < 1 and learner["tokens_per_s"] > 0
