"""The router's orchestration against real engines wired in-process (no Ray, no Flight): the
pipelines, the policy that picks one, the router's view of the MDs, and what the router does not
keep to itself (scale-out). The backends are tests/serve/inprocess.py's; every pipeline and handoff
mode must give exactly one engine's greedy output, with no token lost or repeated. The fault paths
are in test_orchestrator_faults.py.
"""

from __future__ import annotations

import asyncio
import functools
import time

import pytest

from pdd_serve.config import PolicyConfig
from pdd_serve.engine.engine import Engine
from pdd_serve.engine.kv import block_hashes
from pdd_serve.engine.sampling import SamplingParams
from pdd_serve.engine.worker import EngineWorker
from pdd_serve.policy import LinkEstimate, wan_backlog
from pdd_serve.serve.messages import GenRequest
from pdd_serve.serve.request_state import RequestState
from tests.helpers import make_prompt
from tests.serve.inprocess import InProcessBackends, orchestrator, run_request

# ---------------------------------------------------------------- pipelines and the policy


@pytest.mark.parametrize("forced, expect_mode", [
    ({"pipeline": "P-MD"}, "none"),
    ({"pipeline": "P-RLD"}, "none"),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"}, "one-shot"),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, "catch-up"),
])
def test_every_pipeline_equals_single_engine_greedy(model_dir, forced, expect_mode):
    b = InProcessBackends(model_dir, wan_delay_s=0.3, relay_step_s=0.02)
    orch = orchestrator(b, handoff_batch_tokens=1)
    prompt = make_prompt(90, 21)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 60)
    out, st = asyncio.run(run_request(orch, prompt, 60, forced))
    assert out == ref
    assert st.info.pipeline == forced["pipeline"] and st.info.handoff_mode == expect_mode
    if forced["pipeline"] == "P-RLD-MD":
        assert st.info.eager_tokens > 0 and st.info.md_tokens > 0
        assert st.info.eager_tokens + st.info.md_tokens + 1 == len(ref)
    if expect_mode == "catch-up":
        assert st.info.handoff_batches >= 2  # at least one KV-only batch, then the final extend
        assert [c for c in b.calls if c.startswith("batch")], b.calls
    if expect_mode == "one-shot":
        assert st.info.handoff_batches == 1 and not [c for c in b.calls if c.startswith("batch")]
    # nothing left behind anywhere
    assert all(not d for d in b.md_seqs)
    assert b.r.pool.num_free == b.r.pool.num_blocks


def test_policy_picks_relay_for_low_hit_and_md_for_high_hit(model_dir):
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.2, relay_step_s=0.02)
    orch = orchestrator(b, wan_budget_s=0.5)
    turn1 = make_prompt(200, 5)
    ref1 = Engine.from_pretrained(model_dir).generate(turn1, 20)
    out1, st1 = asyncio.run(run_request(orch, turn1, 20, rid="t1"))
    assert out1 == ref1 and st1.info.pipeline == "P-RLD-MD"  # cold: 200 tokens of KV over a slow link
    turn2 = turn1 + out1 + make_prompt(5, 6)
    ref2 = Engine.from_pretrained(model_dir).generate(turn2, 20)
    out2, st2 = asyncio.run(run_request(orch, turn2, 20, rid="t2"))
    assert out2 == ref2
    assert st2.info.pipeline == "P-MD", st2.info.reason  # MD's DRC holds turn 1: small delta
    assert st2.info.md_replica == st1.info.md_replica  # prefix affinity
    assert st2.info.prefix_hit_md > 0.9
    # the response says where in the line's jitter each request fell (the simulator replays it)
    assert (st1.info.link_t_s, st2.info.link_t_s) == (len(turn1), len(turn2))


