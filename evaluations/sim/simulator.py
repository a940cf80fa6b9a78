"""Discrete-event simulation of one deployment (P, RLD, MD instances and the inter-site line)
driven by pdd_serve's own policy: `choose_pipeline`, `pick_md`, `plan_handoff`, `catchup_done`
(and, through choose_pipeline, `is_anomalous`) decide exactly as the Router's orchestrator does;
KV transfers take `LinkModel.transfer_time`; P's prefix cache and MD's DRC are `RadixCache`s.

The pieces: the engine replicas in instances.py (Prefill: chunked forwards; decode: continuous
batching in closed-form segments), the line in line.py (the LinkModel, a kernel-shaped wire, a
Prefill replica's shared pacer); here the event loop, the caches and the Router's pipelines.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Callable
from typing import Any

from evaluations.sim.config import DeploymentSpec, Scenario
from evaluations.sim.instances import DecodeInstance, Member, PrefillInstance, PrefillJob
from evaluations.sim.line import SharedPacer, line_model
from evaluations.sim.workload import SimRequest, Workload
from pdd_serve.emulation.costmodel import ChipSpec, ModelShape, kv_copy_time, prefill_time
from pdd_serve.engine.kv import blocks_needed
from pdd_serve.engine.radix_cache import RadixCache
from pdd_serve.policy import (
    LinkEstimate,
    MDStatus,
    catchup_done,
    choose_pipeline,
    pick_md,
    plan_handoff,
    wan_backlog,
)
from pdd_serve.transport.link import BW_SAMPLE_MIN_BYTES, BandwidthEstimator

INF = math.inf
_NO_EVICT = 1 << 62  # the caches evict in bulk at a watermark (see _cache_insert), not per insert


def _slowed(c: ChipSpec, k: float) -> ChipSpec:
    """Every forward k times slower (a shared machine), the chip's shape unchanged."""
    if k == 1.0:
        return c
    return dataclasses.replace(c, peak_tflops=c.peak_tflops / k, mem_bw_gb_s=c.mem_bw_gb_s / k,
                               forward_overhead_ms=c.forward_overhead_ms * k)


# ---------------------------------------------------------------- the Router's view of an MD's DRC


