"""experiments/bench/engine.py: the request mix, ratio and sync arithmetic by hand, and a real run of the JAX engine
against transformers' generate on a one-layer model that writes every figure to JSON (vLLM is left to the full
benchmark: its server start alone takes minutes here; tests/rollout/test_vllm_fleet.py covers the fleet)."""

import json

import gin
import pytest

from experiments.bench import engine as bench


@pytest.fixture
def clean_gin():
    yield
    gin.clear_config()


def test_request_mix_is_seeded_and_within_bounds():
    mix = bench.request_mix(20, 3, 9, new_tokens=5, vocab_size=50, seed=1)
    assert mix == bench.request_mix(20, 3, 9, new_tokens=5, vocab_size=50, seed=1)
    assert mix != bench.request_mix(20, 3, 9, new_tokens=5, vocab_size=50, seed=2)
    assert all(3 <= len(p) <= 9 and min(p) >= 2 and max(p) < 50 for p in mix.prompts)
    assert mix.requested_tokens == 100
    sampling = mix.sampling(7)
    assert (sampling.seed, sampling.max_new_tokens, sampling.stop_token_ids, sampling.temperature) == (7, 5, (), 1.0)
    with pytest.raises(ValueError, match="min_prompt <= max_prompt"):
        bench.request_mix(2, 9, 3, new_tokens=5, vocab_size=50)


def test_requests_that_cannot_fit_are_named():
    mix = bench.request_mix(4, 10, 10, new_tokens=7, vocab_size=50)
    bench.check_fits(mix, 17)
    with pytest.raises(ValueError, match="needs 17 tokens .* max_len=16"):
        bench.check_fits(mix, 16)


def test_ratios_are_against_transformers_and_sync_is_per_megabyte():
    results = {"jax": bench.throughput(300, 2.0), "transformers": bench.throughput(100, 4.0)}
    ratios = bench.with_ratios(results)
    assert ratios["jax"]["tokens_per_s"] == 150.0 and ratios["jax"]["ratio_vs_transformers"] == 6.0
    assert ratios["transformers"]["ratio_vs_transformers"] == 1.0
    assert "ratio_vs_transformers" not in bench.with_ratios({"jax": results["jax"]})["jax"]
    sync = bench.sync_figures(4.0, [0.3, 0.1, 0.2])
    assert sync["median_s"] == 0.2 and sync["seconds_per_mb"] == pytest.approx(0.05)


def test_unknown_engines_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown or no engines \\['sglang'\\]"):
        bench.run_benchmark(tmp_path, ["jax", "sglang"], bench.request_mix(1, 2, 2, 2, 10), slots=2, max_len=8)


@pytest.mark.slow
def test_jax_and_transformers_run_writes_every_figure(tmp_path, clean_gin):
    out = tmp_path / "engine.json"
    bindings = ["ModelConfig.num_layers = 1", "ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 96",
                "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 2",
                "ModelConfig.vocab_size = 128"]
    result = bench.main(["--engines", "jax,transformers", "--requests", "3", "--min_prompt", "2", "--max_prompt",
                         "9", "--new_tokens", "5", "--slots", "2", "--max_len", "16", "--sync_repeats", "2",
                         *[arg for binding in bindings for arg in ("--gin_param", binding)], "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["model"]["num_hidden_layers"] == 1 and result["model"]["vocab_size"] == 128
    throughput = result["throughput"]
    assert set(throughput) == {"jax", "transformers"}
    for figures in throughput.values():
        assert figures["generated_tokens"] == 15 and figures["tokens_per_s"] > 0
    assert throughput["transformers"]["ratio_vs_transformers"] == 1.0
    probed = throughput["transformers"]["thread_probe_s"]
    assert "1" in probed and str(throughput["transformers"]["threads"]) in probed  # the faster of the probes
    assert throughput["jax"]["ratio_vs_transformers"] == pytest.approx(
        throughput["jax"]["tokens_per_s"] / throughput["transformers"]["tokens_per_s"])
    assert throughput["jax"]["prefill_buckets"] == [16]
    sync = result["weight_sync"]["jax"]
    assert sync["megabytes"] == pytest.approx(result["model"]["param_count"] * 4 / 1e6)  # float32
    assert len(sync["seconds"]) == 2 and sync["seconds_per_mb"] > 0