def test_link_estimate_shares_the_line_fairly():
    idle = LinkEstimate(1000.0, 0.05)
    assert idle.transfer_s(0) == 0.0 and idle.transfer_s(500) == pytest.approx(0.55)
    # a 5000-byte flow on the line delays a 500-byte one by 500 bytes (fair share), not 5000 (FIFO)
    busy = LinkEstimate(1000.0, 0.05, backlog=(5000, 100))
    assert busy.transfer_s(500) == pytest.approx(0.05 + (500 + 500 + 100) / 1000)
    # the router's view of what is left: each flow drains at its fair share since it started
    assert wan_backlog([(4000, 0.0), (1000, 1.0)], now=2.0, bandwidth_bps=1000.0) == (3000, 500)
    assert wan_backlog([(4000, 0.0), (400, 1.0)], now=2.0, bandwidth_bps=1000.0) == (3000, 0)  # crossed
    assert wan_backlog([(4000, 0.0)], 2.0, float("inf")) == (0,)


def test_request_behind_a_cold_transfer_goes_through_the_relay(model_dir):
    """A high-hit request would go P->MD on an idle line; with a cold transfer still crossing, its
    delta would wait for a share of the line, so RLD masks it: output identical either way."""
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.05, relay_step_s=0.01)
    orch = orchestrator(b, wan_budget_s=0.5)
    turn1 = make_prompt(200, 5)
    out1, _ = asyncio.run(run_request(orch, turn1, 8, rid="t1"))
    turn2 = turn1 + out1 + make_prompt(40, 6)
    ref2 = Engine.from_pretrained(model_dir).generate(turn2, 8)
    # on an idle line the delta (40 new tokens, at most 4 blocks) is within the 0.5 s budget
    assert orch.line().transfer_s(4 * b.p.layout.block_bytes) < 0.5
    orch.wan["cold"] = (10 * 2**20, time.monotonic())  # another request's 10 MB still crossing
    out2, st2 = asyncio.run(run_request(orch, turn2, 8, rid="t2"))
    assert out2 == ref2
    assert st2.info.pipeline == "P-RLD-MD", st2.info.reason
    assert "t2" not in orch.wan  # its own transfer left the ledger when its KV landed
    del orch.wan["cold"]
    out3, st3 = asyncio.run(run_request(orch, turn2, 8, rid="t3"))
    assert out3 == ref2 and st3.info.pipeline == "P-MD", st3.info.reason


def test_relay_that_finishes_first_leaves_md_clean(model_dir):
    b = InProcessBackends(model_dir, wan_delay_s=1.0)
    orch = orchestrator(b)
    prompt = make_prompt(40, 9)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 5)

    async def main():
        out, st = await run_request(orch, prompt, 5, {"pipeline": "P-RLD-MD"})
        await asyncio.gather(*orch.bg, return_exceptions=True)  # MD absorbs the finished request
        return out, st

    out, st = asyncio.run(main())
    assert out == ref and st.info.handoff_mode == "none" and st.info.md_tokens == 0
    assert all(not d for d in b.md_seqs)
    # MD built the output's KV anyway: its DRC now holds the prompt's full blocks
    assert b.mds[0].cache.peek(block_hashes(prompt, 16)) == 2


def test_anomalous_request_goes_p_rld_without_wan(model_dir):
    b = InProcessBackends(model_dir)
    orch = orchestrator(b, anomalous_min_input_tokens=100, anomalous_max_output_tokens=8, anomalous_min_transfer_s=0.1)
    prompt = make_prompt(300, 2)
    out, st = asyncio.run(run_request(orch, prompt, 4))
    assert out == Engine.from_pretrained(model_dir).generate(prompt, 4)
    assert st.info.pipeline == "P-RLD" and st.info.wan_bytes == 0 and st.info.md_replica is None


def test_policy_config_guards():
    with pytest.raises(ValueError, match="pipelines"):
        PolicyConfig(pipelines=("P-RLD",)).__class__(pipelines=())
    hashes = block_hashes(list(range(40)), 16)
    assert len(hashes) == 2


def test_catchup_ends_once_a_round_no_longer_shrinks_the_gap():
    """Across a WAN the gap levels off at what RLD makes in one round trip: the final extend takes it."""
    from pdd_serve.policy import catchup_done

    pol = PolicyConfig(handoff_batch_tokens=8)
    assert catchup_done(8, pol) and not catchup_done(40, pol)
    assert not catchup_done(20, pol, previous_tokens=40)  # still shrinking: another round
    assert catchup_done(12, pol, previous_tokens=12) and catchup_done(13, pol, previous_tokens=12)


