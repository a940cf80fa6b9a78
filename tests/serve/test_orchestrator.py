"""The router's orchestration against real engines wired in-process (no Ray, no Flight).

The backends here are real `Engine`s behind async methods; KV moves as `KVBlocks` objects and the
WAN is an asyncio delay. This isolates the handoff logic: every pipeline and handoff mode must
give exactly one engine's greedy output, with no token lost or repeated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time

import pytest

from pdd_serve.config import PolicyConfig, load_config
from pdd_serve.engine.engine import Engine
from pdd_serve.engine.kv import block_hashes, blocks_needed, concat_blocks
from pdd_serve.engine.sampling import SamplingParams
from pdd_serve.engine.worker import EngineWorker
from pdd_serve.policy import LinkEstimate, wan_backlog
from pdd_serve.serve.common import take_over
from pdd_serve.serve.messages import GenRequest, KVReady, MDPrepareReply, MDView, PrefillResult, TokenChunk
from pdd_serve.serve.orchestrator import Orchestrator
from pdd_serve.serve.request_state import RequestState
from tests.engine.test_engine import _prompt


class InProcessBackends:
    def __init__(self, model_dir, num_md: int = 2, wan_delay_s: float = 0.0, relay_step_s: float = 0.0) -> None:
        self.p = Engine.from_pretrained(model_dir)
        self.r = Engine.from_pretrained(model_dir, enable_prefix_cache=False)
        self.mds = [Engine.from_pretrained(model_dir) for _ in range(num_md)]
        self.pw, self.rw = EngineWorker(self.p), EngineWorker(self.r)
        self.mws = [EngineWorker(e) for e in self.mds]
        self.live: list[int] | None = list(range(num_md))  # as Serve's request router knows them
        self.wan_delay_s = wan_delay_s
        self.relay_step_s = relay_step_s
        self.md_seqs: list[dict] = [{} for _ in range(num_md)]
        self.expect: dict[str, tuple[int, int]] = {}  # request -> MD's [start, end) blocks to receive
        self.kv_runs: dict[str, list] = {}  # request -> KV runs landed at MD (any order, overlaps ok)
        self.kv_event: dict[str, asyncio.Event] = {}
        self.epochs = [0] * num_md  # bumped to model an MD restart
        self.prepare_delay_s = 0.0
        self.prepares: list[tuple[int, int | None, int]] = []  # (MD, planned start, real start)
        self.prefill_starts: list[float] = []
        self.calls: list[str] = []
        self.import_locks: dict[str, asyncio.Lock] = {}
        # fault injection (counts of failures still to inject)
        self.fail_md_after: dict[int, int] = {}  # MD index -> die after this many chunks
        self.lose_kv = 0  # transfers that never arrive
        self.abort_kv = 0  # transfers whose sender aborts mid-stream (Flight's `abort` action)
        self.kv_aborted: set[str] = set()
        self.fail_prefill = 0
        self.fail_relay = 0
        self.fail_relay_after = 0  # the relay dies after this many chunks (0: never)
        self.fail_relay_in_catch_up = False  # the relay dies once a catch-up batch went to MD
        self.batch_rtt_s = 0.0
        self.tombstones: dict[str, int] = {}  # aborts that found no registration, by attempt
        self.attempts: dict[str, int] = {}
        # decode streams (MD's and RLD's) not yet released: a stream the orchestrator cut releases
        # in the cancelled read's task, which nothing awaits, so a test waits for this to reach 0
        self.open_streams = 0

    def md_replicas(self):
        return self.live

    def prefill_replicas(self):  # one sender here: the router's own ledger is the whole line
        return None

    async def line_state(self, i):
        raise AssertionError("no Prefill replicas to poll")

    def relay_load(self):
        return None

    def _unpinned(self, i):  # as PinnedRequestRouter: an unpinned call goes to the least loaded
        return min(self.live or range(len(self.mds)), key=lambda j: len(self.md_seqs[j])) if i is None else i

    async def md_view(self, i, known):
        i = self._unpinned(i)
        c = self.mds[i].cache
        return MDView(i, f"e{self.epochs[i]}", c.stats.inserted_blocks + c.stats.evicted_blocks, tuple(c.nodes),
                      len(self.md_seqs[i]), 32, f"inproc://md{i}")

    async def md_prepare(self, i, req: GenRequest, planned_start):
        i = self._unpinned(i)
        await asyncio.sleep(self.prepare_delay_s)
        gone = self.tombstones.get(req.request_id)
        if gone is not None and gone >= req.attempt:  # as MainDecode: an abort overtook this prepare
            del self.tombstones[req.request_id]
            raise RuntimeError(f"{req.request_id} was aborted before its prepare arrived")
        self.attempts[req.request_id] = req.attempt
        old = self.md_seqs[i].pop(req.request_id, None)
        if old is not None:  # a re-delivery: start over
            await self.mws[i].release(old, cache=False)
            self.kv_runs.pop(req.request_id, None)
        self.kv_aborted.discard(req.request_id)  # a new expect: the old transfer's abort is gone
        seq = self.mds[i].add(req.request_id, list(req.prompt_token_ids), req.params, req.block_hashes)
        hit = self.mds[i].match_prefix(seq, planned_start)
        self.md_seqs[i][req.request_id] = seq
        n = blocks_needed(seq.prompt_len, 16)
        self.expect[req.request_id] = (hit // 16, n)
        self.kv_event.setdefault(req.request_id, asyncio.Event()).set()  # re-check what landed
        self.prepares.append((i, planned_start, hit // 16))
        return MDPrepareReply(i, hit, hit // 16, n - hit // 16, f"inproc://md{i}")

    def _landed(self, rid):
        """The runs covering MD's expected blocks, joined; None while a gap remains."""
        start, n = self.expect[rid]
        out, nxt = [], start
        for r in sorted(self.kv_runs.get(rid, []), key=lambda r: r.start_block):
            if r.start_block <= nxt < r.start_block + r.num_blocks:
                out.append(r.slice(nxt - r.start_block, r.num_blocks))
                nxt = r.start_block + r.num_blocks
        return concat_blocks(out) if nxt >= n and out else None

    async def md_wait_kv(self, i, rid, timeout_s):
        deadline = time.monotonic() + timeout_s
        while rid not in self.md_seqs[i]:  # the call overtook its prepare, as on a real line
            if time.monotonic() > deadline:
                raise RuntimeError(f"{rid} is not registered at MD {i}")
            await asyncio.sleep(0.005)
        seq = self.md_seqs[i][rid]
        while seq.num_computed < seq.prompt_len:
            if rid in self.kv_aborted:
                return KVReady(False, error="TransferAborted: the sender aborted the transfer")
            blocks = self._landed(rid)
            if blocks is not None:
                async with self.import_locks.setdefault(rid, asyncio.Lock()):  # like MD's single receive task
                    if seq.num_computed < seq.prompt_len:
                        await self.mws[i].call(self.mds[i].import_kv, seq, blocks)
                break
            ev = self.kv_event.setdefault(rid, asyncio.Event())
            ev.clear()
            try:
                await asyncio.wait_for(ev.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return KVReady(False, error="timeout")
        return KVReady(True, 0, 0.0)

    async def md_handoff_batch(self, i, rid, token_ids, timeout_s):
        self.calls.append(f"batch:{len(token_ids)}")
        await asyncio.sleep(self.batch_rtt_s)  # the round trip to MD
        await self.md_wait_kv(i, rid, timeout_s)
        seq = self.md_seqs[i][rid]
        await self.mws[i].call(self.mds[i].extend, seq, list(token_ids), sample=False)
        return len(seq.output_ids)

    async def md_decode(self, i, rid, committed, timeout_s):
        self.calls.append(f"decode{i}:{len(committed)}")
        ready = await self.md_wait_kv(i, rid, timeout_s)
        if not ready.ok:  # as MD's `_ready`: the router's fault path takes over
            raise TimeoutError(ready.error)
        seq = self.md_seqs[i][rid]
        self.open_streams += 1
        try:  # as MainDecode: the takeover checks the context it holds before it extends
            tok = await self.mws[i].call(take_over, self.mds[i], seq, list(committed[len(seq.output_ids):]),
                                         f"MD {i}", "in-process")
            yield TokenChunk([tok], seq.finish_reason)
            n = 1
            if seq.finish_reason is None:
                async for step in self.mws[i].decode(seq):
                    if self.fail_md_after.get(i) == n:
                        del self.fail_md_after[i]
                        raise RuntimeError(f"MD {i} replica died")
                    n += 1
                    yield TokenChunk(step.token_ids, step.finish_reason)
        finally:
            self.md_seqs[i].pop(rid, None)
            try:
                await self.mws[i].release(seq, cache=seq.finish_reason is not None)
            finally:
                self.open_streams -= 1

    async def md_absorb(self, i, rid, output_ids, timeout_s):
        await self.md_wait_kv(i, rid, timeout_s)
        seq = self.md_seqs[i].pop(rid)
        if len(output_ids) > 1:
            await self.mws[i].call(self.mds[i].extend, seq, list(output_ids[:-1]), sample=False)
        seq.finish_reason = "stop"
        await self.mws[i].release(seq, cache=True)
        return True

    async def md_abort(self, i, rid, attempt=None):
        if rid in self.md_seqs[i] and attempt is not None and self.attempts.get(rid, 0) > attempt:
            return False  # a later re-delivery holds it: a stale abort
        if rid not in self.md_seqs[i] and attempt is not None:  # as MainDecode: refuse a late prepare
            self.tombstones[rid] = max(attempt, self.tombstones.get(rid, -1))
        self.kv_runs.pop(rid, None)
        seq = self.md_seqs[i].pop(rid, None)
        if seq is not None:
            seq.finish_reason = "abort"
            await self.mws[i].release(seq, cache=False)
        return seq is not None

    async def prefill(self, preq):
        if self.fail_prefill:
            self.fail_prefill -= 1
            raise RuntimeError("prefill replica died mid-prefill")
        req = preq.req
        self.prefill_starts.append(time.monotonic())
        seq = self.p.add(req.request_id, list(req.prompt_token_ids), req.params, req.block_hashes)
        first = await self.pw.call(self.p.prefill, seq)
        kv = await self.pw.call(self.p.export_kv, seq)
        finish = seq.finish_reason
        await self.pw.release(seq)
        wan = 0
        if preq.md_target is not None:
            t = preq.md_target
            delta = kv.slice(t.start_block, kv.num_blocks if t.end_block is None else t.end_block)
            wan = delta.nbytes

            async def arrive() -> None:
                await asyncio.sleep(self.wan_delay_s)
                if self.lose_kv:  # the WAN cut mid-transfer: it never completes
                    self.lose_kv -= 1
                    return
                if self.abort_kv:  # prefill failed mid-stream: the sender says so, MD's wait fails now
                    self.abort_kv -= 1
                    self.kv_aborted.add(req.request_id)
                    self.kv_event.setdefault(req.request_id, asyncio.Event()).set()
                    return
                self.kv_runs.setdefault(req.request_id, []).append(delta)
                self.kv_event.setdefault(req.request_id, asyncio.Event()).set()

            asyncio.ensure_future(arrive())
        # link_t_s: where the (here imaginary) line's clock stood, reported as a real Prefill does
        return PrefillResult(first, finish, seq.prefix_hit_tokens, 0.0, wan, kv if preq.to_relay else None,
                             link_t_s=float(len(req.prompt_token_ids)))

    async def relay(self, rreq):
        req = rreq.req
        seq = self.r.add(req.request_id, list(req.prompt_token_ids), req.params, req.block_hashes)
        self.open_streams += 1
        try:
            if self.fail_relay:
                self.fail_relay -= 1
                raise RuntimeError("relay replica died")
            await self.rw.call(self.r.import_kv, seq, rreq.kv_ref)
            if len(rreq.committed) > 1:
                tok = await self.rw.call(take_over, self.r, seq, list(rreq.committed), "relay", "in-process")
                yield TokenChunk([tok], seq.finish_reason)
            else:
                self.r.append_tokens(seq, list(rreq.committed))
            if not seq.finished:
                n = 0
                async for step in self.rw.decode(seq):
                    await asyncio.sleep(self.relay_step_s)
                    n += 1
                    caught_up = self.fail_relay_in_catch_up and any(c.startswith("batch") for c in self.calls)
                    if n == self.fail_relay_after or caught_up:
                        self.fail_relay_after, self.fail_relay_in_catch_up = 0, False
                        raise RuntimeError("relay replica died mid-stream")
                    yield TokenChunk(step.token_ids, step.finish_reason)
        finally:
            try:
                await self.rw.release(seq, cache=False)
            finally:
                self.open_streams -= 1


def _orch(backends, **policy) -> Orchestrator:
    cfg = load_config({"policy": policy})
    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, **policy))
    return Orchestrator(cfg, backends, backends.p.layout.block_bytes, LinkEstimate(1e5, 0.01))


