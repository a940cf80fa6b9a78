"""One request as the orchestrator carries it, and how a failure on its way is classified.

`RequestState` is what the Router hands the orchestrator and reads back (the committed tokens,
the finish reason, and `PDDInfo`, the `pdd` object its response reports). The exceptions and
`is_request_error` / `is_overloaded` decide what a failure means: the request's own fault (a 400),
a full pool (503 + Retry-After), or a lost relay (MD takes over). They are separate from the
orchestrator because the Router uses the same state and classification to answer the client,
without the pipelines that fill them in. `prompt_hashes` reads a request's prompt block chain.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from pdd_serve.engine.blocks import PoolFullError, block_hashes
from pdd_serve.engine.sampling import RequestError
from pdd_serve.serve.backends import MDKey
from pdd_serve.serve.messages import GenRequest, PrefillBusy, PrefillPoolFull, PrefillSendFull, RelaySaturated


class RelayLost(RuntimeError):
    """RLD failed mid-stream (its replica died, or it refused the request): MD takes over."""


class Overloaded(RuntimeError):
    """Every pool that could take the request is full now: not a fault, and not the client's.
    The Router answers 503 + Retry-After."""


def _cause(e: BaseException) -> BaseException:
    return getattr(e, "cause", None) or e  # Ray wraps a replica's exception (RayTaskError)


def is_request_error(e: BaseException) -> bool:
    """The request itself is bad (e.g. non-finite logits): a 400, never migrated as a fault."""
    return isinstance(e, RequestError) or isinstance(_cause(e), RequestError)


def is_overloaded(e: BaseException) -> bool:
    """A pool could not admit the request now (PoolFullError): retry later, not a dead replica."""
    return any(isinstance(x, (PoolFullError, Overloaded, RelaySaturated, PrefillBusy)) for x in (e, _cause(e)))


# what refused an overloaded request, by the refusal's type: (type, reason, what the client is
# told). The reason is `pdd_rejected_total`'s label and the Router's log line's
REFUSALS: tuple[tuple[type[BaseException], str, str], ...] = (
    (PrefillBusy, "prefill_queue", "Prefill's queue would not reach the prompt within its budget"),
    (PrefillSendFull, "prefill_send_buffer", "Prefill's buffer of KV waiting for the inter-site line is full"),
    (PrefillPoolFull, "prefill_kv_pool", "Prefill's KV pool is full"),
    # admitted, then still queued in Prefill when its budget ran out: the same overload, found late
    (TimeoutError, "prefill_timeout", "the prompt waited in Prefill's queue past its budget"),
    (RelaySaturated, "relay", "the relay pool is at policy.relay_max_running"),
)
# Prefill's refusals all have their own types: the rest are the decode side's pools
DECODE_REFUSAL = ("decode_kv_pool", "every main decode KV pool that could take the request is full")


def refusal(e: BaseException) -> tuple[str, str, str]:
    """(reason, what the client is told, the refusal's own words) of an overloaded request: the
    first refusal of a known type down its explicit causes (`raise ... from`, Ray's `cause`),
    else the decode side's. For Prefill's queue, its words give the estimate."""
    x: BaseException | None = e
    last = e
    for _ in range(16):  # a chain is a few links: bounded all the same
        if x is None:
            break
        last = x
        inner = getattr(x, "cause", None)
        if isinstance(inner, BaseException):  # Ray's wrapper: its cause holds the replica's own words
            x = inner
            continue
        for kind, reason, told in REFUSALS:
            if isinstance(x, kind):
                return reason, told, str(x)
        x = x.__cause__
    return (*DECODE_REFUSAL, str(last))


def relay_fault(e: BaseException) -> str:
    """A relay that refused (its pool is at relay_max_running, whichever routers sent) is full,
    not lost: the request goes to MD all the same."""
    full = is_overloaded(e) or is_overloaded(e.__cause__ or e) or "RelaySaturated" in f"{type(e).__name__}: {e}"
    return "relay_full" if full else "relay_lost"


def prompt_hashes(gen: GenRequest, block_size: int) -> list[int]:
    """The chain the Router computed on its parser thread (computed here only for a caller that
    built its GenRequest without one)."""
    return list(gen.block_hashes) or block_hashes(list(gen.prompt_token_ids), block_size)


@dataclass
class PDDInfo:
    """The `pdd` object each response carries: what PDD did with the request."""

    pipeline: str = ""
    handoff_mode: str = "none"
    handoff_batches: int = 0
    eager_tokens: int = 0  # tokens the client got from RLD
    md_tokens: int = 0
    wan_bytes: int = 0
    relay_kv_bytes: int = 0  # the prompt's KV put into the object store for the relay (emulated bytes)
    md_replica: MDKey | None = None
    prefix_hit_p: float = 0.0
    prefix_hit_md: float = 0.0
    ttft_s: float = 0.0
    # where a TTFT went (P->MD): the router's decision, prefill as the router saw it, MD's wait for
    # the KV after the decode call landed, MD's first step; the rest is the calls across the line
    decision_s: float | None = None
    prefill_s: float | None = None
    md_kv_wait_s: float | None = None
    md_kv_land_s: float | None = None  # of md_kv_wait_s: until the stream was complete
    md_step_s: float | None = None
    kv_ready_s: float | None = None
    handoff_s: float | None = None
    link_t_s: float | None = None  # Prefill's link clock at the call (PrefillResult.link_t_s)
    reason: str = ""
    fallback: str | None = None  # the last fault path taken, with its cause
    fallbacks: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class RequestState:
    gen: GenRequest
    info: PDDInfo = field(default_factory=PDDInfo)
    committed: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # a decoder (or P) ended the request itself; else (a stop string, max_tokens at the router,
    # the client gone, a fault) every decoder still working on it must be stopped
    decoder_done: bool = False
    t0: float = field(default_factory=time.monotonic)
