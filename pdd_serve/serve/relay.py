"""Relay decode (RLD), site A: a small pool beside Prefill that starts decoding the moment the KV is
in the local object store, streaming eager tokens while the KV crawls to MD. It stops when the
router cancels its stream at the handoff; its KV is freed then."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator

from ray import serve

from pdd_serve.config import PDDConfig
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.pacer import build_emulation
from pdd_serve.engine.worker import EngineWorker
from pdd_serve.metrics import ReplicaGauges
from pdd_serve.serve.common import (
    batch_cap,
    check_engine,
    emulation_stats,
    load_engine,
    logger,
    placement,
    take_over,
)
from pdd_serve.serve.messages import RelayRequest, RelaySaturated, ReplicaStats, TokenChunk
from pdd_serve.serve.pinning import ROUTER_CLASS


def relay_share(max_running: int, replicas: int) -> int:
    """Each relay replica's share of `policy.relay_max_running` (the pool never holds more)."""
    return max(1, max_running // max(1, replicas))


# how often a replica recounts the pool's live replicas: the graph's `deployments:` entry (or an
# autoscaler) may run more or fewer than `sites.relay_replicas`
RECOUNT_S = 5.0


# `generate` goes to the least loaded replica by the replicas' routing stats (`pinning.py`), which
# also give every router the pool's load.
@serve.deployment(max_ongoing_requests=64,
                  request_router_config={"request_router_class": ROUTER_CLASS,
                                         "request_routing_stats_period_s": 0.5})
class Relay:
    def __init__(self, cfg: PDDConfig) -> None:
        self.cfg = cfg
        self.clock = Clock(cfg.time_scale)  # slow motion: real seconds waited, emulated ones reported
        # no prefix cache: RLD receives every prompt's KV from P; it holds KV only while it relays
        self.engine = load_engine(cfg.engine_for("relay"), enable_prefix_cache=False,
                                  emulation=build_emulation(cfg, "relay"), clock=self.clock)
        self.worker = EngineWorker(self.engine, batch_cap(cfg, "relay", self.engine))
        self.where = placement()
        self.tokens_generated = 0
        self.live: set[str] = set()  # requests holding KV here
        self.peak_live = 0
        self.die_after: int | None = None  # injected: the process exits after this many more tokens
        # the relay pool admits at most policy.relay_max_running in total, whichever routers send:
        # each replica takes its share (the pool's admission is decided here, not by a router)
        self.max_running = relay_share(cfg.policy.relay_max_running, cfg.sites.relay_replicas)
        self._counted_at = -RECOUNT_S  # the first request counts the pool (a replica added by a scale-up)
        self._recounting: asyncio.Task | None = None
        self._gauges = ReplicaGauges.watch("relay", self.stats)  # pdd_replica_requests / kv_usage

    async def generate(self, rreq: RelayRequest) -> AsyncIterator[TokenChunk]:
        """Decode from the prompt KV in the object store, after the `committed` tokens, until the
        request finishes or the router cuts the stream (the handoff)."""
        from pdd_serve.transport.object_store import get_kv

        req = rreq.req
        self._maybe_recount()
        if len(self.live) >= self.max_running:
            # admission control: an overloaded relay pool is how PDD fails (docs/pdd.md), so refuse
            raise RelaySaturated(f"relay replica holds {len(self.live)} requests, its share of "
                                 f"policy.relay_max_running ({self.max_running})")
        self.live.add(req.request_id)  # counted before any await: the check above stays atomic
        self.peak_live = max(self.peak_live, len(self.live))
        try:  # admission reads the pool and the cache and hashes the prompt: on the engine thread
            seq = await self.worker.call(self.engine.add, req.request_id, list(req.prompt_token_ids), req.params,
                                        req.block_hashes)
        except BaseException:
            self.live.discard(req.request_id)
            raise
        final: TokenChunk | None = None
        try:
            # a local object store read (zero-copy); off the event loop so other streams keep flowing
            blocks = await asyncio.to_thread(get_kv, rreq.kv_ref, self.cfg.policy.kv_wait_timeout_s,
                                             layout=self.engine.layout)
            await self.worker.call(self.engine.import_kv, seq, blocks, verify=False)  # get_kv verified them
            del blocks
            if len(rreq.committed) > 1:  # taking over mid-stream (a fallback): rebuild from token ids
                tok = await self.worker.call(take_over, self.engine, seq, list(rreq.committed), "Relay",
                                             f"{seq.num_computed} prompt tokens from the object store")
                self.tokens_generated += 1
                if seq.finish_reason is not None:
                    final = TokenChunk([tok], seq.finish_reason)
                else:
                    yield TokenChunk([tok])
            else:
                self.engine.append_tokens(seq, list(rreq.committed))
            if final is None:
                async with contextlib.aclosing(self.worker.decode(seq)) as steps:
                    async for step in steps:
                        self.tokens_generated += len(step.token_ids)
                        self._maybe_die(len(step.token_ids))
                        if step.finish_reason is not None:
                            final = TokenChunk(step.token_ids, step.finish_reason)
                            break
                        yield TokenChunk(step.token_ids)
        finally:
            try:  # the release is shielded, but a cancel still interrupts this await: discard regardless
                await self.worker.release(seq, cache=False)
            finally:
                self.live.discard(req.request_id)
        if final is not None:  # after the release: nothing is left to clean once the caller has it
            yield final

    def _maybe_recount(self) -> None:
        """Keep this replica's share right when the pool has more or fewer replicas than the graph's
        `sites.relay_replicas` (a `num_replicas` in `deployments:`, a replica lost or restarting).
        In the background: a request never waits on the GCS for it."""
        if time.monotonic() - self._counted_at >= RECOUNT_S and self._recounting is None:
            self._counted_at = time.monotonic()
            self._recounting = asyncio.get_running_loop().create_task(self._recount())

    async def _recount(self) -> None:
        from pdd_serve.serve.pinning import replica_actors

        try:
            ctx = serve.get_replica_context()
            n = len(await asyncio.to_thread(replica_actors, ctx.app_name, ctx.deployment))
        except Exception as e:  # noqa: BLE001 - outside Serve or GCS busy: keep the last share
            logger.debug("relay pool recount skipped: %s", e)
            n = 0
        finally:
            self._recounting = None
        if n:
            self.max_running = relay_share(self.cfg.policy.relay_max_running, n)

    def record_routing_stats(self) -> dict:
        """The routers' view of the relay pool's load (a hint for the pipeline decision; the
        binding admission is the check in `generate`)."""
        return {"running": len(self.live), "capacity": self.max_running}

    def inject(self, fault: str, after_tokens: int = 4) -> None:
        """Fault injection for tests and the soak (policy.allow_fault_injection): `die_mid_stream`
        kills this replica's process once it has decoded `after_tokens` more tokens, so the death
        lands in the middle of a relay stream (every stream it holds dies with it, as on a lost host)."""
        if not self.cfg.policy.allow_fault_injection:
            raise PermissionError("fault injection is off (policy.allow_fault_injection)")
        if fault != "die_mid_stream":
            raise ValueError(f"unknown relay fault {fault!r}")
        self.die_after = max(1, after_tokens)

    def _maybe_die(self, tokens: int) -> None:
        if self.die_after is not None:
            self.die_after -= tokens
            if self.die_after <= 0:
                logger.warning("injected fault: relay replica exits mid-stream")
                os._exit(1)

    def check_health(self) -> None:  # Serve's health probe: a failed engine gets this replica replaced
        check_engine(self.engine)

    def stats(self) -> ReplicaStats:
        e = self.engine
        return ReplicaStats("relay", len(self.live), e.pool.num_free, e.pool.num_blocks,
                            extra={"tokens_generated": self.tokens_generated, "live": sorted(self.live),
                                   "peak_live": self.peak_live, "max_running": self.max_running,
                                   "context_mismatches": e.context_mismatches,
                                   "preemptions": e.preemptions, **emulation_stats(e, self.worker.max_batch), **self.where})