async def _streams_released(b, timeout_s: float = 10.0) -> None:
    """Wait until every decode stream the orchestrator cut has released its sequence."""
    deadline = time.monotonic() + timeout_s
    while getattr(b, "open_streams", 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not getattr(b, "open_streams", 0), f"{b.open_streams} decode streams never released"


async def _run(orch: Orchestrator, prompt: list[int], n: int, forced=None, rid="r",
               fresh_view: bool = True) -> tuple[list[int], RequestState]:
    """One request with the router's background view of the MDs running (current at the start)."""
    if fresh_view:
        await orch.refresh_views()
    watch = asyncio.ensure_future(orch.watch_views())
    st = RequestState(GenRequest(rid, tuple(prompt), SamplingParams(n)))
    out: list[int] = []
    try:
        async for toks in orch.run(st, forced):
            out += toks
    finally:
        watch.cancel()
    await asyncio.gather(*orch.bg, return_exceptions=True)  # cleanups and MD's absorb
    await _streams_released(orch.b)
    assert out == st.committed
    return out, st


@pytest.mark.parametrize("forced, expect_mode", [
    ({"pipeline": "P-MD"}, "none"),
    ({"pipeline": "P-RLD"}, "none"),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"}, "one-shot"),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, "catch-up"),
])
def test_every_pipeline_equals_single_engine_greedy(model_dir, forced, expect_mode):
    b = InProcessBackends(model_dir, wan_delay_s=0.3, relay_step_s=0.02)
    orch = _orch(b, handoff_batch_tokens=1)
    prompt = _prompt(90, 21)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 60)
    out, st = asyncio.run(_run(orch, prompt, 60, forced))
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
    orch = _orch(b, wan_budget_s=0.5)
    turn1 = _prompt(200, 5)
    ref1 = Engine.from_pretrained(model_dir).generate(turn1, 20)
    out1, st1 = asyncio.run(_run(orch, turn1, 20, rid="t1"))
    assert out1 == ref1 and st1.info.pipeline == "P-RLD-MD"  # cold: 200 tokens of KV over a slow link
    turn2 = turn1 + out1 + _prompt(5, 6)
    ref2 = Engine.from_pretrained(model_dir).generate(turn2, 20)
    out2, st2 = asyncio.run(_run(orch, turn2, 20, rid="t2"))
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
    orch = _orch(b, wan_budget_s=0.5)
    turn1 = _prompt(200, 5)
    out1, _ = asyncio.run(_run(orch, turn1, 8, rid="t1"))
    turn2 = turn1 + out1 + _prompt(40, 6)
    ref2 = Engine.from_pretrained(model_dir).generate(turn2, 8)
    # on an idle line the delta (40 new tokens, at most 4 blocks) is within the 0.5 s budget
    assert orch.line().transfer_s(4 * b.p.layout.block_bytes) < 0.5
    orch.wan["cold"] = (10 * 2**20, time.monotonic())  # another request's 10 MB still crossing
    out2, st2 = asyncio.run(_run(orch, turn2, 8, rid="t2"))
    assert out2 == ref2
    assert st2.info.pipeline == "P-RLD-MD", st2.info.reason
    assert "t2" not in orch.wan  # its own transfer left the ledger when its KV landed
    del orch.wan["cold"]
    out3, st3 = asyncio.run(_run(orch, turn2, 8, rid="t3"))
    assert out3 == ref2 and st3.info.pipeline == "P-MD", st3.info.reason


