"""`pdd scale`'s parts that need no cluster: its config, the records it keeps, and the per-phase
figures, table and JSON line made from them (tests/evaluations/test_scale_eval.py). scale.py runs
the evaluation on the cluster.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from evaluations.compare import safe_ratio
from evaluations.harness import EvalEnv, EvalError
from evaluations.loadgen import SLA, LoadConfig, RequestRecord, summarize_run

PHASES = ("probe", "before", "ramp", "after", "control")
MAX_POSITIONS = 4096  # the default model's context
JSON_KEYS = ("md_replicas_max", "tokens_lost", "outputs_identical", "goodput_after_vs_before")


@dataclass(frozen=True)
class ScaleConfig:
    graph: str = "graphs/pdd.yaml"
    rate_before: float | None = None  # req/s; None: load_before x the probe's capacity_rps
    rate_after: float | None = None  # req/s; None: load_after x the probe's capacity_rps
    # the calibrated rates, as multiples of the rate at which one MD replica holds
    # target_ongoing_requests: before stays well under it, after well past it (Serve adds a replica)
    load_before: float = 0.5
    load_after: float = 1.5
    probe_s: float = 30.0
    before_s: float = 60.0
    after_s: float = 60.0
    ramp_timeout_s: float = 180.0
    system_tokens: int = 256  # shared prefix, warmed into Prefill's and MD's caches first
    prompt_tokens: int = 64  # fresh tokens per request after it
    max_tokens: int = 128
    sample_s: float = 0.5
    control: bool = False  # also offer rate_after to the graph at one fixed MD replica
    seed: int = 0
    link: Any = None
    sla: SLA = field(default_factory=SLA)
    load: LoadConfig = field(default_factory=LoadConfig)
    env: EvalEnv = field(default_factory=EvalEnv)
    experiment: str = "pdd-scale"
    tracking_uri: str | None = None
    mlflow: bool = True
    out_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if any(r is not None and not r > 0 for r in (self.rate_before, self.rate_after)):
            raise ValueError(f"ScaleConfig rates must be > 0 (or None: calibrated), got rate_before="
                             f"{self.rate_before}, rate_after={self.rate_after}")
        if self.rate_before is not None and self.rate_after is not None and self.rate_after <= self.rate_before:
            raise ValueError(f"ScaleConfig.rate_after ({self.rate_after}) must exceed rate_before "
                             f"({self.rate_before}): the ramp raises the offered load")
        if not 0 < self.load_before < 1 < self.load_after:
            raise ValueError(f"ScaleConfig needs 0 < load_before < 1 < load_after (multiples of the rate at which one "
                             f"MD replica holds its target), got {self.load_before} and {self.load_after}")
        for k in ("before_s", "after_s", "ramp_timeout_s", "sample_s", "probe_s"):
            if not getattr(self, k) > 0:
                raise ValueError(f"ScaleConfig.{k} must be > 0, got {getattr(self, k)}")
        if self.sample_s > 5:
            raise ValueError(f"ScaleConfig.sample_s must be <= 5 (the replica count is sampled), got {self.sample_s}")
        if self.system_tokens < 0 or self.prompt_tokens <= 0 or self.max_tokens <= 1:
            raise ValueError("ScaleConfig needs system_tokens >= 0, prompt_tokens > 0 and max_tokens > 1")
        if self.system_tokens + self.prompt_tokens + self.max_tokens > MAX_POSITIONS:
            raise ValueError(f"ScaleConfig: system_tokens + prompt_tokens + max_tokens must fit the model's "
                             f"{MAX_POSITIONS} positions, got {self.system_tokens + self.prompt_tokens + self.max_tokens}")


@dataclass
class ScaleRecord:
    phase: str
    prompt: list[int]
    rec: RequestRecord


@dataclass
class Sample:
    t_s: float  # offset from the load's start
    running: int  # RUNNING MainDecode replicas (serve.status())
    replicas: int  # all MainDecode replicas Serve reports (any state)
    actors: int  # live MainDecode replica actors (replica_actors)
    seqs: dict[str, int] | None = None  # running sequences per replica (its stats), every other sample
    ongoing: float | None = None  # MainDecode's ongoing requests as Serve's autoscaler reads them


def phase_metrics(records: Sequence[ScaleRecord], phase: str, window_s: float, sla: SLA, rate: float,
                  samples: Sequence[Sample] = (), window: tuple[float, float] | None = None) -> dict[str, Any]:
    """One phase's figures from the requests sent in it. Goodput: SLA-meeting requests per second
    of the phase's send window (`window_s`), so the phases compare at their own offered rates."""
    recs = [s.rec for s in records if s.phase == phase]
    s = summarize_run(recs, sla, makespan_s=window_s) if recs else {}
    ok = [r for r in recs if not r.error]
    by_rep = Counter(str(r.pdd.get("md_replica") or "?") for r in ok)
    out: dict[str, Any] = {
        "offered_rps": rate, "window_s": window_s, "requests": len(recs),
        "sent_rps": len(recs) / window_s if window_s > 0 else math.nan,
        "errors": sum(1 for r in recs if r.error),
        "ttft_p50_s": s.get("ttft_p50_s"), "ttft_p90_s": s.get("ttft_p90_s"),
        "itl_p50_s": s.get("itl_p50_s"), "itl_p90_s": s.get("itl_p90_s"), "tpot_p50_s": s.get("tpot_p50_s"),
        "e2e_p50_s": s.get("e2e_p50_s"),
        "sla_ok": s.get("sla_ok", 0), "sla_attainment": s.get("sla_attainment", math.nan),
        "goodput_rps": s.get("goodput_rps", math.nan) if recs else 0.0,
        "requests_per_md_replica": dict(sorted(by_rep.items())),
        "pipelines": s.get("pipelines", {}), "fallbacks": s.get("fallbacks", 0),
    }
    if window is not None:
        inside = [x for x in samples if window[0] <= x.t_s <= window[1]]
        out["md_replicas_min"] = min((x.running for x in inside), default=None)
        out["md_replicas_max"] = max((x.running for x in inside), default=None)
        out["md_replicas_any_state_max"] = max((x.replicas for x in inside), default=None)  # starting ones too
        seqs = [sum(x.seqs.values()) for x in inside if x.seqs]
        out["md_running_seqs_mean"] = sum(seqs) / len(seqs) if seqs else None
        out["md_running_seqs_max"] = max(seqs, default=None)
        ongoing = [x.ongoing for x in inside if x.ongoing is not None]
        out["md_serve_ongoing_mean"] = sum(ongoing) / len(ongoing) if ongoing else None  # what the autoscaler read
    return out


