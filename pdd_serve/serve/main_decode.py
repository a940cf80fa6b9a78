"""Main decode (MD), site B: Flight server for KV, decode-side radix cache (DRC), continuous
batching, and `extend` over the token ids a relay hands off."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from ray import serve

from pdd_serve.config import PDDConfig
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.pacer import build_emulation
from pdd_serve.engine.engine import Sequence
from pdd_serve.engine.kv import blocks_needed
from pdd_serve.engine.worker import EngineWorker
from pdd_serve.metrics import ReplicaGauges
from pdd_serve.serve.common import (
    batch_cap,
    check_engine,
    emulation_stats,
    graph_link,
    load_engine,
    logger,
    placement,
    take_over,
)
from pdd_serve.serve.messages import GenRequest, KVReady, MDPrepareReply, MDView, ReplicaStats, TokenChunk
from pdd_serve.serve.pinning import ROUTER_CLASS, ReplicaGone, check_pin, this_replica
from pdd_serve.serve.tasks import spawn
from pdd_serve.transport.base import KVReceiver


class MDRequestError(RuntimeError):
    """The router asked about a request this MD replica does not hold (restarted, aborted)."""


EXPECT_WAIT_FLOOR_S = 2.0  # Serve's dispatch of a prepare + MD's admission, under load (emulated seconds)


# One deployment, any number of replicas (`num_replicas` or an `autoscaling_config` in the graph):
# Serve's request router pins every call about a request to the replica that holds it
# (`pinning.py`). No per-call access log: every router polls `routing_view` several times a
# second (the Router's own access log shows every request; a graph's `logging_config` can turn
# this back on).

@serve.deployment(max_ongoing_requests=512, health_check_period_s=5, logging_config={"enable_access_log": False},
                  graceful_shutdown_timeout_s=30,
                  request_router_config={"request_router_class": ROUTER_CLASS,
                                         "request_routing_stats_period_s": 1.0})
class MainDecode:
    def __init__(self, cfg: PDDConfig, replica: str | None = None) -> None:
        self.cfg = cfg
        self.replica = replica or this_replica()
        self.clock = Clock(cfg.time_scale)  # slow motion: real seconds waited, emulated ones reported
        self.engine = load_engine(cfg.engine_for("main_decode"), enable_prefix_cache=cfg.policy.drc,
                                  emulation=build_emulation(cfg, "main_decode"), clock=self.clock)
        self.worker = EngineWorker(self.engine, batch_cap(cfg, "main_decode", self.engine))
        self.where = placement()
        self.started_at = time.time()
        self.flight = self._new_flight()
        self.seqs: dict[str, Sequence] = {}
        self._kv: dict[str, asyncio.Task] = {}
        # a decode call waiting for its KV leaves its extend here; the import runs it in the same
        # engine-thread call, before the batch loop's next step can take the thread (a step lost)
        self._extend_on_import: dict[str, Callable[[Sequence, float], None]] = {}
        self._t_prepare: dict[str, float] = {}
        self._calls: dict[str, int] = {}  # router calls in progress per request
        self._touched: dict[str, float] = {}  # last router activity per request
        # prepare now runs concurrently with prefill: a router call may overtake it on the line
        self._registered: dict[str, asyncio.Event] = {}
        # aborts that overtook their prepare: request -> (attempt, when); a prepare of that attempt
        # or an earlier one is refused when it lands, a later attempt (a re-delivery) is not
        self._aborted: dict[str, tuple[int, float]] = {}
        self._attempt: dict[str, int] = {}  # the attempt each registered request came with
        self._reaper_task: asyncio.Task | None = None
        self.pin_refusals = 0  # calls pinned to a replica that is gone (they reached this one)
        logger.info("MainDecode replica %s: Flight at %s", self.replica, self.flight.location)
        self._gauges = ReplicaGauges.watch("main_decode", self.stats)  # pdd_replica_requests / kv_usage

    # ------------------------------------------------------------ control plane

    def record_routing_stats(self) -> dict:
        """Serve's routing stats (polled by the controller, handed to every request router): the
        load an unpinned call is routed by. The DRC's hashes go by `routing_view`, which the
        routers poll directly, more often and only when changed."""
        return {"running": len(self.seqs), "capacity": self.worker.max_batch, "free_blocks": self.engine.pool.num_free}

    def routing_view(self, known: tuple[str, int] | None = None) -> MDView:
        """What this replica caches and how loaded it is, for the routers' background view (their
        affinity and pipeline input). The block hashes are sent only when they changed."""
        cache = self.engine.cache
        if cache is not None:
            cache.refresh(wait=False)  # a vLLM engine's view trails its events; an idle engine drains none
        version = cache.stats.inserted_blocks + cache.stats.evicted_blocks if cache is not None else 0
        epoch = f"{self.started_at}:{self.flight.location}"
        # list(dict) runs in C under the GIL: a consistent copy while the engine thread inserts
        hashes = None if known == (epoch, version) else tuple(cache.nodes) if cache is not None else ()
        return MDView(self.replica, epoch, version, hashes, len(self.seqs), self.worker.max_batch,
                      self.flight.location, cache.hit_unit if cache is not None else 1)

    async def prepare(self, req: GenRequest, planned_start: int | None = None) -> MDPrepareReply:
        """Register a request: adopt its DRC prefix and expect the rest of the prompt over Flight.

        `planned_start` is the block the router's view told Prefill to send from (Prefill is
        already sending). Holding more than that, MD adopts only `planned_start` blocks and takes
        the rest from the stream (the stale view costs bytes); holding less, it expects from its
        own start and the router has Prefill send the gap."""
        rid = req.request_id
        self._pinned()
        try:
            self._refuse_if_aborted(req)
            if rid in self.seqs:  # a re-delivery after a lost transfer: start the request over
                await self._drop(rid, cache=False)
            # one engine-thread call: admission (it reads the pool and the cache it changes) and
            # the DRC match. Each call waits for the decode step in flight, and the _run loop
            # queues the next step as soon as one ends, so a second call would wait a whole step
            # more before MD expects the KV (and Prefill's stream can land)
            admit = asyncio.ensure_future(self.worker.call(self._admit, req, planned_start))
            try:
                seq, hit = await asyncio.shield(admit)
            except asyncio.CancelledError:  # the engine thread still runs it: give back what it adopts
                admit.add_done_callback(self._give_back_admitted)
                raise
        except BaseException:
            self._wake(rid)  # a call that overtook this prepare learns at once that it failed
            raise
        try:
            self._refuse_if_aborted(req)  # an abort that landed during the await
            bs = self.engine.block_size
            start = hit // bs
            n = blocks_needed(seq.prompt_len, bs) - start
            hashes = self.engine.hash_chain(seq, seq.prompt_len)[start:]
            hashes += [0] * (n - len(hashes))  # a trailing partial block has no identity
            self.flight.expect(rid, n, start_block=start, num_tokens=seq.prompt_len - hit, hashes=hashes)
        except BaseException:  # nothing registered: give back the adopted prefix blocks
            seq.finish_reason = "abort"
            await self.worker.release(seq, cache=False)
            self._wake(rid)
            raise
        self.seqs[rid] = seq
        self._attempt[rid] = req.attempt
        self._wake(rid)
        self._t_prepare[req.request_id] = self._touched[req.request_id] = time.monotonic()
        if self._reaper_task is None or self._reaper_task.done():
            self._reaper_task = asyncio.get_running_loop().create_task(self._reaper())
        return MDPrepareReply(self.replica, hit, start, n, self.flight.location)

    def _admit(self, req: GenRequest, planned_start: int | None) -> tuple[Sequence, int]:
        """On the engine thread: create the request's state and adopt its DRC prefix (hit tokens)."""
        seq = self.engine.add(req.request_id, list(req.prompt_token_ids), req.params, req.block_hashes)
        if self.engine.cache is None:
            return seq, 0
        try:
            return seq, self.engine.match_prefix(seq, planned_start)
        except BaseException:
            seq.finish_reason = "abort"
            self.engine.release(seq, cache=False)
            raise

    def _give_back_admitted(self, admit: asyncio.Future) -> None:
        if not admit.cancelled() and admit.exception() is None:
            seq, _ = admit.result()
            seq.finish_reason = "abort"
            spawn(self.worker.release(seq, cache=False))

    async def wait_kv(self, request_id: str, timeout_s: float) -> KVReady:
        """Wait (bounded) until the prompt's KV has arrived and is loaded."""
        self._pinned()
        with self._call(request_id):
            return await self._wait_kv(request_id, timeout_s)

    async def _wait_kv(self, request_id: str, timeout_s: float) -> KVReady:
        # one budget for the whole wait: a prepare that arrives late leaves the KV only the rest
        # (the Router's silence timer is sized to timeout_s, and MD's reason must reach it first)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        seq = await self._seq_registered(request_id, timeout_s)
        if seq.num_computed >= seq.prompt_len:
            return KVReady(True, 0, 0.0)
        task = self._kv.get(request_id)
        if task is None:
            task = self._kv[request_id] = loop.create_task(self._receive(request_id, seq))
        try:
            return await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return KVReady(False, error=f"KV for {request_id} not complete after {timeout_s:.1f}s")
        except asyncio.CancelledError:
            if task.cancelled() and not asyncio.current_task().cancelling():
                self._kv.pop(request_id, None)
                return KVReady(False, error=f"the transfer of {request_id} was lost (Flight server restarted)")
            raise

    async def _receive(self, request_id: str, seq: Sequence) -> KVReady:
        try:
            got = await self.flight.wait_complete(request_id, self.clock.real(self.cfg.flight.deadline_s))
            landed = time.perf_counter()  # the stream is complete: the rest is the engine thread's
            # joining the received runs copies the whole delta: on the engine thread, not the event
            # loop; the Flight server verified every block's CRC on arrival, once per hop is enough
            def load() -> None:
                self.engine.import_kv(seq, got.blocks, verify=not self.flight.verify_checksums)
                then = self._extend_on_import.pop(request_id, None)
                if then is not None:
                    then(seq, landed)

            await self.worker.call(load)
            return KVReady(True, got.bytes_received, got.seconds)
        except Exception as e:  # a broken transfer is reported, the router falls back
            return KVReady(False, error=f"{type(e).__name__}: {e}")
        finally:
            self.flight.release(request_id)

    async def handoff_batch(self, request_id: str, token_ids: list[int], timeout_s: float) -> int:
        """Catch-up handoff: build KV for a batch of committed tokens (no sampling yet).
        Returns how many output tokens MD now holds."""
        self._pinned()
        with self._call(request_id):
            seq = await self._ready(request_id, timeout_s)
            if token_ids:
                await self.worker.call(self.engine.extend, seq, list(token_ids), sample=False)
            return len(seq.output_ids)

    async def decode(self, request_id: str, committed: list[int], timeout_s: float) -> AsyncIterator[TokenChunk]:
        """Take over a request: extend over the committed tokens MD lacks, then decode in the
        shared batch. `committed` is everything the client has seen (the router's truth)."""
        self._pinned()
        final: TokenChunk | None = None
        self._calls[request_id] = self._calls.get(request_id, 0) + 1  # decoding: never an orphan
        try:
            t0 = time.perf_counter()
            first: list = []  # (KV landed, extend start, token or error) once the import ran the extend

            def extend_on_import(seq: Sequence, landed: float) -> None:  # on the engine thread, after the import
                t = time.perf_counter()
                try:
                    first.append((landed, t, self._extend_committed(seq, committed)))
                except Exception as e:  # noqa: BLE001 - raised below, on this call's path
                    first.append((landed, t, e))

            self._extend_on_import[request_id] = extend_on_import
            try:
                seq = await self._ready(request_id, timeout_s)
            finally:
                waiting = self._extend_on_import.pop(request_id, None) is not None
            if waiting:  # the KV was already in (or came by another path): extend now
                landed = t1 = time.perf_counter()
                tok = await self.worker.call(self._extend_committed, seq, committed)
            else:
                if not first:  # the import took it and is running it on the engine thread now
                    await self.worker.call(lambda: None)  # (one thread, FIFO: done after this)
                landed, t1, tok = first[0]
                if isinstance(tok, BaseException):
                    raise tok
            emulated = self.clock.emulated  # reported in emulated seconds
            # md_kv_wait_s = the stream's rest after the call landed (md_kv_land_s) + the import's
            # wait for the engine thread and the import itself
            timings = {"md_kv_wait_s": emulated(t1 - t0), "md_kv_land_s": emulated(max(0.0, landed - t0)),
                       "md_step_s": emulated(time.perf_counter() - t1)}
            if seq.finish_reason is not None:
                final = TokenChunk([tok], seq.finish_reason, timings)
            else:
                yield TokenChunk([tok], timings=timings)
                async with contextlib.aclosing(self.worker.decode(seq)) as steps:
                    async for step in steps:
                        if step.finish_reason is not None:
                            final = TokenChunk(step.token_ids, step.finish_reason)
                            break
                        yield TokenChunk(step.token_ids)
        finally:
            self._uncall(request_id)
            await self._drop(request_id, cache=final is not None)
        if final is not None:  # released first: the last chunk leaves nothing behind
            yield final

    def _extend_committed(self, seq: Sequence, committed: list[int]) -> int:
        """On the engine thread: extend over the committed tokens MD lacks and sample the next."""
        have = len(seq.output_ids)
        if seq.output_ids != list(committed[:have]):
            raise MDRequestError(f"{seq.request_id}: MD holds tokens that differ from the committed stream")
        hit = seq.prefix_hit_tokens
        return take_over(self.engine, seq, list(committed[have:]), f"MainDecode {self.replica}",
                         f"DRC hit {hit} tokens, {seq.num_computed - hit} imported or handed off")

    async def absorb(self, request_id: str, output_ids: list[int], timeout_s: float) -> bool:
        """The relay finished a request before the handoff: build the output's KV anyway so MD's
        DRC stays aligned with P's (docs/pdd.md: both pipelines end at MD)."""
        self._pinned()
        try:
            seq = await self._ready(request_id, timeout_s)
            new = list(output_ids[len(seq.output_ids):])
            if len(new) > 1:
                await self.worker.call(self.engine.extend, seq, new[:-1], sample=False)
            seq.finish_reason = "stop"
            return True
        except Exception as e:
            logger.warning("absorb %s failed: %s", request_id, e)
            return False
        finally:
            await self._drop(request_id, cache=True)

    async def abort(self, request_id: str, attempt: int | None = None) -> bool:
        """Drop a request (`attempt`: only that registration or an earlier one; None: any)."""
        self._pinned()
        held = self._attempt.get(request_id)
        if held is not None and attempt is not None and held > attempt:
            return False  # a later re-delivery holds it now: this abort is stale
        known = request_id in self.seqs
        if not known and attempt is not None:  # its prepare may still be on the line: refuse it
            old = self._aborted.get(request_id, (-1, 0.0))[0]
            self._aborted[request_id] = (max(old, attempt), time.monotonic())
        await self._drop(request_id, cache=False)
        self._wake(request_id)  # a call waiting for the registration fails now, not at its timeout
        return known

    async def inject(self, fault: str) -> str:
        """Fault injection for tests and the soak (policy.allow_fault_injection): `restart_flight`
        closes the Flight server and opens a new one on another port; transfers in flight are lost."""
        if not self.cfg.policy.allow_fault_injection:
            raise PermissionError("fault injection is off (policy.allow_fault_injection)")
        if fault != "restart_flight":
            raise ValueError(f"unknown MD fault {fault!r}")
        old, self.flight = self.flight, self._new_flight()
        for task in list(self._kv.values()):
            task.cancel()  # their requests get KVReady(ok=False) and are re-delivered by the router
        old.close()
        return self.flight.location

    def check_health(self) -> None:  # Serve's health probe: a failed engine gets this replica replaced
        check_engine(self.engine)

    def stats(self) -> ReplicaStats:
        e = self.engine
        return ReplicaStats("main_decode", len(self.seqs), e.pool.num_free, e.pool.num_blocks,
                            e.cache.num_blocks if e.cache else 0, e.cache.stats.hit_rate if e.cache else 0.0,
                            {"flight": self.flight.location, "replica": self.replica, "calls": len(self._calls),
                             "registering": len(self._registered), "pin_refusals": self.pin_refusals,
                             "context_mismatches": e.context_mismatches, "held": sorted(self.seqs),
                             "worker_running": self.worker.num_running,
                             "flight_bytes_reserved": self.flight.bytes_reserved, "started_at": self.started_at,
                             "preemptions": e.preemptions, **emulation_stats(e, self.worker.max_batch),
                             **self.where})

    # ------------------------------------------------------------ helpers

    async def _reap_orphans(self) -> None:
        """Drop requests no router call has touched for a while (a router that gave up on this
        replica, or a client stream cancelled before its abort arrived): nothing leaks."""
        grace = 2 * self.clock.real(self.cfg.policy.kv_wait_timeout_s)
        now = time.monotonic()
        for rid, (_, t) in list(self._aborted.items()):
            if now - t > grace:
                del self._aborted[rid]
        for rid, t in list(self._touched.items()):
            if now - t > grace and not self._calls.get(rid):
                await self._drop(rid, cache=False)

    async def _reaper(self) -> None:
        while True:
            await asyncio.sleep(self.clock.real(self.cfg.policy.kv_wait_timeout_s) / 2)
            await self._reap_orphans()

    @contextlib.contextmanager
    def _call(self, request_id: str):  # noqa: ANN202 - marks a router call in progress for the reaper
        self._calls[request_id] = self._calls.get(request_id, 0) + 1
        try:
            yield
        finally:
            self._uncall(request_id)
            if request_id in self.seqs:
                self._touched[request_id] = time.monotonic()

    def _pinned(self) -> None:
        """Refuse (and count) a call pinned to another replica: that one is gone, the router migrates."""
        try:
            check_pin(self.replica)
        except ReplicaGone:
            self.pin_refusals += 1
            raise

    def _uncall(self, request_id: str) -> None:
        """A router call ended; the count goes with the request once none is left (a `_drop`
        during the call could not remove it)."""
        n = self._calls.get(request_id, 0) - 1
        if n > 0 or request_id in self.seqs:
            self._calls[request_id] = max(n, 0)
        else:
            self._calls.pop(request_id, None)

    def _new_flight(self) -> KVReceiver:
        from pdd_serve.transport.flight import KVFlightServer

        fl = self.cfg.flight
        server = KVFlightServer(fl.bind_host, fl.port, layout=self.engine.layout, token=fl.token,
                                tls_cert=fl.tls_cert, tls_key=fl.tls_key, advertise_host=fl.advertise_host,
                                max_bytes_per_request=fl.max_bytes_per_request, max_bytes_total=fl.max_bytes_total,
                                mac_key=fl.mac_key)
        # a push may land before its `expect`: the prepare crosses the control plane (one way)
        # while Prefill computes its first chunk, then waits for Serve's dispatch and this
        # replica's engine thread. The wait: that dispatch floor plus the line's one-way delay
        # twice (the base delay of the emulated link; a trace's extra delay is not known here),
        # in slow motion when emulated
        one_way = graph_link(self.cfg, self.engine.layout.bytes_per_token).config.one_way_latency_s
        server.expect_wait_s = self.clock.real(EXPECT_WAIT_FLOOR_S + 2 * one_way)
        return server

    def _seq(self, request_id: str) -> Sequence:
        seq = self.seqs.get(request_id)
        if seq is None:
            raise MDRequestError(f"request {request_id} is not registered at MD replica {self.replica}")
        return seq

    async def _seq_registered(self, request_id: str, timeout_s: float) -> Sequence:
        """The request's sequence, waiting (bounded) for a prepare that this call overtook; a
        prepare that fails or an abort wakes it at once."""
        if request_id not in self.seqs and request_id not in self._aborted:
            ev = self._registered.setdefault(request_id, asyncio.Event())
            try:
                await asyncio.wait_for(ev.wait(), min(timeout_s, self.clock.real(self.cfg.policy.kv_wait_timeout_s)))
            except asyncio.TimeoutError:
                pass
            finally:  # also when the caller went away (a cancelled stream)
                if self._registered.get(request_id) is ev and not ev.is_set():
                    del self._registered[request_id]
        return self._seq(request_id)

    def _wake(self, request_id: str) -> None:
        ev = self._registered.pop(request_id, None)
        if ev is not None:
            ev.set()

    def _refuse_if_aborted(self, req: GenRequest) -> None:
        gone = self._aborted.get(req.request_id)
        if gone is not None and gone[0] >= req.attempt:
            del self._aborted[req.request_id]
            raise MDRequestError(f"request {req.request_id} was aborted before its prepare arrived")

    async def _ready(self, request_id: str, timeout_s: float) -> Sequence:
        ready = await self.wait_kv(request_id, timeout_s)
        if not ready.ok:
            raise TimeoutError(ready.error)
        return self._seq(request_id)

    async def _drop(self, request_id: str, cache: bool) -> None:
        seq = self.seqs.pop(request_id, None)
        self._attempt.pop(request_id, None)
        task = self._kv.pop(request_id, None)
        self._t_prepare.pop(request_id, None)
        self._touched.pop(request_id, None)
        if not self._calls.get(request_id):
            self._calls.pop(request_id, None)
        if task is not None and not task.done():
            task.cancel()
        self.flight.release(request_id)
        if seq is not None:
            if not cache and seq.finish_reason is None:
                seq.finish_reason = "abort"
            await self.worker.release(seq, cache=cache)

    def __del__(self) -> None:
        flight = getattr(self, "flight", None)
        if flight is not None:
            flight.close()