def test_relay_that_finishes_first_leaves_md_clean(model_dir):
    b = InProcessBackends(model_dir, wan_delay_s=1.0)
    orch = _orch(b)
    prompt = _prompt(40, 9)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 5)

    async def main():
        out, st = await _run(orch, prompt, 5, {"pipeline": "P-RLD-MD"})
        await asyncio.gather(*orch.bg, return_exceptions=True)  # MD absorbs the finished request
        return out, st

    out, st = asyncio.run(main())
    assert out == ref and st.info.handoff_mode == "none" and st.info.md_tokens == 0
    assert all(not d for d in b.md_seqs)
    # MD built the output's KV anyway: its DRC now holds the prompt's full blocks
    assert b.mds[0].cache.peek(block_hashes(prompt, 16)) == 2


def test_anomalous_request_goes_p_rld_without_wan(model_dir):
    b = InProcessBackends(model_dir)
    orch = _orch(b, anomalous_min_input_tokens=100, anomalous_max_output_tokens=8, anomalous_min_transfer_s=0.1)
    prompt = _prompt(300, 2)
    out, st = asyncio.run(_run(orch, prompt, 4))
    assert out == Engine.from_pretrained(model_dir).generate(prompt, 4)
    assert st.info.pipeline == "P-RLD" and st.info.wan_bytes == 0 and st.info.md_replica is None


