"""The balancer's reservations in a paged cache's terms (issue 26 item 2): whole blocks, and prefix blocks that
requests in flight on one engine share counted once, released only when the last of them is over."""

from __future__ import annotations

import asyncio

import pytest

from rstar_jax.rollout.balancer import Balancer
from rstar_jax.rollout.balancing import EngineState, KVAware, Turn
from rstar_jax.rollout.engine import FINISH_STOP, EngineCapacity, Generation, SamplingParams
from rstar_jax.rollout.prefix_blocks import HeldBlocks, block_keys
from rstar_jax.rollout.vllm_metrics import capacity_from_metrics


def test_block_keys_name_whole_prefixes() -> None:
    a = block_keys(range(10), 4)
    assert len(a) == 2  # 10 tokens: two full blocks of 4, the last two tokens hold no key
    assert block_keys(range(8), 4) == a and block_keys([*range(8), 99, 98, 97], 4) == a
    assert block_keys([0, 1, 2, 3, 4, 5, 6, 99], 4)[0] == a[0]
    changed_first = block_keys([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert changed_first[0] != a[0] and changed_first[1] != a[1]  # the same second block after another first
    assert block_keys(range(3), 4) == ()
    with pytest.raises(ValueError, match="block_size"):
        block_keys(range(3), 0)


def test_held_blocks_count_each_block_once_until_its_last_holder_goes() -> None:
    held, keys = HeldBlocks(), block_keys(range(12), 4)
    assert held.shared(keys) == 0
    held.hold(keys)
    held.hold(keys[:2])
    assert len(held) == 3 and held.shared(keys) == 3 and held.shared(block_keys([*range(8), 0, 0, 0, 0], 4)) == 2
    held.release(keys)
    assert len(held) == 2 and held.shared(keys) == 2
    held.release(keys[:2])
    assert len(held) == 0


def test_need_is_whole_blocks_less_the_shared_ones() -> None:
    turn = Turn(prompt_tokens=300, max_new_tokens=64)
    assert EngineState(0, 0, 3072, 3072).need(turn) == 363  # the 64th new token is never stored
    assert EngineState(0, 0, 3072, 3072, block_size=128).need(turn) == 384  # 3 blocks
    assert EngineState(0, 0, 3072, 3072, block_size=128, shared_tokens=256).need(turn) == 128
    assert EngineState(0, 0, 256, 256, block_size=128).need(turn) == 256  # larger than the cache: runs alone


def test_kv_aware_prefers_the_engine_where_the_turn_takes_least_room() -> None:
    turn = Turn(prompt_tokens=300, max_new_tokens=64)
    sharing = EngineState(0, 0, 3072, 1000, block_size=128, shared_tokens=256)  # 872 free after it
    empty = EngineState(1, 0, 3072, 1100, block_size=128)  # 716 free after it
    assert KVAware(affinity=False).choose(turn, [sharing, empty], None) == 0


def test_vllm_metrics_give_the_block_size_and_prefix_caching() -> None:
    text = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0",'
            'kv_cache_size_tokens="3072",num_gpu_blocks="24"} 1.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0"} 0.5\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0"} 2.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 0.0\n')
    capacity = capacity_from_metrics(text)
    assert (capacity.kv_tokens_total, capacity.block_size, capacity.shares_prefixes) == (3072 - 128, 128, True)
    assert not capacity_from_metrics(text.replace('"True"', '"False"')).shares_prefixes


class PagedEngine:
    """Holds requests until released; reports a paged cache of `blocks` x `block_size` that shares prefixes."""

    def __init__(self, blocks: int, block_size: int) -> None:
        self.blocks, self.block_size = blocks, block_size
        self.pending: list[asyncio.Future] = []

    async def generate(self, prompt_ids, sampling: SamplingParams) -> Generation:
        answer = asyncio.get_running_loop().create_future()
        self.pending.append(answer)
        try:
            return await answer
        finally:
            self.pending.remove(answer)

    async def capacity(self) -> EngineCapacity:
        return EngineCapacity(self.blocks * self.block_size, 0, len(self.pending), 0, block_size=self.block_size,
                              shares_prefixes=True)

    def finish_oldest(self) -> None:
        next(answer for answer in self.pending if not answer.done()).set_result(
            Generation((1,), (-1.0,), FINISH_STOP))


def test_requests_of_one_prompt_reserve_its_blocks_once() -> None:
    """Three samples of a 10-token prompt (two full blocks of 4) asking for 4 new tokens: the first reserves
    ceil(14 / 4) = 4 blocks, each other 2 (its partial block and new tokens); the shared blocks stay reserved until
    the last sample holding them is over."""

    async def scenario() -> None:
        engine = PagedEngine(blocks=8, block_size=4)
        balancer = Balancer([engine], policy="kv_aware", part_tokens=None, scrape_interval_s=0.0)
        prompt = list(range(10))
        calls = [asyncio.create_task(balancer.generate(prompt, SamplingParams(max_new_tokens=4)))
                 for _ in range(3)]
        await asyncio.sleep(0.05)
        assert balancer.reserved == (4 * 4 + 2 * 2 * 4,) and len(engine.pending) == 3 and balancer.queued == 0
        other = asyncio.create_task(balancer.generate(list(range(100, 110)), SamplingParams(max_new_tokens=4)))
        await asyncio.sleep(0.05)
        assert balancer.queued == 1  # 8 blocks less 8 reserved: no room for 4 blocks of another prompt
        engine.finish_oldest()
        await asyncio.sleep(0.05)
        assert balancer.reserved == (6 * 4,) and balancer.queued == 1  # the shared blocks are still held
        engine.finish_oldest()
        engine.finish_oldest()
        await asyncio.gather(*calls)
        await asyncio.sleep(0.05)
        assert balancer.reserved == (4 * 4,) and balancer.queued == 0  # the other prompt got its 4 blocks
        engine.finish_oldest()
        await other
        assert balancer.reserved == (0,)

    asyncio.run(scenario())
