"""The vLLM fleet's pure parts and error paths, without a running server: /metrics parsing (on text a vLLM 0.32 CPU
server produced), completion replies, the sync checkpoint folder, the server command and environment,
and clear errors for bad input; plus a real server start that fails on a bad flag."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open

from rstar_jax.model import ModelConfig, init_params, load_hf, tensor_specs
from rstar_jax.parallel import make_mesh, shard_params
from rstar_jax.processes import cpu_list, free_port, pinned_command
from rstar_jax.rollout.engine import FINISH_LENGTH, EngineUnavailable, GenerationEngine, SamplingParams
from rstar_jax.rollout.vllm_engine import VLLMServerEngine, generation_from_completion
from rstar_jax.rollout.vllm_fleet import VLLMFleet, make_fleet, measure_weight_sync
from rstar_jax.rollout.vllm_metrics import capacity_from_metrics, kv_tokens_per_engine
from rstar_jax.rollout.vllm_server import (
    launch_servers,
    server_command,
    server_env,
    start_server,
    wait_healthy,
)
from rstar_jax.rollout.vllm_weight_sync import SharedSyncCheckpoints, push_weights, write_sync_checkpoint
from rstar_jax.rollout.vllm_worker_extension import EXTENSION_QUALNAME, shard_paths

CACHE_INFO = ('vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="{e}",'
              'gpu_memory_utilization="0.92",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="524288",'
              'model_name="policy",num_cpu_blocks="None",num_gpu_blocks="4096"}} 1.0')


def metrics_text(engines: dict[str, tuple[float, int, int]]) -> str:
    """/metrics in vLLM 0.32's layout; per engine label: (kv usage fraction, running, waiting)."""
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             "# TYPE vllm:num_requests_running gauge"]
    lines += [f'vllm:num_requests_running{{engine="{e}",model_name="policy"}} {r}.0'
              for e, (_, r, _) in engines.items()]
    lines += ["# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
              "# TYPE vllm:num_requests_waiting gauge"]
    lines += [f'vllm:num_requests_waiting{{engine="{e}",model_name="policy"}} {w}.0'
              for e, (_, _, w) in engines.items()]
    lines += ["# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
              "# TYPE vllm:kv_cache_usage_perc gauge"]
    lines += [f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="policy"}} {u}' for e, (u, _, _) in engines.items()]
    lines += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
              "# TYPE vllm:cache_config_info gauge"]
    lines += [CACHE_INFO.replace("{e}", e).replace("}}", "}") for e in engines]
    return "\n".join(lines) + "\n"


