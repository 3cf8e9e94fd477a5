"""The in-process JAX generation engine: continuous batching over the Flax model's KV cache (issue 5, item 3).

DESIGN: the embedded default `GenerationEngine`. A fixed number of slots share one KV cache of `max_len` tokens
per slot. One background thread steps the model: between steps, waiting requests start in free slots and finished
ones leave; each step feeds every running slot its pending token and samples the next, `decode_steps` times in one
device call (temperature, top-p, a per-request seed; `rstar_jax.rollout.sampling`). Callers `await generate(...)`
from any number of asyncio tasks; the event loop never runs a jitted step.

A request starts from what the cache already holds when it can (`CacheMemo`, issue 26 item 1): a slot that holds
its whole prompt (another rollout of a GRPO group) is copied and the first token sampled from the logits kept
after that prompt; a slot that holds a prefix of it (the trajectory's previous turn: prompt plus sampled tokens,
left in the slot when that turn ended) is reused and only the rest of the prompt, the tool response and the next
turn's header, is prefilled. A finished turn's slot stays as it was ("parked") until a request needs a slot: new
requests take slots that hold nothing first, then the least recently used parked slot, whose tokens move to a park
store of `park_rows` rows (least recently used row dropped); new weights invalidate everything held. Exact: a
reused prefix gives the same tokens and log-probs as prefilling the whole conversation, up to float rounding
(tests/rollout/test_jax_engine_reuse.py).

Prompts are padded to buckets, suffixes to turn buckets, and decode attends over windows, so the engine compiles
len(buckets) + len(turn buckets) + len(windows) + 3 programs, all during warm-up, and nothing afterwards. New
weights swap in between steps: every forward pass uses one parameter set. If the stepping thread dies, every
pending and later request gets `EngineUnavailable` instead of hanging.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import gin
import jax
import numpy as np

from rstar_jax.model import ModelConfig, init_cache, load_hf
from rstar_jax.model.lm import Params
from rstar_jax.rollout.engine import EngineCapacity, EngineUnavailable, Generation, SamplingParams
from rstar_jax.rollout.jax_engine_slots import CacheMemo, Request, SlotTable
from rstar_jax.rollout.jax_engine_steps import (LARGEST_TURN_BUCKET, SMALLEST_DECODE_WINDOW, bucket_for, check_buckets,
                                                clone_and_sample, copy_row, decode_and_sample, extend_and_sample,
                                                power_of_two_buckets, prefill_and_sample, suffix_chunks)
from rstar_jax.rollout.sampling import seed_words

# One engine's weight copy at a time in a process. Two engines copying the learner's 8-device-sharded parameters from
# two worker threads at once failed once in CI inside JAX's resharding copy (`safe_zip() argument 1 has length 8 but
# argument 0 has length 6`, shard_sharded_device_array_slow_path); it did not recur alone or in a stress test, so the
# copies are serialised rather than trusted. Each copy is memory-bound, so little is lost.
_WEIGHT_COPY_LOCK = threading.Lock()

logger = logging.getLogger(__name__)


@gin.configurable
class JaxEngine:
    """Continuous-batching generation with the Flax model in this process; implements `GenerationEngine`.

    slots: requests decoded together; max_len: tokens one slot holds (prompt plus sampled tokens; a longer prompt
    is rejected with ValueError, a turn that fills its slot ends with finish_reason 'length'); prefill_buckets:
    padded prompt lengths (default: powers of two from 16, then max_len); dtype: serving dtype of the parameters,
    activations and KV cache (default: the config's); seed: draws the seeds of requests that give none;
    decode_steps: tokens each running slot samples per device call (requests join and leave between calls; a
    turn that ends inside a call wastes the rest of it); decode_windows: cache lengths a decode call may attend
    over, the smallest that holds the longest running sequence is used (default: powers of two from 128, then
    max_len; one decode program each); warmup: compile every shape in the stepping thread before the first
    request runs; reuse_turns: start a request from the longest prefix of its prompt some cache row holds, and keep
    finished turns' caches (parked) for the trajectory's next turn (False: only a whole prompt held with its
    logits is reused, as for a GRPO group, and new requests take the lowest free slot);
    turn_buckets: padded lengths of the suffix a reused prefix leaves to prefill (default: powers of two from 16 to
    128; a longer suffix goes in several calls, or is prefilled whole when that pads to fewer tokens); park_rows:
    rows of the park store a parked slot's cache moves to when a new request needs the slot (default: 2 x slots,
    twice the decoding cache's memory: room for two parked trajectories a slot, the demo's 48 rollouts on an
    engine of 16; 0: parked caches live only in free slots).
    """

    def __init__(self, config: ModelConfig, params: Params, slots: int = 8, max_len: int = 1024,
                 prefill_buckets: Sequence[int] | None = None, dtype: str | None = None, seed: int = 0,
                 decode_steps: int = 8, decode_windows: Sequence[int] | None = None, warmup: bool = True,
                 reuse_turns: bool = True, turn_buckets: Sequence[int] | None = None,
                 park_rows: int | None = None) -> None:
        if slots < 1:
            raise ValueError(f"JaxEngine needs at least one slot, got slots={slots}")
        if decode_steps < 1:
            raise ValueError(f"JaxEngine decode_steps must be at least 1, got {decode_steps}")
        if max_len < 2:
            raise ValueError(f"JaxEngine max_len must be at least 2, got {max_len}")
        if park_rows is not None and park_rows < 0:
            raise ValueError(f"JaxEngine park_rows must be >= 0, got {park_rows}")
        if max_len > config.max_position_embeddings:
            raise ValueError(f"JaxEngine max_len {max_len} exceeds the model's max_position_embeddings "
                             f"{config.max_position_embeddings}")
        if dtype is not None:
            config = dataclasses.replace(config, dtype=dtype, param_dtype=dtype)
        self.config = config
        self.slots = slots
        self.max_len = max_len
        self.decode_steps = decode_steps
        self.buckets = check_buckets(prefill_buckets or power_of_two_buckets(max_len), max_len, "prefill buckets")
        self.decode_windows = check_buckets(
            decode_windows or power_of_two_buckets(max_len, smallest=min(SMALLEST_DECODE_WINDOW, max_len)), max_len,
            "decode windows")
        if self.decode_windows[-1] != max_len:
            raise ValueError(f"the largest decode window must be max_len={max_len}, got {self.decode_windows}")
        self.reuse_turns = reuse_turns
        self.turn_buckets = _check_turn_buckets(turn_buckets or power_of_two_buckets(min(LARGEST_TURN_BUCKET,
                                                                                         max_len)), max_len)
        self.park_rows = (2 * slots if park_rows is None else park_rows) if reuse_turns else 0
        self._device = jax.local_devices()[0]
        self._param_paths, self._param_treedef = _paths_and_treedef(params)
        self._param_shapes = [tuple(np.shape(leaf)) for leaf in jax.tree_util.tree_leaves(params)]
        self._params = self._prepare_params(params)
        self._version = 0
        self._cache = jax.device_put(init_cache(config, slots, max_len), self._device)
        self._park = (jax.device_put(init_cache(config, self.park_rows, max_len), self._device) if self.park_rows
                      else None)
        self._table = SlotTable(slots)
        self._memo = CacheMemo(slots, self.park_rows)
        self._weights_changed = False  # set by update_weights, cleared by the stepping thread as it forgets the cache
        # Counters (the stepping thread writes them; `stats` reads them): requests started by a prefill of the whole
        # prompt, by a copy of a slot holding the whole prompt, by a prefill of the suffix a held prefix leaves.
        self.prefills = 0
        self.copies = 0
        self.extends = 0
        self.prefill_tokens = 0  # prompt tokens run through the model at admission (their real count)
        self.padded_prefill_tokens = 0  # the same, padded to the buckets: what the device computed
        self.reused_tokens = 0  # prompt tokens taken from the cache instead
        self.parked = 0  # slot caches moved to the park store
        self.unparked = 0  # park-store rows copied back into a slot
        self.evicted = 0  # held caches overwritten (least recently used)
        self.invalidations = 0  # weight updates that dropped every held cache
        self.admission_s = 0.0  # the stepping thread's seconds starting requests (prefills, copies, extensions)
        self.decode_s = 0.0  # and decoding
        self._waiting: collections.deque[Request] = collections.deque()
        self._seed_rng = np.random.default_rng(seed)
        self._cond = threading.Condition()
        self._stopping = False
        self._failure: str | None = None
        self._snapshot = EngineCapacity(slots * max_len, 0, 0, 0, max_sequences=slots)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(warmup,), name="jax-engine-steps", daemon=True)
        self._thread.start()

    @classmethod
    def from_hf(cls, path: str | os.PathLike, **kwargs: Any) -> "JaxEngine":
        """An engine serving the Hugging Face folder at `path` (read by `load_hf`); kwargs as the constructor."""
        model = load_hf(path)
        return cls(model.config, model.params, **kwargs)

    # ---- GenerationEngine -------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """Sample one turn continuing `prompt_ids` (GenerationEngine); EngineUnavailable once the engine is down."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompt = self._check_prompt(prompt_ids)
        loop = asyncio.get_running_loop()
        with self._cond:
            self._raise_if_down()
            seed = self._seed_rng.integers(0, 1 << 63) if sampling.seed is None else sampling.seed
            request = Request(prompt, sampling, seed_words(seed), loop, loop.create_future())
            self._waiting.append(request)
            self._cond.notify()
        try:
            return await request.future
        except asyncio.CancelledError:
            self._cancel(request)
            raise

    async def capacity(self) -> EngineCapacity:
        """KV tokens in use (sum of running sequence lengths) out of slots x max_len; running and waiting counts;
        `max_sequences` = slots (a balancer sends no more than that at once; SPEC section 6)."""
        with self._cond:
            self._raise_if_down()
            return dataclasses.replace(self._snapshot, requests_waiting=len(self._waiting))

    async def update_weights(self, params: Params, version: int) -> None:
        """Serve `params` from the next step on (GenerationEngine): copied to the device, cast to the serving dtype.

        Raises ValueError if the tree or a shape differs from the engine's model. Returns once every later
        forward pass uses the new weights; a running turn continues on them from its next token.
        """
        prepared = await asyncio.to_thread(self._prepare_params, params)
        with self._cond:
            self._raise_if_down()
            self._params, self._version = prepared, version
            self._weights_changed = True

    # ---- control ----------------------------------------------------------------------------------------------

    @property
    def weights_version(self) -> int:
        """The version passed with the weights now served (0 for the constructor's)."""
        with self._cond:
            return self._version

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until warm-up has compiled every shape; EngineUnavailable if the engine died or closed first."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"JaxEngine not warm after {timeout} s")
        with self._cond:
            self._raise_if_down()

    def compiled_programs(self) -> dict[str, int]:
        """How many shapes each jitted step has compiled in this process (all engines): bounded by the buckets."""
        return {"prefill": prefill_and_sample._cache_size(), "decode": decode_and_sample._cache_size(),
                "copy": clone_and_sample._cache_size(), "extend": extend_and_sample._cache_size(),
                "park": copy_row._cache_size()}

    def stats(self) -> dict[str, float]:
        """How requests started since the engine did: counts of prefills, copies and extensions, prompt tokens
        prefilled (real and padded) and reused from the cache, the park store's traffic, and the stepping thread's
        seconds starting requests and decoding."""
        return {"prefills": self.prefills, "copies": self.copies, "extends": self.extends,
                "prefill_tokens": self.prefill_tokens, "padded_prefill_tokens": self.padded_prefill_tokens,
                "reused_tokens": self.reused_tokens, "parked": self.parked, "unparked": self.unparked,
                "evicted": self.evicted, "invalidations": self.invalidations, "admission_s": self.admission_s,
                "decode_s": self.decode_s}

    def close(self) -> None:
        """Stop the stepping thread; requests not yet finished get EngineUnavailable. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()

    # ---- stepping thread --------------------------------------------------------------------------------------

    def _run(self, warmup: bool) -> None:
        """The stepping loop: admit waiting requests into free slots, then decode every running slot."""
        admitted: list[Request] = []  # out of the queue, maybe not in a slot yet: failed too if the thread dies
        try:
            if warmup:
                self._warm_up()
            self._ready.set()
            while True:
                admitted = self._next_admissions()
                if admitted is None:
                    break
                began = time.perf_counter()
                finished = [done for request in admitted for done in self._admit(request)]
                admitted_at = time.perf_counter()
                self.admission_s += admitted_at - began
                if self._table.running:
                    finished += self._decode()
                    self.decode_s += time.perf_counter() - admitted_at
                self._publish_capacity()  # before delivering, so a caller woken by its result sees its slot free
                for request, finish_reason in finished:
                    request.deliver(request.generation(finish_reason))
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the callers, not hang them
            logger.exception("JaxEngine stepping thread died")
            self._shut_down(f"JaxEngine stepping thread died: {exc!r}", admitted)
        else:
            self._shut_down("JaxEngine is closed", [])
        finally:
            self._ready.set()

    def _next_admissions(self) -> list[Request] | None:
        """Wait for work; pop the waiting requests that free slots can take now, in order. None when closing.

        In order even with `reuse_turns`: admitting the turns that continue a parked trajectory first kept its cache
        more often, but made the rollout phase slower (longer sequences decoded together, over larger windows, and
        more decode calls; the demo's rollouts in the engine bench: 13.9 / 12.3 s against 12.9 / 10.5 s in order)."""
        with self._cond:
            self._cond.wait_for(lambda: self._stopping or self._waiting or self._table.running)
            if self._stopping:
                return None
            self._drop_cancelled_running()
            free = self.slots - self._table.running
            return [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]

    def _drop_cancelled_running(self) -> None:
        for slot, request in self._table.occupied():
            if request.future.cancelled():
                self._table.release(slot)

    def _free_slots(self) -> list[int]:
        return [slot for slot, request in enumerate(self._table.requests) if request is None]

    def _take_params(self) -> Params:
        """The weights to run now; on new ones, every held cache is forgotten first (it was computed with others)."""
        with self._cond:
            params, weights_changed, self._weights_changed = self._params, self._weights_changed, False
        if weights_changed:
            self._memo.forget()
            self.invalidations += 1
        return params

    def _admit(self, request: Request) -> list[tuple[Request, str]]:
        """Start `request` in a free slot and record its first token; [(request, reason)] if that ended it.

        The prompt is copied from a row that holds it with the logits after it (the same cache and first token, bit
        for bit, for a copy instead of a forward pass), or (`reuse_turns`) extended from the longest prefix a row
        holds, or prefilled."""
        params = self._take_params()
        prompt, sampling = request.prompt_ids, request.sampling
        sample = (np.float32(sampling.temperature), np.float32(sampling.top_p), request.seed)
        free = self._free_slots()
        busy = [slot for slot in range(self.slots) if slot not in free]
        plan = self._memo.plan(prompt, free, busy, self._worth_extending(len(prompt)) if self.reuse_turns else None)
        slot = plan.source if plan.in_place else self._target(keep=plan.source)
        source, logits = plan.source, self._memo.logits(plan.source) if plan.kind == "copy" else None
        if source is not None and source >= self.slots:  # in the park store: back into the slot first
            self._cache = copy_row(self._cache, self._park, np.int32(slot), np.int32(source - self.slots))
            self.unparked += 1
            if len(self._memo.tokens(source)) == plan.shared:  # the trajectory goes on in the slot
                self._memo.drop(source)
            source = slot
        if plan.kind == "copy":
            token, logprob, self._cache = clone_and_sample(self._cache, np.int32(source), np.int32(slot),
                                                           np.int32(len(prompt)), logits, *sample)
            self.copies += 1
        elif plan.kind == "extend":
            token, logprob, logits = self._extend(params, source, slot, prompt, plan.shared, sample)
            self.extends += 1
        else:
            ids = np.zeros(bucket_for(len(prompt), self.buckets), np.int32)
            ids[:len(prompt)] = prompt
            mask = (np.arange(ids.shape[0]) < len(prompt)).astype(np.int32)
            token, logprob, logits = self._prefill(params, slot, ids, mask, *sample)
            self.prefills += 1
            self.prefill_tokens += len(prompt)
            self.padded_prefill_tokens += len(ids)
        self.reused_tokens += plan.shared
        self._memo.hold(slot, prompt, logits)
        token, logprob = jax.device_get((token, logprob))
        finish_reason = request.record(int(token), float(logprob), self.max_len)
        if finish_reason:
            return [(request, finish_reason)]
        self._table.occupy(slot, request, int(token))
        return []

    def _worth_extending(self, length: int) -> Callable[[int], bool]:
        """Whether a prompt of `length` tokens sharing so many with a held row is cheaper extended than prefilled:
        fewer padded tokens to compute."""
        whole = bucket_for(length, self.buckets)
        return lambda shared: sum(bucket for _, bucket in suffix_chunks(length - shared, self.turn_buckets)) < whole

    def _target(self, keep: int | None) -> int:
        """The free slot a request starts in (not `keep`, the row it reads from, unless no other is free): with
        `reuse_turns` one that holds nothing, else the least recently used, whose cache first moves to the park
        store; without, the lowest."""
        if not self.reuse_turns:
            return self._table.free_slot()
        free = self._free_slots()
        slot = self._memo.victim([other for other in free if other != keep] or free)
        if self._memo.tokens(slot) is not None:
            self._park_out(slot, keep)
        return slot

    def _park_out(self, slot: int, keep: int | None) -> None:
        """Move `slot`'s cache to the park store's least recently used row (not `keep`), dropping what that held."""
        rows = [row for row in self._memo.park if row != keep]
        if not rows:
            self.evicted += 1
            return
        row = self._memo.victim(rows)
        if self._memo.tokens(row) is not None:
            self.evicted += 1
        self._park = copy_row(self._park, self._cache, np.int32(row - self.slots), np.int32(slot))
        self._memo.move(slot, row)
        self.parked += 1

    def _extend(self, params: Params, source: int, slot: int, prompt: np.ndarray, shared: int,
                sample: tuple[np.float32, np.float32, np.ndarray]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Start `slot` with `source`'s first `shared` tokens and prefill the rest of `prompt` in turn buckets; the
        first token, its log-prob and the logits after the prompt (on the device)."""
        start = shared
        for length, bucket in suffix_chunks(len(prompt) - shared, self.turn_buckets):
            ids = np.zeros(bucket, np.int32)
            ids[:length] = prompt[start:start + length]
            mask = (np.arange(bucket) < length).astype(np.int32)
            token, logprob, logits, self._cache = extend_and_sample(params, self.config, self._cache,
                                                                    np.int32(source), np.int32(slot),
                                                                    np.int32(start), ids, mask, *sample)
            source, start = slot, start + length
            self.prefill_tokens += length
            self.padded_prefill_tokens += bucket
        return token, logprob, logits

    def _decode(self) -> list[tuple[Request, str]]:
        """`decode_steps` tokens for every running slot; finished requests leave their slots and are returned.

        A slot's tokens are recorded in order up to the one that ends its turn; the rest of the call's are dropped.
        """
        table = self._table
        tokens, logprobs = self._decode_call()
        finished = []
        for slot, request in table.occupied():
            for step in range(self.decode_steps):
                finish_reason = request.record(int(tokens[step, slot]), float(logprobs[step, slot]), self.max_len)
                if finish_reason:
                    table.release(slot)
                    if self.reuse_turns:  # cached: the prompt and every sampled token but the last (never fed)
                        self._memo.grow(slot, np.concatenate([request.prompt_ids,
                                                              np.asarray(request.token_ids[:-1], np.int32)]))
                    finished.append((request, finish_reason))
                    break
            else:
                table.pending_tokens[slot] = tokens[-1, slot]
        return finished

    def _decode_call(self) -> tuple[np.ndarray, np.ndarray]:
        """Decode the running slots over the smallest window that holds the longest of them after this call."""
        longest = max((request.sequence_length for _, request in self._table.occupied()), default=0)
        return self._decode_window_call(bucket_for(min(longest + self.decode_steps, self.max_len),
                                                   self.decode_windows))

    def _decode_window_call(self, window: int) -> tuple[np.ndarray, np.ndarray]:
        """Run the jitted decode on the slot table's arrays (warm-up and decoding share it: same programs)."""
        table = self._table
        params = self._take_params()
        tokens, logprobs, self._cache = decode_and_sample(params, self.config, self._cache, table.pending_tokens,
                                                          table.active, table.temperature, table.top_p, table.seeds,
                                                          steps=self.decode_steps, window=window)
        return jax.device_get((tokens, logprobs))

    def _prefill(self, params: Params, slot: int, ids: np.ndarray, mask: np.ndarray, temperature: np.float32,
                 top_p: np.float32, seed: np.ndarray) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Run the jitted prefill on host arrays of fixed dtypes (warm-up and admission share it: same programs);
        returns the first token, its log-prob and the logits (on the device)."""
        token, logprob, logits, self._cache = prefill_and_sample(params, self.config, self._cache, np.int32(slot),
                                                                 ids, mask, temperature, top_p, seed)
        return token, logprob, logits

    def _warm_up(self) -> None:
        """Compile every prefill bucket, turn bucket, decode window, the slot copy and the park store's copies on
        empty inputs (all-padding prompts, no active slot)."""
        sample = (np.float32(1.0), np.float32(1.0), seed_words(0))
        with self._cond:
            params = self._params
        for bucket in self.buckets:
            _, _, logits = self._prefill(params, 0, np.zeros(bucket, np.int32), np.zeros(bucket, np.int32), *sample)
        outputs = clone_and_sample(self._cache, np.int32(0), np.int32(0), np.int32(0), logits, *sample)
        self._cache = outputs[-1]
        if self.reuse_turns:
            for bucket in self.turn_buckets:
                *outputs, self._cache = extend_and_sample(params, self.config, self._cache, np.int32(0), np.int32(0),
                                                          np.int32(0), np.zeros(bucket, np.int32),
                                                          np.zeros(bucket, np.int32), *sample)
        if self._park is not None:
            self._park = copy_row(self._park, self._cache, np.int32(0), np.int32(0))
            self._cache = copy_row(self._cache, self._park, np.int32(0), np.int32(0))
        jax.block_until_ready(outputs)
        for window in self.decode_windows:
            self._decode_window_call(window)

    def _publish_capacity(self) -> None:
        with self._cond:
            self._snapshot = EngineCapacity(self.slots * self.max_len, self._table.live_tokens(),
                                            self._table.running, len(self._waiting), max_sequences=self.slots)

    def _shut_down(self, reason: str, admitted: list[Request]) -> None:
        """Mark the engine down; fail with `reason` every request it still holds: running, waiting or `admitted`.

        A request already settled ignores the failure (`Request.deliver` settles a future once).
        """
        with self._cond:
            self._failure = reason
            pending = [request for _, request in self._table.occupied()] + list(self._waiting) + admitted
            self._waiting.clear()
            for slot, _ in self._table.occupied():
                self._table.release(slot)
        for request in pending:
            request.deliver(EngineUnavailable(reason))

    # ---- helpers ----------------------------------------------------------------------------------------------

    def _raise_if_down(self) -> None:
        """Called under the lock: EngineUnavailable once closed or dead."""
        if self._failure is not None:
            raise EngineUnavailable(self._failure)
        if self._stopping:
            raise EngineUnavailable("JaxEngine is closing")

    def _cancel(self, request: Request) -> None:
        """A caller stopped waiting: drop its request if queued; a running one leaves its slot at the next step."""
        with self._cond:
            if request in self._waiting:
                self._waiting.remove(request)

    def _check_prompt(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """Prompt ids as int32; ValueError for an empty prompt, ids outside the vocabulary or no room to generate."""
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"prompt_ids must be a non-empty sequence of token ids, got shape {prompt.shape}")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt_ids must be integers, got dtype {prompt.dtype}")
        if prompt.min() < 0 or prompt.max() >= self.config.vocab_size:
            raise ValueError(f"prompt_ids must lie in [0, {self.config.vocab_size}), got values in "
                             f"[{prompt.min()}, {prompt.max()}]")
        if prompt.size >= self.max_len:
            raise ValueError(f"a prompt of {prompt.size} tokens leaves no room in this engine's slots of "
                             f"max_len={self.max_len} tokens (the prompt must be shorter than max_len)")
        return prompt.astype(np.int32)

    def _prepare_params(self, params: Params) -> Params:
        """A private device copy of `params` in the serving dtype; ValueError naming a mismatched tree or shape."""
        paths, treedef = _paths_and_treedef(params)
        if treedef != self._param_treedef:
            missing = sorted(set(self._param_paths) - set(paths))
            extra = sorted(set(paths) - set(self._param_paths))
            raise ValueError(f"parameter tree differs from the engine's model: missing {missing}, unexpected {extra}")
        leaves = jax.tree_util.tree_leaves(params)
        for path, leaf, shape in zip(paths, leaves, self._param_shapes):
            if tuple(np.shape(leaf)) != shape:
                raise ValueError(f"parameter {path} has shape {tuple(np.shape(leaf))}, the engine's model needs "
                                 f"{shape}")
        dtype = self.config.jnp_param_dtype
        with _WEIGHT_COPY_LOCK:
            copies = [jax.device_put(leaf, self._device, may_alias=False) if _is_array_of(leaf, dtype)
                      else jax.device_put(np.asarray(leaf).astype(dtype), self._device) for leaf in leaves]
            return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, copies))


def _check_turn_buckets(buckets: Sequence[int], max_len: int) -> tuple[int, ...]:
    """Sorted, de-duplicated turn buckets; an error unless they are in [1, max_len]."""
    result = tuple(sorted({int(b) for b in buckets}))
    if not result or result[0] < 1 or result[-1] > max_len:
        raise ValueError(f"turn buckets must be non-empty and within [1, max_len={max_len}], got {tuple(buckets)}")
    return result


def _paths_and_treedef(params: Params) -> tuple[list[str], Any]:
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    return [jax.tree_util.keystr(path) for path, _ in with_paths], treedef


def _is_array_of(leaf: Any, dtype: Any) -> bool:
    return isinstance(leaf, jax.Array) and leaf.dtype == dtype
