"""The in-process JAX generation engine: continuous batching over the Flax model's KV cache (issue 5, item 3).

DESIGN: the embedded default `GenerationEngine`. A fixed number of slots share one KV cache of `max_len` tokens
per slot. One background thread steps the model: between steps, waiting requests are prefilled into free slots
(or, when a slot still holds the same prompt, e.g. another rollout of a GRPO group, copied from it) and finished
ones leave; each step feeds every running slot its pending token and samples the next, `decode_steps` times in one
device call (temperature, top-p, a per-request seed; `rstar_jax.rollout.sampling`). Callers `await generate(...)`
from any number of asyncio tasks; the event loop never runs a jitted step. Prompts are padded to buckets and decode
attends over windows, so the engine compiles len(buckets) + len(windows) + 1 programs, all during warm-up, and
nothing afterwards. New weights swap in between steps: every forward pass uses one parameter set. If the stepping
thread dies, every pending and later request gets `EngineUnavailable` instead of hanging.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import threading
from typing import Any, Sequence

import gin
import jax
import numpy as np

from rstar_jax.model import ModelConfig, init_cache, load_hf
from rstar_jax.model.lm import Params
from rstar_jax.rollout.engine import EngineCapacity, EngineUnavailable, Generation, SamplingParams
from rstar_jax.rollout.jax_engine_slots import PromptMemo, Request, SlotTable
from rstar_jax.rollout.jax_engine_steps import (SMALLEST_DECODE_WINDOW, bucket_for, check_buckets, clone_and_sample,
                                                decode_and_sample, power_of_two_buckets, prefill_and_sample)
from rstar_jax.rollout.sampling import seed_words

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
    request runs.
    """

    def __init__(self, config: ModelConfig, params: Params, slots: int = 8, max_len: int = 1024,
                 prefill_buckets: Sequence[int] | None = None, dtype: str | None = None, seed: int = 0,
                 decode_steps: int = 8, decode_windows: Sequence[int] | None = None, warmup: bool = True) -> None:
        if slots < 1:
            raise ValueError(f"JaxEngine needs at least one slot, got slots={slots}")
        if decode_steps < 1:
            raise ValueError(f"JaxEngine decode_steps must be at least 1, got {decode_steps}")
        if max_len < 2:
            raise ValueError(f"JaxEngine max_len must be at least 2, got {max_len}")
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
        self._device = jax.local_devices()[0]
        self._param_paths, self._param_treedef = _paths_and_treedef(params)
        self._param_shapes = [tuple(np.shape(leaf)) for leaf in jax.tree_util.tree_leaves(params)]
        self._params = self._prepare_params(params)
        self._version = 0
        self._cache = jax.device_put(init_cache(config, slots, max_len), self._device)
        self._table = SlotTable(slots)
        self._prompts = PromptMemo(slots)
        self._weights_changed = False  # set by update_weights, cleared by the stepping thread as it forgets prompts
        self.prefills = 0  # prompts run through the model, and prompts started from a copy of another slot
        self.copies = 0
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
                "copy": clone_and_sample._cache_size()}

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
                finished = [done for request in admitted for done in self._admit(request)]
                if self._table.running:
                    finished += self._decode()
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
        """Wait for work; pop the waiting requests that free slots can take now. None when closing."""
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

    def _admit(self, request: Request) -> list[tuple[Request, str]]:
        """Start `request` in a free slot and record its first token; [(request, reason)] if that ended it.

        The prompt is prefilled, or copied from a slot that holds it under the same weights (the same cache and
        first token, bit for bit, for a copy instead of a forward pass)."""
        slot = self._table.free_slot()
        with self._cond:
            params, weights_changed, self._weights_changed = self._params, self._weights_changed, False
        if weights_changed:
            self._prompts.forget()
        prompt, sampling = request.prompt_ids, request.sampling
        held = self._prompts.lookup(prompt)
        if held is None:
            ids = np.zeros(bucket_for(len(prompt), self.buckets), np.int32)
            ids[:len(prompt)] = prompt
            mask = (np.arange(ids.shape[0]) < len(prompt)).astype(np.int32)
            token, logprob, logits = self._prefill(params, slot, ids, mask, sampling.temperature, sampling.top_p,
                                                   request.seed)
            self.prefills += 1
        else:
            source, logits = held
            token, logprob = self._copy(source, slot, len(prompt), logits, sampling.temperature, sampling.top_p,
                                        request.seed)
            self.copies += 1
        self._prompts.record(slot, prompt, logits)
        finish_reason = request.record(int(token), float(logprob), self.max_len)
        if finish_reason:
            return [(request, finish_reason)]
        self._table.occupy(slot, request, int(token))
        return []

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
        with self._cond:
            params = self._params
        tokens, logprobs, self._cache = decode_and_sample(params, self.config, self._cache, table.pending_tokens,
                                                          table.active, table.temperature, table.top_p, table.seeds,
                                                          steps=self.decode_steps, window=window)
        return jax.device_get((tokens, logprobs))

    def _prefill(self, params: Params, slot: int, ids: np.ndarray, mask: np.ndarray, temperature: float,
                 top_p: float, seed: np.ndarray) -> tuple[np.ndarray, np.ndarray, jax.Array]:
        """Run the jitted prefill on host arrays of fixed dtypes (warm-up and admission share it: same programs);
        returns the first token, its log-prob and the logits (left on the device)."""
        token, logprob, logits, self._cache = prefill_and_sample(params, self.config, self._cache, np.int32(slot),
                                                                 ids, mask, np.float32(temperature),
                                                                 np.float32(top_p), seed)
        token, logprob = jax.device_get((token, logprob))
        return token, logprob, logits

    def _copy(self, source: int, slot: int, length: int, logits: jax.Array, temperature: float, top_p: float,
              seed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Run the jitted slot copy (warm-up and admission share it: same program); the first token and log-prob."""
        token, logprob, self._cache = clone_and_sample(self._cache, np.int32(source), np.int32(slot), np.int32(length),
                                                       logits, np.float32(temperature), np.float32(top_p), seed)
        return jax.device_get((token, logprob))

    def _warm_up(self) -> None:
        """Compile every prefill bucket, decode window and the slot copy on empty inputs (all-padding prompts, no
        active slot)."""
        seed = seed_words(0)
        with self._cond:
            params = self._params
        for bucket in self.buckets:
            _, _, logits = self._prefill(params, 0, np.zeros(bucket, np.int32), np.zeros(bucket, np.int32), 1.0, 1.0,
                                         seed)
        self._copy(0, 0, 0, logits, 1.0, 1.0, seed)
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
        copies = [jax.device_put(leaf, self._device, may_alias=False) if _is_array_of(leaf, dtype)
                  else jax.device_put(np.asarray(leaf).astype(dtype), self._device) for leaf in leaves]
        return jax.block_until_ready(jax.tree_util.tree_unflatten(treedef, copies))


def _paths_and_treedef(params: Params) -> tuple[list[str], Any]:
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    return [jax.tree_util.keystr(path) for path, _ in with_paths], treedef


def _is_array_of(leaf: Any, dtype: Any) -> bool:
    return isinstance(leaf, jax.Array) and leaf.dtype == dtype
