"""The KV transport seam: what Prefill's sender and Main Decode's receiver do, whatever moves the bytes.

Sender (Prefill's side, one per target MD; `KVFlightClient`):
- `push(request_id, feed)`: send the runs of KV blocks `feed` yields, in batches, as prefill makes
  them; return a `PushResult` once the receiver acked every batch. A feed that raises
  `SenderAborted` aborts the transfer at the receiver, then the push re-raises it.
- `abort(request_id, reason)`: tell the receiver the blocks will not all come.
- `missing(request_id)`: the absolute [lo, hi) block ranges the receiver still lacks.

Receiver (MD's side, one per replica; `KVFlightServer`):
- `location`: the address senders are given (`MDPrepareReply.flight_location`).
- `expect(request_id, num_blocks, start_block=, num_tokens=, hashes=)`: register the blocks MD lacks.
- `missing(request_id)`: as the sender's.
- `wait_complete(request_id, timeout)`: await every expected block; a `ReceivedKV`.
- `abort(request_id, reason)`: the sender gave up; waiters fail at once.
- `release(request_id)`: forget the request and free its reservation.
- `bytes_reserved`: bytes reserved by the requests expected now.
- `verify_checksums`: whether every block's CRC was checked on arrival (MD then skips it on import).
- `close()`.

One transfer's life:
1. MD `expect`s the blocks it lacks (those past its prefix-cache hit); their bytes are reserved
   (`CapacityError` over a cap). A push for a request not expected is refused
   (`UnknownRequestError`), after a short wait for an `expect` it may have overtaken.
2. Prefill `push`es batches of consecutive blocks as its chunks finish. The receiver checks each
   batch whole (layout, checksums, range, partial block, token count, hashes) before storing any
   of it (`RejectedError`, its reason in `.code`), then acks it.
3. Re-sending a block the receiver holds is idempotent if identical and a `conflict` if not, so a
   broken stream resumes by re-sending what `missing` still names.
4. MD's `wait_complete` returns once every block arrived, or raises `TransferTimeout` at its
   timeout; an `abort` fails it at once with `TransferAborted` and refuses later batches.
5. MD `release`s the request once loaded or given up: `bytes_reserved` drops by its share, and a
   later push or wait for it gets `UnknownRequestError`.

The errors are `TransportError`s (flight_wire.py). Implementations: flight.py (Arrow Flight, what
the system runs) and fake.py (`InProcessKVLink`, in one process, for unit tests);
tests/transport/test_contract.py runs one suite over both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pdd_serve.engine.kv import KVBlocks
    from pdd_serve.transport.flight_client import PushResult
    from pdd_serve.transport.flight_server import ReceivedKV


@runtime_checkable
class KVSender(Protocol):
    """Prefill's side of one link to one MD."""

    def push(self, request_id: str, feed: Iterable[KVBlocks], *,
             deadline_s: float | None = None) -> PushResult:
        """Send every block of `feed`; return once all are acked, raise a TransportError if not."""
        ...

    def abort(self, request_id: str, reason: str) -> bool:
        """Fail the receiver's waiters now; False when there was nothing to abort."""
        ...

    def missing(self, request_id: str) -> list[tuple[int, int]]:
        """The absolute [lo, hi) block ranges the receiver still lacks."""
        ...


@runtime_checkable
class KVReceiver(Protocol):
    """Main Decode's side: receives every request's KV that senders push to `location`."""

    location: str  # where senders reach it
    verify_checksums: bool  # True: every block's CRC was checked on arrival

    def expect(self, request_id: str, num_blocks: int, *, start_block: int = 0, num_tokens: int | None = None,
               hashes: list[int] | None = None) -> None:
        """Reserve and accept blocks [start_block, start_block + num_blocks); idempotent."""
        ...

    def missing(self, request_id: str) -> list[tuple[int, int]]:
        """The absolute [lo, hi) block ranges not yet received."""
        ...

    async def wait_complete(self, request_id: str, timeout: float) -> ReceivedKV:
        """Every expected block, or TransferTimeout / TransferAborted / UnknownRequestError."""
        ...

    def abort(self, request_id: str, reason: str) -> bool:
        """Fail the waiters now and refuse later batches, until released; False if nothing to abort."""
        ...

    def release(self, request_id: str) -> bool:
        """Forget the request and free its reservation; False if it was not held."""
        ...

    @property
    def bytes_reserved(self) -> int:
        """Bytes reserved by the requests expected now."""
        ...

    def close(self) -> None:
        """Stop receiving."""
        ...


def transport_members(side: type) -> frozenset[str]:
    """The names a side of the seam defines: all that the serve code may use of it."""
    return frozenset(n for n in vars(side) if not n.startswith("_")) | frozenset(side.__annotations__)


__all__ = ["KVReceiver", "KVSender", "transport_members"]