def calibrate(done: int, span_s: float, clients: int, cfg: ScaleConfig,
              md_seqs_mean: float | None = None) -> dict[str, Any]:
    """The offered rates from the probe: `clients` (= target_ongoing_requests) in a closed loop
    against one MD replica, drained at the end. Its throughput X = done / span is, by Little's
    law, the offered rate at which the graph holds `clients` requests in flight: capacity_rps.
    Measured at that load, not extrapolated from a light one: on shared cores latency climbs
    steeply with load, and a rate scaled up from a one-client probe overshot (the before phase
    already held 6). Rates given in `cfg` are kept."""
    if done < 4 or not span_s > 0:
        raise EvalError(f"the capacity probe measured too little to calibrate ({done} requests in {span_s:.0f}s): "
                        "raise --probe-s, or give --rate-before and --rate-after")
    capacity = done / span_s
    before = cfg.rate_before if cfg.rate_before is not None else cfg.load_before * capacity
    after = cfg.rate_after if cfg.rate_after is not None else cfg.load_after * capacity
    if after <= before:
        raise EvalError(f"rate_after {after:.3f} req/s would not exceed rate_before {before:.3f} "
                        f"(calibrated capacity {capacity:.3f} req/s): give both rates, or neither")
    return {"capacity_rps": round(capacity, 4), "rate_before": round(before, 4), "rate_after": round(after, 4),
            "probe_clients": clients, "probe_requests": done, "probe_s": round(span_s, 2),
            "probe_latency_s": round(clients / capacity, 4),
            "probe_md_seqs_mean": None if md_seqs_mean is None else round(md_seqs_mean, 3),
            "calibrated": [k for k in ("rate_before", "rate_after") if getattr(cfg, k) is None]}


def tokens_lost(records: Sequence[ScaleRecord], max_tokens: int) -> int:
    """Requests that ended in an error or whose streamed token ids are not exactly max_tokens long."""
    return sum(1 for s in records if s.rec.error or len(s.rec.token_ids) != max_tokens)


def compare_outputs(records: Sequence[ScaleRecord], expected: Sequence[Sequence[int]]) -> tuple[bool, int, list[str]]:
    """(identical, mismatched, examples): each answered request's token ids against the reference's
    greedy ids for its prompt. Errored requests are counted by `tokens_lost`, not here; identical
    needs at least one answered request."""
    bad, checked = [], 0
    for s, want in zip(records, expected):
        if s.rec.error:
            continue
        checked += 1
        if list(s.rec.token_ids) != list(want):
            first = next((i for i, (a, b) in enumerate(zip(s.rec.token_ids, want)) if a != b),
                         min(len(s.rec.token_ids), len(want)))
            bad.append(f"{s.rec.session_id} ({s.phase}, md {s.rec.pdd.get('md_replica')}, "
                       f"{s.rec.pdd.get('pipeline')}): first difference at token {first}")
    return not bad and checked > 0, len(bad), bad[:5]


