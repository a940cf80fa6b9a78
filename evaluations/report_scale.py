"""The report's scale in the simulator (issue 40, item 7): `pdd simulate --capacity-of SCENARIO --report-scale`.

The measured compare runs one replica per role on this machine. The report deploys tens of chips:
88 A for the same-DC baseline against 43 A (P + RLD) + 32 B (MD) + one inter-DC line for PDD
(docs/pdd.md). Here the scenario's graphs get those chip budgets, in whole replicas of the
scenario's `tp` (88 A at tp 4: 22 replicas), and the simulator, blind as in `pdd simulate
--capacity-of`, finds each graph's capacity. How a site's replicas split between roles is searched
(the best capacity wins), since a baseline runs in its strongest configuration too: same-DC splits
its A replicas between P and MD, PDD its site-a replicas between P and RLD; the strong cross-DC PD
gives every site-a replica to P. The line grows with the MDs (each MD keeps the share of the line
it has in the measured deployment), so a line bought for one MD does not bottleneck four.

Beside each figure: BCR priced whole (market and the report's relative prices), P90 TTFT against
the strong cross-DC PD at a common rate (0.8 x its capacity, fixed from the search before the
common-rate runs), and RLD's share of output tokens, with the report's numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from evaluations.capacity_compare import (
    CAPACITY_GRAPHS,
    COMMON_RATE_FRACTION,
    CROSS,
    PDD,
    REPORT_MARGINS,
    SAME,
    CapacityConfig,
    agentic_spec,
    bcr_gains,
    blind,
    gain,
    gap_s,
    placeholder_answers,
    price_sets,
    probe_requests,
    rounded,
)
from evaluations.cost import bcr
from evaluations.harness import PreparedGraph, for_repeat, link_seed, log_err, prepare_graphs
from evaluations.open_loop import at_rate, probe_load

# docs/pdd.md: 64K total, 1K output, 90% hit: same-DC needs 88 A; PDD 43 A (P + RLD) + 32 B (MD)
REPORT_CHIPS = {SAME: {"a": 88}, CROSS: {"a": 43, "b": 32}, PDD: {"a": 43, "b": 32}}
REPORT_FIGURES = {"bcr_gain_vs_same_dc": 0.375, "ttft_vs_cross_dc": -0.515, "goodput_vs_cross_dc": 0.278,
                  "rld_token_share": 0.062}
REPORT_PROBE_REQUESTS = 400  # tens of replicas need more requests per probe to reach steady load


def site_replicas(sc: Any, graph: str) -> dict[str, int]:
    """Whole replicas per site from the report's chip budget at the scenario's tp (at least one)."""
    return {site: max(1, chips // int(sc.chips[graph][site]["tp"])) for site, chips in REPORT_CHIPS[graph].items()}


def splits(graph: str, sites: dict[str, int]) -> list[dict[str, int]]:
    """The role counts a graph may deploy on its sites' replicas: same-DC P + MD = a; PDD P + RLD =
    a and MD = b; the strong cross-DC PD P = a and MD = b."""
    a, b = sites["a"], sites.get("b", 0)
    if graph == SAME:
        return [{"prefill": p, "main_decode": a - p} for p in range(1, a)]
    if graph == CROSS:
        return [{"prefill": a, "main_decode": b}]
    return [{"prefill": a - r, "relay": r, "main_decode": b} for r in range(1, a)]


def with_counts(g: PreparedGraph, counts: dict[str, int]) -> PreparedGraph:
    """The graph with these replicas per role; the relay pool's admission (policy.relay_max_running,
    pool-wide) grows with its replicas, each keeping the deployed replica's share (as `pdd plan`)."""
    cfg = g.cfg
    sites = dataclasses.replace(cfg.sites, **{f"{r}_replicas": n for r, n in counts.items()})
    per_relay = cfg.policy.relay_max_running / max(1, cfg.sites.relay_replicas)
    policy = dataclasses.replace(cfg.policy, relay_max_running=max(1, round(per_relay * counts.get("relay", 1))))
    return dataclasses.replace(g, cfg=dataclasses.replace(cfg, sites=sites, policy=policy))


def scaled_scenario(sc: Any, md_replicas: int, deployed_md: int = 1) -> Any:
    """The scenario with its line grown with the MDs: each keeps the share of the line it has in
    the deployment the scenario describes (`deployed_md` MD replicas on the scenario's line)."""
    link = dict(sc.link)
    link["bandwidth_bps"] = float(link["bandwidth_bps"]) * md_replicas / deployed_md
    return dataclasses.replace(sc, link=link)