# ---------------------------------------------------------------- the router's view of the MDs


def _two_turns(model_dir, b, orch, n=12):
    turn1 = make_prompt(120, 41)
    out1, st1 = asyncio.run(run_request(orch, turn1, n, rid="v1"))
    asyncio.run(orch.refresh_views())
    turn2 = turn1 + out1 + make_prompt(6, 42)
    return st1, turn2, Engine.from_pretrained(model_dir).generate(turn2, n)


def test_view_picks_up_a_turns_prefix_after_md_caches_it(model_dir):
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.05)
    orch = orchestrator(b)
    turn1 = make_prompt(120, 41)
    hashes = block_hashes(turn1, 16)
    asyncio.run(orch.refresh_views())
    assert all(orch.index.status(i, hashes).hit_blocks == 0 for i in range(2))
    _, st1 = asyncio.run(run_request(orch, turn1, 12, {"pipeline": "P-MD"}, rid="v1"))
    md = st1.info.md_replica
    asyncio.run(orch.refresh_views())
    assert orch.index.status(md, hashes).hit_blocks == len(turn1) // 16  # no call to MD was needed
    assert orch.index.status(1 - md, hashes).hit_blocks == 0


def test_a_view_in_whole_cache_units_plans_whole_units():
    """A vLLM MD's cache hits in its 32-token blocks (2 of PDD's): the router's view counts whole
    units only, so Prefill never starts sending inside one (MD would find the hit one block short and
    the router would have P resend it: bytes, a round trip, an index_miss for nothing)."""
    from pdd_serve.serve.md_index import MDIndex
    from pdd_serve.serve.messages import MDView

    chain = block_hashes(make_prompt(130, 112), 16)  # 7 blocks
    idx = MDIndex(max_age_s=10, settle_s=0)
    idx.update(MDView("vllm", "e", 1, tuple(chain[:5]), 0, 8, "loc", hit_unit=2))  # a unit and a half
    idx.update(MDView("torch", "e", 1, tuple(chain[:5]), 0, 8, "loc"))
    assert idx.status("vllm", chain).hit_blocks == 4 and idx.status("vllm", chain).hit_unit == 2
    assert idx.status("torch", chain).hit_blocks == 5


@pytest.mark.parametrize("stale", ["evicted", "restarted"])
def test_stale_view_costs_a_resend_never_a_token(model_dir, stale):
    """The view says MD holds turn 1; MD lost it meanwhile. Prefill already sends from the planned
    block; MD's prepare reply shows the gap and P resends it: output identical, miss counted."""
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.05)
    orch = orchestrator(b, pipelines=("P-MD",))
    st1, turn2, ref2 = _two_turns(model_dir, b, orch)
    assert orch.index.status(0, block_hashes(turn2, 16)).hit_blocks > 0
    if stale == "evicted":
        b.mds[0].cache.clear()
    else:  # a new process: empty DRC, new epoch (the view still holds the old one)
        b.mds[0] = Engine.from_pretrained(model_dir)
        b.mws[0] = EngineWorker(b.mds[0])
        b.epochs[0] += 1

    async def main():
        out, st = await run_request(orch, turn2, 12, rid="v2", fresh_view=False)
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st

    out2, st2 = asyncio.run(main())
    assert out2 == ref2
    assert "index_miss" in st2.info.fallbacks and orch.index_misses == 1
    planned, real = b.prepares[-1][1:]
    assert real == 0 and planned > 0
    assert all(not d for d in b.md_seqs)


