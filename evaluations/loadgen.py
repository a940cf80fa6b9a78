"""Asynchronous OpenAI-API load generator: open-loop sessions, streamed token-id requests, client-side
latencies, SLA goodput.

Sessions start open loop on their `start_s`; a session's turns run in order (each prompt is the
context kept from the earlier turns, plus the turn's tokens, where the context includes the model's
answers). Every request is greedy, streamed, with `return_token_ids` (so outputs can be compared
across graphs by token ids) and `ignore_eos` by default (so output lengths are what the workload
planned).

Latencies, per request, measured at the client:
- `ttft_s`: time to the first token (what an OpenAI client sees first). On P->MD the router sends
  Prefill's first token with MD's first chunk, once MD holds the KV (policy.stream_first_token off,
  the default), so the WAN wait is in it; on the relay pipelines the first token leaves at once.
- `tt2t_s`: time to the second token: when the stream is really flowing (with
  stream_first_token on, the KV wait shows up here instead of in `ttft_s`).
- `tpot_s`: (last token - first token) / (tokens - 1), stalls included (vLLM's definition); `itl_max_s`.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from evaluations.workloads import Session, Turn, Workload
from pdd_serve.emulation.clock import Clock


@dataclass
class RequestRecord:
    session_id: str
    turn: int
    kind: str
    prompt_tokens: int = 0
    planned_hit: float | None = None
    max_tokens: int = 0
    t_send_s: float | None = None  # offset from the run's start
    status: int = 0
    error: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    ttft_s: float | None = None
    tt2t_s: float | None = None
    tpot_s: float | None = None
    itl_max_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # every gap between tokens (pooled ITL percentiles)
    e2e_s: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    pdd: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int]:
        return self.session_id, self.turn

    @property
    def t_done_s(self) -> float | None:
        return None if self.t_send_s is None or self.e2e_s is None else self.t_send_s + self.e2e_s

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row.pop("pdd")
        row.pop("itl_s")
        row.update({f"pdd_{k}": v for k, v in self.pdd.items()})
        return row


TTFT_FROM = ("decoder", "prefill", "client")


@dataclass(frozen=True)
class SLA:
    """The one SLA (`pdd compare`, emulated and simulator scenarios): a request meets it when its
    TTFT and its TPOT are within these targets; goodput is the highest rate at which `attainment`
    of the requests do."""

    ttft_s: float = 1.0
    tpot_s: float = 0.1
    attainment: float = 0.9
    # which first token TTFT counts, where the simulator models it (a real run's client measures
    # what it receives): decoder, when a decoder starts streaming (PD systems such as the report's,
    # where the decode side returns every token); prefill, P streams its own token first (the
    # Router with policy.stream_first_token on); client, what the Router sends by default (P->MD
    # holds P's token until MD's first chunk; the relay pipelines send it at once)
    ttft_from: str = "client"

    def __post_init__(self) -> None:
        for f in ("ttft_s", "tpot_s"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"{f}: must be > 0, got {v!r}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment: must be in (0, 1], got {self.attainment!r}")
        if self.ttft_from not in TTFT_FROM:
            raise ValueError(f"ttft_from: must be one of {TTFT_FROM}, got {self.ttft_from!r}")

    def meets(self, r: RequestRecord) -> bool:
        if r.error or r.ttft_s is None or r.ttft_s > self.ttft_s:
            return False
        return r.tpot_s is None or r.tpot_s <= self.tpot_s  # one-token answers have no TPOT


@dataclass(frozen=True)
class LoadConfig:
    model: str = "pdd-small"
    timeout_s: float = 300.0
    ignore_eos: bool = True
    api_key: str | None = None
    max_connections: int = 256
    # an emulated graph's slow motion (pdd_serve/emulation/clock.py): arrivals, think times and the
    # timeout stretch by it, and every measured time is divided back, so records read in emulated seconds
    time_scale: float = 1.0
    # closed loop: this many clients, each starting the next session when its last one ended
    # (sessions' start_s ignored); None: open loop, every session at its start_s
    clients: int | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or self.max_connections <= 0:
            raise ValueError("LoadConfig needs timeout_s > 0 and max_connections > 0")
        if self.clients is not None and self.clients <= 0:
            raise ValueError(f"LoadConfig.clients must be > 0 or None, got {self.clients}")
        if not self.time_scale > 0:
            raise ValueError(f"LoadConfig.time_scale must be > 0, got {self.time_scale}")

    @property
    def clock(self) -> Clock:
        return Clock(self.time_scale)


async def stream_completion(client: Any, base_url: str, prompt: Sequence[int], turn: Turn, rec: RequestRecord,
                            cfg: LoadConfig = LoadConfig()) -> None:
    """One streaming greedy /v1/completions call over token ids, filling `rec`."""
    body: dict[str, Any] = {"model": cfg.model, "prompt": list(prompt), "max_tokens": turn.max_tokens,
                            "temperature": 0.0, "stream": True, "return_token_ids": True,
                            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    t0 = time.monotonic()
    stamps: list[float] = []  # arrival time of each token
    parts: list[str] = []
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers,
                                 timeout=cfg.clock.real(cfg.timeout_s)) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: " + (await r.aread()).decode(errors="replace")[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                obj = json.loads(line[6:])
                if "error" in obj:
                    rec.error = obj["error"].get("message", "stream error")
                    continue
                for ch in obj.get("choices", []):
                    ids = ch.get("token_ids") or []
                    rec.token_ids.extend(ids)
                    stamps.extend([now] * len(ids))
                    parts.append(ch.get("text") or "")
                    if ch.get("finish_reason"):
                        rec.finish_reason = ch["finish_reason"]
                if "pdd" in obj:
                    rec.pdd = obj["pdd"]
    except Exception as e:  # recorded, the run goes on
        rec.error = f"{type(e).__name__}: {e}"
        return
    rec.e2e_s = time.monotonic() - t0
    rec.text = "".join(parts)
    rec.output_tokens = len(rec.token_ids)
    if stamps:
        rec.ttft_s = stamps[0] - t0
        if len(stamps) > 1:
            rec.tt2t_s = stamps[1] - t0
            rec.tpot_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
            rec.itl_s = [b - a for a, b in zip(stamps, stamps[1:])]
            rec.itl_max_s = max(rec.itl_s)
    elif not rec.error:
        rec.error = "the stream ended without a token"


async def run_workload(base_url: str, sessions: Iterable[Session], cfg: LoadConfig = LoadConfig(),
                       progress: Any = None, transport: Any = None) -> list[RequestRecord]:
    """Replay sessions open loop (each starts at its start_s; its turns follow their answers), or
    closed loop by `cfg.clients` clients. `transport`: an httpx transport to use instead of the
    network (tests)."""
    import httpx

    sessions = list(sessions)
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=cfg.max_connections, max_keepalive_connections=64)
    clock = cfg.clock
    async with httpx.AsyncClient(limits=limits, timeout=clock.real(cfg.timeout_s), transport=transport) as client:
        t_start = time.monotonic()

        async def one(s: Session) -> None:
            if cfg.clients is None:
                await asyncio.sleep(max(0.0, clock.real(s.start_s) - (time.monotonic() - t_start)))
            context: list[int] = []
            for i, turn in enumerate(s.turns):
                if i and turn.think_s:
                    await asyncio.sleep(clock.real(turn.think_s))
                if turn.reset_to is not None:
                    context = context[: turn.reset_to]
                context = context + list(turn.tokens)
                rec = RequestRecord(s.session_id, i, turn.kind, len(context), turn.planned_hit, turn.max_tokens,
                                    time.monotonic() - t_start)
                await stream_completion(client, base_url, context, turn, rec, cfg)
                if cfg.time_scale != 1.0:
                    to_emulated(rec, clock)
                records.append(rec)
                if progress is not None:
                    progress.update(1)
                if rec.error:  # the session's later prompts would depend on a missing answer
                    for j in range(i + 1, len(s.turns)):
                        t = s.turns[j]
                        records.append(RequestRecord(s.session_id, j, t.kind, 0, t.planned_hit, t.max_tokens,
                                                     error=f"skipped: turn {i} failed"))
                        if progress is not None:
                            progress.update(1)
                    return
                context += rec.token_ids

        if cfg.clients is None:
            await asyncio.gather(*(one(s) for s in sessions))
        else:
            queue = iter(sessions)  # shared: each client takes the next session not yet taken

            async def closed_client() -> None:
                for s in queue:
                    await one(s)

            await asyncio.gather(*(closed_client() for _ in range(cfg.clients)))
    return sorted(records, key=lambda r: (r.t_send_s is None, r.t_send_s or 0.0, r.session_id, r.turn))


def to_emulated(rec: RequestRecord, clock: Clock) -> None:
    """A record measured in real seconds, read in emulated ones (the router's `pdd` facts already are)."""
    for k in ("t_send_s", "e2e_s", "ttft_s", "tt2t_s", "tpot_s", "itl_max_s"):
        v = getattr(rec, k)
        if v is not None:
            setattr(rec, k, clock.emulated(v))
    if rec.itl_s:
        rec.itl_s = [clock.emulated(x) for x in rec.itl_s]


def run_sessions(base_url: str, sessions: Iterable[Session], progress: Any = None,
                 cfg: LoadConfig = LoadConfig()) -> Any:
    """The coroutine of `run_workload` (pdd demo's entry point)."""
    return run_workload(base_url, sessions, cfg, progress)


def drive(base_url: str, workload: Workload, cfg: LoadConfig = LoadConfig(), desc: str = "requests",
          log: Any = print, progress: bool = True,
          settle_s: float | Callable[[list[RequestRecord]], float] = 3.0) -> list[RequestRecord]:
    """Warm-up sessions first (awaited, not measured), then the workload, with a tqdm bar.

    `settle_s` after the warm-up (or a function of the warm-up's records): a warm-up answered by the
    relay alone is absorbed into MD's cache in the background once its KV has crossed the link; the
    measured run must not race that."""
    from tqdm import tqdm

    if workload.warmup:
        warm = asyncio.run(run_workload(base_url, workload.warmup, cfg))
        bad = [r for r in warm if r.error]
        if bad:
            log(f"warning: {len(bad)} warm-up request(s) failed, e.g. {bad[0].error}")
        time.sleep(cfg.clock.real(settle_s(warm) if callable(settle_s) else settle_s))
    with tqdm(total=workload.num_requests, desc=desc, unit="req", disable=not progress, leave=False) as bar:
        return asyncio.run(run_workload(base_url, workload.sessions, cfg, bar))


# ---------------------------------------------------------------- statistics


def percentile(values: Iterable[float | None], q: float) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    k = (len(vals) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (k - lo)


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def makespan(records: Sequence[RequestRecord]) -> float:
    """First send to last answer of one run."""
    sends = [r.t_send_s for r in records if r.t_send_s is not None]
    dones = [r.t_done_s for r in records if not r.error and r.t_done_s is not None]
    return (max(dones) - min(sends)) if dones and sends else math.nan


def summarize_run(records: Sequence[RequestRecord], sla: SLA, makespan_s: float | None = None) -> dict[str, Any]:
    """One run's figures: latency percentiles, SLA goodput, what PDD did (pipelines, eager tokens,
    handoffs, WAN bytes). Goodput is SLA-meeting requests per second of the run's makespan (first
    send to last answer), so a graph that falls behind an open-loop arrival schedule pays for it.
    `makespan_s` overrides it (records pooled from several runs: the sum of their makespans)."""
    ok = [r for r in records if not r.error]
    span = makespan(records) if makespan_s is None else makespan_s
    good = sum(1 for r in records if sla.meets(r))
    out: dict[str, Any] = {"requests": len(records), "errors": len(records) - len(ok), "sla_ok": good,
                           "sla_attainment": good / len(records) if records else math.nan,
                           "makespan_s": span,
                           "goodput_rps": good / span if span > 0 else math.nan,
                           "throughput_tok_s": sum(r.output_tokens for r in ok) / span if span > 0 else math.nan}
    for name in ("ttft", "tt2t", "tpot", "e2e", "itl_max"):
        vals = [getattr(r, f"{name}_s") for r in ok]
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(vals, q / 100)
    itls = [g for r in ok for g in r.itl_s]  # pooled: each gap a client waited, as vLLM's ITL
    for q in (50, 90, 99):
        out[f"itl_p{q}_s"] = percentile(itls, q / 100)
    out_tokens = sum(r.output_tokens for r in ok)
    eager = sum(int(r.pdd.get("eager_tokens") or 0) for r in ok)
    out["output_tokens"] = out_tokens
    out["eager_tokens"] = eager
    out["rld_token_share"] = eager / out_tokens if out_tokens else math.nan
    out["wan_bytes"] = sum(int(r.pdd.get("wan_bytes") or 0) for r in ok)
    out["pipelines"] = dict(sorted(Counter(r.pdd.get("pipeline") or "?" for r in ok).items()))
    out["handoffs"] = dict(sorted(Counter(r.pdd["handoff_mode"] for r in ok
                                          if r.pdd.get("handoff_mode", "none") != "none").items()))
    out["fallbacks"] = sum(1 for r in ok if r.pdd.get("fallback"))
    for side in ("p", "md"):
        hits = [r.pdd.get(f"prefix_hit_{side}") for r in ok]
        hits = [h for h in hits if h is not None]
        out[f"prefix_hit_{side}_mean"] = sum(hits) / len(hits) if hits else math.nan
    planned = [r.planned_hit for r in records if r.planned_hit is not None]
    out["planned_hit_mean"] = sum(planned) / len(planned) if planned else math.nan
    return out
