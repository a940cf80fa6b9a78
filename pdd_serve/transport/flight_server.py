"""The receiving side of KV over Flight: `KVFlightServer`, the endpoint a Main Decode replica runs."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from pdd_serve.engine.kv import KVBlocks, KVLayout, concat_blocks
from pdd_serve.transport.codec import CodecError, check_schema, decode, kv_schema
from pdd_serve.transport.flight_wire import (
    DESCRIPTOR_ROOT,
    MAX_REQUEST_ID,
    CapacityError,
    TransferAborted,
    TransferTimeout,
    UnknownRequestError,
    abort_mac,
    codec_wire_code,
    flight_error,
    missing_ranges,
)

# ---------------------------------------------------------------- server side


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
            raise flight_error("unauthenticated", "missing or wrong bearer token")
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
        if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID:
            raise ValueError(f"request_id must be a non-empty str of <= {MAX_REQUEST_ID} chars")
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
            return missing_ranges(t.have, t.start_block)

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
            raise flight_error("bad_descriptor", f"descriptor must be path [{DESCRIPTOR_ROOT!r}, request_id]")
        try:
            return path[1].decode()
        except UnicodeDecodeError:
            raise flight_error("bad_descriptor", "request id is not UTF-8") from None

    def _lookup(self, request_id: str, wait_s: float = 0.0) -> _Transfer:
        with self._expected:
            self._expected.wait_for(lambda: request_id in self._transfers, timeout=wait_s)
        try:
            return self._get(request_id)
        except UnknownRequestError as e:
            raise flight_error("unknown_request", str(e)) from None

    def _do_put(self, descriptor: flight.FlightDescriptor, reader: flight.MetadataRecordBatchReader,
                writer: flight.FlightMetadataWriter) -> None:
        rid = self._request_of(descriptor)
        t = self._lookup(rid, self.expect_wait_s)
        try:
            check_schema(reader.schema, self.layout)
        except CodecError as e:
            raise flight_error(codec_wire_code(e), str(e)) from None
        while True:
            try:
                batch, _ = reader.read_chunk()
            except StopIteration:
                return
            except pa.ArrowException as e:  # the stream itself is malformed (or the peer went away)
                raise flight_error("malformed", f"unreadable KV stream: {e}") from None
            if batch is None:  # a metadata-only message: nothing to store
                continue
            lo, hi = self._accept(t, batch)
            writer.write(pa.py_buffer(json.dumps({"lo": lo, "hi": hi}).encode()))

    def _reject(self, t: _Transfer, code: str, msg: str) -> Exception:
        with t.lock:
            t.batches_rejected += 1
        return flight_error(code, f"request {t.request_id!r}: {msg}")

    def _accept(self, t: _Transfer, batch: pa.RecordBatch) -> tuple[int, int]:
        """Verify a whole batch, then store it: a rejected batch changes nothing."""
        try:
            kv = decode(batch, self.layout, request_id=t.request_id, verify=self.verify_checksums,
                        mac_key=self.mac_key)  # outside any lock
        except CodecError as e:
            raise self._reject(t, codec_wire_code(e), str(e)) from None
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
                raise flight_error("unknown_request", f"request {t.request_id!r} was released")
            if t.aborted is not None:
                raise flight_error("aborted", f"request {t.request_id!r}: the transfer was aborted")
            dup = t.have[lo:hi]
            for i in np.flatnonzero(dup).tolist():  # re-sends: fine if identical, an error if not
                if not _same_block(t.runs, kv, i):
                    t.batches_rejected += 1
                    raise flight_error("conflict", f"request {t.request_id!r}: block {kv.start_block + i} re-sent "
                                "with different content")
            # keep a new batch as views of its Flight buffer: no copy on the receive path. Where part
            # of it was a re-send, copy the new blocks out so a partly redundant buffer isn't pinned
            # (memory stays within the reservation however the sender slices its re-sends).
            for a, b in missing_ranges(dup, 0):
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
            raise flight_error("bad_action", f"unknown action {action.type!r}")
        try:
            rid = action.body.to_pybytes().decode()
        except UnicodeDecodeError:
            raise flight_error("bad_descriptor", "request id is not UTF-8") from None
        try:
            ranges = self.missing(rid)
        except UnknownRequestError as e:
            raise flight_error("unknown_request", str(e)) from None
        return iter([json.dumps({"missing": ranges}).encode()])

    def _abort_action(self, action: flight.Action) -> Iterator[bytes]:
        try:
            body = json.loads(action.body.to_pybytes())
            rid, reason, mac = str(body["request_id"]), str(body.get("reason", "")), str(body.get("mac", ""))
        except (ValueError, KeyError, TypeError):
            raise flight_error("bad_action", "abort needs a JSON body {request_id, reason, mac}") from None
        if self.mac_key is not None and not hmac.compare_digest(mac.encode(), abort_mac(self.mac_key, rid).encode()):
            raise flight_error("mac", f"abort of {rid[:MAX_REQUEST_ID]!r}: the MAC does not verify")
        # an abort may overtake MD's `expect` (prepare runs concurrently with prefill), as a push may
        with contextlib.suppress(pa.ArrowKeyError):
            self._lookup(rid, self.expect_wait_s)
        return iter([json.dumps({"aborted": self.abort(rid, reason)}).encode()])
