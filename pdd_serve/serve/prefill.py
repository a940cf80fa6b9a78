"""Prefill (P), site A: computes the prompt's KV with its own prefix cache, puts it in the object
store for Relay and streams the blocks MD lacks to MD over Flight, in parallel, as they are made."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ray import serve

from pdd_serve.config import PDDConfig
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.pacer import build_emulation, kv_scale
from pdd_serve.engine.engine import Sequence
from pdd_serve.engine.kv import KVBlocks, PoolFullError, blocks_needed, num_full_blocks
from pdd_serve.engine.sampling import RequestError, SamplingParams
from pdd_serve.engine.worker import EngineWorker
from pdd_serve.policy import PREFILL_ADMIT_SHARE, PrefillCost, fit_prefill_cost, prefill_admits, wan_backlog
from pdd_serve.serve.common import (
    batch_cap,
    check_engine,
    emulation_stats,
    graph_link,
    load_engine,
    logger,
    placement,
)
from pdd_serve.serve.messages import (
    GenRequest,
    KVTarget,
    LineState,
    PrefillBusy,
    PrefillPoolFull,
    PrefillRequest,
    PrefillResult,
    PrefillSendFull,
    ReplicaStats,
)
from pdd_serve.serve.pinning import ROUTER_CLASS, this_replica
from pdd_serve.transport.link import BW_SAMPLE_MIN_BYTES, BandwidthEstimator, LinkModel, SharedLine

COST_WINDOW = 32  # recent prefills the replica's prefill cost is fitted over
MAX_SENDERS = 32  # KV transfers a Prefill replica runs at once (more share the line no faster)
PREFILL_CHUNK_TOKENS = 256  # blocks of a chunk leave for MD while the next chunk computes


class LinkCut(ConnectionError):
    """An injected cut of the inter-site link (tests and the soak)."""


class PrefillAbandoned(TimeoutError):
    """The prefill stopped: its budget ran out, or its caller went away."""


class _Stop:
    """When a prefill's work is no longer wanted: checked on the engine thread between chunks."""

    def __init__(self, deadline: float | None) -> None:
        self.deadline = deadline  # time.monotonic() on this replica
        self.cancelled = threading.Event()
        self.started = False  # the prefill job began on the engine thread

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def check(self, request_id: str) -> None:
        if self.cancelled.is_set():
            raise PrefillAbandoned(f"prefill of {request_id} stopped: its caller went away")
        if self.expired():
            raise PrefillAbandoned(f"prefill of {request_id} stopped: past the router's budget")


class BlockFeed:
    """Hands a request's finished blocks from the engine thread to its Flight sender thread."""

    def __init__(self, target: KVTarget, fault: tuple[str, float] | None = None, wait_s: float | None = None,
                 reserved: int = 0) -> None:
        self.target = target
        self.reserved = reserved  # its bytes in the replica's send buffer, given back when the transfer ends
        self.wait_s = wait_s  # the longest a sender waits for the next block: a pooled sender thread never hangs
        self.fault = fault  # ("stall", seconds) | ("cut", 0), injected by tests and the soak
        self.applied: str | None = None
        self.next_block = target.start_block
        self.q: queue.Queue[KVBlocks | Exception | None] = queue.Queue()  # None: every block is in
        self.nbytes = 0

    def on_chunk(self, engine, seq: Sequence) -> None:  # noqa: ANN001 - runs on the engine thread
        done = seq.num_computed >= seq.prompt_len
        end = blocks_needed(seq.prompt_len, engine.block_size) if done else num_full_blocks(seq.num_computed, engine.block_size)
        if self.target.end_block is not None:  # a resend of the blocks a stale view left out
            end = min(end, self.target.end_block)
        if end > self.next_block:
            run = engine.export_kv(seq, self.next_block, end)
            self.nbytes += run.nbytes
            self.q.put(run)
            self.next_block = end
        if done:
            self.q.put(None)

    def abort(self, reason: str) -> None:
        """Prefill failed: the push ends with an explicit abort, so MD falls back at once instead
        of waiting out its timeout for blocks that will never come (issue 13, item 3)."""
        from pdd_serve.transport.flight import SenderAborted

        self.q.put(SenderAborted(reason))

    def _next(self) -> KVBlocks | Exception | None:
        try:
            return self.q.get(timeout=self.wait_s)
        except queue.Empty:
            return TimeoutError(f"no KV block from prefill in {self.wait_s:.0f}s")

    def __iter__(self):
        while (run := self._next()) is not None:
            if isinstance(run, Exception):
                raise run
            if self.fault is not None:  # the stream is open: the link dies or stalls under it
                kind, seconds = self.fault
                self.fault = None
                self.applied = kind
                if kind == "cut":
                    raise LinkCut("injected: the inter-site link was cut mid-transfer")
                time.sleep(seconds)
            yield run


