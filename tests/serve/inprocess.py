"""The router's orchestration against real engines wired in-process (no Ray, no Flight).

`InProcessBackends` holds real `Engine`s behind the async methods the orchestrator calls; KV moves as
`KVBlocks` objects and the WAN is an asyncio delay. This isolates the handoff logic: every pipeline and
handoff mode must give exactly one engine's greedy output, with no token lost or repeated. Used by
tests/serve/test_orchestrator*.py and tests/engine/test_context.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from pdd_serve.config import load_config
from pdd_serve.engine.engine import Engine
from pdd_serve.engine.kv import blocks_needed, concat_blocks
from pdd_serve.engine.sampling import SamplingParams
from pdd_serve.engine.worker import EngineWorker
from pdd_serve.policy import LinkEstimate
from pdd_serve.serve.common import take_over
from pdd_serve.serve.messages import GenRequest, KVReady, MDPrepareReply, MDView, PrefillResult, TokenChunk
from pdd_serve.serve.orchestrator import Orchestrator
from pdd_serve.serve.request_state import RequestState


class InProcessBackends:
    """The backends the orchestrator calls (Prefill, the relay, the MDs), as real engines in this
    process: KV moves as `KVBlocks` objects, the WAN is an asyncio delay, and the attributes below
    inject faults."""

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


def orchestrator(backends: InProcessBackends, **policy) -> Orchestrator:
    """A router's orchestrator over `backends`, with these policy settings and a 100 kB/s line."""
    cfg = load_config({"policy": policy})
    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, **policy))
    return Orchestrator(cfg, backends, backends.p.layout.block_bytes, LinkEstimate(1e5, 0.01))


async def streams_released(b, timeout_s: float = 10.0) -> None:
    """Wait until every decode stream the orchestrator cut has released its sequence."""
    deadline = time.monotonic() + timeout_s
    while getattr(b, "open_streams", 0) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert not getattr(b, "open_streams", 0), f"{b.open_streams} decode streams never released"


async def run_request(orch: Orchestrator, prompt: list[int], n: int, forced=None, rid="r",
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
    await streams_released(orch.b)
    assert out == st.committed
    return out, st


def full_md_prepare(b: InProcessBackends, full: set[int]) -> None:
    """The MDs in `full` refuse every prepare: their KV pool is full."""
    from pdd_serve.engine.kv import PoolFullError

    real = b.md_prepare

    async def prepare(i, req, planned_start):
        if i in full:
            raise PoolFullError(f"MD {i}: the KV pool is full")
        return await real(i, req, planned_start)

    b.md_prepare = prepare
