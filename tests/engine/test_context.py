"""A decoder never continues a request from KV that is not the request's own context.

The soak of 2026-12-07 (issue 37) sent wrong tokens to three clients, each after an `md_lost`. The
cause was the prefix cache's insert: it evicted to its budget *before* the engine took its
references to the blocks it had just adopted, so a release or a preemption into a full cache whose
other blocks were locked freed blocks a request still held. The next allocation rewrote them under
the running request (wrong tokens, with clear margins), and the pool's refcount assertion then
failed MD's steps (the `md_lost`). These tests reproduce that at the engine, then plant the state it
left (a cached block rewritten by another request) on each takeover path that diverged: the check
in front of every continuing decoder (`check_context`, and the prefix cache's adoption) recomputes
from token ids instead of decoding from it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdd_serve.engine.engine import Engine, Sequence
from pdd_serve.engine.sampling import SamplingParams
from pdd_serve.serve.common import take_over
from tests.helpers import make_prompt
from tests.serve.inprocess import InProcessBackends, full_md_prepare, orchestrator, run_request


def _assert_pool_consistent(eng: Engine, live: list[Sequence] = ()) -> None:
    """Every block's count is exactly its holders (running sequences + the cache); the free list
    is exactly the blocks nobody holds."""
    held = [0] * eng.pool.num_blocks
    for s in live:
        for b in s.block_table:
            held[b] += 1
    for node in (eng.cache.nodes.values() if eng.cache is not None else ()):
        held[node.value] += 1
    assert eng.pool.refcount == held
    assert sorted(eng.pool._free) == [b for b, n in enumerate(held) if n == 0]


def _tight(model_dir, blocks: int, cache_blocks: int) -> Engine:
    probe = Engine.from_pretrained(model_dir)
    bb = probe.layout.block_bytes
    return Engine.from_pretrained(model_dir, kv_cache_bytes=blocks * bb, prefix_cache_bytes=cache_blocks * bb)


def test_a_release_into_a_full_locked_cache_keeps_every_block(model_dir):
    """The cache is at its budget and every block in it is locked by a running request: the blocks
    a finishing request offers stay its own until the cache owns them (before the fix: its insert
    evicted them first and the pool counted them free: `incref of free block`)."""
    eng = _tight(model_dir, 64, 4)
    a = eng.add("a", make_prompt(65, 1), SamplingParams(8))
    eng.prefill(a)  # 4 full blocks: the cache's whole budget, locked by `a`
    b = eng.add("b", make_prompt(40, 2), SamplingParams(8))
    eng.prefill(b)  # over budget, nothing else evictable
    _assert_pool_consistent(eng, [a, b])
    eng.release(b)
    _assert_pool_consistent(eng, [a])
    eng.release(a)
    _assert_pool_consistent(eng)


def test_preemption_and_release_into_a_tight_cache_give_every_request_its_greedy_tokens(model_dir):
    """Many requests sharing a prefix through a pool small enough to preempt and a cache at its
    budget: each request's tokens equal its own single-request generate, nothing leaks."""
    shared = make_prompt(48, 3)
    prompts = [shared + make_prompt(20 + 7 * i, 10 + i) for i in range(5)]
    ref = Engine.from_pretrained(model_dir)
    want = [ref.generate(p, 50) for p in prompts]
    eng = _tight(model_dir, 28, 4)
    assert eng.generate_batch(prompts, SamplingParams(50)) == want
    assert eng.preemptions > 0  # the pool was short: the preemption path ran
    _assert_pool_consistent(eng)


def _rewrite_under_its_name(eng: Engine, hashes: list[int], k: int, seed: int) -> int:
    """What the bug left behind: cached block `k` of a chain, freed under its name and rewritten by
    another request (its KV and its tag now that request's). Returns the pool block."""
    b = eng.cache.nodes[hashes[k]].value
    other = eng.add("other", make_prompt(40, seed), SamplingParams(1))
    eng.prefill(other, use_cache=False)
    src = other.block_table[0]
    eng.pool.data[b] = eng.pool.data[src]
    eng.pool.tags[b] = eng.pool.tags[src]
    eng.release(other, cache=False)
    return b


def test_a_decoder_given_a_wrong_context_refuses_it_and_recomputes(model_dir):
    eng = Engine.from_pretrained(model_dir)
    prompt = make_prompt(70, 4)
    want = eng.generate(prompt, 30, use_cache=False)
    seq = eng.add("s", prompt, SamplingParams(30))
    eng.prefill(seq, use_cache=False)
    assert eng.check_context(seq) == []
    b = seq.block_table[2]
    eng.pool.tags[b] ^= 1  # block 2 now holds some other chain's KV
    assert eng.check_context(seq) == [2]
    tok = take_over(eng, seq, want[1:10], "test", "a planted block")
    assert eng.context_mismatches == 1 and eng.check_context(seq) == []
    out = want[:10] + [tok]
    while not seq.finished:
        out += [t for _, t in eng.step([seq])]
    assert out == want
    eng.release(seq)
    _assert_pool_consistent(eng)


