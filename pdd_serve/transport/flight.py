"""KV over Arrow Flight: the cross-site data plane (Prefill at site A -> Main Decode at site B).

Protocol (one DoPut per stream, descriptor path `["pdd.kv", request_id]`):
- MD first `expect()`s a request: which blocks it lacks (`start_block`, `num_blocks`). A push for
  any other request id is rejected; a descriptor can only write the request it names.
- The client streams batches of consecutive blocks as prefill produces them, paced by a
  `LinkModel`. The server verifies each batch whole (schema, layout, sizes, checksums, range)
  before it stores any of it, then acks it with app_metadata `{"lo": .., "hi": ..}`.
- A broken stream loses nothing verified: the client asks the server which of its unacked blocks
  are still missing (action `missing`; acks may have died with the stream) and re-sends only those.
- Re-sending a block the server holds is idempotent if identical and an error if different.
- A push ends in one of two explicit ways: every block acked, or an `abort` action (the producer
  failed: prefill raised or was cancelled). An abort fails the receiver's `wait_complete` at once
  (`TransferAborted`) and refuses later batches, so MD falls back now instead of at its timeout.
  Only a dead sender process or link ends a transfer silently; MD's bounded wait covers those.

Every call carries the bearer token and a deadline. Errors cross the wire as `pdd.kv/<code>: ...`
and come back to the caller as a typed `TransportError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import re
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from pdd_serve.engine.kv import KVBlocks, KVError, KVLayout, concat_blocks
from pdd_serve.transport.codec import (
    ChecksumMismatch,
    CodecError,
    LayoutMismatch,
    MacMismatch,
    RequestMismatch,
    SchemaMismatch,
    check_schema,
    decode,
    encode,
    kv_schema,
)
from pdd_serve.transport.link import BandwidthEstimator, LinkModel

DESCRIPTOR_ROOT = "pdd.kv"
_CODE_RE = re.compile(r"pdd\.kv/([a-z_]+)")
_MAX_REQUEST_ID = 256


# ---------------------------------------------------------------- errors


class TransportError(RuntimeError):
    """A KV transfer failed; `code` is the wire code (`pdd.kv/<code>`)."""

    code = "transport"


class AuthError(TransportError):
    code = "unauthenticated"


class UnknownRequestError(TransportError):
    """The receiver does not expect (or no longer holds) this request."""

    code = "unknown_request"


class RejectedError(TransportError):
    """The receiver refused a batch: bad schema, layout, size, checksum, range, conflict."""

    code = "rejected"


class CapacityError(TransportError):
    """Over the receiver's per-request or per-server byte cap."""

    code = "capacity"


class TransferTimeout(TransportError, TimeoutError):
    code = "deadline"


class StreamBroken(TransportError):
    """The stream kept breaking after every resume allowed."""

    code = "broken"


class TransferAborted(TransportError):
    """The sender aborted the transfer (its producer failed): the blocks will never all arrive."""

    code = "aborted"


class SenderAborted(Exception):
    """Raised by a push's feed when its producer gave up (prefill failed or was cancelled): the
    client then tells the receiver (action `abort`) before it re-raises this."""


_TYPED = {c.code: c for c in (AuthError, UnknownRequestError, CapacityError, TransferTimeout, TransferAborted)}


def _fail(code: str, msg: str) -> Exception:
    """A server-side error whose code survives the trip to the client."""
    text = f"{DESCRIPTOR_ROOT}/{code}: {msg}"
    if code == "unauthenticated":
        return flight.FlightUnauthenticatedError(text)
    if code == "unknown_request":
        return pa.ArrowKeyError(text)
    return pa.ArrowInvalid(text)


def _codec_code(e: CodecError) -> str:
    for cls, code in ((ChecksumMismatch, "checksum"), (RequestMismatch, "request_mismatch"),
                      (LayoutMismatch, "layout"), (SchemaMismatch, "schema"), (MacMismatch, "mac")):
        if isinstance(e, cls):
            return code
    return "malformed"


def kv_descriptor(request_id: str) -> flight.FlightDescriptor:
    return flight.FlightDescriptor.for_path(DESCRIPTOR_ROOT, request_id)


