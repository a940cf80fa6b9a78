"""The report's comparison: SLA goodput and BCR per deployment, latency at a common load,
the headline ratios beside the report's (docs/pdd.md), and the bathtub curve (benefit vs hit rate)."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evaluations.sim.config import DeploymentSpec, Scenario
from evaluations.sim.metrics import GoodputResult, max_goodput, summarize
from evaluations.sim.simulator import Simulation
from evaluations.sim.workload import Workload, build_workload, synthetic


def simulate(sc: Scenario, dep: DeploymentSpec, wl: Workload, progress: bool = False,
             warmup_s: float = 0.0) -> tuple[dict[str, Any], Simulation]:
    sim = Simulation(sc, dep, wl, progress=progress)
    reqs = sim.run()
    s = summarize(reqs, sc.sla, warmup_s)
    s.update(sim_seconds=sim.wall_s, events=sim.events, backsteps=sim.backsteps)
    return s, sim


def requests_for(rate: float, horizon_s: float) -> int:
    """Enough requests for `horizon_s` seconds of arrivals: decode of a 1K answer takes ~30 s, so a
    short run never fills the decode pools and overstates what they sustain."""
    return max(200, int(rate * horizon_s))


def goodput_of(sc: Scenario, dep: DeploymentSpec, hit: float | None = None, horizon_s: float | None = None,
               warmup_s: float | None = None, iterations: int | None = None,
               on_probe: Callable[[], None] | None = None) -> GoodputResult:
    g = sc.goodput
    horizon = float(horizon_s or g.get("horizon_s", 240.0))
    warm = float(g.get("warmup_s", 60.0) if warmup_s is None else warmup_s)

    def run_at(rate: float) -> dict[str, Any]:
        wl = synthetic(sc.workload, rate_rps=rate, requests=requests_for(rate, horizon), hit=hit)
        s, _ = simulate(sc, dep, wl, warmup_s=warm)
        if on_probe is not None:
            on_probe()
        return s

    return max_goodput(run_at, sc.sla.attainment, float(g.get("lo_rps", 1.0)), float(g.get("hi_rps", 20.0)),
                       int(iterations or g.get("iterations", 7)))


def chips_label(sc: Scenario, dep: DeploymentSpec) -> str:
    roles = dep.roles()
    short = {"prefill": "P", "relay": "RLD", "main_decode": "MD"}
    return " + ".join(f"{roles[k].count} {roles[k].chip} {v}" for k, v in short.items() if k in roles)


def _gain(a: float, b: float) -> float:
    return a / b - 1 if b > 0 else math.inf


def run_report(sc: Scenario, progress: bool = True) -> dict[str, Any]:
    """Goodput search per deployment, latency at a common load, headline ratios."""
    t0 = time.perf_counter()
    cmp = sc.compare
    subject = cmp.get("subject", "pdd")
    cost_base = cmp.get("cost_baseline", "same_dc")
    lat_base = cmp.get("latency_baseline", "cross_dc_pd")
    naive = cmp.get("naive_baseline", "cross_dc_naive")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="goodput search", unit="run", leave=False)
    rows: dict[str, dict[str, Any]] = {}
    for name, dep in sc.deployments.items():
        g = goodput_of(sc, dep, on_probe=(bar.update if bar is not None else None))
        cost = sc.cost_per_hour(dep)
        rows[name] = {"chips": chips_label(sc, dep), "cost_per_hour": cost, "goodput_rps": g.rate,
                      "bcr": g.rate / cost, "probes": g.probes}
    if bar is not None:
        bar.close()
    rate = float(cmp.get("load_fraction", 0.8)) * rows[lat_base]["goodput_rps"]
    n = requests_for(rate, float(sc.goodput.get("horizon_s", 240.0)))
    warm = float(sc.goodput.get("warmup_s", 60.0))
    for name, dep in sc.deployments.items():
        s, _ = simulate(sc, dep, synthetic(sc.workload, rate_rps=rate, requests=n), progress=progress, warmup_s=warm)
        rows[name]["at_load"] = s
    sub, cb, lb = rows[subject], rows[cost_base], rows[lat_base]
    head: dict[str, Any] = {
        "scenario": sc.name,
        "bcr_gain": _gain(sub["bcr"], cb["bcr"]),
        "ttft_reduction": 1 - sub["at_load"]["ttft_p90"] / lb["at_load"]["ttft_p90"],
        "goodput_gain": _gain(sub["goodput_rps"], lb["goodput_rps"]),
        "rld_token_share": sub["at_load"]["rld_token_share"],
        "cost_delta": sub["cost_per_hour"] / cb["cost_per_hour"] - 1,
        "goodput_gain_vs_same_dc": _gain(sub["goodput_rps"], cb["goodput_rps"]),
        # against cross-DC PD without a decode-side cache (graphs/pd_cross_dc_naive.yaml)
        "goodput_gain_vs_cross_dc_naive": (_gain(sub["goodput_rps"], rows[naive]["goodput_rps"])
                                           if naive in rows else None),
        "ttft_reduction_p50": 1 - sub["at_load"]["ttft_p50"] / lb["at_load"]["ttft_p50"],
        "ttft_reduction_p99": 1 - sub["at_load"]["ttft_p99"] / lb["at_load"]["ttft_p99"],
        "compare_rate_rps": rate,
    }
    if naive in rows and rows[naive]["goodput_rps"] == 0:
        head["goodput_gain_vs_cross_dc_naive_note"] = f"{naive} meets the SLA at no rate (goodput 0): the gain is unbounded"
    ps = sc.price_sensitivity
    if ps:
        rng = []
        for price in ps.get("prices", []):
            c_sub = sc.cost_per_hour(sc.deployments[subject], {ps["chip"]: price})
            c_base = sc.cost_per_hour(sc.deployments[cost_base], {ps["chip"]: price})
            rng.append({"price": price, "cost_delta": c_sub / c_base - 1,
                        "bcr_gain": _gain(sub["goodput_rps"] / c_sub, cb["goodput_rps"] / c_base)})
        head["price_sensitivity"] = rng
    head["sim_seconds"] = time.perf_counter() - t0
    return {"rows": rows, "headline": head, "reference": sc.reference}


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}ms" if math.isfinite(x) else "-"


def _ttft_cell(s: dict[str, Any]) -> str:
    if not math.isfinite(s["ttft_p50"]):
        return "overloaded"
    return f"{s['ttft_p50']:.2f}/{s['ttft_p90']:.2f}/" + (f"{s['ttft_p99']:.2f}" if math.isfinite(s["ttft_p99"]) else "fail")


def format_report(res: dict[str, Any]) -> str:
    rows, head, ref = res["rows"], res["headline"], res["reference"]
    out = [f"{'deployment':<15}{'chips':<44}{'cost/h':>8}{'goodput':>9}{'BCR':>8}   "
           f"{'TTFT p50/p90/p99 (s)':<22}{'TPOT p90':>9}{'RLD tok':>8}  pipelines @ {head['compare_rate_rps']:.1f} req/s"]
    for name, r in rows.items():
        s = r["at_load"]
        ttft = _ttft_cell(s)
        pipes = " ".join(f"{k}:{v}" for k, v in sorted(s["pipelines"].items()))
        out.append(f"{name:<15}{r['chips']:<44}{r['cost_per_hour']:>8.2f}{r['goodput_rps']:>9.2f}{r['bcr']:>8.3f}   "
                   f"{ttft:<22}{_ms(s['tpot_p90']):>9}{s['rld_token_share']:>8.1%}  {pipes}")
    out.append("")
    out.append(f"{'headline':<34}{'simulated':>10}{'docs/pdd.md':>12}")
    for k, label in (("bcr_gain", "BCR gain vs same-DC"), ("ttft_reduction", "TTFT P90 reduction vs cross-DC PD"),
                     ("goodput_gain", "SLA goodput gain vs cross-DC PD"),
                     ("goodput_gain_vs_cross_dc_naive", "SLA goodput gain vs naive cross-DC"),
                     ("rld_token_share", "RLD share of output tokens")):
        r, v = ref.get(k), head.get(k)
        sim = "-" if v is None else ("unbounded" if math.isinf(v) else f"{v:+.1%}")
        out.append(f"{label:<34}{sim:>10}{(f'{r:+.1%}' if r is not None else '-'):>12}")
    cd = ref.get("cost_delta")
    cds = f"{cd[0]:+.1%}..{cd[1]:+.1%}" if isinstance(cd, (list, tuple)) else "-"
    out.append(f"{'cost vs same-DC':<34}{head['cost_delta']:>+10.1%}{cds:>14}")
    for p in head.get("price_sensitivity", []):
        out.append(f"  chip price {p['price']:.2f}: cost {p['cost_delta']:+.1%}, BCR gain {p['bcr_gain']:+.1%}")
    return "\n".join(out)


# ---------------------------------------------------------------- bathtub


def run_bathtub(sc: Scenario, progress: bool = True, hits: list[float] | None = None,
                deployments: list[str] | None = None) -> dict[str, Any]:
    """Goodput per cost vs a constant hit rate (every request hits exactly h)."""
    b = sc.bathtub
    hits = hits or [float(h) for h in b.get("hits", [0.0, 0.5, 0.9, 1.0])]
    deps = deployments or list(b.get("deployments", list(sc.deployments)))
    horizon = float(b.get("horizon_s", 120.0))
    warm = float(b.get("warmup_s", 40.0))
    it = int(b.get("iterations", 5))
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(hits) * len(deps), desc="bathtub", unit="point", leave=False)
    rows = []
    for h in hits:
        row: dict[str, Any] = {"hit": h}
        for d in deps:
            dep = sc.deployments[d]
            g = goodput_of(sc, dep, hit=h, horizon_s=horizon, warmup_s=warm, iterations=it)
            row[d] = {"goodput_rps": g.rate, "bcr": g.rate / sc.cost_per_hour(dep),
                      "ttft_p90": g.summary["ttft_p90"], "pipelines": g.summary["pipelines"]}
            if bar is not None:
                bar.update(1)
        rows.append(row)
    if bar is not None:
        bar.close()
    return {"deployments": deps, "rows": rows, "tail_chunk": sc.scheduler.tail_chunk,
            "chunk": sc.scheduler.prefill_chunk_tokens}


def plot_bathtub(curves: dict[str, dict[str, Any]], path: str | Path, title: str) -> Path:
    """One panel of BCR vs hit per deployment and tail-chunk mode (curves: label -> run_bathtub())."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for label, res in curves.items():
        hits = [r["hit"] for r in res["rows"]]
        for d in res["deployments"]:
            ax.plot(hits, [r[d]["bcr"] for r in res["rows"]], marker="o", ms=3, label=f"{d} ({label})")
        if len(res["deployments"]) >= 2:
            a, b = res["deployments"][:2]
            ax2.plot(hits, [r[a]["bcr"] / r[b]["bcr"] - 1 if r[b]["bcr"] > 0 else float("nan") for r in res["rows"]],
                     marker="o", ms=3, label=f"{a} vs {b} ({label})")
    ax.set_ylabel("BCR: SLA goodput (req/s) per cost/h")
    ys = [r[d]["bcr"] for res in curves.values() for r in res["rows"] for d in res["deployments"] if r[d]["bcr"] > 0]
    if ys and max(ys) > 4 * min(ys):  # a prefill-bound curve spans 10x: small drops need a log axis
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("prefix-cache hit rate (every request)")
    ax2.set_ylabel("BCR gain")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def with_tail_mode(sc: Scenario, mode: str) -> Scenario:
    return dataclasses.replace(sc, scheduler=dataclasses.replace(sc.scheduler, tail_chunk=mode))