class DRCLog:
    """When each block entered and left one MD's DRC, so the Router's view of it can be answered
    as of an earlier time: pdd_serve's MDIndex holds what the MD published at its last poll."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.added: dict[int, float] = {}
        self.evicted: dict[int, float] = {}

    def on_evict(self, block: int) -> None:  # RadixCache's callback (its values are the block ids)
        self.evicted[block] = self.sim.now

    def held_at(self, cache: RadixCache, blocks: list[int], s: float) -> int:
        """Leading blocks the cache held at time s (a block evicted and re-added since counts as absent)."""
        n = 0
        for b in blocks:
            a = self.added.get(b)
            if a is None or a > s:
                break
            if b not in cache.nodes and self.evicted.get(b, -INF) <= s:
                break
            n += 1
        return n


# ---------------------------------------------------------------- the simulation


class Simulation:
    """One deployment under one workload. `run()` returns the requests with their outcomes."""

    def __init__(self, sc: Scenario, dep: DeploymentSpec, wl: Workload, progress: bool = False):
        self.sc, self.dep, self.wl = sc, dep, wl
        self.model: ModelShape = sc.model
        self.pol = dep.policy
        sched = sc.scheduler
        self.chunk, self.tail_mode = sched.prefill_chunk_tokens, sched.tail_chunk
        self.batch_requests = sched.prefill_batch_requests
        self.bs = wl.block_size
        self.block_bytes = self.bs * self.model.kv_bytes_per_token
        ls = sc.links[dep.link]
        self.cross = ls.cross_site
        self.link = line_model(ls, self.model.kv_bytes_per_token) if self.cross else None
        bw = self.link.bandwidth_bps if self.link is not None else None
        self.lat = self.link.config.one_way_latency_s if self.link is not None else 0.0  # KV's
        self.ctl = self.lat if ls.control_latency else 0.0  # every Router <-> MD message's (crosssite.py)
        # a Router -> MD call as it leaves: the line's latency plus the platform's handling of the call
        self.call = self.ctl + sc.scheduler.md_call_overhead_s
        # the Router polls every MD's DRC view each period, a cross-site round trip (watch_views)
        self.view_cycle = max(self.pol.drc_view_period_s, 2 * self.ctl)
        self.index_misses = 0
        self.late_switches = 0
        # the Router's estimate: the nominal line (pdd_serve's router seeds its estimator with it)
        self.est = LinkEstimate(INF if bw is None else bw / 8, self.lat)
        self.line_bps = ls.line_gbps * 1e9 if ls.line_gbps else None
        self.line_free = 0.0
        self.kv_sent: dict[int, float] = {}  # rid -> when its stream's last byte lands (before P is done)
        self.kv_floor: dict[int, float] = {}  # rid -> the earliest its KV can land (P done, stream not)
        self.kv_wait: dict[int, list[float]] = {}  # rid -> [transfers still crossing, latest landing]
        cache_bytes = sched.prefix_cache_gb * 1e9
        p_bytes, md_bytes = (cache_bytes if v is None else v * 1e9
                             for v in (sched.prefix_cache_gb_prefill, sched.prefix_cache_gb_main_decode))

        def cache() -> RadixCache:
            return RadixCache(self.bs, self.block_bytes, _NO_EVICT)

        roles = dep.roles()
        chips = {n: _slowed(c, sched.compute_slowdown) for n, c in sc.chips.items()}
        dchips = {n: dataclasses.replace(c, forward_overhead_ms=c.forward_overhead_ms + sched.decode_step_overhead_ms)
                  for n, c in chips.items()}  # decoders pay the serving loop's per-step overhead too
        rp, rm = roles["prefill"], roles["main_decode"]
        self.ps = [PrefillInstance(self, i, chips[rp.chip], rp.chips_per_instance, cache(), p_bytes)
                   for i in range(rp.instances)]
        if self.link is not None and ls.paced_line:
            # one pacer for the site pair, shared by every Prefill replica's streams, as pdd_serve's
            # `Line` deployment is (serve/line.py); each replica keeps its own live estimate
            line = SharedPacer(self, line_model(ls, self.model.kv_bytes_per_token), ls.streams, ls.stream_unit_bytes)
            for p in self.ps:
                p.pacer = line
                p.bw = BandwidthEstimator(initial_bps=bw)
        self.senders: dict[int, tuple[float, bool, int]] = {}  # rid -> (sender start, alone, start count)
        self.ledger: dict[int, tuple[int, float]] = {}  # the Router's transfers on the line: rid -> (bytes, since)
        self.drc = self.pol.drc
        self.drc_logs = [DRCLog(self) for _ in range(rm.instances)] if self.drc else []
        self.mds = [DecodeInstance(self, i, "main_decode", dchips[rm.chip], rm.chips_per_instance,
                                   rm.max_batch or sched.decode_max_batch,
                                   RadixCache(self.bs, self.block_bytes, _NO_EVICT, self.drc_logs[i].on_evict)
                                   if self.drc else None, md_bytes) for i in range(rm.instances)]
        rr = roles.get("relay")
        self.relays = ([DecodeInstance(self, i, "relay", dchips[rr.chip], rr.chips_per_instance,
                                      rr.max_batch or sched.decode_max_batch)
                        for i in range(rr.instances)] if rr is not None else [])
        # P->MD requests leave their KV for RLD too, so a stale view can still switch at prefill's end
        self.late_relay = self.pol.late_relay and "P-RLD-MD" in self.pol.pipelines and bool(self.relays)
        mean_len = sum(r.prompt + r.output for r in wl.requests) / max(1, len(wl.requests))
        self.md_capacity = max(1, min(self.mds[0].max_batch, int(self.mds[0].cap_tokens // max(1.0, mean_len))))
        self.relay_running = 0  # the orchestrator's counter: relay streams open
        self.relay_member: dict[int, Member] = {}
        self.followers: dict[int, list[SimRequest]] = {}  # rid -> the session turns sent after it
        self.now = 0.0
        self.heap: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.events = 0
        self.backsteps = 0  # events that would have run in the past (must stay 0)
        self.completed = 0
        self.progress = progress
        self.wall_s = 0.0
        for f, blocks in wl.warm:  # the benchmark's shared prefixes are cached before it starts
            self._cache_insert(self.ps[f % len(self.ps)], blocks)
            if self.drc:
                self._cache_insert(self.mds[f % len(self.mds)], blocks)

    # ---- event loop

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self.heap, (t, next(self._seq), fn, args))

    def run(self) -> list[SimRequest]:
        t0 = time.perf_counter()
        reqs = self.wl.requests
        for r in reqs:
            if r.after >= 0:  # a session's next turn leaves when the previous answer is complete
                self.followers.setdefault(r.after, []).append(r)
            else:
                self._send(r, r.arrival)
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(reqs), desc=f"sim {self.dep.name}", unit="req", leave=False)
        heap = self.heap
        last = 0
        while heap:
            t, _, fn, args = heapq.heappop(heap)
            if t < self.now - 1e-9:
                self.backsteps += 1
            else:
                self.now = t
            fn(*args)
            self.events += 1
            if bar is not None and self.completed - last >= 200:
                bar.update(self.completed - last)
                last = self.completed
        if bar is not None:
            bar.update(self.completed - last)
            bar.close()
        self.wall_s = time.perf_counter() - t0
        return reqs

    def _send(self, r: SimRequest, t: float) -> None:
        r.arrival = t
        self.at(t + self.sc.scheduler.request_overhead_s, self._arrive, r)

    # ---- caches

    def _cache_insert(self, inst: PrefillInstance | DecodeInstance, blocks: tuple[int, ...]) -> None:
        """Insert with bulk LRU eviction at a watermark: RadixCache.evict scans its leaves, so
        evicting a slack's worth at once keeps a long trace fast (SGLang evicts in bulk too)."""
        c = inst.cache
        if c is None or not blocks:
            return
        cap = inst.cache_bytes
        slack = self.sc.scheduler.cache_slack
        if c.used_bytes + len(blocks) * c.block_bytes > cap * (1 + slack):
            c.evict(int(c.used_bytes + len(blocks) * c.block_bytes - cap * (1 - slack)))
        if len(blocks) * c.block_bytes <= cap * (1 + slack):
            new = c.insert(list(blocks), list(blocks))
            if isinstance(inst, DecodeInstance) and self.drc_logs:
                added = self.drc_logs[inst.idx].added
                for b, a in zip(blocks, new):
                    if a:
                        added[b] = self.now

    def _hit_tokens(self, r: SimRequest, k_blocks: int) -> int:
        return min(k_blocks * self.bs, r.prompt - 1)  # the last prompt token is always computed

    # ---- the Router's decisions (policy.py) and the pipelines

    def _view_time(self, t: float) -> float:
        """The MD state the Router's view holds at t: polls start every `view_cycle`, each reads
        MD one latency after it leaves and lands one latency later (before the first reply, the
        Router's one blocking poll at start-up: the state at 0)."""
        k = math.floor((t - 2 * self.ctl) / self.view_cycle)
        return k * self.view_cycle + self.ctl if k >= 0 else 0.0

    def _view_hit(self, i: int, r: SimRequest, s: float) -> int:
        """Leading prompt blocks MD i held at time s, as its view tells the Router."""
        if r.fixed_hit_md is not None:
            return r.fixed_hit_md // self.bs
        return self.drc_logs[i].held_at(self.mds[i].cache, list(r.blocks), s) if self.drc else 0

    def _line(self) -> LinkEstimate:
        """The line as the Router sees it (orchestrator.line): the transfers it started and hasn't
        seen land, each assumed to have crossed at a fair share since the Router's decision
        (`wan_backlog`); one that should have crossed by now leaves the ledger. Only where the
        simulation is pdd_serve's (one paced line): at cluster scale a transfer's LinkModel is
        already one share of a wider line, and the Router plans each on its own."""
        if not self.ps or self.ps[0].pacer is None:
            return self.est
        rids = list(self.ledger)
        left = wan_backlog([self.ledger[r] for r in rids], self.now, self.est.bandwidth_bps)
        for r, b in zip(rids, left):
            if b <= 0:
                del self.ledger[r]
        return dataclasses.replace(self.est, backlog=tuple(b for b in left if b > 0))

    def _arrive(self, r: SimRequest) -> None:
        """The Router decides from its own view (no round trip before prefill, orchestrator.run):
        MD replica, the block P starts sending from, pipeline; MD's `prepare` runs concurrently
        and its reply (one round trip later) says what MD really holds."""
        prompt_blocks = blocks_needed(r.prompt, self.bs)
        adoptable = (r.prompt - 1) // self.bs  # MD computes at least the last prompt token itself
        s = self._view_time(self.now)
        statuses = [MDStatus(i, self._view_hit(i, r, s), md.assigned, self.md_capacity)
                    for i, md in enumerate(self.mds)]
        est = self._line()
        mdi = pick_md(statuses, prompt_blocks, self.block_bytes, est)
        planned = min(statuses[mdi].hit_blocks, adoptable) if self.drc else 0
        missing = (prompt_blocks - planned) * self.block_bytes
        if r.fixed_wan_bytes is not None:  # a record: the bytes it really sent say where P started
            missing = r.fixed_wan_bytes
        dec = choose_pipeline(r.prompt, r.output, missing, est, self.relay_running, self.pol)
        r.pipeline, r.reason = dec.pipeline, dec.reason
        if dec.pipeline != "P-RLD":
            md = self.mds[mdi]
            md.assigned += 1
            r.md = mdi
            if r.fixed_hit_md is not None:
                real = min(r.fixed_hit_md // self.bs, adoptable)
            elif md.cache is not None:
                real = min(len(md.cache.match_hashes(list(r.blocks)).hashes), adoptable)
            else:
                real = 0
            r.planned_blocks, r.real_blocks = planned, real
            r.hit_md = min(real * self.bs, r.prompt)
            r.index_miss = real < planned and r.fixed_wan_bytes is None
            self.index_misses += r.index_miss
            r.wan_bytes = missing + self._resend_bytes(r)  # from the planned block, plus a resend
            if self.ps[0].pacer is not None:
                self.ledger[r.rid] = (missing, self.now)
            r.t_prepared = self.now + 2 * self.ctl
        p = self._pick_prefill(r)
        r.p = p.idx
        if r.fixed_hit_p is not None:
            r.hit_p = min(r.fixed_hit_p, r.prompt - 1)
        else:
            r.hit_p = self._hit_tokens(r, len(p.cache.match_hashes(list(r.blocks)).hashes))
        if p.bw is not None and r.pipeline != "P-RLD":  # Prefill's sender starts with the prefill call
            p.sending += 1
            p.started += 1
            # alone: no other stream on the line, from any replica (pdd_serve's `SharedLine.shared`)
            self.senders[r.rid] = (self.now, sum(q.sending for q in self.ps) == 1, sum(q.started for q in self.ps))
        p.submit(PrefillJob(r, r.prompt - r.hit_p, r.hit_p))

    def _pick_prefill(self, r: SimRequest) -> PrefillInstance:
        """Not in policy.py (pdd_serve has one Prefill deployment behind Serve's balancer): at
        cluster scale the sim routes by prefix affinity + backlog, cost = queued + uncached tokens."""
        if len(self.ps) == 1:
            return self.ps[0]
        blocks = list(r.blocks)
        best, best_cost = self.ps[0], INF
        for p in self.ps:
            hit = r.fixed_hit_p if r.fixed_hit_p is not None else self._hit_tokens(r, p.cache.peek(blocks))
            cost = p.backlog + r.prompt - hit
            if cost < best_cost:
                best, best_cost = p, cost
        return best

    def _resend_bytes(self, r: SimRequest) -> int:
        """The gap between what MD holds and where P started (a stale view): resent once MD's
        prepare reply is back (orchestrator._settle_prepare). MD holding more costs nothing extra
        here: those blocks are in `wan_bytes` already."""
        return max(0, r.planned_blocks - r.real_blocks) * self.block_bytes if r.index_miss else 0

    def _kv_arrival(self, r: SimRequest, job: PrefillJob, p: PrefillInstance) -> float:
        """When the last KV block MD lacks lands at MD. Blocks stream as chunks finish (from the
        first chunk on), the last chunk can't leave before the prefill ends, and the line queues
        transfers (FIFO on its aggregate capacity)."""
        now = self.now
        gap = self._resend_bytes(r)
        nbytes = r.wan_bytes - gap
        last = min(nbytes, self.chunk * self.model.kv_bytes_per_token)
        if self.link is None:
            src, dst = p.chip, self.mds[r.md].chip
            end = max(job.t_first_chunk + kv_copy_time(nbytes, src, dst), now + kv_copy_time(last, src, dst))
            return max(end, max(now, r.t_prepared) + kv_copy_time(gap, src, dst)) if gap else end
        start = job.t_first_chunk
        end = max(start + self.link.transfer_time(nbytes, start), now + self.link.transfer_time(last, now))
        if gap:
            t = max(now, r.t_prepared)
            end = max(end, t + self.link.transfer_time(gap, t))
        if self.line_bps is not None and nbytes + gap > 0:
            self.line_free = max(self.line_free, start) + (nbytes + gap) * 8 / self.line_bps
            end = max(end, self.line_free + self.lat)
        return end

    def stream_start(self, job: PrefillJob, p: PrefillInstance) -> None:
        """P's first chunk is done: with the paced line, the KV stream to MD starts sharing it."""
        r = job.req
        if p.pacer is None or r.pipeline == "P-RLD":
            return
        p.pacer.add(r.rid, r.wan_bytes - self._resend_bytes(r), lambda t: self._stream_done(r, t))

    def _stream_done(self, r: SimRequest, t: float) -> None:
        """The stream's last byte left the pacer at t; it lands a latency later, and not before the
        prefill's last chunk could have crossed."""
        self.kv_sent[r.rid] = t + self.lat
        if r.t_prefill_done >= 0:
            self._sent(r, max(t + self.lat, self.kv_floor.pop(r.rid)))

    def _sent(self, r: SimRequest, t: float) -> None:
        """The request's stream from the planned block landed at t: a transfer that had the line to
        itself from the prefill call on feeds Prefill's live estimate (serve/prefill.py), which the
        Router plans with once the prefill returns."""
        p = self.ps[r.p]
        t0, alone, started = self.senders.pop(r.rid)
        p.sending -= 1
        nbytes = r.wan_bytes - self._resend_bytes(r)
        if alone and sum(q.started for q in self.ps) == started and nbytes >= BW_SAMPLE_MIN_BYTES and p.bw is not None:
            p.bw.observe(nbytes, t - t0)
        self._kv_part(r, t)

    def _resend(self, r: SimRequest) -> None:
        """P sends the blocks a stale view left out (its own stream on the line's pacer)."""
        self.ps[r.p].pacer.add(-1 - r.rid, self._resend_bytes(r), lambda t: self._kv_part(r, t + self.lat))

    def _kv_part(self, r: SimRequest, t: float) -> None:
        """One of the request's transfers to MD landed at t; the KV is there when all have."""
        w = self.kv_wait[r.rid]
        w[0] -= 1
        w[1] = max(w[1], t)
        if w[0] <= 0:
            del self.kv_wait[r.rid]
            self.at(w[1], self._kv_at_md, r)

    def relay_export_s(self, r: SimRequest, p: PrefillInstance) -> float:
        """P's copy of the whole prompt's KV out of its pool for the relay (serve/prefill.py's
        `to_relay`): on the relay pipelines, and on P->MD where a late switch may still take it
        (orchestrator: `late_relay`), at the chip's NIC rate as the pacer charges an export."""
        late = self.late_relay and r.pipeline == "P-MD" and "P-RLD-MD" in self.pol.pipelines
        if r.pipeline not in ("P-RLD-MD", "P-RLD") and not late:
            return 0.0
        return kv_copy_time(r.prompt * self.model.kv_bytes_per_token, p.chip, p.chip)

    def _late_relay(self, r: SimRequest) -> None:
        """At the end of prefill: MD's prepare reply is in and shows a larger delta than the view
        promised, so P->MD may still switch to P->RLD->MD (the KV is in the object store)."""
        if not (self.late_relay and r.pipeline == "P-MD" and 0 <= r.t_prepared <= self.now
                and r.real_blocks < r.planned_blocks):
            return
        real = (blocks_needed(r.prompt, self.bs) - r.real_blocks) * self.block_bytes
        redo = choose_pipeline(r.prompt, r.output, real, self._line(), self.relay_running, self.pol)
        if redo.pipeline == "P-RLD-MD":
            r.pipeline, r.reason = redo.pipeline, f"late (the view was stale): {redo.reason}"
            self.late_switches += 1

    def prefill_done(self, job: PrefillJob, p: PrefillInstance) -> None:
        r, now = job.req, self.now
        r.t_prefill_done = r.t_first_prefill = now
        if p.bw is not None and p.bw.bps:  # the PrefillResult carries P's live view of the line
            self.est = dataclasses.replace(self.est, bandwidth_bps=p.bw.bps / 8)
        self._cache_insert(p, r.blocks)
        self._late_relay(r)
        if r.pipeline != "P-RLD" and p.pacer is not None:
            assert self.link is not None
            gap = self._resend_bytes(r)
            self.kv_wait[r.rid] = [2 if gap else 1, now]
            if gap:
                self.at(max(now, r.t_prepared), self._resend, r)
            last = min(r.wan_bytes - gap, self.chunk * self.model.kv_bytes_per_token)
            floor = now + self.link.transfer_time(last, now) if last > 0 else now + self.lat
            if r.rid in self.kv_sent:
                self._sent(r, max(self.kv_sent.pop(r.rid), floor))
            else:
                self.kv_floor[r.rid] = floor
        elif r.pipeline != "P-RLD":
            self.at(self._kv_arrival(r, job, p), self._kv_at_md, r)
        if r.output <= 1:  # P's token was the whole answer
            r.t_first_decoder = now
            self._finish(r, now)
            return
        if r.pipeline in ("P-RLD-MD", "P-RLD"):
            self.relay_running += 1
            rl = min(self.relays, key=lambda x: (x.assigned, x.idx))
            rl.assigned += 1
            r.relay = rl.idx
            m = Member(r, r.output - 1, r.prompt + 1, self._relay_joined, self._relay_finished)
            self.relay_member[r.rid] = m
            copy = kv_copy_time(r.prompt * self.model.kv_bytes_per_token, p.chip, rl.chip)
            self.at(now + copy, rl.join, m)

    # ---- relay

    def _relay_joined(self, m: Member, t: float) -> None:
        if m.req.t_first_decoder < 0:
            m.req.t_first_decoder = t

    def _relay_finished(self, m: Member, t: float) -> None:
        r = m.req
        r.rld_tokens = m.remaining
        self._relay_release(r)
        self._finish(r, t)

    def _relay_release(self, r: SimRequest) -> None:
        self.relay_running -= 1
        self.relays[r.relay].assigned -= 1

    # ---- main decode

    def _md_member(self, r: SimRequest, remaining: int, ctx: int) -> Member:
        return Member(r, remaining, ctx, self._md_joined, self._md_finished)

    def _md_joined(self, m: Member, t: float) -> None:
        r = m.req
        if r.t_first_decoder < 0:
            r.t_first_decoder = t + self.ctl  # MD's tokens reach the client through the router at A
        self.ledger.pop(r.rid, None)  # MD streams: its KV landed (the Router's ledger lets it go)

    def _md_finished(self, m: Member, t: float) -> None:
        r = m.req
        r.md_tokens += m.remaining
        self._md_release(r)
        self._finish(r, t + self.ctl)

    def _md_release(self, r: SimRequest, cache: bool = True) -> None:
        md = self.mds[r.md]
        md.assigned -= 1
        if cache and self.drc:
            self._cache_insert(md, r.decoded_blocks or r.blocks)

    def _extend_cost(self, md: DecodeInstance, tokens: int, ctx: int) -> float:
        return prefill_time(md.chip, self.model, md.n, [(max(1, tokens), ctx)])

    def _absorb(self, r: SimRequest, md_has: int = 0) -> None:
        """RLD (or P's token) finished it: MD extends over the output so the caches stay aligned."""
        md = self.mds[r.md]
        md.op(self._extend_cost(md, r.output - 1 - md_has, r.prompt + md_has), self._md_release, r)

    def _kv_at_md(self, r: SimRequest) -> None:
        now = self.now
        r.t_kv_md = now
        md = self.mds[r.md]
        late = now - r.t_prefill_done > self.pol.kv_wait_timeout_s
        if r.finished:  # P's token ended it, or RLD finished first: MD absorbs so the caches stay aligned
            if r.output > 1 and not late:
                self._absorb(r)
            else:
                self._md_release(r, cache=not late)
            return
        if r.pipeline == "P-MD":
            if late:  # MD's bounded KV wait expires: the request fails (no relay to fall back on)
                r.fallback = "failed: KV wait timeout"
                self._md_release(r, cache=False)
                self._finish(r, now)
                return
            # the Router's decode call (sent when prefill returned) crosses the line; MD extends
            # over P's token once it also holds the KV, and its first chunk crosses back
            r.md_tokens = 0
            m = self._md_member(r, r.output - 1, r.prompt + 1)
            call = r.t_prefill_done + self.call
            if call > now:
                self.at(call, md.join, m)
            else:
                md.join(m)
            return
        if late:  # P-RLD-MD: RLD finishes the request alone
            r.fallback = "relay finished: KV wait timeout"
            self._md_release(r, cache=False)
            return
        # the Router's wait_kv (sent when prefill returned) answers across the line
        self.at(max(now, r.t_prefill_done + self.call) + self.ctl, self._kv_known, r)

    def _kv_known(self, r: SimRequest) -> None:
        """The Router learns MD holds the KV: plan the handoff from what RLD has streamed so far."""
        self.ledger.pop(r.rid, None)
        if r.finished:
            self._absorb(r)
            return
        rm = self.relay_member[r.rid]
        eager = self.relays[r.relay].tokens_by(rm, self.now)
        r.handoff_mode = plan_handoff(eager, self.relay_running, self.pol)
        if r.handoff_mode == "catch-up":
            self._catchup_round(r, 0, None)
        else:
            self._final_handoff(r, 0)

    def _catchup_round(self, r: SimRequest, md_has: int, gap: int | None) -> None:
        """One catch-up batch: a round trip to MD carrying every committed token but the last
        (orchestrator._relay_then_md); it ends when a round no longer shrinks the gap."""
        md = self.mds[r.md]
        if r.finished:  # RLD finished during catch-up: MD absorbs the rest
            self._absorb(r, md_has)
            return
        rm = self.relay_member[r.rid]
        committed = 1 + self.relays[r.relay].tokens_by(rm, self.now)
        pending = committed - md_has
        if catchup_done(pending, self.pol, gap):
            self._final_handoff(r, md_has)
            return
        send = pending - 1  # the last committed token stays back: the final extend needs its logits
        r.handoff_batches += 1
        cost = self._extend_cost(md, send, r.prompt + md_has)
        self.at(self.now + self.call, md.op, cost, self._catchup_reply, r, md_has + send, pending)

    def _catchup_reply(self, r: SimRequest, md_has: int, gap: int) -> None:
        self.at(self.now + self.ctl, self._catchup_round, r, md_has, gap)

    def _final_handoff(self, r: SimRequest, md_has: int) -> None:
        """Cut RLD at what the client has seen; MD extends over the rest and decodes on."""
        now = self.now
        rl, rm, md = self.relays[r.relay], self.relay_member[r.rid], self.mds[r.md]
        r.handoff_batches += 1
        committed = 1 + rl.tokens_by(rm, now)
        rl.cancel(rm)
        r.rld_tokens = committed - 1
        self._relay_release(r)
        if committed >= r.output:  # RLD produced the last token at this very instant
            self._finish(r, now)
            self._absorb(r, md_has)
            return
        cost = self._extend_cost(md, committed - md_has, r.prompt + md_has)
        self.at(now + self.call, md.op, cost, self._md_takeover, r, committed, now)

    def _md_takeover(self, r: SimRequest, committed: int, t_cut: float) -> None:
        now = self.now
        md = self.mds[r.md]
        r.md_tokens = 1  # the final extend samples the next token
        r.max_gap_s = max(r.max_gap_s, now + self.ctl - t_cut)
        left = r.output - committed - 1
        if left <= 0:
            self._md_release(r)
            self._finish(r, now + self.ctl)
            return
        md.join(self._md_member(r, left, r.prompt + committed + 1))

    # ---- bookkeeping

    def _finish(self, r: SimRequest, t: float) -> None:
        r.finished += 1
        if r.finished > 1:
            raise AssertionError(f"request {r.rid} finished twice")
        r.t_done = t
        self.completed += 1
        for nxt in self.followers.pop(r.rid, ()):
            self._send(nxt, t + nxt.think_s)