def headline(phases: Mapping[str, Mapping[str, Any]], samples: Sequence[Sample], scale_up_s: float | None,
             lost: int, identical: bool, mismatched: int, cfg: ScaleConfig) -> dict[str, Any]:
    """The final JSON line."""
    before, after, control = (phases.get(k, {}) for k in ("before", "after", "control"))
    out: dict[str, Any] = {
        "md_replicas_max": max((x.running for x in samples), default=0),
        "tokens_lost": lost,
        "outputs_identical": identical,
        "goodput_after_vs_before": safe_ratio(after.get("goodput_rps"), before.get("goodput_rps")),
        "goodput_after_vs_before_def": "goodput(after: rate_after, 2 MD replicas) / goodput(before: rate_before, "
                                       "1 MD replica); goodput = SLA-meeting requests per second of the phase",
        "offered_load_ratio": cfg.rate_after / cfg.rate_before,
        "rate_before": cfg.rate_before, "rate_after": cfg.rate_after,
        "scale_up_s": scale_up_s,
        # the autoscaler decided to scale while the before phase ran: a 2nd replica in any state
        # (one still starting counts; the probe runs with MainDecode fixed at one, so only "before")
        "scaled_before_ramp": max(before.get("md_replicas_any_state_max") or 0, before.get("md_replicas_max") or 0) >= 2,
        "errors": sum(int(p.get("errors") or 0) for p in phases.values()),
        "mismatched_requests": mismatched,
        "requests": sum(int(p.get("requests") or 0) for p in phases.values()),
        "md_replicas_that_served_after": sum(1 for k, v in after.get("requests_per_md_replica", {}).items()
                                             if k != "?" and v > 0),
        "sla_ttft_s": cfg.sla.ttft_s, "sla_tpot_s": cfg.sla.tpot_s,
        "system_tokens": cfg.system_tokens, "prompt_tokens": cfg.prompt_tokens, "max_tokens": cfg.max_tokens,
    }
    if control:
        out["goodput_after_vs_one_replica"] = safe_ratio(after.get("goodput_rps"), control.get("goodput_rps"))
    for name, p in phases.items():
        for k in ("offered_rps", "window_s", "requests", "errors", "ttft_p50_s", "ttft_p90_s", "itl_p50_s",
                  "itl_p90_s", "sla_attainment", "goodput_rps", "md_replicas_max", "md_running_seqs_mean",
                  "md_serve_ongoing_mean"):
            if k in p:
                out[f"{name}.{k}"] = p[k]
        if name in ("after", "control") and p.get("requests_per_md_replica"):
            out[f"{name}.requests_per_md_replica"] = p["requests_per_md_replica"]
    return {k: (round(v, 4) if isinstance(v, float) and math.isfinite(v) else
                (None if isinstance(v, float) else v)) for k, v in out.items()}


TABLE_COLUMNS = (("phase", "phase", "s"), ("offered r/s", "offered_rps", ".2f"), ("window s", "window_s", ".0f"),
                 ("req (err)", "req", "s"), ("MD replicas", "replicas", "s"), ("TTFT p50", "ttft_p50_s", ".3f"),
                 ("TTFT p90", "ttft_p90_s", ".3f"), ("ITL p50", "itl_p50_s", ".4f"), ("ITL p90", "itl_p90_s", ".4f"),
                 ("SLA att.", "sla_attainment", ".2f"), ("goodput r/s", "goodput_rps", ".3f"),
                 ("req per MD replica", "per_replica", "s"))


def phase_table(phases: Mapping[str, Mapping[str, Any]]) -> str:
    from evaluations.report import simple_table

    rows = []
    for name, p in phases.items():
        lo, hi = p.get("md_replicas_min"), p.get("md_replicas_max")
        reps = "?" if hi is None else (f"{hi}" if lo == hi else f"{lo}-{hi}")
        if name == "control":
            reps = "1 (fixed)"
        per = p.get("requests_per_md_replica") or {}
        rows.append({**p, "phase": name, "req": f"{p.get('requests', 0)} ({p.get('errors', 0)})", "replicas": reps,
                     "per_replica": " ".join(str(v) for _, v in sorted(per.items())) or "-"})
    return simple_table(rows, TABLE_COLUMNS)