def test_policy_config_guards():
    with pytest.raises(ValueError, match="pipelines"):
        PolicyConfig(pipelines=("P-RLD",)).__class__(pipelines=())
    hashes = block_hashes(list(range(40)), 16)
    assert len(hashes) == 2


FAULTS = {
    "md_dies_mid_stream": dict(fail_md_after={0: 5}),
    "md_dies_twice": dict(fail_md_after={0: 5, 1: 3}),
    "wan_cut_p_md": dict(lose_kv=1),
    "prefill_dies": dict(fail_prefill=1),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_paths_complete_with_identical_output(model_dir, fault):
    """Each fault path: the request completes, token-identical to one engine, nothing repeated."""
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.05, relay_step_s=0.0)
    for k, v in FAULTS[fault].items():
        setattr(b, k, dict(v) if isinstance(v, dict) else v)
    orch = _orch(b, kv_wait_timeout_s=1.0, max_migrations=1)
    prompt = _prompt(70, 33)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 40)

    async def main():
        out, st = await _run(orch, prompt, 40, {"pipeline": "P-MD"})
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st

    out, st = asyncio.run(main())
    assert out == ref, st.info
    assert st.info.fallbacks, "the fault path was not taken"
    assert all(not d for d in b.md_seqs)
    if fault == "md_dies_mid_stream":
        assert st.info.md_replica == 1 and st.info.fallbacks == ["md_lost"]
    if fault == "md_dies_twice":  # both MDs lost: RLD finishes from the committed tokens
        assert "relay_finish" in st.info.fallbacks and st.info.eager_tokens > 0


def test_relay_lost_in_phase_one_hands_request_to_md(model_dir):
    b = InProcessBackends(model_dir, wan_delay_s=0.2)
    b.fail_relay = 1
    orch = _orch(b)
    prompt = _prompt(80, 34)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 30)
    out, st = asyncio.run(_run(orch, prompt, 30, {"pipeline": "P-RLD-MD"}))
    assert out == ref and st.info.fallbacks == ["relay_lost"] and st.info.md_tokens == 29, st.info.fallback


def test_kv_timeout_on_relay_path_lets_relay_finish(model_dir):
    b = InProcessBackends(model_dir, wan_delay_s=0.1, relay_step_s=0.01)
    b.lose_kv = 1
    orch = _orch(b, kv_wait_timeout_s=0.5)
    prompt = _prompt(80, 35)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 80)

    async def main():
        out, st = await _run(orch, prompt, 80, {"pipeline": "P-RLD-MD"})
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st

    out, st = asyncio.run(main())
    assert out == ref and st.info.fallbacks == ["kv_timeout"] and st.info.md_tokens == 0
    assert all(not d for d in b.md_seqs)


# ---------------------------------------------------------------- the router's view of the MDs


def _two_turns(model_dir, b, orch, n=12):
    turn1 = _prompt(120, 41)
    out1, st1 = asyncio.run(_run(orch, turn1, n, rid="v1"))
    asyncio.run(orch.refresh_views())
    turn2 = turn1 + out1 + _prompt(6, 42)
    return st1, turn2, Engine.from_pretrained(model_dir).generate(turn2, n)


