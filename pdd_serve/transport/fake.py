"""An in-process KV link for unit tests: a sender and a receiver in one process, no sockets.

`InProcessKVLink(layout)` holds a receiver (`KVReceiver`) and makes senders (`KVSender`) that
push straight into it, with Flight's semantics and typed errors (base.py lists them). It is for
tests of the code around the transport; the system always moves KV over Flight (flight.py).
tests/transport/test_contract.py runs one suite over both, which keeps this one faithful.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from pdd_serve.engine.kv import KVBlocks, KVError, KVLayout
from pdd_serve.transport.flight_client import PushResult
from pdd_serve.transport.flight_server import ReceivedKV
from pdd_serve.transport.flight_wire import (
    DESCRIPTOR_ROOT,
    CapacityError,
    RejectedError,
    SenderAborted,
    TransferAborted,
    TransferTimeout,
    TransportError,
    UnknownRequestError,
    missing_ranges,
)

_LINKS = itertools.count()


def _rejected(request_id: str, code: str, msg: str) -> RejectedError:
    """A refused batch as Flight's client raises it: the precise reason in `code`."""
    err = RejectedError(f"{DESCRIPTOR_ROOT}/{code}: request {request_id!r}: {msg}")
    err.code = code
    return err


@dataclass(eq=False)
class _Transfer:
    request_id: str
    start: int
    n: int
    num_tokens: int | None
    want_hashes: list[int] | None
    data: np.ndarray  # the blocks as they arrive, copied in as the wire would copy them
    got: list[tuple[int, int, int] | None] = field(init=False)  # per block: (hash, checksum, tokens)
    blocks_received: int = 0
    bytes_received: int = 0
    created: float = field(default_factory=time.monotonic)
    ended: str | None = None  # complete | aborted | released: final, the waiters are woken
    reason: str = ""
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.got = [None] * self.n


class InProcessReceiver:
    """MD's side: `KVFlightServer`'s bookkeeping and checks, without the server."""

    verify_checksums = True  # as Flight's default: every block's CRC is checked on arrival

    def __init__(self, layout: KVLayout, *, max_bytes_per_request: int = 1 << 30,
                 max_bytes_total: int = 4 << 30) -> None:
        self.layout, self.location = layout, f"inproc://{next(_LINKS)}"
        self.max_bytes_per_request, self.max_bytes_total = max_bytes_per_request, max_bytes_total
        self.expect_wait_s = 2.0  # a push may overtake its expect here too (flight_server.py)
        self._transfers: dict[str, _Transfer] = {}
        self._reserved = 0
        self._cv = threading.Condition()  # one lock for everything: a test fake, not a hot path

    def expect(self, request_id: str, num_blocks: int, *, start_block: int = 0, num_tokens: int | None = None,
               hashes: list[int] | None = None) -> None:
        bs, nbytes = self.layout.block_size, num_blocks * self.layout.block_bytes
        if (not request_id or num_blocks <= 0 or start_block < 0
                or (hashes is not None and len(hashes) != num_blocks)
                or (num_tokens is not None and not (num_blocks - 1) * bs < num_tokens <= num_blocks * bs)):
            raise ValueError(f"bad expect of {request_id!r}: {num_blocks} blocks from {start_block}")
        spec = (start_block, num_blocks, num_tokens, list(hashes) if hashes else None)
        with self._cv:
            old = self._transfers.get(request_id)
            if old is not None:
                if (old.start, old.n, old.num_tokens, old.want_hashes) != spec:
                    raise ValueError(f"request {request_id!r} is already expected with other blocks")
                return
            if nbytes > self.max_bytes_per_request or self._reserved + nbytes > self.max_bytes_total:
                raise CapacityError(f"request {request_id!r} needs {nbytes} B: over a byte cap")
            self._reserved += nbytes
            data = np.empty((num_blocks, *self.layout.block_shape), self.layout.numpy_dtype)
            self._transfers[request_id] = _Transfer(request_id, *spec, data)
            self._cv.notify_all()

    def missing(self, request_id: str) -> list[tuple[int, int]]:
        t = self._lookup(request_id)
        with self._cv:
            return missing_ranges(np.array([g is not None for g in t.got]), t.start)

    async def wait_complete(self, request_id: str, timeout: float) -> ReceivedKV:
        t, loop = self._lookup(request_id), asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if t.ended is None:
                t.waiters.append((loop, fut))
            else:
                fut.set_result(None)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            arrived = t.n - t.got.count(None)
            msg = f"request {request_id!r}: {arrived}/{t.n} KV blocks after {timeout:.3g}s"
            raise TransferTimeout(msg) from None
        with self._cv:
            if t.ended == "released":
                raise UnknownRequestError(f"request {request_id!r} was released")
            if t.ended == "aborted":
                raise TransferAborted(f"request {request_id!r}: the sender aborted the transfer "
                                      f"({t.n - t.got.count(None)}/{t.n} blocks arrived): {t.reason}")
            hashes, crcs, tokens = zip(*t.got)
            run = KVBlocks(self.layout, t.start, t.data, list(hashes), list(crcs), sum(tokens))
            seconds = time.monotonic() - t.created
            return ReceivedKV(request_id, (run,), t.bytes_received, t.blocks_received, seconds)

    def abort(self, request_id: str, reason: str) -> bool:
        with self._cv:
            t = self._transfers.get(request_id)
            if t is None or t.ended is not None:  # unknown, released, complete or aborted already
                return False
            self._end(t, "aborted", reason[:200] or "no reason given")
            return True

    def release(self, request_id: str) -> bool:
        with self._cv:
            t = self._transfers.pop(request_id, None)
            if t is None:
                return False
            self._reserved -= t.n * self.layout.block_bytes
            self._end(t, "released")
            return True

    @property
    def bytes_reserved(self) -> int:
        with self._cv:
            return self._reserved

    def close(self) -> None:
        pass

    def _lookup(self, request_id: str, wait_s: float = 0.0) -> _Transfer:
        with self._cv:
            self._cv.wait_for(lambda: request_id in self._transfers, timeout=wait_s)
            t = self._transfers.get(request_id)
        if t is None:
            raise UnknownRequestError(f"request {request_id!r} is not expected here (never, or released)")
        return t

    @staticmethod
    def _end(t: _Transfer, how: str, reason: str = "") -> None:  # the caller holds the lock
        t.ended, t.reason = how, reason
        for loop, fut in t.waiters:
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))
        t.waiters = []

    def _accept(self, t: _Transfer, kv: KVBlocks) -> None:
        """Check a whole batch (flight_server.py's checks, in its order), then store it."""
        rid, bs = t.request_id, self.layout.block_size
        lo, hi = kv.start_block - t.start, kv.start_block - t.start + kv.num_blocks
        tokens = [bs] * (kv.num_blocks - 1) + [kv.num_tokens - (kv.num_blocks - 1) * bs]
        try:
            kv.verify()
        except KVError as e:
            raise _rejected(rid, "checksum", str(e)) from None
        if lo < 0 or hi > t.n:
            raise _rejected(rid, "out_of_range", f"blocks [{kv.start_block}, ...) outside those expected")
        if tokens[-1] != bs and hi != t.n:
            raise _rejected(rid, "partial_block", "only the request's last block may be partial")
        if hi == t.n and t.num_tokens is not None and tokens[-1] != t.num_tokens - (t.n - 1) * bs:
            raise _rejected(rid, "num_tokens", f"last block holds {tokens[-1]} tokens")
        if t.want_hashes is not None and kv.hashes != t.want_hashes[lo:hi]:
            raise _rejected(rid, "hash_mismatch", f"block hashes from {kv.start_block} differ from expected")
        with self._cv:
            if t.ended == "released":
                raise UnknownRequestError(f"request {rid!r} was released")
            if t.ended == "aborted":
                raise TransferAborted(f"request {rid!r}: the transfer was aborted")
            got = list(zip(kv.hashes, kv.checksums, tokens))
            for i in range(kv.num_blocks):  # re-sends: fine if identical, an error if not
                held = t.got[lo + i]
                if held is not None and (held != got[i] or t.data[lo + i].tobytes() != kv.data[i].tobytes()):
                    msg = f"block {kv.start_block + i} re-sent with different content"
                    raise _rejected(rid, "conflict", msg)
            t.data[lo:hi], t.got[lo:hi] = kv.data, got
            t.blocks_received += kv.num_blocks
            t.bytes_received += kv.nbytes
            if t.ended is None and None not in t.got:
                self._end(t, "complete")