# ---------------------------------------------------------------- traces


def run_trace(sc: Scenario, trace: str | None = None, limit: int | None = None, progress: bool = True,
              deployments: list[str] | None = None) -> dict[str, Any]:
    """Every deployment (or the named ones) over the trace's own arrival times."""
    wl_kw: dict[str, Any] = {"path": trace, "limit": limit}
    rows = {}
    total = 0.0
    wl0 = build_workload(dataclasses.replace(sc.workload, kind="trace", trace_path=trace or sc.workload.trace_path), **wl_kw)
    for name in deployments or list(sc.deployments):
        dep = sc.deployments[name]
        wl = build_workload(dataclasses.replace(sc.workload, kind="trace", trace_path=trace or sc.workload.trace_path), **wl_kw)
        s, sim = simulate(sc, dep, wl, progress=progress)
        s["cost_per_hour"] = sc.cost_per_hour(dep)
        s["chips"] = chips_label(sc, dep)
        rows[name] = s
        total += sim.wall_s
    return {"rows": rows, "label": wl0.label, "sim_seconds": total, "requests": len(wl0.requests),
            "span_s": wl0.requests[-1].arrival - wl0.requests[0].arrival if wl0.requests else 0.0}


def format_trace(res: dict[str, Any]) -> str:
    out = [f"{res['label']}  (span {res['span_s']:.0f} s of arrivals)",
           f"{'deployment':<15}{'chips':<44}{'TTFT p50/p90/p99 (s)':<24}{'TPOT p90':>9}{'SLA att.':>9}"
           f"{'RLD tok':>8}{'hit P/MD':>12}{'KV GB':>9}{'sim s':>7}  pipelines"]
    for name, s in res["rows"].items():
        ttft = _ttft_cell(s)
        pipes = " ".join(f"{k}:{v}" for k, v in sorted(s["pipelines"].items()))
        out.append(f"{name:<15}{s['chips']:<44}{ttft:<24}{s['tpot_p90'] * 1e3:>7.1f}ms{s['attainment']:>9.1%}"
                   f"{s['rld_token_share']:>8.1%}{s['hit_p']:>6.2f}/{s['hit_md']:.2f}{s['wan_gb']:>9.0f}"
                   f"{s['sim_seconds']:>7.1f}  {pipes}")
    return "\n".join(out)


