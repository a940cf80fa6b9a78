"""RLD's token stream for one request on the P->RLD->MD pipeline, read in phases and cut at the
handoff (the orchestrator's `_relay_then_md` drives it).

Separate from the orchestrator because it holds the stream's own state (the pending read, whether
RLD finished, whether it was cut); it needs from its orchestrator only the three calls in
`RelayDriver`, so it does not import the orchestrator.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from pdd_serve.serve.request_state import RelayLost, RequestState, is_request_error
from pdd_serve.serve.tasks import spawn


class RelayDriver(Protocol):
    """What `RelayReader` needs from the orchestrator that drives it."""

    async def _wait_any(self, *futs: asyncio.Future | None) -> None: ...
    def _take(self, st: RequestState, nxt: asyncio.Task) -> tuple[list[int], bool]: ...
    @staticmethod
    async def _close(it: Any) -> None: ...


class RelayReader:
    """RLD's token stream for one request, read in phases (until the KV is ready, until a catch-up
    batch lands, or to the end) and cut at the handoff."""

    def __init__(self, orch: RelayDriver, st: RequestState, stream: Any) -> None:
        self.o, self.st = orch, st
        self.it = stream.__aiter__()
        self.nxt: asyncio.Future = spawn(self.it.__anext__())
        self.finished = False  # RLD produced the finish reason
        self.closed = False

    async def until(self, fut: asyncio.Future | None) -> AsyncIterator[list[int]]:
        """Commit and yield RLD's tokens until `fut` completes (None: until RLD finishes)."""
        while not self.finished and (fut is None or not fut.done()):
            try:
                await self.o._wait_any(self.nxt, fut)
                if not self.nxt.done():
                    continue
                toks, self.finished = self.o._take(self.st, self.nxt)
            except Exception as e:  # noqa: BLE001 - the relay's failure, whatever it raised
                if is_request_error(e):  # the request's own fault: MD would fail it the same way
                    raise
                raise RelayLost(f"{type(e).__name__}: {e}") from e
            if toks:
                yield toks
            if not self.finished:
                self.nxt = spawn(self.it.__anext__())

    async def cut(self) -> None:
        """Stop RLD (its KV is freed); a token it produced past the cut was never committed."""
        self.closed = True
        if not self.nxt.done():
            self.nxt.cancel()
        await self.o._close(self.it)
        # let go of the stream and its last read: a cancelled read's traceback holds the stream's
        # frames, and through them its request (with the KV's ObjectRef) for as long as MD decodes
        self.it = self.nxt = None
