"""The sending side of KV over Flight: `KVFlightClient`, Prefill's paced, resumable push to an MD."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from pdd_serve.engine.kv import KVBlocks, KVError, KVLayout
from pdd_serve.transport.codec import encode, kv_schema
from pdd_serve.transport.flight_wire import (
    CODE_RE,
    TYPED_ERRORS,
    AuthError,
    RejectedError,
    SenderAborted,
    StreamBroken,
    TransferTimeout,
    TransportError,
    abort_mac,
    kv_descriptor,
    missing_ranges,
)
from pdd_serve.transport.link import BandwidthEstimator, LinkModel

# ---------------------------------------------------------------- connections


CHANNELS: dict[tuple, flight.FlightClient] = {}
_CHANNELS_LOCK = threading.Lock()
MAX_CHANNELS = 64


def _channel(key: tuple, make: Callable[[], flight.FlightClient]) -> flight.FlightClient:
    """A Flight connection shared by every push to one endpoint (gRPC channels are thread-safe).

    A fresh connection per push pays the TCP/TLS/HTTP2 handshake round trips and restarts gRPC's
    flow-control window from 64 KiB; a kept one streams at full window from the first byte.
    """
    with _CHANNELS_LOCK:
        c = CHANNELS.get(key)
        if c is None:
            if len(CHANNELS) >= MAX_CHANNELS:  # forget the oldest; calls in flight keep their reference
                CHANNELS.pop(next(iter(CHANNELS)))
            c = CHANNELS[key] = make()
        return c


def _drop_channel(key: tuple, client: flight.FlightClient) -> None:
    """Forget a connection that failed, so the next call (a resume) dials afresh.

    Not closed here: other pushes may share it; it closes when the last of them lets it go.
    """
    with _CHANNELS_LOCK:
        if CHANNELS.get(key) is client:
            del CHANNELS[key]


# the extra parallel streams of every push in this process share one bounded pool (before: a
# pool per push, so threads grew with the transfers in flight). Stream 0 runs on the caller's
# thread, so a push always moves, with fewer streams while the pool is busy, and never deadlocks
_STREAM_POOL_SIZE = 32
_STREAM_POOL = ThreadPoolExecutor(_STREAM_POOL_SIZE, thread_name_prefix="kv-push")

# ---------------------------------------------------------------- client side


@dataclass(frozen=True)
class PushResult:
    request_id: str
    blocks_sent: int  # re-sends included
    bytes_sent: int
    batches_sent: int
    resumes: int  # streams re-opened after a break
    seconds: float

    @property
    def bps(self) -> float:
        return self.bytes_sent * 8 / self.seconds if self.seconds > 0 else float("inf")


class _Retry(Exception):
    """The stream broke in a way a resume may fix."""


class _Aborted(Exception):
    """Another stream of the same push failed (or the caller cancelled): stop quietly."""


class _Ended(Exception):
    """The server closed the call before acking every batch; its status says why."""


class _Feed:
    """A feed of KVBlocks runs cut into batches; shared (under a lock) by parallel streams."""

    def __init__(self, feed: Iterable[KVBlocks], layout: KVLayout, batch_blocks: int) -> None:
        self._it = iter(feed)
        self._layout = layout
        self._batch = batch_blocks
        self._run: KVBlocks | None = None
        self._pos = 0
        self._lock = threading.Lock()
        self.abort = threading.Event()

    def __iter__(self) -> Iterator[KVBlocks]:
        return self

    def __next__(self) -> KVBlocks:
        with self._lock:
            if self.abort.is_set():
                raise _Aborted()
            while self._run is None or self._pos >= self._run.num_blocks:
                run = next(self._it)  # StopIteration ends every stream; a feed error ends this one
                if run.layout != self._layout:
                    raise KVError(f"fed KV layout {run.layout} != client layout {self._layout}")
                self._run, self._pos = run, 0
            lo = self._pos
            self._pos += self._batch
            return self._run.slice(lo, lo + self._batch)


class _Counters:
    def __init__(self) -> None:
        self.blocks = self.bytes = self.batches = self.resumes = 0
        self.lock = threading.Lock()

    def sent(self, run: KVBlocks) -> None:
        with self.lock:
            self.blocks += run.num_blocks
            self.bytes += run.nbytes
            self.batches += 1


class KVFlightClient:
    """Prefill's side: streams a request's KV blocks to a Main Decode's `KVFlightServer`."""

    def __init__(
        self,
        location: str,
        token: str,
        *,
        layout: KVLayout,
        tls_root_cert: str | Path | None = None,
        override_hostname: str | None = None,
        batch_blocks: int = 16,
        deadline_s: float = 30.0,
        parallel_streams: int = 1,
        window_batches: int = 8,
        max_retries: int = 3,
        retry_backoff_s: float = 0.05,
        link: LinkModel | None = None,
        estimator: BandwidthEstimator | None = None,
        mac_key: str | bytes | None = None,  # codec.py: authenticates every batch to the server
    ) -> None:
        self.mac_key = mac_key
        if batch_blocks <= 0 or parallel_streams <= 0 or window_batches <= 0 or max_retries < 0:
            raise ValueError("batch_blocks, parallel_streams, window_batches must be > 0; max_retries >= 0")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.location = location
        self.layout = layout
        self.schema = kv_schema(layout)
        self.batch_blocks = batch_blocks
        self.deadline_s = deadline_s
        self.parallel_streams = parallel_streams
        self.window_batches = window_batches  # unacked batches in flight per stream
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.link = link
        self.estimator = estimator
        self._headers = [(b"authorization", f"Bearer {token}".encode())]
        self._conn_kw: dict[str, object] = {}
        if tls_root_cert is not None:
            self._conn_kw["tls_root_certs"] = Path(tls_root_cert).read_bytes()
        if override_hostname:
            self._conn_kw["override_hostname"] = override_hostname

    # ------------------------------------------------------------ public API

    def push(self, request_id: str, feed: Iterable[KVBlocks], *, deadline_s: float | None = None) -> PushResult:
        """Stream every block of `feed` (runs, as prefill produces them) to the server.

        Returns once the server acked every block. Raises a TransportError subclass on refusal,
        on the deadline, or when the stream keeps breaking past `max_retries` resumes. A feed that
        raises `SenderAborted` aborts the transfer at the server, then the error is re-raised.
        """
        return self._push(request_id, _Feed(feed, self.layout, self.batch_blocks), deadline_s)

    async def push_async(self, request_id: str, feed: Iterable[KVBlocks] | AsyncIterable[KVBlocks], *,
                         deadline_s: float | None = None) -> PushResult:
        """`push` from asyncio: the stream runs in a thread, an async feed is pulled from this loop."""
        if isinstance(feed, AsyncIterable):
            feed = _sync_iter(feed.__aiter__(), asyncio.get_running_loop())
        src = _Feed(feed, self.layout, self.batch_blocks)
        try:
            return await asyncio.to_thread(self._push, request_id, src, deadline_s)
        except asyncio.CancelledError:
            src.abort.set()  # the thread stops at its next batch (it may be parked in the feed)
            threading.Thread(target=self._tell_abort, args=(request_id, "the sender cancelled the push"),
                             daemon=True).start()
            raise

    def abort(self, request_id: str, reason: str, *, timeout_s: float = 5.0) -> bool:
        """Tell the server this request's blocks will not all come (its waiters fail at once).
        True when the server aborted a transfer; raises a TransportError if it could not be told."""
        body = {"request_id": request_id, "reason": reason[:200],
                "mac": abort_mac(self.mac_key, request_id) if self.mac_key is not None else ""}
        client = self._connect()
        try:
            res = list(client.do_action(flight.Action("abort", json.dumps(body).encode()),
                                        self._options(time.monotonic() + timeout_s)))
            return bool(json.loads(res[0].body.to_pybytes())["aborted"])
        except (flight.FlightError, pa.ArrowException, OSError) as e:
            err = _classify(e)
            if isinstance(err, (_Retry, TransferTimeout)):
                _drop_channel(self._key(0), client)
            raise (err if not isinstance(err, _Retry) else StreamBroken(str(e))) from e

    def missing(self, request_id: str, *, timeout_s: float | None = None) -> list[tuple[int, int]]:
        """The server's absolute [lo, hi) ranges of blocks it still lacks."""
        deadline = time.monotonic() + (timeout_s or self.deadline_s)
        client = self._connect()
        try:
            res = list(client.do_action(flight.Action("missing", request_id.encode()), self._options(deadline)))
            return [tuple(r) for r in json.loads(res[0].body.to_pybytes())["missing"]]
        except (flight.FlightError, pa.ArrowException, OSError) as e:
            err = _classify(e)
            if isinstance(err, (_Retry, TransferTimeout)):
                _drop_channel(self._key(0), client)
            raise (err if not isinstance(err, _Retry) else StreamBroken(str(e))) from e

    # ------------------------------------------------------------ internals

    def _key(self, slot: int) -> tuple:
        # one connection per parallel stream slot: parallel streams get their own TCP connections
        return (self.location, self._conn_kw.get("tls_root_certs"), self._conn_kw.get("override_hostname"), slot)

    def _connect(self, slot: int = 0) -> flight.FlightClient:
        return _channel(self._key(slot), lambda: flight.FlightClient(self.location, **self._conn_kw))

    def _options(self, deadline: float) -> flight.FlightCallOptions:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"KV push deadline passed ({self.deadline_s}s)")
        return flight.FlightCallOptions(timeout=left, headers=self._headers)

    def _push(self, request_id: str, src: _Feed, deadline_s: float | None) -> PushResult:
        try:
            return self._push_streams(request_id, src, deadline_s)
        except SenderAborted as e:
            # the producer failed: say so, so that MD falls back now and not at its timeout
            self._tell_abort(request_id, str(e) or "the sender's producer failed")
            raise

    def _tell_abort(self, request_id: str, reason: str) -> None:
        """Best effort: where the link is down too, MD's bounded wait decides instead."""
        with contextlib.suppress(TransportError):
            self.abort(request_id, reason, timeout_s=min(5.0, self.deadline_s))

    def _push_streams(self, request_id: str, src: _Feed, deadline_s: float | None) -> PushResult:
        t0 = time.monotonic()
        deadline = t0 + (deadline_s or self.deadline_s)
        c = _Counters()
        if self.parallel_streams == 1:
            self._stream_with_resume(request_id, src, deadline, c, 0)
        else:  # stream 0 on this thread, the others on the process's shared pool
            futs = [_STREAM_POOL.submit(self._stream_with_resume, request_id, src, deadline, c, slot)
                    for slot in range(1, self.parallel_streams)]
            errors = []
            try:
                self._stream_with_resume(request_id, src, deadline, c, 0)
            except BaseException as e:  # stop the sibling streams, report the first cause
                src.abort.set()
                errors.append(e)
            for f in futs:
                if f.cancel():  # still queued behind other pushes: stream 0 already sent its share
                    continue
                try:
                    f.result()
                except BaseException as e:
                    src.abort.set()
                    errors.append(e)
            errors = [e for e in errors if not isinstance(e, _Aborted)] or errors
            if errors:
                raise errors[0]
        res = PushResult(request_id, c.blocks, c.bytes, c.batches, c.resumes, time.monotonic() - t0)
        if self.estimator is not None:
            self.estimator.observe(res.bytes_sent, res.seconds)
        return res

    def _stream_with_resume(self, request_id: str, src: _Feed, deadline: float, c: _Counters, slot: int) -> None:
        unacked: deque[KVBlocks] = deque()  # written, not acked: what a resume may need again
        resend: deque[KVBlocks] = deque()
        tries = 0
        while True:
            try:
                self._stream(request_id, src, resend, unacked, deadline, c, slot)
                return
            except _Retry as e:
                tries += 1
                if tries > self.max_retries:
                    raise StreamBroken(f"request {request_id!r}: stream broke {tries} times; last: {e}") from e
                if time.monotonic() >= deadline:
                    raise TransferTimeout(f"request {request_id!r}: deadline passed while resuming") from e
                time.sleep(min(self.retry_backoff_s * tries, max(0.0, deadline - time.monotonic())))
                pending = list(unacked) + list(resend)
                unacked.clear()
                resend = deque(self._still_missing(request_id, pending, deadline))
                with c.lock:
                    c.resumes += 1

    def _still_missing(self, request_id: str, runs: list[KVBlocks], deadline: float) -> list[KVBlocks]:
        """The parts of `runs` the server still lacks (its acks may have died with the stream)."""
        if not runs:
            return []
        try:
            ranges = self.missing(request_id, timeout_s=max(deadline - time.monotonic(), 1e-3))
        except StreamBroken:
            return runs  # can't ask: re-send all unacked; the server takes identical re-sends
        out: list[KVBlocks] = []
        for run in runs:
            need = np.zeros(run.num_blocks, dtype=bool)
            for lo, hi in ranges:
                a, b = max(lo - run.start_block, 0), min(hi - run.start_block, run.num_blocks)
                if a < b:
                    need[a:b] = True
            for lo, hi in missing_ranges(~need, 0):
                out.append(run.slice(lo, hi))
        return out

    def _stream(self, request_id: str, src: _Feed, resend: deque[KVBlocks], unacked: deque[KVBlocks],
                deadline: float, c: _Counters, slot: int) -> None:
        if not resend:  # take a run before dialing: a stream that starts late (an extra one queued
            run = next(src, None)  # in the shared pool) finds the feed drained and must not open a
            if run is None:  # call the receiver may already have released ("unknown request")
                return
            resend.append(run)  # held for a resume until written and acked
        client = self._connect(slot)
        writer = None
        try:
            writer, reader = client.do_put(kv_descriptor(request_id), self.schema, self._options(deadline))

            def send(run: KVBlocks) -> None:
                batch = encode(request_id, run, self.mac_key)
                unacked.append(run)  # before the write: a write that fails must not lose the run
                if self.link is not None:
                    self.link.pace_sync(run.nbytes)
                writer.write_batch(batch)
                c.sent(run)
                while len(unacked) > self.window_batches:
                    self._read_ack(reader, unacked)

            while resend:
                send(resend.popleft())
            for run in src:
                send(run)
            writer.done_writing()
            while unacked:
                self._read_ack(reader, unacked)
            w, writer = writer, None
            w.close()
        except (flight.FlightError, pa.ArrowException, OSError, _Ended) as e:
            status, writer = _final_status(writer), None
            err = _classify(status or e)
            if time.monotonic() >= deadline and isinstance(err, _Retry):
                err = TransferTimeout(f"request {request_id!r}: deadline passed mid-stream: {e}")
            if isinstance(err, (_Retry, TransferTimeout)):  # the connection may be dead: resume on a new one
                _drop_channel(self._key(slot), client)
            raise err from e
        finally:
            if writer is not None:  # leaving on a non-Flight error (feed raised, abort): cancel quietly
                _final_status(writer)

    @staticmethod
    def _read_ack(reader: flight.FlightMetadataReader, unacked: deque[KVBlocks]) -> None:
        buf = reader.read()
        if buf is None:  # the server ended the call: its status comes out of writer.close()
            raise _Ended("server ended the stream before acking every batch")
        try:
            ack = json.loads(buf.to_pybytes())
            lo, hi = int(ack["lo"]), int(ack["hi"])
        except (ValueError, KeyError, TypeError) as e:
            raise RejectedError(f"unreadable ack from server: {bytes(buf)[:64]!r}") from e
        run = unacked[0]
        if (lo, hi) != (run.start_block, run.start_block + run.num_blocks):
            raise RejectedError(f"ack for blocks [{lo}, {hi}) but the oldest unacked batch starts at {run.start_block}")
        unacked.popleft()


