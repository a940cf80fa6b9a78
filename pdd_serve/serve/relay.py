"""Relay decode (RLD), site A: a small pool beside Prefill that starts decoding the moment the KV is
in the local object store, streaming eager tokens while the KV crawls to MD. It stops when the
router cancels its stream at the handoff; its KV is freed then."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray import serve

from pdd_serve.config import PDDConfig
from pdd_serve.engine.scheduler import EngineWorker
from pdd_serve.serve.common import load_engine, placement
from pdd_serve.serve.messages import RelayRequest, ReplicaStats, TokenChunk


@serve.deployment(max_ongoing_requests=64)
class Relay:
    def __init__(self, cfg: PDDConfig) -> None:
        self.cfg = cfg
        # no prefix cache: RLD receives every prompt's KV from P; it holds KV only while it relays
        self.engine = load_engine(cfg.model, enable_prefix_cache=False)
        self.worker = EngineWorker(self.engine, cfg.model.max_batch)
        self.where = placement()
        self.tokens_generated = 0
        self.live: set[str] = set()  # requests holding KV here

    async def generate(self, rreq: RelayRequest) -> AsyncIterator[TokenChunk]:
        from pdd_serve.transport.object_store import get_kv

        req = rreq.req
        seq = self.engine.add(req.request_id, list(req.prompt_token_ids), req.params)
        self.live.add(req.request_id)
        try:
            # a local object store read (zero-copy); off the event loop so other streams keep flowing
            blocks = await asyncio.to_thread(get_kv, rreq.kv_ref, self.cfg.policy.kv_wait_timeout_s,
                                             layout=self.engine.layout)
            await self.worker.call(self.engine.import_kv, seq, blocks)
            del blocks
            self.engine.append_tokens(seq, [rreq.first_token])
            async for step in self.worker.decode(seq):
                self.tokens_generated += len(step.token_ids)
                yield TokenChunk(step.token_ids, step.finish_reason)
        finally:
            await self.worker.release(seq, cache=False)
            self.live.discard(req.request_id)

    def stats(self) -> ReplicaStats:
        e = self.engine
        return ReplicaStats("relay", len(self.live), e.pool.num_free, e.pool.num_blocks,
                            extra={"tokens_generated": self.tokens_generated, **self.where})