def test_view_picks_up_a_turns_prefix_after_md_caches_it(model_dir):
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.05)
    orch = _orch(b)
    turn1 = _prompt(120, 41)
    hashes = block_hashes(turn1, 16)
    asyncio.run(orch.refresh_views())
    assert all(orch.index.status(i, hashes).hit_blocks == 0 for i in range(2))
    _, st1 = asyncio.run(_run(orch, turn1, 12, {"pipeline": "P-MD"}, rid="v1"))
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

    chain = block_hashes(_prompt(130, 112), 16)  # 7 blocks
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
    orch = _orch(b, pipelines=("P-MD",))
    st1, turn2, ref2 = _two_turns(model_dir, b, orch)
    assert orch.index.status(0, block_hashes(turn2, 16)).hit_blocks > 0
    if stale == "evicted":
        b.mds[0].cache.clear()
    else:  # a new process: empty DRC, new epoch (the view still holds the old one)
        b.mds[0] = Engine.from_pretrained(model_dir)
        b.mws[0] = EngineWorker(b.mds[0])
        b.epochs[0] += 1

    async def main():
        out, st = await _run(orch, turn2, 12, rid="v2", fresh_view=False)
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
    orch = _orch(b, wan_budget_s=0.5)  # at 100 kB/s: the 2-block delta fits, the whole prompt not
    st1, turn2, ref2 = _two_turns(model_dir, b, orch)
    b.mds[0].cache.clear()
    out2, st2 = asyncio.run(_run(orch, turn2, 12, rid="v2", fresh_view=False))
    assert out2 == ref2
    assert st2.info.pipeline == "P-RLD-MD" and st2.info.reason.startswith("late"), st2.info.reason


def test_prefill_starts_before_a_slow_prepare_returns(model_dir):
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.05)
    b.prepare_delay_s = 0.6
    orch = _orch(b, pipelines=("P-MD",))
    prompt = _prompt(60, 43)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 10)

    async def main():
        await orch.refresh_views()
        t0 = time.monotonic()
        out, st = await _run(orch, prompt, 10, fresh_view=False)
        return out, st, t0

    out, st, t0 = asyncio.run(main())
    assert out == ref
    assert b.prefill_starts[0] - t0 < 0.3  # prefill did not wait for MD's 0.6 s prepare
    assert st.info.ttft_s >= 0.6  # MD could not decode before it was registered


# ---------------------------------------------------------------- early ends and relay-path faults


@pytest.mark.parametrize("pipeline", ["P-MD", "P-RLD-MD", "P-RLD"])
def test_request_ended_by_the_router_stops_every_decoder(model_dir, pipeline):
    """A stop string (or max_tokens at the router, or the client leaving) ends the stream early:
    MD and RLD stop at once and free their KV; the relay count returns to zero."""
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.05, relay_step_s=0.01)
    orch = _orch(b)
    prompt = _prompt(60, 44)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 200)

    async def main():
        await orch.refresh_views()
        st = RequestState(GenRequest("s1", tuple(prompt), SamplingParams(200)))
        out: list[int] = []
        gen = orch.run(st, {"pipeline": pipeline})
        async for toks in gen:
            out += toks
            if len(out) >= 6:
                st.finish_reason = "stop"  # what the router's detokenizer does on a stop string
                break
        await gen.aclose()
        await asyncio.gather(*orch.bg, return_exceptions=True)
        await asyncio.sleep(0.2)
        return out, st

    out, st = asyncio.run(main())
    assert out == ref[: len(out)]
    assert all(not d for d in b.md_seqs), "MD still decodes a request the client has finished"
    assert b.r.pool.num_free == b.r.pool.num_blocks and orch.relay_running == 0
    assert b.mds[0].pool.num_free + sum(1 for _ in b.mds[0].cache.nodes) == b.mds[0].pool.num_blocks


def test_md_lost_before_the_kv_lands_lets_the_relay_finish(model_dir):
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.3, relay_step_s=0.01)
    orch = _orch(b)
    prompt = _prompt(80, 45)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 40)

    async def dead(i, rid, timeout_s):
        raise RuntimeError("MD replica died")

    b.md_wait_kv = dead

    async def main():
        out, st = await _run(orch, prompt, 40, {"pipeline": "P-RLD-MD"})
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st

    out, st = asyncio.run(main())
    assert out == ref and "kv_timeout" in st.info.fallbacks and st.info.md_tokens == 0
    assert orch.relay_running == 0 and b.r.pool.num_free == b.r.pool.num_blocks


def test_catchup_ends_once_a_round_no_longer_shrinks_the_gap():
    """Across a WAN the gap levels off at what RLD makes in one round trip: the final extend takes it."""
    from pdd_serve.policy import catchup_done

    pol = PolicyConfig(handoff_batch_tokens=8)
    assert catchup_done(8, pol) and not catchup_done(40, pol)
    assert not catchup_done(20, pol, previous_tokens=40)  # still shrinking: another round
    assert catchup_done(12, pol, previous_tokens=12) and catchup_done(13, pol, previous_tokens=12)


def test_an_md_missing_from_the_view_is_asked_first_and_a_dead_one_does_not_age_the_others(model_dir):
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.05)
    orch = _orch(b, pipelines=("P-MD",), kv_wait_timeout_s=2.0)
    real_view = b.md_view

    async def md1_dead(i, known):
        if i == 1:
            await asyncio.sleep(10)  # hangs: its poll times out
        return await real_view(i, known)

    b.md_view = md1_dead
    prompt = _prompt(50, 46)
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