def _final_status(writer: flight.FlightStreamWriter | None) -> Exception | None:
    """Close a DoPut writer; the server's error for the call, if any."""
    if writer is None:
        return None
    try:
        writer.close()
    except Exception as e:  # noqa: BLE001 - this *is* the status
        return e
    return None


def _classify(e: BaseException) -> Exception:
    """A typed TransportError for a refusal, or _Retry for a break a resume may fix."""
    if isinstance(e, (TransportError, _Retry)):
        return e  # type: ignore[return-value]
    m = CODE_RE.search(str(e))
    msg = str(e).split(". Detail:")[0]
    if m:
        err = TYPED_ERRORS.get(m.group(1), RejectedError)(msg)
        err.code = m.group(1)  # the precise reason: checksum, layout, conflict, out_of_range...
        return err
    if isinstance(e, flight.FlightUnauthenticatedError):
        return AuthError(msg)
    if isinstance(e, flight.FlightTimedOutError):
        return TransferTimeout(msg)
    return _Retry(msg)


def _sync_iter(ait: AsyncIterator[KVBlocks], loop: asyncio.AbstractEventLoop) -> Iterator[KVBlocks]:
    """Pull an async iterator from a worker thread (the loop keeps producing meanwhile)."""
    while True:
        try:
            yield asyncio.run_coroutine_threadsafe(ait.__anext__(), loop).result()
        except StopAsyncIteration:
            return
