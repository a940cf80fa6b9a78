"""Typed messages that cross a process or a site on the control plane (Serve handle calls).

KV bytes never travel in these: inside a site they go by ObjectRef (object store), across
sites by Arrow Flight. What crosses the WAN on the control plane is small: ids, token ids,
block counts.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from pdd_serve.engine.blocks import PoolFullError
from pdd_serve.engine.sampling import SamplingParams


class RelaySaturated(RuntimeError):
    """A relay replica is at its share of policy.relay_max_running: the router keeps the request
    on MD (or, with nowhere else to go, the client gets a 503 and retries)."""


class PrefillBusy(RuntimeError):
    """A Prefill replica's queue would not reach this prompt within its budget (`prefill_admits`):
    the router tries again (another replica, or after a pause) and otherwise sheds it with a 503."""


class PrefillSendFull(PoolFullError):
    """A Prefill replica's buffer of KV waiting for the line is full (`Prefill.send_cap`)."""


class PrefillPoolFull(PoolFullError):
    """A Prefill replica's own KV pool can't take the prompt now."""


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # which registration at MD this is (a re-delivery is attempt + 1): an abort for an earlier
    # attempt that arrives late neither drops nor refuses a later one
    attempt: int = 0
    # the prompt's block-hash chain (engine.kv.block_hashes), computed once by the Router and
    # carried: the router's DRC view, Prefill, the relay and MD all key blocks by it
    block_hashes: tuple[int, ...] = ()


@dataclass(frozen=True)
class MDPrepareReply:
    """MD registered the request: it holds `hit_tokens` of the prompt in its DRC and expects
    the blocks from `start_block` on over Flight at `flight_location`."""

    replica: Hashable  # the MD replica that holds it (its Serve replica id)
    hit_tokens: int
    start_block: int
    expected_blocks: int
    flight_location: str


@dataclass(frozen=True)
class KVTarget:
    """Where Prefill streams the blocks MD lacks: [start_block, end_block), None = the prompt's end."""

    flight_location: str
    start_block: int
    end_block: int | None = None


@dataclass(frozen=True)
class MDView:
    """What a Main decode replica publishes to the routers in the background (its routing stats):
    its DRC's block hashes and its load, so a router picks an MD and a pipeline with no cross-site
    round trip. `hashes` is None when unchanged since the version the router already holds."""

    replica: Hashable  # its Serve replica id (what the router pins calls to)
    epoch: str  # changes when the replica (or its Flight server) restarts: drop the old view
    version: int  # moves whenever the DRC inserts or evicts
    hashes: tuple[int, ...] | None
    running: int
    capacity: int
    flight_location: str
    # its cache hits in whole units of this many blocks (vLLM's 32-token block is 2 of PDD's 16):
    # a router that plans a hit inside a unit would have Prefill resend the unit's first half
    hit_unit: int = 1


@dataclass(frozen=True)
class LineState:
    """What a Prefill replica has on the inter-site line: it sends every KV byte that crosses, so
    it, not any one router, knows the line's backlog (routers poll it and plan with the sum)."""

    replica: Hashable
    backlog: tuple[int, ...]  # bytes still to cross, per transfer in flight (fair-share model)
    bandwidth_bps: float | None  # its live estimate of the line, bits/s (None: unpaced)


@dataclass(frozen=True)
class PrefillRequest:
    req: GenRequest
    to_relay: bool  # put the whole prompt KV in the object store for Relay
    md_target: KVTarget | None  # stream the missing blocks to MD (None: P->RLD, no WAN transfer)
    # the Router's wait for this call, real seconds: past it the Router has given up (and may retry
    # elsewhere), so Prefill stops the work at its next chunk and frees the blocks. A budget, not a
    # deadline: the sites' clocks are not comparable, each side counts from when it got the call
    budget_s: float | None = None


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    finish_reason: str | None
    prefix_hit_tokens: int
    prefill_s: float
    wan_bytes: int  # bytes queued for the WAN (the blocks MD lacks)
    kv_ref: Any = None  # ray.ObjectRef of the prompt's KVBlocks (object store), for Relay
    link_bps: float | None = None  # Prefill's live estimate of the line (bits/s), None = unpaced
    # the line's clock (emulated seconds since the graph's Line, or the replica's own line, was made)
    # when the call arrived:
    # where in the line's jitter the request fell, so the simulator can replay the same draw
    link_t_s: float | None = None
    # emulated bytes of the prompt's KV put into the object store for the relay (0: none exported)
    relay_kv_bytes: int = 0


@dataclass(frozen=True)
class RelayRequest:
    req: GenRequest
    committed: tuple[int, ...]  # output tokens the client has seen (the first comes from P)
    kv_ref: Any  # ObjectRef of the prompt's KV from Prefill (same site, same object store)


@dataclass(frozen=True)
class KVReady:
    ok: bool
    nbytes: int = 0
    elapsed_s: float = 0.0  # from MD's prepare to KV complete
    error: str = ""


@dataclass(frozen=True)
class TokenChunk:
    """Tokens from a decoder (Relay or MD), in order; `finish_reason` on the last chunk."""

    token_ids: list[int]
    finish_reason: str | None = None
    timings: dict[str, float] | None = None  # MD's first chunk: where its part of the TTFT went


@dataclass
class ReplicaStats:
    role: str
    running: int
    free_blocks: int
    total_blocks: int
    cached_blocks: int = 0
    hit_rate: float = 0.0
    extra: dict = field(default_factory=dict)