def test_stale_view_with_a_relay_may_still_take_it(model_dir):
    """Decide as late as the end of prefill: when MD's real delta is larger than the view said,
    the request still takes the relay if MD's answer is in by then."""
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.3, relay_step_s=0.01)
    orch = orchestrator(b, wan_budget_s=0.5)  # at 100 kB/s: the 2-block delta fits, the whole prompt not
    st1, turn2, ref2 = _two_turns(model_dir, b, orch)
    b.mds[0].cache.clear()
    out2, st2 = asyncio.run(run_request(orch, turn2, 12, rid="v2", fresh_view=False))
    assert out2 == ref2
    assert st2.info.pipeline == "P-RLD-MD" and st2.info.reason.startswith("late"), st2.info.reason


def test_prefill_starts_before_a_slow_prepare_returns(model_dir):
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.05)
    b.prepare_delay_s = 0.6
    orch = orchestrator(b, pipelines=("P-MD",))
    prompt = make_prompt(60, 43)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 10)

    async def main():
        await orch.refresh_views()
        t0 = time.monotonic()
        out, st = await run_request(orch, prompt, 10, fresh_view=False)
        return out, st, t0

    out, st, t0 = asyncio.run(main())
    assert out == ref
    assert b.prefill_starts[0] - t0 < 0.3  # prefill did not wait for MD's 0.6 s prepare
    assert st.info.ttft_s >= 0.6  # MD could not decode before it was registered


def test_an_md_missing_from_the_view_is_asked_first_and_a_dead_one_does_not_age_the_others(model_dir):
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.05)
    orch = orchestrator(b, pipelines=("P-MD",), kv_wait_timeout_s=2.0)
    real_view = b.md_view

    async def md1_dead(i, known):
        if i == 1:
            await asyncio.sleep(10)  # hangs: its poll times out
        return await real_view(i, known)

    b.md_view = md1_dead
    prompt = make_prompt(50, 46)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 8)

    async def main():
        watch = asyncio.ensure_future(orch.watch_views())
        await asyncio.sleep(0.5)
        try:
            assert orch.index.status(0, []).healthy  # MD 0's view stays fresh while MD 1 hangs
            assert orch.index.flight_location(1) is None
            # a request placed on MD 1 (no view of it): MD 1 is asked first, one round trip
            st = RequestState(GenRequest("m1", tuple(prompt), SamplingParams(8)))
            orch.index.entries.pop(0)  # no view of either MD: the first request asks
            out = [t async for toks in orch.run(st) for t in toks]
            return out, st
        finally:
            watch.cancel()

    out, st = asyncio.run(main())
    assert out == ref and st.info.md_replica is not None


# ---------------------------------------------------------------- scale-out: no router-only state


def test_the_pipeline_decision_reads_the_relay_pools_load_not_one_routers_count(model_dir):
    b = InProcessBackends(model_dir)
    orch = orchestrator(b, relay_max_running=2)
    assert orch.relay_load() == 0
    b.relay_load = lambda: 2  # another router's streams fill the pool
    assert orch.relay_load() == 2
    orch.relay_running = 3  # never less than this router's own
    assert orch.relay_load() == 3


def test_the_line_backlog_comes_from_the_senders_reports(model_dir):
    """Two routers share one line: each sees the other's transfers through Prefill's reports, and
    counts its own only until a report that includes them was asked for."""
    from pdd_serve.serve.messages import LineState

    b = InProcessBackends(model_dir)
    orch = orchestrator(b)
    orch.link = LinkEstimate(1e6, 0.01)  # 1 MB/s
    now = time.monotonic()
    orch.wan["mine"] = (400_000, now)  # decided just now: no report can hold it yet
    orch.line_reports["p0"] = (LineState("p0", (800_000,), 8e6), now - 0.01)  # another router's transfer
    backlog = orch.line().backlog
    assert len(backlog) == 2 and sum(backlog) > 1_150_000, backlog
    # a later report (asked for after "mine" was decided) carries it: the router's own entry goes
    orch.line_reports["p0"] = (LineState("p0", (800_000, 400_000), 8e6), now + 0.2)
    backlog = orch.line().backlog
    assert "mine" not in orch.wan and len(backlog) == 2, (orch.wan, backlog)