@pytest.mark.parametrize("forced, fault", [
    ({"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, "relay_dies_in_catch_up"),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"}, "relay_dies_before_kv"),
    ({"pipeline": "P-RLD"}, "relay_dies_p_rld"),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"}, "md_dies_after_one_shot"),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, "md_dies_after_catch_up"),
])
def test_relay_path_faults_lose_no_token(model_dir, forced, fault):
    """The relay or MD dies on the relay paths: the request completes from the committed token ids,
    token-identical to one engine, and nothing is left behind."""
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.3, relay_step_s=0.01)
    if fault == "relay_dies_in_catch_up":
        b.fail_relay_in_catch_up, b.batch_rtt_s = True, 0.1
    elif fault in ("relay_dies_before_kv", "relay_dies_p_rld"):
        b.fail_relay_after = 5
    else:
        b.fail_md_after = {0: 3, 1: 3}  # whichever MD holds it dies 3 chunks after the handoff
    orch = _orch(b, handoff_batch_tokens=1, kv_wait_timeout_s=3.0, handoff_token_threshold=4)
    prompt = _prompt(90, 47)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 80)
    out, st = asyncio.run(_run(orch, prompt, 80, forced))
    assert out == ref, st.info
    kind = "relay_lost" if fault.startswith("relay") else "md_lost"
    assert kind in st.info.fallbacks, st.info
    assert all(not d for d in b.md_seqs) and orch.relay_running == 0
    assert b.r.pool.num_free == b.r.pool.num_blocks


@pytest.mark.parametrize("forced, relay_dies", [
    ({"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"}, False),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, False),
    ({"pipeline": "P-RLD"}, True),  # the relay dies: MD takes the request over
])
def test_the_relays_kv_copy_is_freed_when_the_relay_is_cut(model_dir, forced, relay_dies):
    """Item 2: the prompt KV Prefill put in the object store for RLD (here the KVBlocks object the
    in-process Prefill hands over) is dropped once RLD is cut or ends, while MD still decodes."""
    import gc
    import weakref

    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.2, relay_step_s=0.01)
    if relay_dies:
        b.fail_relay_after = 4
    refs: list[weakref.ref] = []
    prefill = b.prefill

    async def tracked(preq):
        res = await prefill(preq)
        if res.kv_ref is not None:
            refs.append(weakref.ref(res.kv_ref))
        return res

    b.prefill = tracked
    orch = _orch(b, handoff_batch_tokens=1, handoff_token_threshold=4)
    prompt = _prompt(120, 48)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 80)

    async def main():
        await orch.refresh_views()
        st = RequestState(GenRequest("kv1", tuple(prompt), SamplingParams(80)))
        out, alive_while_md_decodes = [], []
        async for toks in orch.run(st, forced):
            out += toks
            if st.info.md_tokens >= 20 and not alive_while_md_decodes:  # well after the cut (RLD's
                gc.collect()  # own cleanup may still run at MD's first token), long before the end
                alive_while_md_decodes.append(refs[0]() is not None)
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st, alive_while_md_decodes

    out, st, alive = asyncio.run(main())
    assert out == ref, st.info
    assert refs and alive == [False], f"the relay's KV copy was still held while MD decoded ({st.info})"
    if relay_dies:
        assert "relay_lost" in st.info.fallbacks


# ---------------------------------------------------------------- full pools and bad requests (item 13 leftovers)


def _full_md_prepare(b, full: set[int]):
    from pdd_serve.engine.kv import PoolFullError

    real = b.md_prepare

    async def prepare(i, req, planned_start):
        if i in full:
            raise PoolFullError(f"MD {i}: the KV pool is full")
        return await real(i, req, planned_start)

    b.md_prepare = prepare


def test_a_full_md_is_not_marked_failed_and_the_request_goes_elsewhere(model_dir):
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.05, relay_step_s=0.0)
    _full_md_prepare(b, {0})
    orch = _orch(b, pipelines=("P-MD",), kv_wait_timeout_s=2.0)
    prompt = _prompt(60, 49)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 20)

    async def main():
        await orch.refresh_views()
        orch.index.entries[1].view = dataclasses.replace(orch.index.entries[1].view, running=50)  # pick MD 0
        out, st = await _run(orch, prompt, 20, fresh_view=False)
        return out, st

    out, st = asyncio.run(main())
    assert out == ref, st.info
    assert "md_full" in st.info.fallbacks and st.info.md_replica == 1, st.info
    assert orch.index.failures.get(0, 0) == 0  # busy is not dead: MD 0's view stands
    assert all(not d for d in b.md_seqs)


def test_every_pool_full_is_overloaded_not_a_fault(model_dir):
    """No MD can admit the request and neither can the relay: the orchestrator raises Overloaded
    (the router's 503 + Retry-After) before any token, and leaves nothing behind."""
    from pdd_serve.engine.kv import PoolFullError
    from pdd_serve.serve.request_state import Overloaded, is_overloaded

    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.05)
    _full_md_prepare(b, {0, 1})
    real_relay = b.relay

    async def full_relay(rreq):
        raise PoolFullError("relay: the KV pool is full")
        yield  # an async generator, like the real stream

    b.relay = full_relay
    orch = _orch(b, pipelines=("P-MD", "P-RLD-MD"), kv_wait_timeout_s=2.0)
    prompt = _prompt(60, 50)

    async def main():
        await orch.refresh_views()
        st = RequestState(GenRequest("full", tuple(prompt), SamplingParams(20)))
        out = []
        with pytest.raises(Overloaded) as ei:
            async for toks in orch.run(st, {"pipeline": "P-MD"}):
                out += toks
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st, ei.value

    out, st, err = asyncio.run(main())
    assert out == [] and is_overloaded(err)  # P->MD holds P's first token: the client saw nothing
    assert "md_full" in st.info.fallbacks and orch.index.failures.get(0, 0) == orch.index.failures.get(1, 0) == 0
    assert all(not d for d in b.md_seqs) and orch.relay_running == 0
    b.relay = real_relay


