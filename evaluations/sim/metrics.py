"""Per-run summaries (TTFT/TPOT percentiles, SLA attainment, token shares) and the SLA-goodput
search: goodput = the highest arrival rate at which `sla.attainment` of requests meet both the
TTFT and the TPOT bound (DistServe's definition); BCR = goodput / hardware cost per hour."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from evaluations.loadgen import SLA
from evaluations.sim.workload import SimRequest


def first_token(r: SimRequest, sla: SLA) -> float:
    """When the client gets its first token, under the SLA's convention (-1: never)."""
    if sla.ttft_from == "decoder" or (sla.ttft_from == "client" and r.pipeline == "P-MD" and r.output > 1):
        return r.t_first_decoder
    return r.t_first_prefill


def ttft(r: SimRequest, sla: SLA) -> float:
    t = first_token(r, sla)
    return (t - r.arrival) if t >= 0 else float("inf")


def tpot(r: SimRequest, sla: SLA) -> float:
    if r.output <= 1:
        return 0.0
    t = first_token(r, sla)
    return (r.t_done - t) / (r.output - 1) if t >= 0 and r.t_done >= 0 else float("inf")


def meets_sla(r: SimRequest, sla: SLA) -> bool:
    return (r.finished == 1 and not r.fallback.startswith("failed")
            and ttft(r, sla) <= sla.ttft_s and tpot(r, sla) <= sla.tpot_s)


def _pct(x: np.ndarray, q: float) -> float:
    if not len(x):
        return float("nan")
    with np.errstate(invalid="ignore"):  # failed requests are inf; inf - inf while interpolating
        v = float(np.percentile(x, q))
    return float("inf") if np.isnan(v) else v


def summarize(reqs: list[SimRequest], sla: SLA, warmup_s: float = 0.0) -> dict[str, Any]:
    """Metrics over the requests arriving after `warmup_s` (the system starts empty)."""
    if warmup_s > 0:
        t0 = reqs[0].arrival if reqs else 0.0
        kept = [r for r in reqs if r.arrival - t0 >= warmup_s]
        reqs = kept if len(kept) >= 10 else reqs
    n = len(reqs)
    tt = np.array([ttft(r, sla) for r in reqs])
    tp = np.array([tpot(r, sla) for r in reqs])
    ok = np.array([meets_sla(r, sla) for r in reqs])
    arr = np.array([r.arrival for r in reqs])
    span = float(arr.max() - arr.min()) if n > 1 else 1.0
    out_tok = sum(r.output for r in reqs)
    prompt_tok = sum(r.prompt for r in reqs)
    pipes = Counter(r.pipeline for r in reqs)
    modes = Counter(r.handoff_mode for r in reqs if r.pipeline == "P-RLD-MD")
    gaps = np.array([r.max_gap_s for r in reqs if r.handoff_mode != "none"])
    md_reqs = [r for r in reqs if r.md >= 0]
    return {
        "requests": n,
        "finished": sum(1 for r in reqs if r.finished == 1),
        "offered_rps": (n - 1) / span if span > 0 else float("nan"),
        "ttft_p50": _pct(tt, 50), "ttft_p90": _pct(tt, 90), "ttft_p99": _pct(tt, 99), "ttft_mean": float(tt[np.isfinite(tt)].mean()) if np.isfinite(tt).any() else float("inf"),
        "tpot_p50": _pct(tp, 50), "tpot_p90": _pct(tp, 90), "tpot_p99": _pct(tp, 99),
        "attainment": float(ok.mean()) if n else 0.0,
        "goodput_rps_at_load": float(ok.sum()) / span if span > 0 else float("nan"),
        "rld_token_share": sum(r.rld_tokens for r in reqs) / max(1, out_tok),
        "md_token_share": sum(r.md_tokens for r in reqs) / max(1, out_tok),
        "pipelines": dict(pipes),
        "handoff_modes": dict(modes),
        "handoff_gap_p99": _pct(gaps, 99) if len(gaps) else 0.0,
        "hit_p": sum(r.hit_p for r in reqs) / max(1, prompt_tok),
        "hit_md": sum(r.hit_md for r in md_reqs) / max(1, sum(r.prompt for r in md_reqs)),
        "wan_gb": sum(r.wan_bytes for r in reqs) / 1e9 if reqs else 0.0,
        "fallbacks": sum(1 for r in reqs if r.fallback),
    }


@dataclass
class GoodputResult:
    rate: float  # highest feasible rate found (req/s)
    summary: dict[str, Any]  # the run at that rate
    probes: list[tuple[float, float]]  # (rate, attainment) in probe order


def max_goodput(run_at: Callable[[float], dict[str, Any]], target: float, lo: float, hi: float,
                iterations: int, max_doublings: int = 4) -> GoodputResult:
    """Bisect the arrival rate for the highest one whose attainment >= target. `run_at(rate)`
    returns a summary. Attainment is treated as non-increasing in the rate (same request mix
    at every rate: only the arrival times scale)."""
    probes: list[tuple[float, float]] = []
    best: tuple[float, dict[str, Any]] | None = None

    def feasible(rate: float) -> bool:
        nonlocal best
        s = run_at(rate)
        probes.append((rate, s["attainment"]))
        ok = s["attainment"] >= target
        if ok and (best is None or rate > best[0]):
            best = (rate, s)
        return ok

    if feasible(hi):  # the bracket was too low: double until a rate misses
        for _ in range(max_doublings):
            lo, hi = hi, hi * 2
            if not feasible(hi):
                break
        else:
            return GoodputResult(best[0], best[1], probes)  # type: ignore[index]
    elif not feasible(lo):  # even the floor misses the SLA: search below it
        lo, hi = 0.0, lo
    for _ in range(iterations):
        mid = (lo + hi) / 2
        if feasible(mid):
            lo = mid
        else:
            hi = mid
    if best is None:
        return GoodputResult(0.0, run_at(max(lo, 1e-3)), probes)
    return GoodputResult(best[0], best[1], probes)
