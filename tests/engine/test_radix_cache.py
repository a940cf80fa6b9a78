"""Radix prefix cache invariants (pure logic, no model)."""

from __future__ import annotations

import random

from pdd_serve.engine.kv import BlockPool, KVLayout, block_hashes
from pdd_serve.engine.radix_cache import RadixCache

BS = 4


def _cache(capacity_blocks: int, evicted: list[int] | None = None) -> RadixCache:
    return RadixCache(BS, block_bytes=100, capacity_bytes=capacity_blocks * 100,
                      on_evict=(evicted.append if evicted is not None else None))


def test_match_insert_and_hit_rate():
    c = _cache(100)
    toks = list(range(17))
    hs = block_hashes(toks, BS)
    assert len(hs) == 4
    assert c.match(toks).num_tokens == 0
    assert c.insert(hs, [10, 11, 12, 13]) == [True] * 4
    m = c.match(toks[:10] + [999] * 7)
    assert m.num_tokens == 8 and m.values == [10, 11]
    assert c.insert(hs[:2], [50, 51]) == [False, False]  # already cached: caller keeps its blocks
    assert c.stats.hit_tokens == 8 and c.stats.query_tokens == 34
    assert c.peek(hs) == 4


def test_eviction_is_lru_over_unlocked_leaves_and_respects_budget():
    evicted: list[int] = []
    c = _cache(6, evicted)
    a = block_hashes(list(range(16)), BS)  # 4 blocks
    b = block_hashes(list(range(100, 108)), BS)  # 2 blocks
    c.insert(a, [0, 1, 2, 3])
    c.insert(b, [4, 5])
    c.lock(a)
    c.match(list(range(100, 108)))  # b is recently used but unlocked
    d = block_hashes(list(range(200, 208)), BS)
    c.insert(d, [6, 7])
    assert c.used_bytes <= 600
    assert set(evicted) <= {4, 5, 6, 7}, "a locked block was evicted"
    assert all(h in c.nodes for h in a)
    c.unlock(a)
    c.evict(10_000)
    assert c.num_blocks == 0 and sorted(evicted) == list(range(8))


def test_children_are_evicted_before_parents():
    evicted: list[int] = []
    c = _cache(100, evicted)
    hs = block_hashes(list(range(12)), BS)
    c.insert(hs, [0, 1, 2])
    c.evict(100)
    assert evicted == [2]
    assert c.match(list(range(12))).num_tokens == 8


def test_random_workload_keeps_refcounts_and_budget():
    """Pool refcounts return to zero and the budget always holds under a random mix."""
    rng = random.Random(0)
    pool = BlockPool(KVLayout(1, 1, 2, BS), 64)
    c = RadixCache(BS, pool.layout.block_bytes, 20 * pool.layout.block_bytes, on_evict=lambda b: pool.decref([b]))
    live: list[tuple[list[int], list[int], list[int]]] = []  # (blocks, locked hashes, hashes)
    for _ in range(400):
        if live and rng.random() < 0.45:
            blocks, locked, hashes = live.pop(rng.randrange(len(live)))
            adopted = c.insert(hashes, blocks)
            pool.incref([b for b, a in zip(blocks, adopted) if a])
            c.unlock(locked)
            pool.decref(blocks)
            continue
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 6) * BS)]
        hs = block_hashes(toks, BS)
        m = c.match(toks)
        pool.incref(m.values)
        c.lock(m.hashes)
        if pool.num_free < len(hs) - len(m.hashes):
            c.evict((len(hs) - len(m.hashes)) * pool.layout.block_bytes)
        if pool.num_free < len(hs) - len(m.hashes):
            c.unlock(m.hashes)
            pool.decref(m.values)
            continue
        blocks = m.values + pool.allocate(len(hs) - len(m.hashes))
        live.append((blocks, m.hashes, hs))
        assert c.used_bytes <= c.capacity_bytes
        for n in c.nodes.values():
            assert pool.refcount[n.value] >= 1
    for blocks, locked, _ in live:
        c.unlock(locked)
        pool.decref(blocks)
    assert all(n.lock == 0 for n in c.nodes.values())
    c.clear()
    assert pool.num_free == pool.num_blocks and all(r == 0 for r in pool.refcount)


def test_insert_never_evicts_the_chain_it_just_took():
    """The caller takes its references to adopted values after insert returns: evicting one first
    would hand on_evict a value the cache never owned (issue 37: a running request's block freed)."""
    evicted: list[int] = []
    c = _cache(4, evicted)
    a = block_hashes(list(range(16)), BS)
    c.insert(a, [0, 1, 2, 3])
    c.lock(a)  # the whole budget locked by a running request
    b = block_hashes(list(range(100, 108)), BS)
    assert c.insert(b, [4, 5]) == [True, True]
    assert evicted == [] and all(h in c.nodes for h in b)  # over budget until b is evictable
    c.unlock(a)
    c.evict_to_budget()
    assert c.used_bytes <= c.capacity_bytes and len(evicted) == 2


def test_discard_drops_a_block_and_everything_under_it_unless_locked():
    evicted: list[int] = []
    c = _cache(100, evicted)
    hs = block_hashes(list(range(16)), BS)
    c.insert(hs, [0, 1, 2, 3])
    c.lock(hs[:3])
    assert c.discard(hs[1]) == 0 and c.num_blocks == 4  # in use: left for now
    c.unlock(hs[:3])
    assert c.discard(hs[1]) == 3 and sorted(evicted) == [1, 2, 3]
    assert c.match(list(range(16))).num_tokens == BS and c.discard(hs[1]) == 0
