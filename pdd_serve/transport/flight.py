"""KV over Arrow Flight: the cross-site data plane (Prefill at site A -> Main Decode at site B).

The seam's two sides and a transfer's life are in base.py (`KVSender`: `KVFlightClient`;
`KVReceiver`: `KVFlightServer`); fake.py is an in-process stand-in for unit tests. Below: how
Flight carries that.

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

The code lives in three modules: flight_wire.py (descriptors, typed errors and wire codes, the abort
MAC), flight_server.py (`KVFlightServer`, MD's side) and flight_client.py (`KVFlightClient`,
Prefill's side). This module re-exports their public names.
"""

from __future__ import annotations

from pdd_serve.transport.flight_client import KVFlightClient, PushResult
from pdd_serve.transport.flight_server import KVFlightServer, ReceivedKV, TransferStats
from pdd_serve.transport.flight_wire import (
    DESCRIPTOR_ROOT,
    AuthError,
    CapacityError,
    RejectedError,
    SenderAborted,
    StreamBroken,
    TransferAborted,
    TransferTimeout,
    TransportError,
    UnknownRequestError,
    abort_mac,
    kv_descriptor,
)

__all__ = ["DESCRIPTOR_ROOT", "AuthError", "CapacityError", "KVFlightClient", "KVFlightServer", "PushResult",
           "ReceivedKV", "RejectedError", "SenderAborted", "StreamBroken", "TransferAborted", "TransferStats",
           "TransferTimeout", "TransportError", "UnknownRequestError", "abort_mac", "kv_descriptor"]
