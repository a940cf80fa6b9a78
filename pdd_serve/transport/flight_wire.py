"""The KV Flight wire format: descriptors, typed errors and their wire codes, the abort MAC."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

from pdd_serve.transport.codec import (
    ChecksumMismatch,
    CodecError,
    LayoutMismatch,
    MacMismatch,
    RequestMismatch,
    SchemaMismatch,
)

DESCRIPTOR_ROOT = "pdd.kv"
CODE_RE = re.compile(r"pdd\.kv/([a-z_]+)")
MAX_REQUEST_ID = 256


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


TYPED_ERRORS = {c.code: c for c in (AuthError, UnknownRequestError, CapacityError, TransferTimeout, TransferAborted)}


def flight_error(code: str, msg: str) -> Exception:
    """A server-side error whose code survives the trip to the client."""
    text = f"{DESCRIPTOR_ROOT}/{code}: {msg}"
    if code == "unauthenticated":
        return flight.FlightUnauthenticatedError(text)
    if code == "unknown_request":
        return pa.ArrowKeyError(text)
    return pa.ArrowInvalid(text)


def codec_wire_code(e: CodecError) -> str:
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


def missing_ranges(have: np.ndarray, start: int) -> list[tuple[int, int]]:
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