def abort_mac(key: str | bytes, request_id: str) -> str:
    """The abort action's MAC (hex): with the graph's key set, the Flight token alone can't abort
    another request's transfer, as it can't write its KV (codec.batch_mac)."""
    k = key.encode() if isinstance(key, str) else key
    h = hashlib.blake2b(key=hashlib.sha256(k).digest(), digest_size=32, person=b"pdd.kv.abort.v1")
    h.update(request_id.encode())
    return h.hexdigest()


def _same_block(runs: list[KVBlocks], kv: KVBlocks, i: int) -> bool:
    """Is block i of `kv` identical (bytes, hash, checksum, token count) to the one already held?"""
    j = kv.start_block + i
    for r in runs:
        if r.start_block <= j < r.start_block + r.num_blocks:
            k = j - r.start_block
            return (r.hashes[k] == kv.hashes[i] and r.checksums[k] == kv.checksums[i]
                    and _tokens_in(r, k) == _tokens_in(kv, i)
                    and np.array_equal(r.data[k].view(np.uint8), kv.data[i].view(np.uint8)))
    return False


def _tokens_in(run: KVBlocks, k: int) -> int:
    bs = run.layout.block_size
    return run.num_tokens - k * bs if k == run.num_blocks - 1 else bs


def _ranges(have: np.ndarray, start: int) -> list[tuple[int, int]]:
    """[lo, hi) absolute block ranges where `have` is False."""
    out: list[tuple[int, int]] = []
    lo = None
    for i, h in enumerate(have.tolist()):
        if not h and lo is None:
            lo = i
        elif h and lo is not None:
            out.append((start + lo, start + i))
            lo = None
    if lo is not None:
        out.append((start + lo, start + len(have)))
    return out


# ---------------------------------------------------------------- connections


_CHANNELS: dict[tuple, flight.FlightClient] = {}
_CHANNELS_LOCK = threading.Lock()
_MAX_CHANNELS = 64


def _channel(key: tuple, make: Callable[[], flight.FlightClient]) -> flight.FlightClient:
    """A Flight connection shared by every push to one endpoint (gRPC channels are thread-safe).

    A fresh connection per push pays the TCP/TLS/HTTP2 handshake round trips and restarts gRPC's
    flow-control window from 64 KiB; a kept one streams at full window from the first byte.
    """
    with _CHANNELS_LOCK:
        c = _CHANNELS.get(key)
        if c is None:
            if len(_CHANNELS) >= _MAX_CHANNELS:  # forget the oldest; calls in flight keep their reference
                _CHANNELS.pop(next(iter(_CHANNELS)))
            c = _CHANNELS[key] = make()
        return c


def _drop_channel(key: tuple, client: flight.FlightClient) -> None:
    """Forget a connection that failed, so the next call (a resume) dials afresh.

    Not closed here: other pushes may share it; it closes when the last of them lets it go.
    """
    with _CHANNELS_LOCK:
        if _CHANNELS.get(key) is client:
            del _CHANNELS[key]


# ---------------------------------------------------------------- server side


@dataclass(frozen=True)
class ReceivedKV:
    """A request's KV as MD received it.

    `runs` are the verified batches as they arrived: numpy views over the Flight buffers, no copy
    yet. Load them into the block pool run by run (the only copy), or take `blocks`: all of them
    joined into one buffer (one copy, made on first access; none if a single batch carried it all).
    """

    request_id: str
    runs: tuple[KVBlocks, ...]  # consecutive, non-overlapping, ascending
    bytes_received: int  # data bytes accepted over the wire, idempotent re-sends included
    blocks_received: int  # rows accepted, idempotent re-sends included
    seconds: float  # expect() -> complete

    @cached_property
    def blocks(self) -> KVBlocks:
        return self.runs[0] if len(self.runs) == 1 else concat_blocks(list(self.runs))


@dataclass(frozen=True)
class TransferStats:
    request_id: str
    num_blocks: int
    have: int
    blocks_received: int
    bytes_received: int
    batches_rejected: int
    complete: bool


@dataclass(eq=False)
class _Transfer:
    request_id: str
    start_block: int
    num_blocks: int
    num_tokens: int | None
    hashes: list[int] | None
    have: np.ndarray
    created: float
    runs: list[KVBlocks] = field(default_factory=list)  # verified blocks, zero-copy views of batches
    blocks_received: int = 0
    bytes_received: int = 0
    batches_rejected: int = 0
    completed_at: float | None = None
    released: bool = False
    aborted: str | None = None  # the sender's reason; set by its `abort`, final until MD releases
    done: threading.Event = field(default_factory=threading.Event)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def spec(self) -> tuple:
        return (self.start_block, self.num_blocks, self.num_tokens, self.hashes)