def coarse(options: list[dict[str, int]], keep: int) -> list[int]:
    """Indices of at most `keep` options spread evenly (both ends kept): the first pass."""
    if len(options) <= keep:
        return list(range(len(options)))
    return sorted({round(i * (len(options) - 1) / (keep - 1)) for i in range(keep)})


def best_split(options: list[dict[str, int]], capacity_of: Callable[[dict[str, int]], float],
               keep: int = 6) -> tuple[list[tuple[float, dict[str, int]]], int]:
    """The split with the highest capacity: a coarse pass over evenly spread splits, then every
    split between the best one's neighbours in that pass (capacity is unimodal in the split: too
    few of either role starves the other). Returns every (capacity, split) tried, in order, and
    the best one's index among them. Every graph is searched the same way."""
    tried: dict[int, float] = {}

    def at(i: int) -> float:
        if i not in tried:
            tried[i] = capacity_of(options[i])
        return tried[i]

    first = coarse(options, keep)
    top = max(first, key=at)
    pos = first.index(top)
    lo = first[pos - 1] if pos > 0 else top
    hi = first[pos + 1] if pos + 1 < len(first) else top
    for i in range(lo, hi + 1):
        at(i)
    order = sorted(tried)
    best = max(order, key=lambda i: tried[i])
    return [(tried[i], options[i]) for i in order], order.index(best)


def report_scale(sc: Any, overhead_s: float, out_dir: Path, keep: int = 6,
                 log: Callable[[str], None] = log_err) -> dict[str, Any]:
    """Every graph at the report's chip budgets: the best role split, its blind capacity and BCR,
    and P90 TTFT / RLD share at the common rate."""
    from evaluations.sim.blind import sim_workload, with_overhead
    from evaluations.sim.emulated import cost_per_hour, sim_scenario_for
    from evaluations.sim.metrics import summarize
    from evaluations.sim.simulator import Simulation
    from evaluations.sim.validate import with_link_seed

    base = CapacityConfig.of(sc.capacity)
    cap = dataclasses.replace(base, requests=max(base.requests, REPORT_PROBE_REQUESTS), draws=0)
    graphs = {g.name: for_repeat(g, 0) for g in prepare_graphs(CAPACITY_GRAPHS, out_dir / "graphs", 8000, sc.link,
                                                               False, emulate=sc)}
    prices = price_sets(sc)
    rows: dict[str, Any] = {}
    best_graph: dict[str, tuple[PreparedGraph, Any]] = {}
    for name in (SAME, CROSS, PDD):
        sites = site_replicas(sc, name)
        deployed_md = graphs[name].cfg.sites.main_decode_replicas
        runs: dict[tuple[int, ...], tuple[PreparedGraph, Any, dict[str, Any]]] = {}

        def capacity_of(counts: dict[str, int], name: str = name, deployed_md: int = deployed_md,
                        runs: dict = runs) -> float:
            g = with_counts(graphs[name], counts)
            scx = scaled_scenario(sc, counts["main_decode"], deployed_md) if g.cross_site else sc
            pred = blind(scx, [g], cap, overhead_s, out_dir / f"{name}-{'-'.join(map(str, counts.values()))}",
                         log=lambda _m: None)[name]
            runs[tuple(counts.values())] = (g, scx, pred)
            log(f"report scale: {name} {counts}: capacity {pred['capacity_rps']} req/s")
            return pred["capacity_rps"] or 0.0

        tried, best = best_split(splits(name, sites), capacity_of, keep)
        counts = tried[best][1]
        g, scx, pred = runs[tuple(counts.values())]
        best_graph[name] = (g, scx)
        cost = {k: cost_per_hour(g.cfg, v) for k, v in prices.items()}
        rows[name] = {"replicas": counts, "chips": {s: n * int(sc.chips[name][s]["tp"]) for s, n in
                                                    _site_counts(name, counts).items()},
                      # grown with the MDs, still priced as one line (the catalog's links.cross_dc)
                      "line_bps": float(scx.link["bandwidth_bps"]) if g.cross_site else None,
                      "capacity_rps": pred["capacity_rps"], "capacity_bracket": pred["capacity_bracket"],
                      "splits_tried": [{"replicas": c, "capacity_rps": cap_} for cap_, c in tried],
                      "cost_per_hour": cost, "bcr": {k: bcr(pred["capacity_rps"], c) for k, c in cost.items()}}
    # the common rate, fixed from the cross-DC PD's capacity above before these runs
    rate = COMMON_RATE_FRACTION * (rows[CROSS]["capacity_rps"] or 0.0)
    load = probe_load(agentic_spec(sc, probe_requests(sc, cap, rate), 0), placeholder_answers)
    bs = graphs[PDD].cfg.model.block_size
    for name in (CROSS, PDD):
        g, scx = best_graph[name]
        sim = with_overhead(sim_scenario_for(scx, [g], out_dir / f"{name}-common"), overhead_s)
        sim = with_link_seed(sim, name, link_seed(g))
        wl = sim_workload(at_rate(load, rate, gap_s(sc)), bs, None, sc.context_scale) if rate > 0 else None
        if wl is None:
            continue
        s = summarize(Simulation(sim, sim.deployments[name], wl).run(), sim.sla)
        rows[name]["at_common_rate"] = {"rate_rps": rate, "ttft_p90_s": s["ttft_p90"], "ttft_p50_s": s["ttft_p50"], "ttft_p99_s": s["ttft_p99"],
                                        "attainment": s["attainment"], "rld_token_share": s["rld_token_share"],
                                        "pipelines": s["pipelines"]}
    out: dict[str, Any] = {"report_scale": True, "simulated": True, "scenario": sc.name,
                           "context_scale": sc.context_scale, "software_overhead_s_emulated": overhead_s,
                           "priced": "every replica whole, and the inter-DC line", "graphs": rows,
                           "common_rate_rps": rate, "report": REPORT_FIGURES}
    out.update(bcr_gains(rows, prices))
    pc, cc = rows[PDD].get("at_common_rate"), rows[CROSS].get("at_common_rate")
    if pc and cc and all(math.isfinite(x) and x > 0 for x in (pc["ttft_p90_s"], cc["ttft_p90_s"])):
        out["p90_ttft_vs_cross_dc_at_rate"] = pc["ttft_p90_s"] / cc["ttft_p90_s"]
    if pc:
        out["rld_token_share"] = pc["rld_token_share"]
    out["goodput_vs_cross_dc"] = gain(rows[PDD]["capacity_rps"], rows[CROSS]["capacity_rps"])
    out["report_margins"] = REPORT_MARGINS
    return rounded(out)


