"""Routing policies of the rollout balancer (SPEC section 6): which live engine takes a turn, or none yet.

Pure functions of what the balancer knows when it routes: the turn (the KV tokens it may hold and its trajectory)
and each live engine's state (requests in flight, KV tokens free after the balancer's reservations). A policy that
returns None holds the turn back; the balancer queues it until capacity frees. Only the KV-aware policies do.

  kv_aware              among the engines that can hold the turn's prompt plus its max new tokens without
                        overflowing (in whole blocks, prefix blocks that requests in flight there already hold
                        counted once), the one with the most free KV tokens after it; but the engine that served the
                        trajectory's previous request (its prefix cache holds the context) while its load is within
                        `affinity_margin` of that one's, and whenever it fits for the next part of a turn
                        generated in parts; none fits: wait
  kv_aware_no_affinity  the same without the preference for the previous engine
  least_requests        the fewest requests in flight (what common routers do); never waits
  round_robin           the live engines in turn; never waits
  static_split          the batch split evenly up front (the scheme SPEC section 6 improves on): the trajectory at
                        index i of a batch of B goes to engine i * N // B of the N engines for every turn (the next
                        live one while that is down); never waits
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from rstar_jax.rollout.engine import RoutingKey, SamplingParams
from rstar_jax.rollout.prefix_blocks import block_keys
from rstar_jax.rollout.router import EngineLoad, least_in_flight
from rstar_jax.rollout.turn_parts import ContinuedIds

POLICIES = ("kv_aware", "kv_aware_no_affinity", "least_requests", "round_robin", "static_split")


@dataclasses.dataclass(frozen=True)
class Turn:
    """What routing sees of one request: its prompt length, the most tokens it may add, its trajectory, and whether
    it continues a turn generated in parts (`turn_parts`)."""

    prompt_tokens: int
    max_new_tokens: int
    key: RoutingKey | None = None
    continuing: bool = False
    prompt_ids: Sequence[int] = dataclasses.field(default=(), compare=False, repr=False)
    _keys: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, prompt_ids: Sequence[int], sampling: SamplingParams) -> Turn:
        """The request a `generate(prompt_ids, sampling)` call makes."""
        continuing = isinstance(prompt_ids, ContinuedIds) and prompt_ids.continues
        return cls(len(prompt_ids), sampling.max_new_tokens, sampling.routing_key, continuing, prompt_ids)

    def block_keys(self, block_size: int) -> tuple[int, ...]:
        """The keys of the prompt's full blocks of `block_size` tokens (`prefix_blocks.block_keys`; computed once
        per block size, however often the turn is routed while it waits)."""
        if block_size not in self._keys:
            self._keys[block_size] = block_keys(self.prompt_ids, block_size)
        return self._keys[block_size]

    @property
    def kv_tokens(self) -> int:
        """KV tokens the turn holds at most: what the balancer reserves for it. The prompt and every new token but
        the last, which is sampled from the step before and never fed back (a part that runs one token into a
        block, `turn_parts`, holds no token of that block)."""
        return self.prompt_tokens + self.max_new_tokens - 1


@dataclasses.dataclass(frozen=True)
class EngineState(EngineLoad):
    """One live engine as a policy sees it: requests in flight and KV tokens free after what is reserved there.

    `max_sequences`: sequences the engine runs at once whatever their length (the JAX engine's slots), or None;
    `block_size`: the tokens of one block of its cache (a sequence holds whole blocks); `shared_tokens`: tokens of
    the turn being routed that requests in flight there already hold (its leading prefix blocks, `prefix_blocks`).
    """

    kv_tokens_total: int
    kv_tokens_free: int
    max_sequences: int | None = None
    block_size: int = 1
    shared_tokens: int = 0

    def need(self, turn: Turn) -> int:
        """KV tokens `turn` would add here: its own rounded up to whole blocks (what a paged cache hands it;
        vLLM's CPU blocks are 128 tokens, so a turn of 300 holds 384) less the blocks it shares with requests in
        flight, or the whole cache if that is less (it then runs alone)."""
        blocks = -(-turn.kv_tokens // self.block_size)
        return min(blocks * self.block_size - self.shared_tokens, self.kv_tokens_total)

    def fits(self, turn: Turn) -> bool:
        """Whether the engine can take `turn` now without overflowing its KV cache or its sequences."""
        if self.max_sequences is not None and self.in_flight >= self.max_sequences:
            return False
        return self.need(turn) <= self.kv_tokens_free

    @property
    def load(self) -> float:
        """Share of the KV cache that is reserved or in use (1.0 for an engine that reports no cache)."""
        return 1.0 - self.kv_tokens_free / self.kv_tokens_total if self.kv_tokens_total > 0 else 1.0


class BalancingPolicy(Protocol):
    """Picks the engine for a turn among the live ones, or None to hold it back (SPEC section 6).

    `reserves_kv`: whether the policy routes by the balancer's KV reservations (then the balancer keeps them
    tight by generating long turns in parts); `affinity`: whether it keeps a trajectory on its previous engine
    (then, when an engine frees room, the balancer first admits a queued turn whose context that engine holds).
    """

    reserves_kv: bool
    affinity: bool

    def choose(self, turn: Turn, engines: Sequence[EngineState], previous: EngineState | None) -> int | None:
        """The index of the chosen engine among `engines` (the live ones); `previous` is the one among them that
        served the trajectory's last request, if any."""
        ...


class KVAware:
    """The most free KV tokens among engines the turn fits; the previous engine within `affinity_margin` of load."""

    reserves_kv = True

    def __init__(self, affinity: bool = True, affinity_margin: float = 0.25) -> None:
        if not 0 <= affinity_margin <= 1:
            raise ValueError(f"affinity_margin must be in [0, 1], got {affinity_margin}")
        self.affinity, self.affinity_margin = affinity, affinity_margin

    def choose(self, turn: Turn, engines: Sequence[EngineState], previous: EngineState | None) -> int | None:
        """See the module docstring (`kv_aware`)."""
        sticky = previous if self.affinity and previous is not None and previous.fits(turn) else None
        if sticky is not None and turn.continuing:
            return sticky.index
        best: EngineState | None = None
        for engine in engines:  # the most free KV once the turn is placed (a shared prompt takes less)
            if (best is None or engine.kv_tokens_free - engine.need(turn) > best.kv_tokens_free - best.need(turn)) \
                    and engine.fits(turn):
                best = engine
        if best is None:
            return None
        if sticky is not None and sticky.load <= best.load + self.affinity_margin:
            return sticky.index
        return best.index


class LeastRequests:
    """The engine with the fewest requests in flight (`router.least_in_flight`)."""

    reserves_kv = False
    affinity = False

    def choose(self, turn: Turn, engines: Sequence[EngineState], previous: EngineState | None) -> int:
        """See the module docstring (`least_requests`)."""
        return least_in_flight(engines)


class RoundRobin:
    """The live engines in turn."""

    reserves_kv = False
    affinity = False

    def __init__(self) -> None:
        self._count = 0

    def choose(self, turn: Turn, engines: Sequence[EngineState], previous: EngineState | None) -> int:
        """See the module docstring (`round_robin`)."""
        chosen = engines[self._count % len(engines)].index
        self._count += 1
        return chosen


class StaticSplit:
    """Engine i * N // B for the trajectory at index i of a batch of B (turns without a key: round robin)."""

    reserves_kv = False
    affinity = False

    def __init__(self, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"num_engines must be >= 1, got {num_engines}")
        self.num_engines = num_engines
        self._keyless = RoundRobin()

    def choose(self, turn: Turn, engines: Sequence[EngineState], previous: EngineState | None) -> int:
        """See the module docstring (`static_split`)."""
        if turn.key is None:
            return self._keyless.choose(turn, engines, previous)
        home = turn.key.index * self.num_engines // turn.key.batch_size
        return min((engine.index for engine in engines), key=lambda index: (index - home) % self.num_engines)


def make_policy(name: str, num_engines: int, affinity_margin: float = 0.25) -> BalancingPolicy:
    """The policy called `name` (one of POLICIES) for a balancer over `num_engines` engines."""
    if name == "kv_aware":
        return KVAware(affinity=True, affinity_margin=affinity_margin)
    if name == "kv_aware_no_affinity":
        return KVAware(affinity=False)
    if name == "least_requests":
        return LeastRequests()
    if name == "round_robin":
        return RoundRobin()
    if name == "static_split":
        return StaticSplit(num_engines)
    raise ValueError(f"unknown balancing policy {name!r}; choose one of {POLICIES}")