class _BearerAuth(flight.ServerMiddlewareFactory):
    def __init__(self, token: str) -> None:
        self._want = f"Bearer {token}".encode()

    def start_call(self, info: flight.CallInfo, headers: dict) -> None:
        got = headers.get("authorization", [])
        # constant-time compare: the token must not leak through response timing
        if not any(hmac.compare_digest(v.encode() if isinstance(v, str) else bytes(v), self._want) for v in got):
            raise _fail("unauthenticated", "missing or wrong bearer token")
        return None


class _Service(flight.FlightServerBase):
    def __init__(self, owner: KVFlightServer, location: str, **kw: object) -> None:
        super().__init__(location, **kw)
        self._owner = owner

    def do_put(self, context, descriptor, reader, writer) -> None:  # noqa: ANN001 (Flight's signature)
        self._owner._do_put(descriptor, reader, writer)

    def do_action(self, context, action):  # noqa: ANN001
        return self._owner._do_action(action)

    def list_actions(self, context):  # noqa: ANN001
        return [("missing", "JSON: which blocks of a request the server still lacks"),
                ("abort", "JSON {request_id, reason, mac}: the sender gave up; waiters fail at once")]


def _default_advertise_host() -> str:
    """The address other hosts reach us on (the interface of the default route)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class KVFlightServer:
    """The Flight endpoint a Main Decode replica runs to receive KV.

    gRPC serves on its own thread pool from construction; nothing blocks the caller.
    """

    def __init__(
        self,
        bind_host: str,
        port: int = 0,
        *,
        layout: KVLayout,
        token: str,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        max_bytes_per_request: int = 1 << 30,
        max_bytes_total: int = 4 << 30,
        advertise_host: str | None = None,
        verify_checksums: bool = True,
        mac_key: str | bytes | None = None,  # codec.py: every batch's MAC must verify under it
    ) -> None:
        if not token:
            raise ValueError("a KV Flight server needs a bearer token")
        self.mac_key = mac_key
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        if max_bytes_per_request <= 0 or max_bytes_total <= 0:
            raise ValueError("byte caps must be > 0")
        self.layout = layout
        self.schema = kv_schema(layout)
        self.max_bytes_per_request = max_bytes_per_request
        self.max_bytes_total = max_bytes_total
        # CRC32 of every block on arrival (ISA-L, ~20 GB/s/core: a few % of the receive path, where
        # zlib's ~3 GB/s was most of it); switch it off only to measure the bare transport.
        self.verify_checksums = verify_checksums
        self._transfers: dict[str, _Transfer] = {}
        self._reserved = 0
        self._lock = threading.Lock()
        # MD's prepare runs concurrently with prefill, so a push may arrive just before its
        # `expect`: a push for an unknown request waits this long for it before it is refused
        self.expect_wait_s = 2.0
        self._expected = threading.Condition(self._lock)
        self.tls = tls_cert is not None
        scheme = "grpc+tls" if self.tls else "grpc+tcp"
        kw: dict[str, object] = {"middleware": {"auth": _BearerAuth(token)}}
        if self.tls:
            kw["tls_certificates"] = [flight.CertKeyPair(Path(tls_cert).read_bytes(), Path(tls_key).read_bytes())]
        self._service = _Service(self, f"{scheme}://{bind_host}:{port}", **kw)
        self.port: int = self._service.port
        host = advertise_host or (_default_advertise_host() if bind_host in ("0.0.0.0", "::", "") else bind_host)
        self.location = f"{'grpc+tls' if self.tls else 'grpc'}://{host}:{self.port}"
        self._closed = False

    # ------------------------------------------------------------ MD-side API

    def expect(self, request_id: str, num_blocks: int, *, start_block: int = 0, num_tokens: int | None = None,
               hashes: list[int] | None = None) -> None:
        """Register that blocks [start_block, start_block + num_blocks) of `request_id` are to come.

        `num_tokens` (valid tokens over those blocks) and `hashes` are checked against what
        arrives when given. Idempotent for the same arguments. Raises CapacityError when the
        request alone, or with everything already expected, exceeds the byte caps.
        """
        if not isinstance(request_id, str) or not 0 < len(request_id) <= _MAX_REQUEST_ID:
            raise ValueError(f"request_id must be a non-empty str of <= {_MAX_REQUEST_ID} chars")
        bs = self.layout.block_size
        if num_blocks <= 0 or start_block < 0:
            raise ValueError(f"need num_blocks > 0 and start_block >= 0, got {num_blocks}, {start_block}")
        if num_tokens is not None and not (num_blocks - 1) * bs < num_tokens <= num_blocks * bs:
            raise ValueError(f"num_tokens={num_tokens} does not fit {num_blocks} blocks of {bs}")
        if hashes is not None and len(hashes) != num_blocks:
            raise ValueError(f"{len(hashes)} hashes for {num_blocks} blocks")
        nbytes = num_blocks * self.layout.block_bytes
        t = _Transfer(request_id, start_block, num_blocks, num_tokens, list(hashes) if hashes else None,
                      np.zeros(num_blocks, dtype=bool), time.monotonic())
        with self._lock:
            old = self._transfers.get(request_id)
            if old is not None:
                if old.spec() != t.spec():
                    raise ValueError(f"request {request_id!r} is already expected with other blocks")
                return
            if nbytes > self.max_bytes_per_request:
                raise CapacityError(f"request {request_id!r} needs {nbytes} B > per-request cap "
                                    f"{self.max_bytes_per_request} B")
            if self._reserved + nbytes > self.max_bytes_total:
                raise CapacityError(f"request {request_id!r} needs {nbytes} B; server holds {self._reserved} B "
                                    f"of its {self.max_bytes_total} B cap")
            self._reserved += nbytes
            self._transfers[request_id] = t
            self._expected.notify_all()

    def missing(self, request_id: str) -> list[tuple[int, int]]:
        """Absolute [lo, hi) block ranges not yet received."""
        t = self._get(request_id)
        with t.lock:
            return _ranges(t.have, t.start_block)

    def stats(self, request_id: str) -> TransferStats:
        t = self._get(request_id)
        with t.lock:
            return TransferStats(request_id, t.num_blocks, int(t.have.sum()), t.blocks_received,
                                 t.bytes_received, t.batches_rejected, t.completed_at is not None)

    async def wait_complete(self, request_id: str, timeout: float) -> ReceivedKV:
        """Await every expected block (asyncio-friendly: no thread is parked)."""
        t = self._get(request_id)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with t.lock:
            if t.completed_at is None and not t.released and t.aborted is None:
                t.waiters.append((loop, fut))
            else:
                fut.set_result(None)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise self._timeout(t, timeout) from None
        finally:
            with t.lock:
                t.waiters = [w for w in t.waiters if w[1] is not fut]
        return self._result(t)

    def wait_complete_sync(self, request_id: str, timeout: float) -> ReceivedKV:
        """Blocking variant of `wait_complete`, for threads."""
        t = self._get(request_id)
        if not t.done.wait(timeout):
            raise self._timeout(t, timeout)
        return self._result(t)

    def abort(self, request_id: str, reason: str) -> bool:
        """The sender gave up on `request_id`: its waiters fail now with TransferAborted and later
        batches are refused, until MD releases the request (a re-delivery expects it afresh).
        False when there is nothing to abort (unknown, released, or already complete)."""
        with self._lock:
            t = self._transfers.get(request_id)
        if t is None:
            return False
        with t.lock:
            if t.completed_at is not None or t.released or t.aborted is not None:
                return False
            t.aborted, t.runs = reason[:200] or "no reason given", []  # nobody will load what came
            self._wake(t)
        return True

    def release(self, request_id: str) -> bool:
        """Forget a request and free its memory and reservation (waiters get UnknownRequestError).

        Expected requests never expire on their own: MD releases each one once loaded, or when
        its wait timed out (its fallback), so a lost sender cannot pin a reservation.
        """
        with self._lock:
            t = self._transfers.pop(request_id, None)
            if t is None:
                return False
            self._reserved -= t.num_blocks * self.layout.block_bytes
        with t.lock:
            t.released, t.runs = True, []
            self._wake(t)
        return True

    @property
    def bytes_reserved(self) -> int:
        with self._lock:
            return self._reserved

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._service.shutdown()

    def __enter__(self) -> KVFlightServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _get(self, request_id: str) -> _Transfer:
        with self._lock:
            t = self._transfers.get(request_id)
        if t is None:
            raise UnknownRequestError(f"request {request_id!r} is not expected here (never, or released)")
        return t

    def _timeout(self, t: _Transfer, timeout: float) -> TransferTimeout:
        have = int(t.have.sum())
        return TransferTimeout(f"request {t.request_id!r}: {have}/{t.num_blocks} KV blocks after {timeout:.3g}s")

    def _result(self, t: _Transfer) -> ReceivedKV:
        with t.lock:
            if t.released:
                raise UnknownRequestError(f"request {t.request_id!r} was released")
            if t.aborted is not None:
                raise TransferAborted(f"request {t.request_id!r}: the sender aborted the transfer "
                                      f"({int(t.have.sum())}/{t.num_blocks} blocks arrived): {t.aborted}")
            runs = tuple(sorted(t.runs, key=lambda r: r.start_block))
            return ReceivedKV(t.request_id, runs, t.bytes_received, t.blocks_received,
                              (t.completed_at or time.monotonic()) - t.created)

    @staticmethod
    def _wake(t: _Transfer) -> None:  # caller holds t.lock
        t.done.set()
        for loop, fut in t.waiters:
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))
        t.waiters = []

    def _request_of(self, descriptor: flight.FlightDescriptor) -> str:
        path = descriptor.path if descriptor.descriptor_type == flight.DescriptorType.PATH else None
        if not path or len(path) != 2 or path[0] != DESCRIPTOR_ROOT.encode():
            raise _fail("bad_descriptor", f"descriptor must be path [{DESCRIPTOR_ROOT!r}, request_id]")
        try:
            return path[1].decode()
        except UnicodeDecodeError:
            raise _fail("bad_descriptor", "request id is not UTF-8") from None

    def _lookup(self, request_id: str, wait_s: float = 0.0) -> _Transfer:
        with self._expected:
            self._expected.wait_for(lambda: request_id in self._transfers, timeout=wait_s)
        try:
            return self._get(request_id)
        except UnknownRequestError as e:
            raise _fail("unknown_request", str(e)) from None

    def _do_put(self, descriptor: flight.FlightDescriptor, reader: flight.MetadataRecordBatchReader,
                writer: flight.FlightMetadataWriter) -> None:
        rid = self._request_of(descriptor)
        t = self._lookup(rid, self.expect_wait_s)
        try:
            check_schema(reader.schema, self.layout)
        except CodecError as e:
            raise _fail(_codec_code(e), str(e)) from None
        while True:
            try:
                batch, _ = reader.read_chunk()
            except StopIteration:
                return
            except pa.ArrowException as e:  # the stream itself is malformed (or the peer went away)
                raise _fail("malformed", f"unreadable KV stream: {e}") from None
            if batch is None:  # a metadata-only message: nothing to store
                continue
            lo, hi = self._accept(t, batch)
            writer.write(pa.py_buffer(json.dumps({"lo": lo, "hi": hi}).encode()))

    def _reject(self, t: _Transfer, code: str, msg: str) -> Exception:
        with t.lock:
            t.batches_rejected += 1
        return _fail(code, f"request {t.request_id!r}: {msg}")

    def _accept(self, t: _Transfer, batch: pa.RecordBatch) -> tuple[int, int]:
        """Verify a whole batch, then store it: a rejected batch changes nothing."""
        try:
            kv = decode(batch, self.layout, request_id=t.request_id, verify=self.verify_checksums,
                        mac_key=self.mac_key)  # outside any lock
        except CodecError as e:
            raise self._reject(t, _codec_code(e), str(e)) from None
        bs = self.layout.block_size
        lo, hi = kv.start_block - t.start_block, kv.start_block - t.start_block + kv.num_blocks
        if lo < 0 or hi > t.num_blocks:
            raise self._reject(t, "out_of_range", f"blocks [{kv.start_block}, {kv.start_block + kv.num_blocks}) "
                               f"outside expected [{t.start_block}, {t.start_block + t.num_blocks})")
        last_tokens = kv.num_tokens - (kv.num_blocks - 1) * bs
        if last_tokens != bs and hi != t.num_blocks:
            raise self._reject(t, "partial_block", "only the request's last block may be partial")
        if hi == t.num_blocks and t.num_tokens is not None and last_tokens != t.num_tokens - (t.num_blocks - 1) * bs:
            raise self._reject(t, "num_tokens", f"last block holds {last_tokens} tokens, expected "
                               f"{t.num_tokens - (t.num_blocks - 1) * bs}")
        if t.hashes is not None and kv.hashes != t.hashes[lo:hi]:
            raise self._reject(t, "hash_mismatch", f"block hashes of [{kv.start_block}, ...) differ from expected")
        with t.lock:
            if t.released:
                raise _fail("unknown_request", f"request {t.request_id!r} was released")
            if t.aborted is not None:
                raise _fail("aborted", f"request {t.request_id!r}: the transfer was aborted")
            dup = t.have[lo:hi]
            for i in np.flatnonzero(dup).tolist():  # re-sends: fine if identical, an error if not
                if not _same_block(t.runs, kv, i):
                    t.batches_rejected += 1
                    raise _fail("conflict", f"request {t.request_id!r}: block {kv.start_block + i} re-sent "
                                "with different content")
            # keep a new batch as views of its Flight buffer: no copy on the receive path. Where part
            # of it was a re-send, copy the new blocks out so a partly redundant buffer isn't pinned
            # (memory stays within the reservation however the sender slices its re-sends).
            for a, b in _ranges(dup, 0):
                run = kv.slice(a, b)
                if b - a < kv.num_blocks:
                    run = KVBlocks(run.layout, run.start_block, run.data.copy(), run.hashes, run.checksums,
                                   run.num_tokens)
                t.runs.append(run)
            t.have[lo:hi] = True
            t.blocks_received += kv.num_blocks
            t.bytes_received += kv.nbytes
            if t.completed_at is None and t.have.all():
                t.completed_at = time.monotonic()
                self._wake(t)
        return kv.start_block, kv.start_block + kv.num_blocks

    def _do_action(self, action: flight.Action) -> Iterator[bytes]:
        if action.type == "abort":
            return self._abort_action(action)
        if action.type != "missing":
            raise _fail("bad_action", f"unknown action {action.type!r}")
        try:
            rid = action.body.to_pybytes().decode()
        except UnicodeDecodeError:
            raise _fail("bad_descriptor", "request id is not UTF-8") from None
        try:
            ranges = self.missing(rid)
        except UnknownRequestError as e:
            raise _fail("unknown_request", str(e)) from None
        return iter([json.dumps({"missing": ranges}).encode()])

    def _abort_action(self, action: flight.Action) -> Iterator[bytes]:
        try:
            body = json.loads(action.body.to_pybytes())
            rid, reason, mac = str(body["request_id"]), str(body.get("reason", "")), str(body.get("mac", ""))
        except (ValueError, KeyError, TypeError):
            raise _fail("bad_action", "abort needs a JSON body {request_id, reason, mac}") from None
        if self.mac_key is not None and not hmac.compare_digest(mac.encode(), abort_mac(self.mac_key, rid).encode()):
            raise _fail("mac", f"abort of {rid[:_MAX_REQUEST_ID]!r}: the MAC does not verify")
        # an abort may overtake MD's `expect` (prepare runs concurrently with prefill), as a push may
        with contextlib.suppress(pa.ArrowKeyError):
            self._lookup(rid, self.expect_wait_s)
        return iter([json.dumps({"aborted": self.abort(rid, reason)}).encode()])


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
        else:
            with ThreadPoolExecutor(self.parallel_streams, thread_name_prefix="kv-push") as pool:
                futs = [pool.submit(self._stream_with_resume, request_id, src, deadline, c, slot)
                        for slot in range(self.parallel_streams)]
                errors = []
                for f in futs:
                    try:
                        f.result()
                    except BaseException as e:  # stop the sibling streams, report the first cause
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
            for lo, hi in _ranges(~need, 0):
                out.append(run.slice(lo, hi))
        return out

    def _stream(self, request_id: str, src: _Feed, resend: deque[KVBlocks], unacked: deque[KVBlocks],
                deadline: float, c: _Counters, slot: int) -> None:
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
    m = _CODE_RE.search(str(e))
    msg = str(e).split(". Detail:")[0]
    if m:
        err = _TYPED.get(m.group(1), RejectedError)(msg)
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