@pytest.mark.parametrize("where", ["md", "relay"])
def test_a_request_error_while_decoding_fails_the_request_and_is_not_migrated(model_dir, where):
    """Non-finite logits (a RequestError) mid-decode: the request's own fault, so it fails (a 400)
    at once; it is not migrated to another MD or handed to the relay as an infrastructure fault."""
    from pdd_serve.engine.sampling import RequestError
    from pdd_serve.serve.request_state import is_request_error

    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.2, relay_step_s=0.01)
    real_decode, real_relay = b.md_decode, b.relay

    async def bad_md(i, rid, committed, timeout_s):
        n = 0
        async for chunk in real_decode(i, rid, committed, timeout_s):
            yield chunk
            n += 1
            if n == 3:
                raise RequestError("non-finite logits (inf/NaN) while sampling")

    async def bad_relay(rreq):
        n = 0
        async for chunk in real_relay(rreq):
            yield chunk
            n += 1
            if n == 3:
                raise RequestError("non-finite logits (inf/NaN) while sampling")

    if where == "md":
        b.md_decode = bad_md
    else:
        b.relay = bad_relay
    orch = _orch(b)
    prompt = _prompt(60, 51)
    forced = {"pipeline": "P-MD"} if where == "md" else {"pipeline": "P-RLD-MD"}

    async def main():
        await orch.refresh_views()
        st = RequestState(GenRequest("bad", tuple(prompt), SamplingParams(40)))
        with pytest.raises(Exception) as ei:
            async for _ in orch.run(st, forced):
                pass
        await asyncio.gather(*orch.bg, return_exceptions=True)
        await asyncio.sleep(0.1)
        return st, ei.value

    st, err = asyncio.run(main())
    assert is_request_error(err), repr(err)
    assert not st.info.fallbacks, st.info.fallbacks  # no migration, no relay takeover
    assert all(not d for d in b.md_seqs) and orch.relay_running == 0
    assert b.r.pool.num_free == b.r.pool.num_blocks


def test_router_maps_full_pools_to_503_and_request_errors_to_400():
    from pdd_serve.engine.kv import PoolFullError
    from pdd_serve.engine.sampling import RequestError
    from pdd_serve.serve.request_state import Overloaded
    from pdd_serve.serve.router import client_error

    class Wrapped(RuntimeError):  # how Ray hands back a replica's exception
        def __init__(self, cause):
            super().__init__("Traceback ... /home/secret/path.py")
            self.cause = cause

    for e in (Overloaded("all full"), Wrapped(PoolFullError("full"))):
        err = client_error(e, "cmpl-1")
        assert err.status == 503 and err.type == "overloaded_error" and int(err.headers()["Retry-After"]) >= 1
    err = client_error(Wrapped(RequestError("non-finite logits")), "cmpl-1")
    assert err.status == 400 and "non-finite" in err.message
    err = client_error(Wrapped(RuntimeError("boom")), "cmpl-1")
    assert err.status == 500 and "secret" not in err.message and "cmpl-1" in err.message


@pytest.mark.parametrize("pipeline", ["P-MD", "P-RLD-MD"])
def test_an_aborted_transfer_takes_the_fallback_at_once(model_dir, pipeline):
    """Item 3: the sender aborts mid-stream (prefill failed): MD's KV wait fails now, so the router
    re-delivers (P->MD) or lets RLD finish (P->RLD->MD) long before the KV wait's timeout."""
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.1, relay_step_s=0.01)
    b.abort_kv = 1
    orch = _orch(b, kv_wait_timeout_s=20.0)
    prompt = _prompt(80, 52)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 40)
    t0 = time.monotonic()
    out, st = asyncio.run(_run(orch, prompt, 40, {"pipeline": pipeline}))
    assert out == ref, st.info
    assert st.info.fallbacks == ["kv_timeout"] and "aborted" in st.info.fallback, st.info
    assert time.monotonic() - t0 < 10  # not the 20 s KV wait
    assert all(not d for d in b.md_seqs) and orch.relay_running == 0



def test_a_single_md_takes_a_request_back_after_its_kv_was_lost(model_dir):
    """One MD (as in pd_cross_dc): the KV is lost, MD drops the request, the router aborts it and
    re-delivers to the same MD. The late abort of the first registration must neither refuse nor
    drop the second (attempts), so MD finishes the request, token-identical."""
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.05)
    b.lose_kv = 1
    orch = _orch(b, pipelines=("P-MD",), kv_wait_timeout_s=1.0)
    prompt = _prompt(70, 48)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 30)
    out, st = asyncio.run(_run(orch, prompt, 30))
    assert out == ref and "kv_timeout" in st.info.fallbacks and st.info.md_tokens > 0, st.info
    assert st.gen.attempt == 1 and "relay_finish" not in st.info.fallbacks
    assert all(not d for d in b.md_seqs)


# ---------------------------------------------------------------- scale-out: no router-only state