def _site_counts(graph: str, counts: dict[str, int]) -> dict[str, int]:
    if graph == SAME:
        return {"a": counts["prefill"] + counts["main_decode"]}
    return {"a": counts["prefill"] + counts.get("relay", 0), "b": counts["main_decode"]}


def report_table(h: dict[str, Any]) -> str:
    lines = [f"REPORT SCALE for {h['scenario']} (simulated, blind; context_scale {h['context_scale']}; "
             "the report's chip budgets, the best role split per graph):",
             f"  {'graph':<12} {'replicas':<38} {'capacity':>9} {'$/h':>8} {'BCR':>8}  P90 TTFT @ common"]
    for name, r in h["graphs"].items():
        at = r.get("at_common_rate") or {}
        p90 = f"{at['ttft_p90_s']:.2f} s (P99 {at['ttft_p99_s']:.1f} s)" if at else "-"
        lines.append(f"  {name:<12} {str(r['replicas']):<38} {r['capacity_rps'] or 0:>9.3g} "
                     f"{r['cost_per_hour']['market']:>8.1f} {r['bcr']['market'] or 0:>8.1f}  {p90}")
    rep = h["report"]
    lines.append(f"  BCR gain vs same-DC {_pct(h.get('bcr_gain_vs_same_dc'))} (market), "
                 f"{_pct(h.get('bcr_gain_vs_same_dc_b_1.2x_a'))} / {_pct(h.get('bcr_gain_vs_same_dc_b_1.3x_a'))} "
                 f"(B at 1.2x / 1.3x A); report {_pct(rep['bcr_gain_vs_same_dc'])}")
    lines.append(f"  P90 TTFT vs cross-DC PD at {h['common_rate_rps']:.3g} req/s: "
                 f"{_pct(_minus_one(h.get('p90_ttft_vs_cross_dc_at_rate')))}; report TTFT "
                 f"{_pct(rep['ttft_vs_cross_dc'])}")
    lines.append(f"  capacity vs cross-DC PD {_pct(h.get('goodput_vs_cross_dc'))}; report goodput "
                 f"{_pct(rep['goodput_vs_cross_dc'])}; RLD token share {_pct(h.get('rld_token_share'))}, "
                 f"report {_pct(rep['rld_token_share'])}")
    return "\n".join(lines)


def _minus_one(x: Any) -> float | None:
    return x - 1 if isinstance(x, (int, float)) else None


def _pct(x: Any) -> str:
    return f"{x:+.1%}" if isinstance(x, (int, float)) else "-"