# prefill calls go to the replica with the fewest prefills in progress (routing stats), then the
# shortest queue; the routers' `line_state` polls are
# pinned to each replica, to sum the line's backlog over every sender (`pinning.py`)
@serve.deployment(max_ongoing_requests=64,
                  request_router_config={"request_router_class": ROUTER_CLASS,
                                         "request_routing_stats_period_s": 0.5})
class Prefill:
    def __init__(self, cfg: PDDConfig, line: Any = None) -> None:
        self.cfg = cfg
        self.clock = Clock(cfg.time_scale)  # slow motion: real seconds waited, emulated ones reported
        self.engine = load_engine(cfg.engine_for("prefill"), enable_prefix_cache=True, threads=2,
                                  emulation=build_emulation(cfg, "prefill"), clock=self.clock)
        self.worker = EngineWorker(self.engine, batch_cap(cfg, "prefill", self.engine))
        self.where = placement()
        self.replica = this_replica()
        # the graph's one line (serve/line.py): every Prefill replica's transfers book on it, so a
        # second replica shares the line's bandwidth instead of bringing its own; without a Line
        # (in-process tests) this replica's transfers share a line of their own
        local = graph_link(cfg, self.engine.layout.bytes_per_token)
        self.link: LinkModel | SharedLine = local
        if line is not None:
            book = line.options(method_name="book")  # made here, once: sender threads only call it
            self.link = SharedLine(local, lambda flow, n, chained: book.remote(flow, n, chained), name=str(self.replica))
        # emulated: the line carries the emulated model's KV (this many bytes per real byte), on the
        # emulated clock; every byte count and time below that the routers plan with is in those units
        self.kv_scale = kv_scale(cfg, self.engine.layout.bytes_per_token)
        # the live line rate the router plans with: transfers that had the line to themselves
        self.bw = BandwidthEstimator(initial_bps=self.link.bandwidth_bps)
        self.sending = 0  # transfers on the line now (sender threads: under _send_lock)
        # request -> (KV bytes it sends, when it started): what this replica has on the line now.
        # The sender knows the line's backlog; routers poll `line_state` and plan with it
        self.on_line: dict[tuple[str, int], tuple[int, float]] = {}  # by (request, transfer): a resend is its own
        self.send_buffered = 0  # real KV bytes of transfers admitted and not yet ended (<= the cap, but one)
        self.send_refused = 0  # prefills refused because that buffer was full
        self.prefilling = 0  # prefill calls in progress (the routing stats' load)
        self.abandoned = 0  # prefills stopped early: past the router's budget, or the caller gone
        # admission (`policy.prefill_admits`): the prefills this replica has taken and not finished
        # and the prompt tokens they compute, at its fitted cost; past the budget one is refused at once
        self.queued = 0
        self.queued_tokens = 0
        self.shed = 0  # prefills refused that way
        self._done: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)  # (tokens computed, engine seconds)
        self._calibration: list[tuple[int, float]] = []  # (`_calibrate`) taken before the first prefill
        self._send_lock = threading.Lock()
        # one bounded pool of sender threads per replica, not a thread per transfer: past
        # MAX_SENDERS transfers at once, a transfer waits its turn (its blocks wait in its feed,
        # MD's bounded wait decides) instead of each adding a thread
        self._senders = ThreadPoolExecutor(MAX_SENDERS, thread_name_prefix="kv-send")
        self.faults: dict[str, list[tuple[str, float]]] = {}
        self.transfers = {"started": 0, "done": 0, "failed": 0, "dropped": 0, "aborted": 0, "bytes": 0}
        if isinstance(self.link, SharedLine) and self.link.config.paced:
            self._senders.submit(self.link.sync_clock)  # report the line's times from the first request

    async def prefill(self, preq: PrefillRequest) -> PrefillResult:
        req = preq.req
        # the Router stops waiting after its budget (and may retry elsewhere); the caller may also
        # go away (Serve cancels this call): either way the engine stops at its next chunk, not
        # after the whole prompt, and frees the blocks, so a timeout under overload does not leave
        # a duplicate of its work running. The budget counts from the call's arrival: time queued
        # behind a burst for admission is spent from it too
        stop = _Stop(None if preq.budget_s is None else time.monotonic() + preq.budget_s)
        n = self._to_compute(req)
        cost = self.cost
        if not prefill_admits(self.queued, self.queued_tokens, n, cost, preq.budget_s):
            self.shed += 1
            ahead = cost.seconds(self.queued, self.queued_tokens)
            raise PrefillBusy(f"Prefill's queue is past the budget: {self.queued} prefills queued ahead, "
                              f"{self.queued_tokens} prompt tokens to compute, ~{ahead:.3g}s at "
                              f"{cost.fixed_s * 1e3:.3g} ms + {cost.per_token_s * 1e3:.3g} ms/token; "
                              f"{req.request_id}'s {n} tokens would end at ~{ahead + cost.seconds(1, n):.3g}s, past "
                              f"{PREFILL_ADMIT_SHARE:g} of its {preq.budget_s:.3g}s budget; retry later")
        self.queued += 1
        self.queued_tokens += n
        try:
            return await self._prefill_admitted(preq, stop)
        finally:
            self.queued -= 1
            self.queued_tokens -= n

    @property
    def cost(self) -> PrefillCost | None:
        """Engine time per prefill, fitted over the last prefills and the calibration."""
        return fit_prefill_cost(list(self._done), self._calibration)  # both set on the engine thread

    def _to_compute(self, req: GenRequest) -> int:
        """The prompt tokens a prefill of `req` would compute now: its prompt less the leading
        blocks this replica's prefix cache holds. Read off the engine thread (one membership test
        per block): an estimate, which an insert or eviction meanwhile may change."""
        n = len(req.prompt_token_ids)
        nodes = self.engine.cache.nodes if self.engine.cache is not None else {}
        hit = next((i for i, h in enumerate(req.block_hashes) if h not in nodes), len(req.block_hashes))
        return max(1, n - hit * self.engine.block_size)  # at least one token is always computed

    def _calibrate(self) -> list[tuple[int, float]]:
        """On the engine thread, before the first prefill: this engine's prefill time at two sizes,
        one block and one chunk (the faster of two runs each: a shape's first run pays one-off
        costs). Every fit (`cost`) has them, so the per-token part is measured on more than one
        size from the start, whatever sizes the traffic brings. Not in `__init__`: there the
        graph's other replicas load and warm up on the same cores, and a calibration measured 24x
        this engine's time (180 ms + 6.2 ms/token, against 6 ms + 0.26), which refused a fresh
        graph's first prompts. Uncached: the second run of a size starts one token later. A pool
        too full to calibrate leaves it to the next prefill; with none, the fit has the samples."""
        out = []
        for n in (self.engine.block_size, PREFILL_CHUNK_TOKENS):
            runs = []
            for i in range(2):
                try:
                    seq = self.engine.add(f"calibrate-{n}-{i}", [3 + (t + i) % 250 for t in range(n)],
                                          SamplingParams(1, ignore_eos=True))
                except (PoolFullError, RequestError):  # full now, or a model whose context is shorter
                    return []
                try:
                    t0 = time.perf_counter()
                    self.engine.prefill(seq, use_cache=False, chunk_tokens=PREFILL_CHUNK_TOKENS)
                    runs.append(time.perf_counter() - t0)
                finally:
                    self.engine.release(seq, cache=False)
            out.append((n, min(runs)))
        return out

    async def _prefill_admitted(self, preq: PrefillRequest, stop: _Stop) -> PrefillResult:
        from pdd_serve.transport.object_store import put_kv

        req = preq.req
        link_t = self.link.now() if self.link.config.paced else None
        held = self._reserve_send(req, preq.md_target)
        try:
            seq = await self.worker.call(self._admit, req, stop)
        except BaseException as e:
            self._unreserve(held)
            if isinstance(e, asyncio.CancelledError):
                self.abandoned += 1  # the caller went away before admission: nothing was computed
            raise
        feed = (BlockFeed(preq.md_target, self._take_fault("link"), self.clock.real(self.cfg.flight.deadline_s),
                           held) if preq.md_target is not None else None)
        die = self._take_fault("die_in_prefill")
        if feed is not None:
            t = preq.md_target
            end = blocks_needed(seq.prompt_len, self.engine.block_size) if t.end_block is None else t.end_block
            self.on_line[(req.request_id, id(feed))] = (
                max(0, end - t.start_block) * self.engine.layout.block_bytes * self.kv_scale, self.link.now())
            self._start_sender(req.request_id, feed)
        t0 = time.perf_counter()
        kv_ref = None
        self.prefilling += 1
        try:
            def on_chunk(s: Sequence) -> None:
                if die is not None:  # injected: the process dies mid-prefill, as on a lost host
                    logger.warning("injected fault: prefill replica exits mid-prefill")
                    os._exit(1)
                if feed is not None:
                    feed.on_chunk(self.engine, s)
                if s.num_computed < s.prompt_len:  # work left: stop it; after the last chunk, keep the result
                    stop.check(req.request_id)

            first, finish, kv = await self.worker.call(self._prefill_once, seq, on_chunk, preq.to_relay, stop)
            if kv is not None:  # a full copy into the object store: off the event loop
                kv_ref = await asyncio.to_thread(put_kv, kv)
        except BaseException as e:
            stop.cancelled.set()  # a call cancelled while its job waits or runs: the job stops too
            if isinstance(e, asyncio.CancelledError) and not stop.started:
                self.abandoned += 1  # its job was still queued: it will not run at all
            if feed is not None:  # after its last block this changes nothing: the transfer is whole
                feed.abort(f"prefill of {req.request_id} failed: {type(e).__name__}")
            raise
        finally:
            self.prefilling -= 1
        wan = int(feed.nbytes * self.kv_scale) if feed is not None else 0
        relay_bytes = int(kv.num_tokens * self.engine.layout.bytes_per_token * self.kv_scale) if kv is not None else 0
        return PrefillResult(first, finish, seq.prefix_hit_tokens, self.clock.emulated(time.perf_counter() - t0),
                             wan, kv_ref, self.bw.bps, link_t, relay_bytes)

    def _reserve_send(self, req: GenRequest, target: KVTarget | None) -> int:
        """Count the KV this request will put on the line against the replica's send buffer, or
        refuse it (PoolFullError: the router's overload path) when the buffer is full."""
        if target is None:
            return 0
        bs = self.engine.block_size
        end = blocks_needed(len(req.prompt_token_ids), bs) if target.end_block is None else target.end_block
        need = max(0, end - target.start_block) * self.engine.layout.block_bytes
        cap = self.send_cap()
        with self._send_lock:
            if self.send_buffered and self.send_buffered + need > cap:
                self.send_refused += 1
                raise PrefillSendFull(f"this Prefill replica holds {self.send_buffered} bytes of KV still on the "
                                      f"line (its cap {cap}: flight.send_buffer_bytes, or what the line drains "
                                      f"within policy.kv_wait_timeout_s): {req.request_id} is retried "
                                      "elsewhere or later")
            self.send_buffered += need
        return need

    def send_cap(self) -> int:
        """Real KV bytes this replica holds for the line at most: flight.send_buffer_bytes, and no
        more than the line drains, at its live rate, within MD's wait for KV
        (policy.kv_wait_timeout_s): a transfer queued behind more reaches MD after MD stopped
        waiting for it, so its blocks would only grow this replica's memory (the soak's 2x
        overload grew Prefill by 500 MiB on a 16 Mbit/s line before this bound)."""
        cap = self.cfg.flight.send_buffer_bytes
        bps = self.bw.bps  # emulated bits/s, and the timeout in emulated seconds: / kv_scale is real bytes
        if bps:
            cap = min(cap, int(bps / 8 * self.cfg.policy.kv_wait_timeout_s / self.kv_scale))
        return cap

    def _unreserve(self, nbytes: int) -> None:
        with self._send_lock:
            self.send_buffered -= nbytes

    def _admit(self, req: GenRequest, stop: _Stop) -> Sequence:
        """On the engine thread: admission reads the pool and the prefix cache that thread changes,
        and hashes the prompt. Past the budget already (queued behind a burst): refused, not run."""
        try:
            stop.check(req.request_id)
        except PrefillAbandoned:
            self.abandoned += 1
            raise
        try:
            return self.engine.add(req.request_id, list(req.prompt_token_ids), req.params, req.block_hashes)
        except PoolFullError as e:  # named as Prefill's pool for the Router's 503
            raise PrefillPoolFull(str(e)) from None

    def _prefill_once(self, seq: Sequence, on_chunk: Callable[[Sequence], None],
                      to_relay: bool, stop: _Stop | None = None) -> tuple[int, str | None, KVBlocks | None]:
        """On the engine thread: prefill, export the prompt's KV for the relay and release, as one
        call. As three queued calls, a request came back only after every prefill submitted before
        its release: in a burst, the first request waited for the whole burst's prefill."""
        try:
            if stop is not None:  # queued behind a burst past its budget, or its caller gone: skip it
                stop.started = True
                stop.check(seq.request_id)
            if not self._calibration:
                self._calibration = self._calibrate()
            t0 = time.perf_counter()
            first = self.engine.prefill(seq, chunk_tokens=PREFILL_CHUNK_TOKENS, on_chunk=on_chunk)
            self._done.append((seq.prompt_len - seq.prefix_hit_tokens, time.perf_counter() - t0))
            finish = seq.finish_reason  # read before release, which marks unfinished sequences aborted
            return first, finish, (self.engine.export_kv(seq) if to_relay else None)
        except PrefillAbandoned:
            self.abandoned += 1  # on the engine thread, where the work stopped
            raise
        finally:
            self.engine.release(seq)

    def _start_sender(self, request_id: str, feed: BlockFeed) -> None:
        from pdd_serve.transport.flight import KVFlightClient, SenderAborted, UnknownRequestError

        fl = self.cfg.flight

        def send() -> None:
            with self._send_lock:
                self.transfers["started"] += 1
                self.sending += 1
                alone, started = self.sending == 1, self.transfers["started"]
                shared = getattr(self.link, "shared", 0)  # bookings that met another replica's stream
            try:
                client = KVFlightClient(feed.target.flight_location, fl.token, layout=self.engine.layout,
                                        tls_root_cert=fl.tls_root_cert, override_hostname=fl.tls_server_name,
                                        mac_key=fl.mac_key, batch_blocks=fl.batch_blocks, parallel_streams=fl.streams,
                                        deadline_s=self.clock.real(fl.deadline_s),
                                        link=self.link if self.link.config.paced else None)
                stats = client.push(request_id, iter(feed))
                with self._send_lock:  # sender threads and stats readers share the counters
                    # none of this replica's began meanwhile, nor did another replica's stream share the line
                    alone = alone and self.transfers["started"] == started and getattr(self.link, "shared", 0) == shared
                    self.transfers["done"] += 1
                    self.transfers["bytes"] += stats.bytes_sent
                if alone and stats.bytes_sent * self.kv_scale >= BW_SAMPLE_MIN_BYTES:  # emulated bytes, seconds
                    self.bw.observe(stats.bytes_sent * self.kv_scale, self.clock.emulated(stats.seconds))
            except UnknownRequestError:  # MD released it first (cancelled, or RLD finished it)
                self._count("dropped")
            except SenderAborted:  # prefill failed: MD was told (the client's `abort`)
                self._count("aborted")
            except Exception as e:  # MD's bounded wait turns this into a fallback
                self._count("failed")
                logger.warning("KV transfer of %s failed: %s", request_id, e)
            finally:
                with self._send_lock:
                    self.sending -= 1
                    self.send_buffered -= feed.reserved  # the transfer ended: its blocks left the buffer
                self.on_line.pop((request_id, id(feed)), None)

        self._senders.submit(send)

    def _count(self, outcome: str) -> None:
        with self._send_lock:
            self.transfers[outcome] += 1

    def line_state(self) -> LineState:
        """The bytes this replica still has to push across the line, per transfer (a transfer
        leaves the moment its push ends; meanwhile it drains at a fair share of the line)."""
        flows = list(self.on_line.values())
        bps = self.bw.bps  # the line's rate, reported whole
        # on a shared line, this replica's transfers drain at their share of it (other replicas'
        # streams take theirs; the Routers sum every replica's report)
        drain = None if bps is None else bps * (self.link.share() if isinstance(self.link, SharedLine) else 1.0)
        left = wan_backlog(flows, self.link.now(), float("inf") if drain is None else drain / 8)
        return LineState(self.replica, tuple(b for b in left if b > 0), bps)

    def record_routing_stats(self) -> dict:
        # a replica whose send buffer is full refuses any prefill with KV for MD: not the least loaded
        full = self.send_buffered >= self.send_cap()
        return {"running": self.worker.max_batch if full else self.prefilling, "capacity": self.worker.max_batch}

    def inject(self, fault: str, seconds: float = 0.0, count: int = 1) -> None:
        """Fault injection for tests and the soak (policy.allow_fault_injection): the next `count`
        transfers `stall` for `seconds` or are `cut` mid-transfer; `die_in_prefill` kills this
        replica's process during the next prefill."""
        if not self.cfg.policy.allow_fault_injection:
            raise PermissionError("fault injection is off (policy.allow_fault_injection)")
        if fault in ("stall", "cut"):
            self.faults["link"] = [(fault, seconds)] * count
        elif fault == "die_in_prefill":
            self.faults["die_in_prefill"] = [("die", 0.0)] * count
        else:
            raise ValueError(f"unknown prefill fault {fault!r}")

    def _take_fault(self, kind: str) -> tuple[str, float] | None:
        pending = self.faults.get(kind)
        return pending.pop() if pending else None

    def check_health(self) -> None:  # Serve's health probe: a failed engine gets this replica replaced
        check_engine(self.engine)

    def stats(self) -> ReplicaStats:
        e, cost = self.engine, self.cost
        with self._send_lock:  # one consistent snapshot of the sender threads' counters
            transfers = dict(self.transfers)
        return ReplicaStats("prefill", self.worker.num_running, e.pool.num_free, e.pool.num_blocks,
                            e.cache.num_blocks, e.cache.stats.hit_rate,
                            {**transfers, "prefills_abandoned": self.abandoned, "context_mismatches": e.context_mismatches, "send_buffered_bytes": self.send_buffered,
                             "send_cap_bytes": self.send_cap(),
                             "send_refused": self.send_refused, "prefills_shed": self.shed, "queued_prefills": self.queued,
                             "queued_tokens": self.queued_tokens, "prefill_cost": cost and dataclasses.asdict(cost),
                             "line_shared_bookings": getattr(self.link, "shared", 0),
                             "line_errors": getattr(self.link, "errors", 0), "replica": self.replica,
                             **emulation_stats(e, self.worker.max_batch), **self.where})
