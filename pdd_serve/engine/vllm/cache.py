"""The DRC view over vLLM's prefix cache: vLLM's own KV cache events, mirrored in PDD's block hashes.

Main decode's DRC and the routers' affinity need to know which prompt prefixes a replica holds,
named by PDD's chain hashes (`kv.block_hashes`, what the router computes from the prompt). vLLM
names its cached blocks by its own hashes (a different function, over 32-token blocks, with extra
keys), so rather than reading its scheduler's internals we subscribe to the events vLLM publishes
for exactly this purpose (`KVEventsConfig`, what Dynamo's and llm-d's KV-aware routers read):
`BlockStored` carries each stored block's token ids and its parent, so PDD's hashes for the same
tokens are derived here; `BlockRemoved` and `AllBlocksCleared` take them out again.

The publisher sends on an in-process ZMQ endpoint (`inproc://`, nothing binds a port) from its own
thread, so the view lags vLLM by at most the batches not yet drained. It may therefore claim a
block vLLM has just evicted; `VllmEngine.match_prefix` is built for that (the connector sees the
shortfall and vLLM recomputes those tokens), and it never claims a block vLLM never stored. Events
it can't map to PDD's hashes (blocks under a cache salt or LoRA, a child whose parent it never saw)
are skipped: the view under-reports rather than guessing. A hash is held once however often it is
stored (vLLM re-emits stores for reused blocks), so two physical copies of one block are dropped at
the first copy's removal: an under-report again. A gap in the batch sequence (a dropped
message) clears the view for the same reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from pdd_serve.engine.kv import ROOT_HASH, block_hashes
from pdd_serve.engine.radix_cache import CacheStats

logger = logging.getLogger("pdd_serve")


class VllmCacheView:
    """vLLM's prefix cache in PDD's block hashes (the `cache` of a `VllmEngine`): `nodes` (hash ->
    how many vLLM blocks hold it), `stats` and `num_blocks`, as the torch engine's `RadixCache`."""

    def __init__(self, block_size: int, source: KVEventSubscriber | None = None, hit_unit: int = 1) -> None:
        self.block_size = block_size
        self.source = source
        self.hit_unit = hit_unit  # vLLM's cache hits in its own blocks: the routers plan whole ones
        # the engine thread drains and matches; a routing-view poll may drain from the replica's
        # event loop: one at a time (a ZMQ socket is not thread-safe)
        self._lock = threading.Lock()
        self.nodes: dict[int, int] = {}
        self.stats = CacheStats()
        self._ours: dict[Any, tuple[int, ...]] = {}  # vLLM block hash -> PDD hashes of its tokens
        self._next_seq: int | None = None  # the batch sequence number expected next
        self.skipped_blocks = 0  # stored blocks the view could not map (salted, orphaned, odd size)

    @property
    def num_blocks(self) -> int:
        return len(self.nodes)

    # ------------------------------------------------------------ events

    def apply(self, seq_no: int, events: Iterable[Any]) -> None:
        """One published batch (`vllm.distributed.kv_events.KVEventBatch.events`) numbered `seq_no`."""
        if self._next_seq is not None and seq_no != self._next_seq:
            logger.warning("vLLM KV events: batch %d after %d (lost in between): DRC view cleared",
                           seq_no, self._next_seq - 1)
            self.clear()
        self._next_seq = seq_no + 1
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                self._stored(ev)
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    self._remove(h)
            elif kind == "AllBlocksCleared":
                self.clear()

    def clear(self) -> None:
        self.stats.evicted_blocks += len(self.nodes)
        self.nodes.clear()
        self._ours.clear()

    def _stored(self, ev: Any) -> None:
        vbs, bs = ev.block_size, self.block_size
        hashes, tokens = list(ev.block_hashes), list(ev.token_ids)
        unmappable = (
            any(k is not None for k in (getattr(ev, "extra_keys", None) or ()))  # salt, LoRA, media
            or getattr(ev, "lora_id", None) is not None
            or vbs % bs or len(tokens) != len(hashes) * vbs
            or (ev.parent_block_hash is not None and ev.parent_block_hash not in self._ours)
        )
        if unmappable:
            self.skipped_blocks += len(hashes)
            return
        parent = ROOT_HASH if ev.parent_block_hash is None else self._ours[ev.parent_block_hash][-1]
        for i, vh in enumerate(hashes):
            ours = tuple(block_hashes(tokens[i * vbs:(i + 1) * vbs], bs, parent))
            parent = ours[-1]
            if vh in self._ours:  # re-emitted for a block already stored
                continue
            self._ours[vh] = ours
            for h in ours:
                self.nodes[h] = self.nodes.get(h, 0) + 1
            self.stats.inserted_blocks += len(ours)

    def _remove(self, vh: Any) -> None:
        for h in self._ours.pop(vh, ()):
            n = self.nodes.get(h, 0) - 1
            if n > 0:
                self.nodes[h] = n
            else:
                self.nodes.pop(h, None)
            self.stats.evicted_blocks += 1

    def refresh(self, wait: bool = True) -> None:
        """Apply the event batches vLLM has published since the last refresh (non-blocking reads).
        `wait=False` skips it while another thread is draining (that one brings the view up to date)."""
        if self.source is not None and self._lock.acquire(blocking=wait):
            try:
                self.source.drain(self)
            finally:
                self._lock.release()

    # ------------------------------------------------------------ lookups

    def match(self, chain: list[int]) -> int:
        """How many blocks of `chain` (a prompt's PDD hashes, in order) the view holds, from the
        first, after catching up with vLLM's events."""
        self.refresh()
        n = 0
        while n < len(chain) and chain[n] in self.nodes:
            n += 1
        return n

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        self.stats.queries += 1
        self.stats.query_tokens += query_tokens
        self.stats.hit_tokens += hit_tokens


class KVEventSubscriber:
    """Reads vLLM's KV event batches off the in-process ZMQ endpoint it publishes on, without blocking."""

    def __init__(self, endpoint: str, topic: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        # vLLM's publisher binds on the process-wide context; inproc endpoints only connect within one
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.connect(endpoint)
        self._decode = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._zmq = zmq

    def drain(self, view: VllmCacheView) -> int:
        """Apply every batch that has arrived; returns how many."""
        n = 0
        while True:
            try:
                _topic, seq, payload = self._sock.recv_multipart(flags=self._zmq.NOBLOCK)
            except self._zmq.Again:
                return n
            try:
                events = self._decode.decode(payload).events
            except Exception as e:  # noqa: BLE001 - a batch we can't read: forget, don't guess
                logger.warning("vLLM KV events: unreadable batch (%s: %s): DRC view cleared", type(e).__name__, e)
                view.clear()
                continue
            view.apply(int.from_bytes(seq, "big"), events)
            n += 1


__all__ = ["KVEventSubscriber", "VllmCacheView"]