class InProcessSender:
    """Prefill's side: cuts the feed into batches and hands each to the receiver."""

    def __init__(self, receiver: InProcessReceiver, *, batch_blocks: int = 16,
                 deadline_s: float = 30.0) -> None:
        self.receiver, self.batch_blocks, self.deadline_s = receiver, batch_blocks, deadline_s

    def push(self, request_id: str, feed: Iterable[KVBlocks], *,
             deadline_s: float | None = None) -> PushResult:
        t0 = time.monotonic()
        deadline = t0 + (deadline_s or self.deadline_s)
        rx, t, blocks, nbytes, batches = self.receiver, None, 0, 0, 0
        try:
            for run in feed:
                if run.layout != rx.layout:
                    raise KVError(f"fed KV layout {run.layout} != client layout {rx.layout}")
                t = t or rx._lookup(request_id, rx.expect_wait_s)  # once, as Flight opens one stream
                for lo in range(0, run.num_blocks, self.batch_blocks):
                    if time.monotonic() > deadline:  # Flight's call deadline, seen at the next write
                        raise TransferTimeout(f"request {request_id!r}: KV push deadline passed")
                    batch = run.slice(lo, lo + self.batch_blocks)
                    rx._accept(t, batch)
                    blocks, nbytes, batches = blocks + batch.num_blocks, nbytes + batch.nbytes, batches + 1
        except SenderAborted as e:  # the producer failed: say so, as the Flight client does
            with contextlib.suppress(TransportError):
                self.abort(request_id, str(e) or "the sender's producer failed")
            raise
        return PushResult(request_id, blocks, nbytes, batches, 0, time.monotonic() - t0)

    def abort(self, request_id: str, reason: str) -> bool:
        with contextlib.suppress(UnknownRequestError):  # an abort may overtake the expect, as a push may
            self.receiver._lookup(request_id, self.receiver.expect_wait_s)
        return self.receiver.abort(request_id, reason)

    def missing(self, request_id: str) -> list[tuple[int, int]]:
        return self.receiver.missing(request_id)


class InProcessKVLink:
    """One receiver and the senders that reach it, sharing one process's memory."""

    def __init__(self, layout: KVLayout, **receiver_kw: int) -> None:
        self.receiver = InProcessReceiver(layout, **receiver_kw)

    def sender(self, *, batch_blocks: int = 16, deadline_s: float = 30.0) -> InProcessSender:
        return InProcessSender(self.receiver, batch_blocks=batch_blocks, deadline_s=deadline_s)


__all__ = ["InProcessKVLink", "InProcessReceiver", "InProcessSender"]
