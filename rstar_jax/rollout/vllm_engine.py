"""`GenerationEngine` over one vLLM OpenAI server (DESIGN "Token ids end to end", "One protocol per boundary").

Token ids both ways: the prompt goes to /v1/completions as a list of ids, the reply carries the sampled ids
(`return_token_ids`) and each one's raw log-prob (the server runs with `--logprobs-mode raw_logprobs`: the
temperature-1 full-vocabulary distribution). Only the caller's stop ids end a turn (`ignore_eos`). A server that
cannot be reached, drops the connection or fails internally raises `EngineUnavailable`, so a balancer can retry the
request elsewhere.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Sequence

import aiohttp
import gin

from rstar_jax.model.config import ModelConfig
from rstar_jax.model.lm import Params
from rstar_jax.rollout.engine import (
    FINISH_REASONS,
    EngineCapacity,
    EngineUnavailable,
    Generation,
    SamplingParams,
)
from rstar_jax.rollout.vllm_metrics import capacity_from_metrics
from rstar_jax.rollout.vllm_weight_sync import SharedSyncCheckpoints, SyncCheckpoint, push_weights, server_dtype

_UNREACHABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError)
# vLLM's HTTP server closes a keep-alive connection after 5 idle seconds (VLLM_HTTP_TIMEOUT_KEEP_ALIVE) and aiohttp
# keeps idle ones for 15 s, so a request after a pause could go out on a connection the server had just closed
# (seen: "Can not write request body" on /pause after a long turn). Idle connections are dropped sooner here.
IDLE_CONNECTION_S = 2.0


@gin.configurable
class VLLMServerEngine:
    """Client of one vLLM server at `url` (e.g. "http://10.0.0.5:8000").

    `model_config` is the learner's config of the served model; it is needed only by `update_weights`, which turns
    the learner's parameter tree into HF tensors. `request_timeout_s` bounds one generate call. `checkpoints` is
    shared by the engines of one fleet, so a weight version is written once for all of them.
    """

    def __init__(self, url: str, model_config: ModelConfig | None = None, request_timeout_s: float = 3600.0,
                 checkpoints: SharedSyncCheckpoints | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"vLLM server url must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.model_config = model_config
        self.request_timeout_s = request_timeout_s
        self.checkpoints = checkpoints if checkpoints is not None else SharedSyncCheckpoints()
        self.weights_version: int | None = None
        self._served_dtype: str | None = None
        self.last_load_report: dict[str, Any] | None = None  # the worker's report of the latest reload
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> aiohttp.ClientSession:
        """The HTTP session of the running event loop (a new loop, e.g. a new asyncio.run, gets a new session)."""
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_CONNECTION_S))
            self._session_loop = loop
        return self._session

    async def aclose(self) -> None:
        """Close the HTTP session (the server keeps running)."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                       timeout_s: float | None = None) -> str:
        """Send one request and return the reply's text. Unreachable/5xx -> EngineUnavailable, 4xx -> ValueError."""
        url = self.url + path
        try:
            async with self._client().request(method, url, json=body,
                                              timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                text = await response.text()
        except _UNREACHABLE as exc:
            raise EngineUnavailable(f"{method} {url} failed: {exc!r}") from exc
        if response.status >= 500:
            raise EngineUnavailable(f"{method} {url} answered {response.status}: {text[:2000]}")
        if response.status >= 400:
            raise ValueError(f"{method} {url} rejected the request ({response.status}): {text[:2000]}")
        return text

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """Sample one turn continuing `prompt_ids` (the GenerationEngine contract, issue 5 item 2)."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        body = {
            "prompt": [int(token) for token in prompt_ids],
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": True,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        reply = _json(await self._request("POST", "/v1/completions", body, self.request_timeout_s))
        return generation_from_completion(reply, self.url)

    async def score(self, token_ids: Sequence[int]) -> tuple[float, ...]:
        """log p(token_ids[t] | token_ids[:t]) for t >= 1 under the served weights (prompt logprobs).

        For checking a sync against the learner (the same numbers `rstar_jax.model.token_logprobs` gives).
        """
        if len(token_ids) < 2:
            raise ValueError(f"score needs at least 2 token ids, got {len(token_ids)}")
        body = {"prompt": [int(token) for token in token_ids], "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0, "return_token_ids": True}
        reply = _json(await self._request("POST", "/v1/completions", body, self.request_timeout_s))
        entries = reply["choices"][0]["prompt_logprobs"][1:]
        return tuple(float(entry[str(token)]["logprob"]) for entry, token in zip(entries, token_ids[1:]))

    async def capacity(self) -> EngineCapacity:
        """KV-cache and queue gauges from the server's /metrics (SPEC section 6)."""
        return capacity_from_metrics(await self._request("GET", "/metrics", timeout_s=30.0))

    async def served_dtype(self) -> str:
        """The dtype the server holds its weights in (`server_dtype`; asked once, then remembered): what
        `update_weights` writes."""
        if self._served_dtype is None:
            self._served_dtype = await server_dtype(self._client(), self.url)
        return self._served_dtype

    async def load_weights_from(self, checkpoint: SyncCheckpoint, version: int) -> dict[str, Any]:
        """Make the server serve the weights in an already written sync checkpoint; returns the worker's report."""
        report = await push_weights(self._client(), self.url, checkpoint.path)
        self.weights_version, self.last_load_report = version, report
        return report

    async def update_weights(self, params: Params, version: int) -> None:
        """Load `params` into this server from the sync checkpoint of `version` in the server's dtype, written once for
        every engine of that dtype that shares this engine's `checkpoints` (GenerationEngine)."""
        if self.model_config is None:
            raise ValueError(f"VLLMServerEngine({self.url}) needs model_config to convert parameters in update_weights")
        dtype = await self.served_dtype()
        async with self.checkpoints.use(self.model_config, params, version, dtype) as checkpoint:
            await self.load_weights_from(checkpoint, version)


def _json(text: str) -> dict[str, Any]:
    """Decode a server reply, naming it when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise EngineUnavailable(f"vLLM server sent a reply that is not JSON: {text[:500]!r}") from exc


def generation_from_completion(reply: dict[str, Any], url: str = "") -> Generation:
    """A Generation from a /v1/completions reply with return_token_ids and logprobs=0.

    An aborted request (finish_reason "abort", e.g. the server paused with mode="abort") raises EngineUnavailable.
    """
    choice = reply["choices"][0]
    finish = choice.get("finish_reason")
    if finish not in FINISH_REASONS:
        raise EngineUnavailable(f"vLLM server {url} ended the request with finish_reason={finish!r}")
    token_ids = tuple(int(token) for token in choice["token_ids"])
    logprobs = tuple(float(value) for value in choice["logprobs"]["token_logprobs"])
    return Generation(token_ids=token_ids, logprobs=logprobs, finish_reason=finish)
