"""The Router's orchestration of one request through P, RLD and MD (docs/design.md, a request's life).

The router is the source of truth for what the client has seen: `committed` holds every token
yielded so far, and a decoder's token reaches `committed` only when it is yielded. At a handoff
MD gets exactly `committed` (token ids, never KV) and continues from there, so no token is lost
or repeated whichever side produced it.

A request's life (`run`), each step with the call that takes it:

  1. decide, with no round trip: the prompt's block-hash chain (carried from the Router's parse);
     the MD that costs least, the blocks it lacks on the line plus its load, from the router's
     view of every MD's cache (`MDIndex`, `pick_md`); the block MD will receive from (whole cache
     units); the pipeline from the KV MD lacks, the line's backlog and the relay pool's load
     (`choose_pipeline`): P->MD, P->RLD->MD, or P->RLD (anomalous traffic: a long prompt, a short
     answer).
  2. prepare MD, alongside the prefill: `md_prepare` registers the request at MD and says which
     blocks it really lacks (with no view of that MD, it is asked first: `_prepare_now`). The
     transfer enters this router's ledger of the line (`wan`).
  3. prefill at site A: `_prefill` (retried on another replica) computes the prompt's KV and the
     first token; the KV streams to MD over Flight from the planned block, and for the relay
     pipelines a copy goes to the object store for RLD. Where MD's answer shows the view was
     stale, P resends what MD lacks (`_settle_prepare`); with `late_relay`, a P->MD request whose
     real delta turned out large may still take the relay.
  4. decode, token ids only ever moving between decoders:
     - P->MD: MD waits for the KV and streams (`_from_md_recovering`: a lost MD hands the request
       to another, `_redeliver`; with none left, RLD finishes it, `_relay_takeover`);
     - P->RLD: RLD decodes to the end (`_from_relay_recovering`: a lost relay hands it to an MD);
     - P->RLD->MD (`_relay_then_md`): RLD decodes at once while the KV crosses (phase 1); then
       committed tokens go to MD in one shot or in catch-up batches while RLD goes on (phase 2);
       then RLD is cut and MD extends over the rest and goes on (phase 3). RLD lost before the
       cut: MD takes over; the KV late: RLD finishes alone.
  5. end: the finish reason; MD absorbs a request RLD finished, so its cache stays aligned with
     the router's view; an early end (a stop string, the client gone) aborts every decoder at
     once; cleanups run in the background (`bg`), each bounded by the KV wait.

Every fallback is recorded (`info.fallbacks`) and loses no token; a refusal for capacity anywhere
(every pool full, Prefill busy) ends as `Overloaded`, the Router's 503 with Retry-After.

Backends are Serve deployment handles in production; anything with the same async methods
works (the unit tests drive this with in-process fakes: tests/serve/inprocess.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Hashable
from dataclasses import replace
from typing import Any, TypeVar

from pdd_serve.config import PDDConfig
from pdd_serve.emulation.clock import Clock
from pdd_serve.engine.blocks import blocks_needed
from pdd_serve.engine.sampling import RequestError
from pdd_serve.policy import LinkEstimate, catchup_done, choose_pipeline, pick_md, plan_handoff, wan_backlog
from pdd_serve.serve.backends import Backends, MDKey
from pdd_serve.serve.md_index import MDIndex
from pdd_serve.serve.messages import (
    KVReady,
    KVTarget,
    LineState,
    MDPrepareReply,
    PrefillRequest,
    PrefillResult,
    RelayRequest,
    TokenChunk,
)
from pdd_serve.serve.relay_reader import RelayReader
from pdd_serve.serve.request_state import (
    Overloaded,
    RelayLost,
    RequestState,
    is_overloaded,
    is_request_error,
    prompt_hashes,
    relay_fault,
)
from pdd_serve.serve.tasks import follow_replicas, spawn

T = TypeVar("T")
# a prefill call reaches its replica (same site) within this of the decision; one that a retry
# delays past it may be missing from both the router's entries and the report for one period
_REPORT_SLACK_S = 0.05


class Orchestrator:
    def __init__(self, cfg: PDDConfig, backends: Backends, block_bytes: int, link: LinkEstimate) -> None:
        self.cfg = cfg
        self.b = backends
        self.block_bytes = block_bytes
        self.link = link  # bandwidth follows Prefill's live estimate (PrefillResult.link_bps)
        # the line's backlog is known to the side that sends on it: each Prefill replica's report
        # (LineState, when the poll was sent); `wan` holds only this router's own transfers decided
        # since, which no report can include yet (request -> (KV bytes, when))
        self.line_reports: dict[Hashable, tuple[LineState, float]] = {}
        self.wan: dict[str, tuple[int, float]] = {}
        self.relay_running = 0  # relay streams this router holds (its stats; the pool's load decides)
        self.bg: set[asyncio.Task] = set()  # fire-and-forget cleanups, kept referenced
        self.clock = Clock(cfg.time_scale)  # slow motion: real seconds waited, emulated ones reported
        # every cross-site wait, in real seconds: scaled once here (MD takes the Router's value)
        self.timeout = self.clock.real(cfg.policy.kv_wait_timeout_s)
        self.fallbacks: dict[str, int] = {}  # by kind, for metrics and the soak
        self.watchers: dict[MDKey, asyncio.Task] = {}
        self.index_misses = 0  # requests whose MD held less than the router's view said
        period = cfg.policy.drc_view_period_s
        # a view poll crosses the line twice: in slow motion that takes longer in real time
        self.index = MDIndex(max_age_s=max(3.0, 20 * period) + self.clock.real(2 * link.latency_s),
                             settle_s=period + self.clock.real(2 * link.latency_s) + 0.05)

    def _now(self) -> float:
        """The monotonic clock in emulated seconds: what the line's backlog ages on."""
        return self.clock.emulated(time.monotonic())

    def _since(self, t0: float) -> float:
        """Emulated seconds since real monotonic time t0: every duration a response reports."""
        return self.clock.emulated(time.monotonic() - t0)

    # ------------------------------------------------------------ entry point

    async def run(self, st: RequestState, forced: dict[str, str] | None = None) -> AsyncIterator[list[int]]:
        """Yield token-id lists in order; `st` carries committed tokens, finish reason and info."""
        forced = forced or {}
        gen, info, pol = st.gen, st.info, self.cfg.policy
        prompt = list(gen.prompt_token_ids)
        bs = self.cfg.model.block_size
        hashes, nblocks = prompt_hashes(gen, bs), blocks_needed(len(prompt), bs)
        if not self.index.ready:  # only before the first view: one round trip, once per router
            await self.refresh_views()
        statuses = [self.index.status(i, hashes) for i in self.md_replicas()]
        link = self.line()
        md = pick_md(statuses, nblocks, self.block_bytes, link) if statuses else None
        # the router's view stands in for MD's answer: no cross-site round trip before prefill.
        # MD always computes at least one prompt token itself, so it adopts at most this many blocks
        chosen = next((s for s in statuses if s.index == md), None)
        hit, unit = (chosen.hit_blocks, chosen.hit_unit) if chosen is not None else (0, 1)
        planned = min(hit, (len(prompt) - 1) // bs) if pol.drc else 0
        planned -= planned % unit  # MD adopts whole units of its cache (vLLM: 32-token blocks)
        missing = (nblocks - planned) * self.block_bytes
        dec = choose_pipeline(len(prompt) * self.cfg.context_scale, gen.params.max_tokens, missing, link, self.relay_load(), pol,
                              forced.get("pipeline"))
        info.pipeline, info.reason = dec.pipeline, dec.reason
        info.decision_s = self._since(st.t0)
        prepared = False
        prep: asyncio.Future | None = None
        try:
            target = None
            location = self.index.flight_location(md)
            if dec.pipeline != "P-RLD" and location is not None:
                # MD's prepare runs concurrently with prefill; Prefill sends from the planned block
                prep = spawn(self._bounded(self.b.md_prepare(md, gen, planned), "MD prepare"))
                target = KVTarget(location, planned)
            elif dec.pipeline != "P-RLD":  # no view of this MD (yet): ask first, one round trip
                reply = await self._prepare_now(st, md, statuses)
                if reply is None:  # no MD answers: RLD serves it alone, as for anomalous traffic
                    dec = replace(dec, pipeline="P-RLD", reason="no main decode replica answered")
                    info.pipeline, info.reason = dec.pipeline, dec.reason
                else:
                    md, planned = reply.replica, reply.start_block
                    prep = asyncio.get_running_loop().create_future()
                    prep.set_result(reply)  # MD's answer is in: nothing to settle later
                    target = KVTarget(reply.flight_location, planned)
            if target is not None:
                prepared = True
                info.md_replica = md
                self.index.assigned(md)
                self.wan[gen.request_id] = ((nblocks - planned) * self.block_bytes, self._now())
            late = pol.late_relay and "P-RLD-MD" in pol.pipelines and dec.pipeline == "P-MD" and not forced
            pre = await self._prefill(st, PrefillRequest(gen, dec.pipeline != "P-MD" or late, target))
            info.prefill_s = self._since(st.t0) - info.decision_s
            info.prefix_hit_p = pre.prefix_hit_tokens / len(prompt)
            if prep is not None and prep.done() and not prep.exception():
                # decide as late as the end of prefill: a stale view may have hidden a large delta
                real = nblocks - prep.result().start_block
                if late and real > nblocks - planned:
                    self.wan.pop(gen.request_id, None)  # the line without this request's own planned bytes
                    redo = choose_pipeline(len(prompt) * self.cfg.context_scale, gen.params.max_tokens, real * self.block_bytes,
                                           self.line(), self.relay_load(), pol)
                    self.wan[gen.request_id] = (real * self.block_bytes, self._now())
                    if redo.pipeline == "P-RLD-MD":
                        dec = replace(redo, reason=f"late (the view was stale): {redo.reason}")
                        info.pipeline, info.reason = dec.pipeline, dec.reason
            # the relay's copy of the prompt KV (an ObjectRef: holding it pins the object store copy).
            # Only the relay's call keeps it from here, so it is freed when RLD is cut or ends, not
            # when the request does (on P->MD it was not needed after all: freed now)
            kv_ref, pre = pre.kv_ref, replace(pre, kv_ref=None)
            if prep is not None:
                self._background(self._settle_prepare(st, md, prep, target))
            if pre.link_bps:  # Prefill's live view of the line
                self.link = replace(self.link, bandwidth_bps=pre.link_bps / 8)
            info.wan_bytes, info.link_t_s = pre.wan_bytes, pre.link_t_s
            info.relay_kv_bytes += pre.relay_kv_bytes
            st.committed.append(pre.first_token)
            # P->MD streams from MD, as a PD system does: the first token leaves with MD's first
            # chunk, once MD holds the KV (policy.stream_first_token: send P's token at once instead).
            # On the relay pipelines RLD's stream starts at once, so P's first token goes now.
            held = dec.pipeline == "P-MD" and not pol.stream_first_token and pre.finish_reason is None
            if not held:
                info.ttft_s = self._since(st.t0)
                yield [pre.first_token]
            if pre.finish_reason is not None:
                st.finish_reason, st.decoder_done = pre.finish_reason, True
                if prepared:
                    self._background(self.b.md_absorb(md, gen.request_id, st.committed, self.timeout))
                    prepared = False
                return
            if dec.pipeline == "P-MD":
                inner = self._from_md_recovering(st, md)
            elif dec.pipeline == "P-RLD":
                inner = self._from_relay_recovering(st, kv_ref)
            else:
                inner = self._relay_then_md(st, md, kv_ref, forced.get("handoff_mode"))
            kv_ref = None
            # close the inner stream explicitly when the client leaves: its cleanup (cancel RLD,
            # stop MD) must not wait for garbage collection
            async with contextlib.aclosing(inner):
                async for toks in inner:
                    if held:
                        toks, held = [pre.first_token, *toks], False
                        info.ttft_s = self._since(st.t0)
                    yield toks
            prepared = False  # MD released the request itself (decode/absorb ended it)
        finally:
            if not st.decoder_done:  # failed, stopped early or the client left: its transfer is cancelled
                self.wan.pop(gen.request_id, None)
            if prepared and not st.decoder_done:
                self._background(self.b.md_abort(info.md_replica if info.md_replica is not None else md,
                                                 gen.request_id, st.gen.attempt))

    def line(self) -> LinkEstimate:
        """The link estimate with what is on the line: every Prefill replica's last report (the
        senders know what every router sent), plus this router's transfers decided since the
        newest report was asked for, draining at a fair share (a transfer whose KV landed leaves
        at once). Any number of routers sees the same line, up to one view period."""
        now = self._now()
        # a transfer decided before every live sender's last report was asked for is in one of
        # them by now (which Prefill replica took it is Serve's choice); a sender with no report
        # yet keeps them all
        senders = self.b.prefill_replicas() or []
        covered = (min((at for _, at in self.line_reports.values()), default=None)
                   if self.line_reports and all(p in self.line_reports for p in senders) else None)
        if covered is not None:
            # the slack is real time (a same-site call); the stamps are on the emulated clock
            for r in [r for r, (_, t) in self.wan.items() if t < covered - self.clock.emulated(_REPORT_SLACK_S)]:
                del self.wan[r]
        rids = list(self.wan)
        reported = [(b, at) for rep, at in self.line_reports.values() for b in rep.backlog]
        left = wan_backlog(reported + [self.wan[r] for r in rids], now, self.link.bandwidth_bps)
        for r, b in zip(rids, left[len(reported):]):
            if b <= 0:
                del self.wan[r]
        return replace(self.link, backlog=tuple(b for b in left if b > 0))

    def relay_load(self) -> int:
        """The relay pool's running requests, as its replicas report them (all routers' streams),
        and never less than this router's own: the pipeline decision's hint (the pool admits)."""
        return max(self.b.relay_load() or 0, self.relay_running)

    def _kv_landed(self, st: RequestState) -> None:
        if st.info.kv_ready_s is None:
            st.info.kv_ready_s = self._since(st.t0)
        self.wan.pop(st.gen.request_id, None)

    # ------------------------------------------------------------ pipelines

    async def _to_end(self, st: RequestState, it: Any, who: str) -> AsyncIterator[TokenChunk]:
        """Commit and yield a decoder's chunks until its finish; a silent or truncated stream raises
        (the caller's fault path takes over from `committed`)."""
        while True:
            silence = asyncio.timeout(self.timeout)
            try:
                async with silence:
                    chunk = await it.__anext__()
            except StopAsyncIteration:
                raise RuntimeError(f"{who} ended the stream of {st.gen.request_id} without a finish") from None
            except TimeoutError:
                if not silence.expired():  # the decoder's own error (MD's KV wait failed: its reason)
                    raise
                raise TimeoutError(f"{who} sent nothing for {self.timeout:.0f}s") from None
            st.committed.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                st.finish_reason, st.decoder_done = chunk.finish_reason, True
            yield chunk
            if chunk.finish_reason is not None:
                return

    async def _from_md(self, st: RequestState, md: MDKey) -> AsyncIterator[list[int]]:
        """MD takes over from `committed` (it extends over what it lacks) and streams to the end."""
        it = self.b.md_decode(md, st.gen.request_id, list(st.committed), self.timeout).__aiter__()
        try:
            async with contextlib.aclosing(self._to_end(st, it, f"MD {md}")) as chunks:
                async for chunk in chunks:
                    self._kv_landed(st)
                    if chunk.timings and st.info.md_step_s is None:
                        st.info.md_kv_wait_s = chunk.timings.get("md_kv_wait_s")
                        st.info.md_kv_land_s = chunk.timings.get("md_kv_land_s")
                        st.info.md_step_s = chunk.timings.get("md_step_s")
                    st.info.md_tokens += len(chunk.token_ids)
                    yield chunk.token_ids
        finally:
            if not st.decoder_done:  # the client left, a stop string or MD failed: stop MD decoding for nobody
                await self._close(it)

    async def _from_md_recovering(self, st: RequestState, md: MDKey) -> AsyncIterator[list[int]]:
        """`_from_md`, surviving MD loss, a cut or stalled WAN and a restarted Flight server: the
        committed token ids are all that must move, so the request migrates to an MD (KV resent
        from P's prefix cache, then `extend`), or RLD finishes it when no MD can take it."""
        migrations = 0
        while True:
            try:
                async with contextlib.aclosing(self._from_md(st, md)) as stream:
                    async for toks in stream:
                        yield toks
                return
            except Exception as e:  # noqa: BLE001 - any MD-side failure takes the same lever
                if is_request_error(e):  # e.g. non-finite logits: the request fails anywhere (a 400)
                    raise
                kind = "kv_timeout" if isinstance(e, TimeoutError) else "md_lost"
                self._fallback(st, kind, f"MD {md}: {type(e).__name__}: {e}")
                self._background(self.b.md_abort(md, st.gen.request_id, st.gen.attempt))
                migrations += 1
                if migrations > self.cfg.policy.max_migrations:
                    break
                try:
                    md = await self._redeliver(st, avoid=md)
                except Exception as e2:  # noqa: BLE001
                    self._fallback(st, "md_full" if is_overloaded(e2) else "md_unavailable",
                                   f"{type(e2).__name__}: {e2}")
                    if is_overloaded(e2) and not self.cfg.uses_relay:
                        raise Overloaded(f"no main decode replica can admit {st.gen.request_id} now") from e2
                    break
        async with contextlib.aclosing(self._relay_takeover(st)) as stream:
            async for toks in stream:
                yield toks

    async def _from_relay(self, st: RequestState, kv_ref: Any) -> AsyncIterator[list[int]]:
        """RLD streams from the committed tokens to the end (P->RLD, or a takeover)."""
        it = self.b.relay(RelayRequest(st.gen, tuple(st.committed), kv_ref)).__aiter__()
        del kv_ref  # RLD's call holds the object store copy until it ends (item 2)
        self.relay_running += 1
        try:
            async with contextlib.aclosing(self._to_end(st, it, "relay")) as chunks:
                async for chunk in chunks:
                    st.info.eager_tokens += len(chunk.token_ids)
                    yield chunk.token_ids
        finally:
            self.relay_running -= 1
            if not st.decoder_done:
                await self._close(it)

    async def _from_relay_recovering(self, st: RequestState, kv_ref: Any) -> AsyncIterator[list[int]]:
        """P->RLD, surviving the relay's loss: an MD takes the request from the committed token
        ids (P sends it the KV it lacks), as in any migration; the WAN carries it after all."""
        relay = self._from_relay(st, kv_ref)
        del kv_ref  # only the relay stream holds the object store copy: it goes when RLD ends
        try:
            async with contextlib.aclosing(relay) as stream:
                async for toks in stream:
                    yield toks
            return
        except Exception as e:  # noqa: BLE001 - whatever the relay raised, the committed ids survive
            if is_request_error(e):
                raise
            self._fallback(st, relay_fault(e), f"{type(e).__name__}: {e}")
        del relay
        md = await self._redeliver(st, avoid=None)
        async with contextlib.aclosing(self._from_md_recovering(st, md)) as stream:
            async for toks in stream:
                yield toks

    async def _relay_takeover(self, st: RequestState) -> AsyncIterator[list[int]]:
        """Last resort: P recomputes the prompt KV (mostly from its prefix cache) into the object
        store and RLD finishes the request from the committed tokens."""
        self._fallback(st, "relay_finish", st.info.fallback or "no MD can take the request")
        relay = self._from_relay(st, (await self._prefill(st, PrefillRequest(st.gen, True, None))).kv_ref)
        try:
            async with contextlib.aclosing(relay) as stream:
                async for toks in stream:
                    yield toks
        except Exception as e:
            if is_overloaded(e):  # MDs and the relay are all full: the client retries later (503)
                raise Overloaded(f"neither main decode nor the relay can admit {st.gen.request_id} now") from e
            raise

    async def _redeliver(self, st: RequestState, avoid: MDKey | None) -> MDKey:
        """Register the request at a (preferably other) MD and have P resend the KV it lacks. A new
        attempt: a late abort of the old registration can neither drop nor refuse this one."""
        st.gen = gen = replace(st.gen, attempt=st.gen.attempt + 1)
        prompt = list(gen.prompt_token_ids)
        bs = self.cfg.model.block_size
        hashes = prompt_hashes(gen, bs)
        statuses = [self.index.status(i, hashes) for i in self.md_replicas()]
        others = [s for s in statuses if s.index != avoid and s.healthy]
        # no view of any MD (all gone or new): Serve's request router picks the least loaded
        md = pick_md(others or statuses, blocks_needed(len(prompt), bs), self.block_bytes, self.line()) \
            if statuses else None
        prep = await self._bounded(self.b.md_prepare(md, gen, None), "MD prepare")
        st.info.md_replica = md = prep.replica
        pre = await self._prefill(st, PrefillRequest(gen, False, KVTarget(prep.flight_location, prep.start_block)))
        if pre.first_token != st.committed[0]:  # determinism is the whole premise of token-ID handoff
            raise RuntimeError(f"re-prefill gave first token {pre.first_token} != {st.committed[0]}")
        st.info.wan_bytes += pre.wan_bytes
        return md

    async def _settle_prepare(self, st: RequestState, md: MDKey, prep: asyncio.Future, sent: KVTarget) -> None:
        """MD's real answer, which arrives while Prefill already sends from the router's view.
        Where the view was stale, P sends what MD lacks besides (a resend from P's prefix cache):
        the view costs bytes or a resend, never a token. A failed prepare leaves the request to
        the decode path's own fallbacks (MD is told to abort, so nothing waits on it)."""
        try:
            reply: MDPrepareReply = await prep
        except Exception as e:  # noqa: BLE001
            full = is_overloaded(e)  # a full pool is a busy MD, not a dead one: its view stands
            self._fallback(st, "md_full" if full else "md_unavailable", f"MD {md} prepare: {type(e).__name__}: {e}")
            if not full:
                self.index.failed(md)
            await self.b.md_abort(md, st.gen.request_id, st.gen.attempt)
            return
        st.info.prefix_hit_md = reply.hit_tokens / len(st.gen.prompt_token_ids)
        if reply.flight_location != sent.flight_location:  # MD's Flight server moved: resend it all
            miss = KVTarget(reply.flight_location, reply.start_block)
        elif reply.start_block < sent.start_block:  # MD evicted (or never had) part of the prefix
            miss = KVTarget(reply.flight_location, reply.start_block, sent.start_block)
        else:
            return
        self.index_misses += 1
        self._fallback(st, "index_miss", f"MD {md} holds {reply.start_block} prompt blocks, the view "
                       f"said {sent.start_block} at {sent.flight_location}")
        # resend even when the request has ended: an absorb may be waiting for these blocks (and if
        # MD dropped the request, Flight refuses the push: bytes, never a token)
        pre = await self._prefill(st, PrefillRequest(st.gen, False, miss))
        st.info.wan_bytes += pre.wan_bytes

    def md_replicas(self) -> list[MDKey]:
        """The MD replicas to choose among: the live set as Serve's request router knows it (a
        replica scaled down or dead leaves it), else those the router holds a view of."""
        live = self.b.md_replicas()
        return list(self.index.entries) if live is None else list(live)

    async def refresh_views(self) -> None:
        """One poll of every MD's routing view; with no MD known yet, one unpinned poll (Serve's
        request router starts and learns the replicas; the answer names its replica)."""
        mds = self.md_replicas()
        await asyncio.gather(*(self._refresh_view(i) for i in mds or [None]))

    async def _refresh_view(self, i: MDKey | None) -> None:
        known = None if i is None else self.index.known_version(i)
        try:
            view = await asyncio.wait_for(self.b.md_view(i, known), timeout=min(self.clock.real(5.0), self.timeout))
        except Exception:  # noqa: BLE001 - an unreachable MD is skipped while another can serve
            if i is not None:
                self.index.failed(i)
            return
        if i is not None and view.replica != i:  # the pinned replica is gone: another one answered
            self.index.failed(i)
        self.index.update(view)

    async def watch_views(self) -> None:
        """Keep the view of every live MD current (the Router runs this for its lifetime); each
        MD on its own beat, so a dead or slow one does not age the others' views. Replicas come
        and go with autoscaling: a new one gets a watcher, a removed one's view is dropped."""
        period = self.cfg.policy.drc_view_period_s

        async def one(i: MDKey) -> None:
            while True:
                await asyncio.gather(self._refresh_view(i), asyncio.sleep(period))

        async def line(i: Hashable) -> None:
            while True:
                await asyncio.gather(self._refresh_line(i), asyncio.sleep(period))

        self.watchers = watchers = {}  # MD replica -> its view's poll loop (the stats show them)
        senders: dict[Hashable, asyncio.Task] = {}
        try:
            while True:
                live = self.b.md_replicas()
                if live is None:  # Serve's request router has not started: one unpinned poll starts it
                    await asyncio.gather(self._refresh_view(None), asyncio.sleep(period))
                    continue
                follow_replicas(watchers, live, one)
                self.index.retain(live)
                ps = self.b.prefill_replicas() or []
                follow_replicas(senders, ps, line)
                for i in [i for i in self.line_reports if i not in ps]:
                    del self.line_reports[i]
                await asyncio.sleep(period)
        finally:
            for t in (*watchers.values(), *senders.values()):
                t.cancel()

    async def _refresh_line(self, i: Hashable) -> None:
        sent = self._now()
        try:
            rep = await asyncio.wait_for(self.b.line_state(i), timeout=min(self.clock.real(5.0), self.timeout))
        except Exception:  # noqa: BLE001 - a lost Prefill replica's report ages out with it
            return
        self.line_reports[rep.replica] = (rep, sent)
        if rep.bandwidth_bps:
            self.link = replace(self.link, bandwidth_bps=rep.bandwidth_bps / 8)

    async def _relay_then_md(self, st: RequestState, md: MDKey, kv_ref: Any,
                             forced_mode: str | None) -> AsyncIterator[list[int]]:
        relay = RelayReader(self, st, self.b.relay(RelayRequest(st.gen, tuple(st.committed), kv_ref)))
        del kv_ref  # RLD's call holds the object store copy: freed at the cut, while MD decodes on
        self.relay_running += 1
        kv: asyncio.Future = spawn(self.b.md_wait_kv(md, st.gen.request_id, self.timeout))
        try:
            async with contextlib.aclosing(self._relay_phases(st, md, relay, kv, forced_mode)) as phases:
                async for toks in phases:
                    yield toks
        except RelayLost as e:  # RLD failed or refused, before the handoff: MD takes the request
            self._fallback(st, relay_fault(e), str(e))
            await self._end_relay(relay)
            async with contextlib.aclosing(self._from_md_recovering(st, md)) as stream:
                async for toks in stream:
                    yield toks
        finally:
            if not kv.done():
                kv.cancel()
            await self._end_relay(relay)

    async def _relay_phases(self, st: RequestState, md: MDKey, relay: RelayReader, kv: asyncio.Future,
                            forced_mode: str | None) -> AsyncIterator[list[int]]:
        """Phase 1: eager tokens while the KV crawls to MD; phase 2 (catch-up): batches to MD while
        RLD goes on; phase 3: cut RLD, MD extends and goes on. Raises RelayLost before the cut."""
        rid, pol = st.gen.request_id, self.cfg.policy
        batch: asyncio.Future | None = None
        try:
            async for toks in relay.until(kv):
                yield toks
            if relay.finished:  # RLD finished it first: MD still absorbs it so the caches stay aligned
                self._background(self.b.md_absorb(md, rid, list(st.committed), self.timeout))
                return
            try:
                ready: KVReady = kv.result()
            except Exception as e:  # noqa: BLE001 - MD died or lost the request: RLD is healthy
                ready = KVReady(False, error=f"MD {md}: {type(e).__name__}: {e}")
            self._kv_landed(st)
            t_handoff = time.monotonic()
            if not ready.ok:  # the KV did not make it in time: RLD finishes the request alone
                self._fallback(st, "kv_timeout", f"relay finished: {ready.error}")
                self._background(self.b.md_abort(md, rid, st.gen.attempt))
                async for toks in relay.until(None):
                    yield toks
                return
            mode = plan_handoff(st.info.eager_tokens, self.relay_load(), pol, forced_mode)
            st.info.handoff_mode = mode
            md_has = 0  # output tokens whose KV MD has built
            gap: int | None = None  # tokens still to hand over after the previous round
            # Phase 2 (catch-up): hand committed tokens over in batches while RLD keeps generating;
            # each batch keeps the last committed token back, the final extend needs its logits
            while mode == "catch-up" and not catchup_done(len(st.committed) - md_has, pol, gap):
                gap = len(st.committed) - md_has
                batch = spawn(self.b.md_handoff_batch(md, rid, st.committed[md_has:-1], self.timeout))
                st.info.handoff_batches += 1
                async for toks in relay.until(batch):
                    yield toks
                if relay.finished:
                    with contextlib.suppress(Exception):
                        await batch
                    self._background(self.b.md_absorb(md, rid, list(st.committed), self.timeout))
                    return
                try:
                    md_has = batch.result()
                except Exception as e:  # noqa: BLE001 - MD failed mid-handoff: RLD is still running
                    if is_request_error(e):
                        raise
                    self._fallback(st, "md_lost", f"catch-up batch: {type(e).__name__}: {e}")
                    st.info.handoff_mode = "none"
                    self._background(self.b.md_abort(md, rid, st.gen.attempt))
                    async for toks in relay.until(None):
                        yield toks
                    return
            st.info.handoff_batches += 1  # the final extend carries the last token ids
            # Phase 3: cut RLD at what the client has seen; MD extends over the rest and goes on
            await self._end_relay(relay)
            first = True
            async with contextlib.aclosing(self._from_md_recovering(st, md)) as from_md:
                async for toks in from_md:
                    if first:
                        st.info.handoff_s = self._since(t_handoff)
                        first = False
                    yield toks
        finally:
            if batch is not None and not batch.done():
                batch.cancel()

    async def _end_relay(self, relay: RelayReader) -> None:
        if not relay.closed:
            self.relay_running -= 1
            await relay.cut()

    # ------------------------------------------------------------ helpers

    async def _prepare_now(self, st: RequestState, first: MDKey, statuses: list) -> MDPrepareReply | None:
        """Register the request at MD `first`, or the next healthy one, and wait for the answer
        (only where the router has no view of the MD it picked)."""
        order = [first] + [s.index for s in sorted(statuses, key=lambda s: (not s.healthy, s.running))
                           if s.index != first]  # first None: Serve's request router picks one
        full = True
        for i in order:
            try:
                return await self._bounded(self.b.md_prepare(i, st.gen, None), "MD prepare")
            except Exception as e:  # noqa: BLE001 - a dead, restarting or full MD: try the next
                if not is_overloaded(e):  # a full MD is alive: its view stands
                    full = False
                    if i is not None:
                        self.index.failed(i)
                self._fallback(st, "md_full" if is_overloaded(e) else "md_unavailable", f"MD {i}: {type(e).__name__}: {e}")
        if not self.cfg.uses_relay:
            if full:
                raise Overloaded("every main decode replica's KV pool is full")
            raise RuntimeError("no main decode replica answered and this graph has no relay")
        return None

    async def _prefill(self, st: RequestState, preq: PrefillRequest) -> PrefillResult:
        """Prefill with bounded retries: a replica that dies mid-prefill is retried on another
        (or on the one Serve restores); MD's expected blocks are idempotent, so a resend is safe."""
        last: Exception | None = None
        busy = 0  # attempts refused as full or busy, or past the budget: overload, not a dead replica
        for attempt in range(1 + self.cfg.policy.prefill_retries):
            try:
                return await self._bounded(self.b.prefill(replace(preq, budget_s=self.timeout)), "prefill")
            except (RequestError, ValueError):
                raise  # the request itself is bad: no retry helps
            except Exception as e:  # noqa: BLE001
                if is_request_error(e):
                    raise
                last = e
                full = is_overloaded(e)
                # a prefill that ran out of its budget queued behind others: the same overload, found late
                busy += full or isinstance(e, TimeoutError) or isinstance(getattr(e, "cause", None), TimeoutError)
                self._fallback(st, "prefill_full" if full else "prefill_retry", f"{type(e).__name__}: {e}")
                await asyncio.sleep(min(2.0, 0.25 * 2**attempt))
        if busy == 1 + self.cfg.policy.prefill_retries:  # every attempt found Prefill full or too slow
            raise Overloaded(f"Prefill could not take the prompt within its budget over {busy} attempts "
                             f"(last: {last}); retry later") from last
        raise RuntimeError(f"prefill failed after {1 + self.cfg.policy.prefill_retries} attempts: {last}")

    def _fallback(self, st: RequestState, kind: str, detail: str) -> None:
        st.info.fallback = f"{kind}: {detail}"[:300]
        st.info.fallbacks.append(kind)
        self.fallbacks[kind] = self.fallbacks.get(kind, 0) + 1

    async def _wait_any(self, *futs: asyncio.Future | None) -> None:
        """Wait for the first of `futs`; a silent decoder past the timeout is a failure."""
        done, _ = await asyncio.wait([f for f in futs if f is not None], timeout=self.timeout,
                                     return_when=asyncio.FIRST_COMPLETED)
        if not done:
            raise TimeoutError(f"no progress for {self.timeout:.0f}s")

    def _take(self, st: RequestState, nxt: asyncio.Task) -> tuple[list[int], bool]:
        """Commit a finished relay chunk; (tokens, finished)."""
        try:
            chunk: TokenChunk = nxt.result()
        except StopAsyncIteration:
            raise RuntimeError(f"relay stream of {st.gen.request_id} ended without a finish reason") from None
        st.committed.extend(chunk.token_ids)
        st.info.eager_tokens += len(chunk.token_ids)
        if chunk.finish_reason is not None:
            st.finish_reason, st.decoder_done = chunk.finish_reason, True
        return chunk.token_ids, chunk.finish_reason is not None

    async def _bounded(self, aw: Awaitable[T], what: str) -> T:
        try:
            return await asyncio.wait_for(aw, timeout=self.timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what} did not answer within {self.timeout:.0f}s") from None

    def _background(self, aw: Awaitable[Any]) -> None:
        async def run() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(aw, timeout=self.timeout)

        t = spawn(run())
        self.bg.add(t)
        t.add_done_callback(self.bg.discard)

    @staticmethod
    async def _close(it: Any) -> None:
        closer = getattr(it, "aclose", None) or getattr(it, "cancel", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                res = closer()
                if asyncio.iscoroutine(res):
                    await res
