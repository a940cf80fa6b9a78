"""The Backends protocol: what the orchestrator needs from the deployments (Prefill, the relay
and main decode), and MDKey, how it names an MD replica.

Separate from the orchestrator so that what implements the contract -- the Router's adapter
over Serve deployment handles (`router.ServeBackends`), the unit tests' in-process fakes -- can
read it without the handoff and fault-path logic that uses it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Hashable
from typing import Protocol

from pdd_serve.serve.messages import (
    GenRequest,
    KVReady,
    LineState,
    MDPrepareReply,
    MDView,
    PrefillRequest,
    PrefillResult,
    RelayRequest,
    TokenChunk,
)

# an MD replica's key: its Serve replica id (the request router pins calls to it); tests use ints
MDKey = Hashable


class Backends(Protocol):
    """What the orchestrator needs from the deployments (the Router adapts Serve handles)."""

    def md_replicas(self) -> list[MDKey] | None: ...  # the MD replicas live now (None: not known yet)

    async def md_view(self, i: MDKey, known: tuple[str, int] | None) -> MDView: ...
    async def md_prepare(self, i: MDKey, req: GenRequest, planned_start: int | None) -> MDPrepareReply: ...
    async def md_wait_kv(self, i: MDKey, request_id: str, timeout_s: float) -> KVReady: ...
    async def md_handoff_batch(self, i: MDKey, request_id: str, token_ids: list[int], timeout_s: float) -> int: ...
    def md_decode(self, i: MDKey, request_id: str, committed: list[int], timeout_s: float) -> AsyncIterator[TokenChunk]: ...
    async def md_absorb(self, i: MDKey, request_id: str, output_ids: list[int], timeout_s: float) -> bool: ...
    async def md_abort(self, i: MDKey, request_id: str, attempt: int | None) -> bool: ...
    async def prefill(self, preq: PrefillRequest) -> PrefillResult: ...
    def prefill_replicas(self) -> list[Hashable] | None: ...  # the Prefill replicas live now
    async def line_state(self, i: Hashable) -> LineState: ...  # what Prefill replica i has on the line
    def relay_load(self) -> int | None: ...  # the relay pool's running requests (its routing stats)
    def relay(self, rreq: RelayRequest) -> AsyncIterator[TokenChunk]: ...
