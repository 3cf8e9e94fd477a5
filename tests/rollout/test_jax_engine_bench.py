"""experiments/bench/engine.py: the request mix, ratio and sync arithmetic by hand, the engines' turns round by
round, and a real run of the JAX engine against transformers' generate on a one-layer model that writes every figure
to JSON (vLLM is left to the full benchmark: its server start alone takes minutes here;
tests/rollout/test_vllm_fleet.py covers the fleet); the rollout mode's scripted demo trajectories, and a real run of
it (with and without turn reuse) on a one-layer model."""

import asyncio
import json

import gin
import pytest

from experiments.bench import engine as bench
from rstar_jax.rollout.engine import FINISH_LENGTH, EngineCapacity, Generation
from rstar_jax.tokenizers import load_tokenizer


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


def test_rounds_count_at_their_median_and_the_jax_engine_is_compared_with_each_vllm_server():
    figures = bench.rounds_throughput([(100, 2.0), (100, 1.0), (100, 4.0)], slots=2)
    assert (figures["seconds"], figures["tokens_per_s"], figures["slots"]) == (2.0, 50.0, 2)
    assert figures["rounds_tokens_per_s"] == [50.0, 100.0, 25.0]
    with pytest.raises(ValueError, match="same number of tokens, got \\[99, 100\\]"):
        bench.rounds_throughput([(100, 2.0), (99, 1.0)])
    results = {"jax": bench.throughput(300, 1.0), "vllm": bench.throughput(100, 1.0),
               "vllm_pinned": bench.throughput(60, 1.0), "transformers": bench.throughput(50, 1.0)}
    assert bench.jax_ratios(results) == {"jax_vs_vllm": 3.0, "jax_vs_vllm_pinned": 5.0}
    assert bench.jax_ratios({"vllm": results["vllm"]}) == {}


class LoggedEngine:
    """Answers every request at once with its max_new_tokens tokens, and logs which mix it served (by first prompt)
    and how often its capacity was read: the bench's scheduling, without a model."""

    def __init__(self, name: str, log: list[tuple[str, int]]) -> None:
        self.name, self.log, self.reads = name, log, 0

    async def generate(self, prompt_ids, sampling) -> Generation:
        if sampling.seed == 0:  # a mix's first request
            self.log.append((self.name, prompt_ids[0]))
        await asyncio.sleep(0.02)
        return Generation((1,) * sampling.max_new_tokens, (0.0,) * sampling.max_new_tokens, FINISH_LENGTH)

    async def capacity(self) -> EngineCapacity:
        self.reads += 1
        return EngineCapacity(100, 0, 0, 0)


def test_engines_take_turns_round_by_round_and_only_the_polled_are_polled():
    """Round r serves mix r on every engine before round r + 1 starts, the first engine rotating, so a slow spell of
    the machine falls on every engine's rounds alike."""
    mixes = [bench.RequestMix(((10 * index + 2, 3),), new_tokens=4) for index in range(4)]
    log: list[tuple[str, int]] = []
    engines = {name: LoggedEngine(name, log) for name in ("jax", "vllm", "vllm_pinned")}
    served, latencies = asyncio.run(bench.serve_interleaved(engines, mixes, polled={"vllm"}, every_s=0.005,
                                                             settle_s=0.0))
    assert log == [("jax", 2), ("vllm", 2), ("vllm_pinned", 2), ("vllm", 12), ("vllm_pinned", 12), ("jax", 12),
                   ("vllm_pinned", 22), ("jax", 22), ("vllm", 22), ("jax", 32), ("vllm", 32), ("vllm_pinned", 32)]
    assert all(tokens == 4 and seconds > 0 for rounds in served.values() for tokens, seconds in rounds)
    assert [len(rounds) for rounds in served.values()] == [4, 4, 4]
    assert set(latencies) == {"vllm"} and len(latencies["vllm"]) == engines["vllm"].reads >= 4
    assert engines["jax"].reads == engines["vllm_pinned"].reads == 0
    results = {name: bench.rounds_throughput([(4, 1.0), (4, 2.0)]) for name in ("jax", "vllm")}
    results["jax"] = bench.rounds_throughput([(4, 0.5), (4, 0.5)])
    assert bench.jax_round_ratios(results) == {"jax_vs_vllm": [2.0, 4.0]}


def test_unknown_engines_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown or no engines \\['sglang'\\]"):
        bench.run_benchmark(tmp_path, ["jax", "sglang"], [bench.request_mix(1, 2, 2, 2, 10)], slots=2, max_len=8)
    with pytest.raises(ValueError, match="at least one mix, got slots=2, sync_repeats=3, 0 mixes"):
        bench.run_benchmark(tmp_path, ["jax"], [], slots=2, max_len=8)