# ---------------------------------------------------------------- tail chunks, isolated


def prefill_tail_curve(sc: Scenario, hits: list[float], modes: tuple[str, ...] = ("alone", "packed", "padded"),
                       n: int = 16, deployment: str | None = None) -> dict[str, Any]:
    """One saturated Prefill instance (the real PrefillInstance scheduler): n identical requests at
    a constant hit arrive together; throughput = n / makespan. Isolates docs/pdd.md's tail chunks."""
    from evaluations.sim.instances import PrefillJob
    from evaluations.sim.workload import SimRequest

    dep = sc.deployments[deployment or sc.compare.get("subject", "pdd")]
    L = sc.workload.input_tokens
    out: dict[str, Any] = {"hits": hits, "modes": {}}
    for mode in modes:
        sc2 = with_tail_mode(sc, mode)
        rows = []
        for h in hits:
            sim = Simulation(sc2, dep, Workload([], [], sc.workload.block_size))
            p = sim.ps[0]
            done: list[float] = []
            sim.prefill_done = lambda job, inst, done=done, sim=sim: done.append(sim.now)  # type: ignore[method-assign]
            hit = min(int(h * L), L - 1)
            for i in range(n):
                p.submit(PrefillJob(SimRequest(i, 0.0, L, 2, ()), L - hit, hit))
            sim.run()
            span = max(done)
            rows.append({"hit": h, "req_s": n / span, "uncached_tok_s": n * (L - hit) / span,
                         "forwards": p.forwards})
        out["modes"][mode] = rows
    return out


def plot_tail_curve(res: dict[str, Any], path: str | Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for mode, rows in res["modes"].items():
        ax.plot([r["hit"] for r in rows], [r["uncached_tok_s"] / 1e3 for r in rows], label=f"tail chunk: {mode}", lw=1.2)
    ax.set_xlabel("prefix-cache hit rate (every request)")
    ax.set_ylabel("prefill throughput, uncached ktok/s per instance")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
