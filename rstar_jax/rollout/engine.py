"""The `GenerationEngine` protocol: the one boundary between the agent loop and whatever generates tokens.

DESIGN ("One protocol per boundary", "Token ids end to end"): an engine takes prompt token ids and sampling
parameters, generates ONE assistant turn and returns the sampled token ids with their log-probabilities. The
in-process JAX engine, a vLLM server, a fleet of them and the KV-aware balancer all implement it, so the agent loop
never knows which (or how many) it talks to.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

FINISH_STOP = "stop"  # a stop token was sampled (it is the last entry of token_ids)
FINISH_LENGTH = "length"  # max_new_tokens were sampled
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)


@dataclasses.dataclass(frozen=True)
class RoutingKey:
    """The trajectory a turn belongs to, for a balancer (SPEC section 6); engines themselves ignore it.

    Every turn of one trajectory carries the same key, so a balancer can send a turn to the engine that served the
    trajectory's previous turn (whose prefix cache holds its context). `trajectory` tells trajectories apart
    (across rollouts too); `index` of `batch_size` is its place in the rollout batch, by which a static split
    hands each engine one contiguous part of the batch.
    """

    trajectory: int
    index: int = 0
    batch_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.batch_size:
            raise ValueError(f"routing key index must be in [0, batch_size={self.batch_size}), got {self.index}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one turn is sampled (SPEC section 5: temperature 1.0 in RL; section 7: 0.6 at evaluation).

    temperature 0 means greedy. `seed` makes a request's sampling reproducible on engines that support it.
    `routing_key` (optional) names the trajectory the turn belongs to; only a balancer reads it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    routing_key: RoutingKey | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclasses.dataclass(frozen=True)
class Generation:
    """One generated turn: sampled ids (a sampled stop token included), each one's log-prob, and why it ended.

    The log-probs are of the distribution the token was sampled from at temperature 1 over the full vocabulary
    (the policy's log-prob; what the GRPO ratio needs), regardless of the sampling temperature and top_p.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")


@dataclasses.dataclass(frozen=True)
class EngineCapacity:
    """What the KV-aware balancer routes by (SPEC section 6): KV-cache tokens and request queues.

    `max_sequences` is set by engines that run a fixed number of sequences at once whatever their length (the JAX
    engine's slots); None where only KV tokens limit (vLLM's paged cache). `block_size`: the cache hands a sequence
    whole blocks of this many tokens (vLLM's --block-size: 128 on its CPU backend), so n tokens hold
    ceil(n / block_size) blocks; 1 for a cache that holds exactly what it is given. `shares_prefixes`: running
    sequences that begin with the same full blocks hold them once (vLLM's prefix caching).
    """

    kv_tokens_total: int
    kv_tokens_used: int
    requests_running: int
    requests_waiting: int
    max_sequences: int | None = None
    block_size: int = 1
    shares_prefixes: bool = False

    @property
    def kv_tokens_free(self) -> int:
        """KV-cache tokens not in use."""
        return max(0, self.kv_tokens_total - self.kv_tokens_used)

    def __add__(self, other: EngineCapacity) -> EngineCapacity:
        """Two engines' capacities as one fleet's (SPEC section 6): counts add; `max_sequences` only when both
        have one; the larger block size; prefixes shared only when both share them."""
        both = None if self.max_sequences is None or other.max_sequences is None \
            else self.max_sequences + other.max_sequences
        return EngineCapacity(self.kv_tokens_total + other.kv_tokens_total, self.kv_tokens_used + other.kv_tokens_used,
                              self.requests_running + other.requests_running,
                              self.requests_waiting + other.requests_waiting, both,
                              max(self.block_size, other.block_size), self.shares_prefixes and other.shares_prefixes)


class EngineUnavailable(RuntimeError):
    """The engine cannot serve (dead server, shut down); a caller may retry the request on another engine."""


@runtime_checkable
class GenerationEngine(Protocol):
    """Generates assistant turns from token ids; reports capacity; takes new weights between requests."""

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> Generation:
        """Sample one turn continuing `prompt_ids`; raises EngineUnavailable when the engine cannot serve."""
        ...

    async def capacity(self) -> EngineCapacity:
        """Current KV-cache and queue state."""
        ...

    async def update_weights(self, params: Any, version: int) -> None:
        """Serve `params` (the learner's parameter tree for this engine's ModelConfig) from now on.

        Requests in flight finish on either the old or the new weights, never a mix within one forward pass.
        """
        ...