def test_capacity_from_one_engines_gauges():
    capacity = capacity_from_metrics(metrics_text({"0": (0.25, 3, 2)}))
    usable = 524_288 - 128  # less vLLM's null block
    assert (capacity.kv_tokens_total, capacity.kv_tokens_used) == (usable, usable // 4)
    assert (capacity.requests_running, capacity.requests_waiting, capacity.kv_tokens_free) == (3, 2, usable * 3 // 4)


def test_capacity_sums_the_engines_of_a_data_parallel_server():
    capacity = capacity_from_metrics(metrics_text({"0": (0.5, 1, 0), "1": (0.125, 2, 4)}))
    usable = 524_288 - 128
    assert capacity.kv_tokens_total == 2 * usable
    assert capacity.kv_tokens_used == usable // 2 + usable // 8
    assert (capacity.requests_running, capacity.requests_waiting) == (3, 4)


def test_kv_size_falls_back_to_blocks_times_block_size():
    assert kv_tokens_per_engine({"num_gpu_blocks": "100", "block_size": "16", "kv_cache_size_tokens": "None"}) == 1584
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        kv_tokens_per_engine({"block_size": "16"})


def test_missing_gauge_is_named():
    text = "\n".join(line for line in metrics_text({"0": (0.0, 0, 0)}).splitlines() if "waiting" not in line)
    with pytest.raises(ValueError, match="vllm:num_requests_waiting"):
        capacity_from_metrics(text)


REPLY = {"choices": [{"index": 0, "text": " standard wil", "finish_reason": "length", "token_ids": [374, 654],
                      "logprobs": {"token_logprobs": [-7.17, -6.79], "tokens": [" standard", " wil"]}}]}


def test_completion_reply_becomes_a_generation():
    generation = generation_from_completion(REPLY)
    assert generation.token_ids == (374, 654) and generation.logprobs == (-7.17, -6.79)
    assert generation.finish_reason == FINISH_LENGTH


def test_an_aborted_request_is_engine_unavailable():
    aborted = {"choices": [{**REPLY["choices"][0], "finish_reason": "abort"}]}
    with pytest.raises(EngineUnavailable, match="abort"):
        generation_from_completion(aborted, "http://h:1")


def test_nothing_listening_is_engine_unavailable():
    engine = VLLMServerEngine(f"http://127.0.0.1:{free_port()}")

    async def calls():
        try:
            with pytest.raises(EngineUnavailable):
                await engine.generate([1, 2], SamplingParams(max_new_tokens=2))
            with pytest.raises(EngineUnavailable):
                await engine.capacity()
        finally:
            await engine.aclose()

    asyncio.run(calls())


def test_bad_engine_input_is_named():
    with pytest.raises(ValueError, match="http://"):
        VLLMServerEngine("localhost:8000")
    engine = VLLMServerEngine("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="model_config"):
        asyncio.run(engine.update_weights({}, 1))
    with pytest.raises(ValueError, match="empty"):
        asyncio.run(engine.generate([], SamplingParams()))
    with pytest.raises(ValueError, match="at least 2"):
        asyncio.run(engine.score([5]))
    with pytest.raises(ValueError, match="pause_mode"):
        asyncio.run(push_weights(None, "http://127.0.0.1:1", "/tmp/x", pause_mode="later"))  # type: ignore[arg-type]


def test_bad_fleet_input_is_named():
    with pytest.raises(ValueError, match="at least one engine"):
        VLLMFleet([])
    with pytest.raises(ValueError, match="not both"):
        make_fleet(model_dir="/m", urls=["http://a:1"])
    with pytest.raises(ValueError, match="model_dir"):
        make_fleet()
    fleet = make_fleet(urls=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert [engine.url for engine in fleet.engines] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    with pytest.raises(ValueError, match="model_config"):
        asyncio.run(fleet.update_weights({}, 1))
    with pytest.raises(ValueError, match="repeats"):
        asyncio.run(measure_weight_sync(fleet, {}, repeats=0))


SMALL = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=32, tie_word_embeddings=True)


@pytest.mark.parametrize("tied", [True, False])
def test_sync_checkpoint_is_a_sharded_hf_folder_of_the_params(tmp_path, tied):
    config = dataclasses.replace(SMALL, tie_word_embeddings=tied)
    params = init_params(config, jax.random.key(1))
    checkpoint = write_sync_checkpoint(config, params, version=4, directory=tmp_path, shard_size_mb=0.02)
    assert checkpoint.path.name.endswith("-v4-float32") and list(tmp_path.iterdir()) == [checkpoint.path]
    shards = shard_paths(checkpoint.path)
    assert len(shards) > 2, "small shards keep the host copy small"
    names = [name for shard in shards for name in safe_open(shard, "np").keys()]
    assert ("lm_head.weight" in names) == (not tied) and len(names) == len(set(names))
    reloaded = load_hf(checkpoint.path)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, reloaded.params, params))
    n_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
    assert checkpoint.nbytes == 4 * n_params and checkpoint.megabytes == 4 * n_params / 1e6
    checkpoint.remove()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        shard_paths(tmp_path)


def test_a_float32_learner_syncs_a_bfloat16_server_in_bfloat16_cast_on_the_devices(tmp_path, monkeypatch):
    """Issue 22 item 4: float32 parameters, sharded over 8 devices, written for a bfloat16 server are bfloat16 files
    equal to the on-device cast, config.json says bfloat16, and what reaches the host is already bfloat16 (each
    sharded tensor was cast where its shards live): half the bytes of the float32 checkpoint."""
    config = dataclasses.replace(SMALL, tie_word_embeddings=False, num_heads=4, num_kv_heads=2, head_dim=8)
    mesh = make_mesh(fsdp=4, tensor=2)
    params = shard_params(init_params(config, jax.random.key(3)), mesh)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(params))
    expected = jax.device_get(jax.tree_util.tree_map(lambda leaf: leaf.astype(jnp.bfloat16), params))
    to_host = []
    device_get = jax.device_get
    monkeypatch.setattr(jax, "device_get", lambda tree: to_host.append(tree) or device_get(tree))

    checkpoint = write_sync_checkpoint(config, params, version=2, directory=tmp_path, shard_size_mb=0.01,
                                       dtype="bfloat16")
    monkeypatch.undo()
    assert checkpoint.dtype == "bfloat16" and checkpoint.path.name.endswith("-v2-bfloat16")
    assert len(to_host) == len(tensor_specs(config))
    assert all(isinstance(x, jax.Array) and x.dtype == jnp.bfloat16 for x in to_host), "cast before the host"
    assert any(len(x.sharding.device_set) > 1 for x in to_host), "sharded tensors are cast on their devices"
    hf_config = json.loads((checkpoint.path / "config.json").read_text())
    assert hf_config["torch_dtype"] == hf_config["dtype"] == "bfloat16"
    shards = shard_paths(checkpoint.path)
    assert len(shards) > 2
    for shard in shards:
        with safe_open(shard, "np") as reader:
            assert all(reader.get_tensor(name).dtype == jnp.bfloat16 for name in reader.keys())
    reloaded = load_hf(checkpoint.path)
    assert reloaded.config.param_dtype == "bfloat16"
    for got, want in zip(jax.tree_util.tree_leaves(reloaded.params), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))
    n_params = sum(leaf.size for leaf in jax.tree_util.tree_leaves(params))
    assert checkpoint.nbytes == 2 * n_params
    written = sum(shard.stat().st_size for shard in shards)
    assert 2 * n_params < written < 2 * n_params + len(shards) * 4096, "bfloat16 bytes plus the headers"


