"""A vLLM server's capacity from its Prometheus /metrics text (SPEC section 6: the balancer's signals).

Pure parsing, no I/O: the client fetches the text. A server with several engines (data parallel inside one server)
reports one sample per `engine` label; they are summed.
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from rstar_jax.rollout.engine import EngineCapacity

KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
CACHE_CONFIG_INFO = "vllm:cache_config_info"


def _samples(text: str) -> dict[str, dict[str, tuple[dict[str, str], float]]]:
    """metric name -> engine label -> (labels, value), for the gauges this module reads."""
    wanted = {KV_USAGE, RUNNING, WAITING, CACHE_CONFIG_INFO}
    found: dict[str, dict[str, tuple[dict[str, str], float]]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                found[sample.name][sample.labels.get("engine", "0")] = (dict(sample.labels), float(sample.value))
    return found


def block_size_of(labels: dict[str, str]) -> int:
    """The KV block size in tokens from one `vllm:cache_config_info` sample's labels (1 when it is not given)."""
    size = labels.get("block_size", "None")
    return 1 if size in ("None", "") else int(float(size))


def kv_tokens_per_engine(labels: dict[str, str]) -> int:
    """KV-cache tokens requests can use, from one `vllm:cache_config_info` sample's labels.

    vLLM 0.32 publishes `kv_cache_size_tokens`; older builds only `num_gpu_blocks` x `block_size`. Either counts the
    block that vLLM's block pool keeps aside as its null block (v1/core/block_pool.py), which no request can hold
    and which `kv_cache_usage_perc` leaves out of its denominator; it is left out here too (a server of 24 blocks of
    128 holds requests in 23: 2,944 tokens, not 3,072).
    """
    blocks, block_size = labels.get("num_gpu_blocks", "None"), labels.get("block_size", "None")
    size = labels.get("kv_cache_size_tokens", "None")
    if size not in ("None", ""):
        total = int(float(size))
    elif "None" in (blocks, block_size):
        raise ValueError(f"{CACHE_CONFIG_INFO} has neither kv_cache_size_tokens nor num_gpu_blocks and block_size: "
                         f"{labels}")
    else:
        total = int(blocks) * int(block_size)
    return total - block_size_of(labels)


def capacity_from_metrics(text: str) -> EngineCapacity:
    """EngineCapacity from /metrics: KV tokens total (cache_config_info) and used (kv_cache_usage_perc x total),
    requests running and waiting (issue 5 item 2), the block size the cache is handed out in and whether running
    requests share prefix blocks (`enable_prefix_caching`; issue 26 item 2).
    Raises ValueError naming the gauge the text lacks."""
    samples = _samples(text)
    for name in (KV_USAGE, RUNNING, WAITING, CACHE_CONFIG_INFO):
        if not samples.get(name):
            raise ValueError(f"/metrics has no {name} sample (is this a vLLM server with stats logging on?)")
    total = used = 0.0
    for engine, (labels, _) in samples[CACHE_CONFIG_INFO].items():
        engine_total = kv_tokens_per_engine(labels)
        usage = samples[KV_USAGE].get(engine, (labels, 0.0))[1]
        total += engine_total
        used += usage * engine_total
    return EngineCapacity(
        kv_tokens_total=int(total),
        kv_tokens_used=int(round(used)),
        requests_running=int(sum(value for _, value in samples[RUNNING].values())),
        requests_waiting=int(sum(value for _, value in samples[WAITING].values())),
        block_size=max(block_size_of(labels) for labels, _ in samples[CACHE_CONFIG_INFO].values()),
        shares_prefixes=all(labels.get("enable_prefix_caching") == "True"
                            for labels, _ in samples[CACHE_CONFIG_INFO].values()),
    )


PREEMPTIONS = "vllm:num_preemptions_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
COUNTERS = (PREEMPTIONS, GENERATION_TOKENS, PREFIX_HITS, PREFIX_QUERIES)


def counters_from_metrics(text: str, names: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    """Totals of counters in /metrics text, summed over engines (SPEC section 6: preemptions, generated tokens,
    prefix-cache hits and queries); a counter the text lacks is 0."""
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += float(sample.value)
    return totals