def test_a_cached_prefix_rewritten_under_its_name_is_not_adopted(model_dir):
    eng = Engine.from_pretrained(model_dir)
    prompt = make_prompt(90, 5)
    want = eng.generate(prompt, 20)  # caches the prompt's blocks
    _rewrite_under_its_name(eng, eng.hash_chain(eng.add("h", prompt, SamplingParams(1))), 2, 77)
    assert eng.generate(prompt, 20) == want
    assert eng.context_mismatches == 1
    _assert_pool_consistent(eng)
    assert eng.generate(prompt, 20) == want  # the rewritten block left the cache: no second mismatch
    assert eng.context_mismatches == 1


def test_the_context_check_costs_microseconds_per_block(model_dir):
    """Measured, not asserted as a speed: the check is a list walk over the request's blocks."""
    import time

    eng = Engine.from_pretrained(model_dir)
    seq = eng.add("s", make_prompt(480, 6), SamplingParams(1))
    eng.prefill(seq, use_cache=False)
    t0 = time.perf_counter()
    for _ in range(100):
        assert eng.check_context(seq) == []
    per_call = (time.perf_counter() - t0) / 100
    print(f"check_context: {per_call * 1e6:.1f} us for {len(seq.block_table)} blocks")
    eng.release(seq)


# ---------------------------------------------------------------- the three paths that diverged


def _poisoned(b: InProcessBackends, engine: Engine, prompt: list[int]) -> None:
    """`engine` caches the prompt's prefix, and one of its blocks was rewritten under its name."""
    engine.generate(prompt, 2)
    seq = engine.add("h", prompt, SamplingParams(1))
    _rewrite_under_its_name(engine, engine.hash_chain(seq), 1, 99)


def _md0_first(orch) -> None:
    """The router's view makes MD 0 the first choice (MD 1 looks busy)."""
    orch.index.entries[1].view = dataclasses.replace(orch.index.entries[1].view, running=50)


@pytest.mark.parametrize("path", ["md_lost_after_one_shot", "md_lost_no_handoff_after_relay_full",
                                  "md_lost_md_full_relay_finish"])
def test_each_path_that_diverged_continues_from_its_own_context(model_dir, path):
    from pdd_serve.serve.relay import RelaySaturated

    prompt = make_prompt(100, 60)
    want = Engine.from_pretrained(model_dir).generate(prompt, 48)

    class Backends(InProcessBackends):
        async def relay(self, rreq):
            if path == "md_lost_no_handoff_after_relay_full":
                raise RelaySaturated("relay replica holds 8 requests, its share of policy.relay_max_running (8)")
            async for chunk in super().relay(rreq):
                yield chunk

    b = Backends(model_dir, num_md=2, wan_delay_s=0.15, relay_step_s=0.01)
    b.fail_md_after = {0: 4}  # MD 0 is lost a few tokens after it took the request over
    if path == "md_lost_md_full_relay_finish":
        full_md_prepare(b, {1})  # the other MD is full: the relay finishes from P's prefix cache
        _poisoned(b, b.p, prompt)
    else:  # the request migrates to MD 1, whose DRC holds the rewritten block
        _poisoned(b, b.mds[1], prompt)
    orch = orchestrator(b, kv_wait_timeout_s=3.0, max_migrations=1)

    async def main():
        await orch.refresh_views()
        _md0_first(orch)
        return await run_request(orch, prompt, 48, {"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"},
                          fresh_view=False)

    out, st = asyncio.run(main())
    assert out == want, st.info
    assert "md_lost" in st.info.fallbacks, st.info.fallbacks
    if path == "md_lost_after_one_shot":
        assert st.info.handoff_mode == "one-shot" and st.info.eager_tokens > 0
    if path == "md_lost_no_handoff_after_relay_full":
        assert st.info.fallbacks[0] == "relay_full" and st.info.eager_tokens == 0
    if path == "md_lost_md_full_relay_finish":
        assert st.info.fallbacks[-2:] == ["md_full", "relay_finish"], st.info.fallbacks
    assert sum(e.context_mismatches for e in [b.p, b.r, *b.mds]) == 1
    assert all(not d for d in b.md_seqs)
    for e in [b.p, b.r, *b.mds]:
        _assert_pool_consistent(e)