def test_server_command_and_environment(tmp_path):
    command = server_command(tmp_path, 8123)
    assert command[command.index("--worker-extension-cls") + 1] == EXTENSION_QUALNAME
    assert command[command.index("--logprobs-mode") + 1] == "raw_logprobs"
    assert command[command.index("--port") + 1] == "8123" and command[command.index("--host") + 1] == "127.0.0.1"
    try:
        gin.parse_config(["server_command.extra_args = ['--tensor-parallel-size', '2']",
                          "server_env.extra_env = {'VLLM_CPU_KVCACHE_SPACE': '1'}"])
        assert server_command(tmp_path, 8123)[-2:] == ["--tensor-parallel-size", "2"]
        env = server_env()
    finally:
        gin.clear_config()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    module_root = EXTENSION_QUALNAME.split(".")[0]
    assert any((Path(entry) / module_root).is_dir() for entry in env["PYTHONPATH"].split(":"))


def test_start_server_needs_a_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        start_server(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_server_that_fails_to_start_reports_its_log(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    server = start_server(tmp_path, log_dir=tmp_path / "logs", extra_args=["--no-such-flag"])
    with pytest.raises(RuntimeError, match="no-such-flag"):
        wait_healthy(server, startup_timeout_s=240)
    assert server.process.poll() is not None


def test_the_engine_implements_the_generation_engine_protocol():
    assert isinstance(VLLMServerEngine("http://127.0.0.1:1"), GenerationEngine)


def test_launch_servers_checks_its_arguments(tmp_path):
    with pytest.raises(ValueError, match="count"):
        launch_servers(tmp_path, 0)
    with pytest.raises(ValueError, match="per_server_env has 1 entries for 2 servers"):
        launch_servers(tmp_path, 2, per_server_env=[{"CUDA_VISIBLE_DEVICES": "0"}])
    with pytest.raises(ValueError, match="per_server_cpus has 3 entries for 2 servers"):
        launch_servers(tmp_path, 2, per_server_cpus=[[0], [1], [2]])


def test_a_pinned_command_runs_under_taskset_on_the_given_cpus():
    command = pinned_command(["python", "-m", "vllm"], [2, 0, 3])
    assert Path(command[0]).name == "taskset" and command[1:] == ["--cpu-list", "2,0,3", "python", "-m", "vllm"]
    assert cpu_list((5,)) == "5"
    for bad in ([], [-1]):
        with pytest.raises(ValueError, match="non-empty list of CPU ids"):
            cpu_list(bad)


def test_a_fleet_sync_names_the_unreachable_servers(tmp_path):
    fleet = VLLMFleet.attach([f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"], SMALL)
    params = init_params(SMALL, jax.random.key(0))

    async def sync():
        try:
            await fleet.update_weights(params, 3)
        finally:
            await fleet.aclose()

    try:
        gin.bind_parameter("default_sync_dir.sync_dir", str(tmp_path))
        with pytest.raises(EngineUnavailable, match="all 2 engines are down"):
            asyncio.run(sync())
    finally:
        gin.clear_config()
    assert list(tmp_path.iterdir()) == [], "the sync file is removed even when the sync fails"


def test_shared_sync_checkpoints_write_each_version_once_and_remove_it_after_the_last_user(tmp_path):
    params = init_params(SMALL, jax.random.key(0))
    checkpoints = SharedSyncCheckpoints()
    writes = []
    original = checkpoints._write
    checkpoints._write = lambda *args: writes.append(args[2]) or original(*args)  # count the real writes

    async def two_servers_load(version):
        seen = []

        async def load():
            async with checkpoints.use(SMALL, params, version) as checkpoint:
                seen.append(checkpoint.path)
                assert (checkpoint.path / "config.json").is_file()
                await asyncio.sleep(0.01)
        await asyncio.gather(load(), load())
        return seen

    try:
        gin.bind_parameter("default_sync_dir.sync_dir", str(tmp_path))
        first, second = asyncio.run(two_servers_load(4)), asyncio.run(two_servers_load(5))
    finally:
        gin.clear_config()
    assert writes == [4, 5] and first[0] == first[1] and second[0] == second[1] != first[0]
    assert list(tmp_path.iterdir()) == [] and checkpoints.last_megabytes > 0


def test_servers_of_two_dtypes_get_one_checkpoint_each(tmp_path):
    params = init_params(SMALL, jax.random.key(0))
    checkpoints = SharedSyncCheckpoints()

    async def load(dtype):
        async with checkpoints.use(SMALL, params, 6, dtype) as checkpoint:
            await asyncio.sleep(0.01)
            return checkpoint

    async def three_servers():
        return await asyncio.gather(load("bfloat16"), load("float32"), load("bfloat16"))

    try:
        gin.bind_parameter("default_sync_dir.sync_dir", str(tmp_path))
        bf16, f32, bf16_again = asyncio.run(three_servers())
    finally:
        gin.clear_config()
    assert bf16 == bf16_again != f32 and (bf16.dtype, f32.dtype) == ("bfloat16", "float32")
    assert f32.nbytes == 2 * bf16.nbytes and list(tmp_path.iterdir()) == []