@pytest.mark.slow
def test_jax_and_transformers_run_writes_every_figure(tmp_path, clean_gin):
    out = tmp_path / "engine.json"
    bindings = ["ModelConfig.num_layers = 1", "ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 96",
                "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 2",
                "ModelConfig.vocab_size = 128"]
    result = bench.main(["--engines", "jax,transformers", "--requests", "3", "--min_prompt", "2", "--max_prompt",
                         "9", "--new_tokens", "5", "--slots", "2", "--max_len", "16", "--sync_repeats", "2",
                         "--rounds", "3", "--settle_s", "0",
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
    rates = throughput["jax"]["rounds_tokens_per_s"]
    assert len(rates) == 3 and throughput["jax"]["tokens_per_s"] == pytest.approx(sorted(rates)[1])
    assert "rounds_tokens_per_s" not in throughput["transformers"] and result["jax_ratios"] == {}
    assert result["request_mix"]["rounds"] == 3
    sync = result["weight_sync"]["jax"]
    assert sync["megabytes"] == pytest.approx(result["model"]["param_count"] * 4 / 1e6)  # float32
    assert len(sync["seconds"]) == 2 and sync["seconds_per_mb"] > 0


def test_demo_trajectories_are_seeded_groups_of_the_demos_prompts():
    tokenizer = load_tokenizer("tiny")
    step0 = bench.demo_trajectories(tokenizer, 0, problems=3, samples=4, seed=1)
    assert step0 == bench.demo_trajectories(tokenizer, 0, problems=3, samples=4, seed=1)
    step1 = bench.demo_trajectories(tokenizer, 1, problems=3, samples=4, seed=1)
    assert len(step0) == len(step1) == 12 and {t.prompt for t in step0}.isdisjoint({t.prompt for t in step1})
    assert len({t.seed for t in step0 + step1}) == 24
    for group in range(3):
        assert len({t.prompt for t in step0[group * 4:group * 4 + 4]}) == 1  # a GRPO group shares its prompt
    header = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    for trajectory in step0 + step1:
        assert 250 < len(trajectory.prompt) < 320
        assert 1 <= len(trajectory.turn_tokens) <= 3
        assert len(trajectory.tool_responses) == len(trajectory.turn_tokens) - 1
        assert all(bench.TURN_TOKENS[0] <= n <= bench.TURN_TOKENS[1] for n in trajectory.turn_tokens)
        for response in trajectory.tool_responses:
            assert response[0] == header[0] and list(response[-len(header) + 1:]) == header[1:]
            assert 20 < len(response) < 40
    multi = next(t for t in step0 if len(t.turn_tokens) > 1)
    sampling = multi.sampling(1)
    assert (sampling.temperature, sampling.max_new_tokens, sampling.stop_token_ids) == (1.0, multi.turn_tokens[1], ())
    assert sampling.seed != multi.sampling(0).seed


def test_rollout_routers():
    assert type(bench.make_router("failover", [object()])).__name__ == "FailoverEngine"
    assert type(bench.make_router("balancer", [object()])).__name__ == "Balancer"
    with pytest.raises(ValueError, match="unknown router 'random'"):
        bench.make_router("random", [object()])


@pytest.mark.slow
def test_rollout_mode_compares_reuse_with_prefilling_every_turn(tmp_path, clean_gin):
    out = tmp_path / "rollout.json"
    bindings = ["ModelConfig.num_layers = 1", "ModelConfig.hidden_size = 64", "ModelConfig.intermediate_size = 96",
                "ModelConfig.num_heads = 2", "ModelConfig.num_kv_heads = 2", "JaxEngine.prefill_buckets = (1024,)",
                "JaxEngine.decode_windows = (1024,)", "JaxEngine.turn_buckets = (32, 128)"]
    result = bench.main(["--mode", "rollout", "--steps", "2", "--problems", "2", "--samples", "2", "--slots", "2",
                         "--router", "balancer", "--tool_ms", "1",
                         *[arg for binding in bindings for arg in ("--gin_param", binding)], "--json", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["engines"]["prefill_buckets"] == [1024] and result["engines"]["turn_buckets"] == [32, 128]
    assert [step["order"] for step in result["per_step"]] == [["prefill_each_turn", "reuse_turns"],
                                                               ["reuse_turns", "prefill_each_turn"]]
    assert result["identical_tokens"] and result["max_logprob_diff"] < 1e-4
    base, reuse = result["totals"]["prefill_each_turn"], result["totals"]["reuse_turns"]
    assert result["workload"]["rollouts"] == 8 and base["extends"] == 0 and reuse["extends"] > 0
    turns = result["workload"]["turns"]
    assert base["prefills"] + base["copies"] == reuse["prefills"] + reuse["copies"] + reuse["extends"] == turns
    assert reuse["prefill_tokens"] < base["prefill_tokens"]
    assert result["prefill_token_ratio"] == pytest.approx(base["prefill_tokens"] / reuse["prefill_tokens"])
    assert result["speedup"] == pytest.approx(base["seconds"] / reuse["seconds"])
    assert result["cpu_speedup"] == pytest.approx(base["cpu_s"] / reuse["cpu_s"]) and reuse["cpu_s"] > 0
    assert result["speedup_per_step"] == [step["prefill_each_turn"]["seconds"] / step["reuse_turns"]["seconds"]
                                          for step in result["per_step"]]
    assert base["prefill_tokens_per_rollout"] == pytest.approx(base["prefill_tokens"] / 8)