def test_md_replicas_come_and_go_with_the_live_set(model_dir):
    """Autoscaling: the view follows Serve's live replica set: a removed replica is forgotten (never
    picked again), a new one is polled and picked when it is the better choice."""
    b = InProcessBackends(model_dir, num_md=2)
    orch = orchestrator(b)
    prompt = make_prompt(82, 40)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 8)

    async def main():
        b.live = [0]  # replica 1 not up yet
        out, st = await run_request(orch, prompt, 8, {"pipeline": "P-MD"}, rid="a")
        assert out == ref and st.info.md_replica == 0
        b.live = [1]  # replica 0 scaled down, 1 up
        watch = asyncio.ensure_future(orch.watch_views())
        await asyncio.sleep(0.3)
        assert set(orch.index.entries) == {1}
        out, st = await run_request(orch, prompt, 8, {"pipeline": "P-MD"}, rid="b", fresh_view=False)
        watch.cancel()
        return out, st

    out, st = asyncio.run(main())
    assert out == ref and st.info.md_replica == 1 and not st.info.fallbacks, st.info


# ---------------------------------------------------------------- the prompt's hash chain, computed once


def test_the_prompt_hash_chain_is_computed_once_and_carried(model_dir, monkeypatch):
    """The Router hashes the prompt once; the DRC view, Prefill, the relay and MD take the chain
    from GenRequest (each engine re-hashes only the last block, its O(1) check of what it was
    handed). Before, one request's prompt was hashed ~7 times (and once more per prefill chunk)."""
    from pdd_serve.engine import blocks as blocks_mod
    from pdd_serve.engine import engine as engine_mod

    b = InProcessBackends(model_dir, wan_delay_s=0.05, relay_step_s=0.01)
    orch = orchestrator(b, handoff_batch_tokens=1)
    b.p.prefill = functools.partial(Engine.prefill, b.p, chunk_tokens=32)  # as a Prefill replica chunks
    prompt = make_prompt(200, 5)  # 12 full blocks, prefilled in 7 chunks
    ref = Engine.from_pretrained(model_dir).generate(prompt, 40)
    real, calls = blocks_mod.chain_hash, []

    def counting(parent, block):
        h = real(parent, block)
        calls.append(h)
        return h

    monkeypatch.setattr(blocks_mod, "chain_hash", counting)
    monkeypatch.setattr(engine_mod, "chain_hash", counting)
    chain = tuple(block_hashes(prompt, 16))  # what the Router does on its parser thread
    assert len(calls) == len(chain) == 12

    async def go():
        await orch.refresh_views()
        st = RequestState(GenRequest("h1", tuple(prompt), SamplingParams(40), block_hashes=chain))
        out = [t async for toks in orch.run(st, {"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"})
               for t in toks]
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st

    out, st = asyncio.run(go())
    assert out == ref and st.info.pipeline == "P-RLD-MD"
    per_block = {h: calls.count(h) for h in chain}
    engines = 3  # Prefill, the relay and MD each admitted it once, checking its first and last links
    assert per_block[chain[0]] == per_block[chain[-1]] == 1 + engines, per_block
    assert all(n == 1 for h, n in per_block.items() if h not in (chain[0], chain[-1])), per_block


def test_a_carried_hash_chain_for_another_prompt_is_refused(model_dir):
    e = Engine.from_pretrained(model_dir)
    prompt, other = make_prompt(40, 1), make_prompt(40, 2)
    with pytest.raises(ValueError, match="not this prompt's chain"):
        e.add("x", prompt, SamplingParams(4), block_hashes(other, 16))
    with pytest.raises(ValueError, match="not this prompt's chain"):
        e.add("y", prompt, SamplingParams(4), block_hashes(prompt, 16)[:1])
    head = [prompt[0] + 1] + prompt[1:]  # the same prompt but its first token: its last link matches
    with pytest.raises(ValueError, match="not this prompt's chain"):
        e.add("w", prompt, SamplingParams(4), block_hashes(head, 16))
    seq = e.add("z", prompt, SamplingParams(4), block_hashes(prompt, 16))
    assert e.hash_chain(seq) == block_hashes(prompt, 16)