def test_a_relay_that_refuses_is_full_not_lost_and_md_serves_the_request(model_dir):
    """The relay pool admits (relay_max_running in total, whichever routers send): a refusal
    keeps the request on MD, counted as relay_full, token-identical."""
    from pdd_serve.serve.relay import RelaySaturated

    class Refusing(InProcessBackends):
        async def relay(self, rreq):
            raise RelaySaturated("relay replica holds 8 requests, its share of policy.relay_max_running (8)")
            yield  # an async generator, like the real stream

    b = Refusing(model_dir, wan_delay_s=0.1)
    orch = _orch(b)
    prompt = _prompt(81, 34)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 20)
    out, st = asyncio.run(_run(orch, prompt, 20, {"pipeline": "P-RLD-MD"}))
    assert out == ref and st.info.fallbacks == ["relay_full"] and st.info.md_tokens == 19, st.info
    assert orch.relay_running == 0


def test_the_pipeline_decision_reads_the_relay_pools_load_not_one_routers_count(model_dir):
    b = InProcessBackends(model_dir)
    orch = _orch(b, relay_max_running=2)
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
    orch = _orch(b)
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
    orch = _orch(b)
    prompt = _prompt(82, 40)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 8)

    async def main():
        b.live = [0]  # replica 1 not up yet
        out, st = await _run(orch, prompt, 8, {"pipeline": "P-MD"}, rid="a")
        assert out == ref and st.info.md_replica == 0
        b.live = [1]  # replica 0 scaled down, 1 up
        watch = asyncio.ensure_future(orch.watch_views())
        await asyncio.sleep(0.3)
        assert set(orch.index.entries) == {1}
        out, st = await _run(orch, prompt, 8, {"pipeline": "P-MD"}, rid="b", fresh_view=False)
        watch.cancel()
        return out, st

    out, st = asyncio.run(main())
    assert out == ref and st.info.md_replica == 1 and not st.info.fallbacks, st.info


def test_the_prompt_hash_chain_is_computed_once_and_carried(model_dir, monkeypatch):
    """The Router hashes the prompt once; the DRC view, Prefill, the relay and MD take the chain
    from GenRequest (each engine re-hashes only the last block, its O(1) check of what it was
    handed). Before, one request's prompt was hashed ~7 times (and once more per prefill chunk)."""
    from pdd_serve.engine import blocks as blocks_mod
    from pdd_serve.engine import engine as engine_mod

    b = InProcessBackends(model_dir, wan_delay_s=0.05, relay_step_s=0.01)
    orch = _orch(b, handoff_batch_tokens=1)
    b.p.prefill = functools.partial(Engine.prefill, b.p, chunk_tokens=32)  # as a Prefill replica chunks
    prompt = _prompt(200, 5)  # 12 full blocks, prefilled in 7 chunks
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
    prompt, other = _prompt(40, 1), _prompt(40, 2)
    with pytest.raises(ValueError, match="not this prompt's chain"):
        e.add("x", prompt, SamplingParams(4), block_hashes(other, 16))
    with pytest.raises(ValueError, match="not this prompt's chain"):
        e.add("y", prompt, SamplingParams(4), block_hashes(prompt, 16)[:1])
    head = [prompt[0] + 1] + prompt[1:]  # the same prompt but its first token: its last link matches
    with pytest.raises(ValueError, match="not this prompt's chain"):
        e.add("w", prompt, SamplingParams(4), block_hashes(head, 16))
    seq = e.add("z", prompt, SamplingParams(4), block_hashes(prompt, 16))
    assert e.hash_chain(seq) == block_hashes(prompt, 16)


# ---------------------------------------------------------------- shedding at the door


@pytest.mark.parametrize("failure", ["busy", "timeout"])
def test_a_prefill_busy_on_every_attempt_is_shed_as_overloaded_not_a_500(model_dir, failure):
    """Under overload Prefill refuses what its queue would not reach within the budget (or a
    prefill ran out of it): after its retries the request is Overloaded, which the Router answers
    with a 503 + Retry-After at the door, not a 500; nothing is held afterwards."""
    from pdd_serve.serve.messages import PrefillBusy
    from pdd_serve.serve.request_state import Overloaded
    from pdd_serve.serve.router import client_error

    class Busy(InProcessBackends):
        calls = 0

        async def prefill(self, preq):
            Busy.calls += 1
            if failure == "busy":
                raise PrefillBusy("this Prefill replica has 9000 prompt tokens queued")
            await asyncio.sleep(10)

    b = Busy(model_dir)
    orch = _orch(b, prefill_retries=1)
    if failure == "timeout":
        orch.timeout = 0.2
    async def main() -> BaseException:
        try:
            await _run(orch, _prompt(90, 40), 8, {"pipeline": "P-MD"})
        except Overloaded as e:
            await asyncio.gather(*orch.bg, return_exceptions=True)  # MD's cleanup of the prepared request
            return e
        raise AssertionError("not shed")

    e = asyncio.run(main())
    assert Busy.calls == 2
    err = client_error(e, "r")
    assert err.status == 503 and err.headers().get("Retry-After"), err.body()
    assert orch.fallbacks.get("prefill_full" if failure == "busy" else "prefill_retry") == 2
    assert all(not d for d in b.md_seqs) and orch.relay_running == 0


def test_a_prefill_that_fails_otherwise_is_still_an_error(model_dir):
    """A Prefill that dies on every attempt is a fault (500 with the request id), not capacity."""
    b = InProcessBackends(model_dir)
    b.fail_prefill = 5
    orch = _orch(b, prefill_retries=1)
    with pytest.raises(RuntimeError, match="prefill failed after 2 attempts"):
        asyncio.run(_run(orch, _prompt(91, 40), 8, {"pipeline": "P-MD"}))
