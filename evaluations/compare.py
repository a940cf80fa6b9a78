"""`pdd compare`: one workload through pd_same_dc, pd_cross_dc (strong: decode-side cache, P->MD
only), pd_cross_dc_naive (no decode-side cache) and pdd on the same emulated link, in one invocation
and one cluster; a side-by-side table, MLflow runs, and one final JSON line.

The JSON line's ratio keys (PDD over a baseline, or over the physical floor) and their targets are
in TARGETS. TTFT is the client's first token; the `*_tt2t_*` keys give the same ratios on the second
token (see loadgen.py). The floor of a request on a cross-site graph is the same request's same-DC
TTFT, plus one link latency per cross-site hop its first token must take, plus the KV bytes that
must cross before it at the link's rate (`request_floor`). On an emulated graph the floor is built
from the modeled steps instead (`modeled_floor`): the request's prefill alone on its chip, the KV
no faster than the line's mean rate, the hops, MD's first step alone; same-DC's TTFT would carry
its own queueing on slower chips into the floor. `code_fingerprint` hashes the serving
code at each deployment: more than one value means the tree changed under the comparison.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from evaluations.cost import bcr, hardware_cost
from evaluations.harness import (
    DEFAULT_GRAPHS,
    EvalEnv,
    EvalError,
    PreparedGraph,
    code_fingerprint,
    engine_params,
    eval_cluster,
    for_repeat,
    link_params,
    link_seed,
    log_err,
    policy_params,
    prepare_graphs,
    run_graph,
)
from evaluations.loadgen import SLA, LoadConfig, RequestRecord, makespan, summarize_run
from evaluations.workloads import Workload
from pdd_serve.config import PDDConfig
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.costmodel import CATALOG_PATH, user_catalog
from pdd_serve.emulation.pacer import build_emulation

SAME, CROSS, NAIVE, PDD = "pd_same_dc", "pd_cross_dc", "pd_cross_dc_naive", "pdd"
TARGETS: dict[str, tuple[str, float | bool]] = {
    "p50_ttft_vs_floor": ("<=", 1.2),
    "p90_ttft_vs_cross_dc": ("<=", 0.5),
    "goodput_vs_cross_dc": (">=", 1.1),
    "goodput_vs_cross_dc_naive": (">=", 1.2),
    "rld_token_share": ("<=", 0.15),
    "outputs_identical": ("==", True),
    "control_latency_emulated": ("==", True),
}


@dataclass(frozen=True)
class CompareConfig:
    graphs: tuple[str, ...] = DEFAULT_GRAPHS
    link: Any = None  # None: graphs/pdd.yaml's link for every cross-site graph
    sla: SLA = field(default_factory=SLA)
    load: LoadConfig = field(default_factory=LoadConfig)
    env: EvalEnv = field(default_factory=EvalEnv)
    repeats: int = 1  # graph order alternates between repeats (contention drifts on shared machines)
    naive_once: bool = False  # the naive baseline runs in the first repeat only (it is the slowest to run)
    site_chips: tuple[tuple[str, str], ...] = (("a", "cpu"), ("b", "cpu"))
    catalog: str = str(CATALOG_PATH)  # a user's own catalog over the shipped one (user_catalog)
    experiment: str = "pdd-compare"
    tracking_uri: str | None = None
    mlflow: bool = True
    out_dir: str | None = None  # local copies of plots/tables; default .pdd/eval/<experiment>-<time>
    progress: bool = True
    stream_first_token: bool = False  # one first-token convention for every graph (default: PD's)
    emulate: Any = None  # an EmulatedScenario (evaluations/sim/emulated.py): emulated chips, slow motion
    command: str | None = None  # the command line that ran it (`pdd compare ...`), printed with its results

    def __post_init__(self) -> None:
        if not self.graphs:
            raise ValueError("CompareConfig.graphs must not be empty")
        if self.repeats <= 0:
            raise ValueError(f"CompareConfig.repeats must be > 0, got {self.repeats}")


@dataclass
class GraphResult:
    graph: PreparedGraph
    runs: list[list[RequestRecord]] = field(default_factory=list)  # one list per repeat
    pacer: list[dict[str, Any]] = field(default_factory=list)  # emulated: each run's pacer counts
    seeds: list[int | None] = field(default_factory=list)  # each run's link jitter seed (None: same site)

    @property
    def records(self) -> list[RequestRecord]:
        return [r for run in self.runs for r in run]

    def rows(self) -> list[dict[str, Any]]:
        """One row per request of every run, with its graph, repeat and link seed (what the
        simulator needs to replay the same draw of the line)."""
        from evaluations.report import record_rows

        seeds = self.seeds + [None] * (len(self.runs) - len(self.seeds))
        return [row for i, (run, seed) in enumerate(zip(self.runs, seeds))
                for row in record_rows(run, graph=self.graph.name, repeat=i, link_seed=seed)]


def safe_ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or (isinstance(a, float) and math.isnan(a)) or not b or math.isnan(b):
        return None
    return a / b


def outputs_identity(results: Mapping[str, GraphResult]) -> tuple[bool, int, list[str]]:
    """(identical, mismatched requests, examples): greedy token ids per (repeat, session, turn) equal
    across every graph that ran that repeat, and every request answered in each of them. A graph
    that skipped a repeat (`--naive-once`) is compared in the repeats it ran, not counted missing."""
    maps = {}
    for name, res in results.items():
        maps[name] = {(i, *r.key): (r.token_ids if not r.error else None) for i, run in enumerate(res.runs) for r in run}
    keys = set().union(*(m.keys() for m in maps.values()))
    bad: list[str] = []
    for k in sorted(keys):
        ran = {n: m for n, m in maps.items() if k[0] < len(results[n].runs)}
        outs = [m.get(k) for m in ran.values()]
        if any(o is None for o in outs) or any(o != outs[0] for o in outs[1:]):
            lens = {n: (None if m.get(k) is None else len(m[k])) for n, m in ran.items()}
            bad.append(f"repeat {k[0]} {k[1]} turn {k[2]}: output lengths {lens}")
    return not bad and bool(keys), len(bad), bad[:5]


def summarize_graph(res: GraphResult, sla: SLA, site_chips: Mapping[str, str], catalog: Any) -> dict[str, Any]:
    s = summarize_run(res.records, sla, makespan_s=sum(makespan(run) for run in res.runs))
    cost = hardware_cost(res.graph.cfg, site_chips, catalog)
    s["cost_per_hour_usd"] = cost.per_hour
    s["bcr_req_per_usd"] = bcr(s["goodput_rps"], cost.per_hour)
    s["wan_mb"] = s["wan_bytes"] / 1e6 if res.graph.cross_site else None  # same-site KV never meets the WAN
    return s


def first_token_hops(pipeline: str, stream_first_token: bool) -> int:
    """Cross-site hops a first token must take: on P->MD with the PD convention, the KV crosses to
    MD and MD's first token crosses back; P's own token (relay pipelines, or stream_first_token)
    leaves from the site the client is served from."""
    return 2 if pipeline == "P-MD" and not stream_first_token else 0


def request_floor(same_dc_ttft_s: float, pipeline: str, wan_bytes: int, latency_s: float,
                  bandwidth_bps: float | None, stream_first_token: bool = False) -> float:
    """The physical floor of one request's TTFT on a cross-site graph (see the module docstring)."""
    hops = first_token_hops(pipeline, stream_first_token)
    wire = wan_bytes * 8 / bandwidth_bps if hops and bandwidth_bps else 0.0
    return same_dc_ttft_s + hops * latency_s + wire


def modeled_prefill_s(prompt_tokens: int, hit: float, p: Any, chunk: int) -> float:
    """Emulated seconds of one request's prefill alone on its chip (`p`: the role's Emulation):
    the chunks past its prefix hit, as the engine runs them (real tokens; each a prompt's, so
    context_scale emulated ones)."""
    n, k = prompt_tokens, p.context_scale
    done = min(n - 1, int(hit * n))
    total = 0.0
    while done < n:
        step = min(chunk, n - done)
        total += p.prefill_s(step * k, done * k)
        done += step
    return total


def modeled_floor(r: RequestRecord, cfg: PDDConfig, latency_s: float, bandwidth_bps: float | None,
                  stream_first_token: bool = False) -> float:
    """The physical floor of one request's TTFT on an emulated graph, from the modeled steps alone
    (no queue, no software): its prefill on the prefill chip; on P->MD with PD's first-token
    convention also the KV MD lacked (no faster than the line's mean rate, and not before the
    prefill ends, since the last chunk's blocks leave after it), the decode call's hop and the
    first token's hop back, and MD's first step alone. A relay pipeline's first token is P's."""
    from pdd_serve.serve.prefill import PREFILL_CHUNK_TOKENS

    pre = modeled_prefill_s(r.prompt_tokens, r.pdd.get("prefix_hit_p") or 0.0, build_emulation(cfg, "prefill"),
                            PREFILL_CHUNK_TOKENS)
    pipeline = r.pdd.get("pipeline", "P-MD")
    if pipeline != "P-MD" or stream_first_token:
        return pre
    cross = cfg.sites.prefill != cfg.sites.main_decode
    hops = first_token_hops(pipeline, stream_first_token) if cross else 0
    wire = int(r.pdd.get("wan_bytes") or 0) * 8 / bandwidth_bps if cross and bandwidth_bps else 0.0
    md = build_emulation(cfg, "main_decode")
    return max(pre, wire) + hops * latency_s + md.decode_s(1, r.prompt_tokens * md.context_scale)


def floors(results: Mapping[str, GraphResult], stream_first_token: bool = False) -> dict[str, dict[str, Any]]:
    """Per cross-site graph (every graph when emulated): its requests' TTFT against their physical
    floors (P50s and the median of per-request ratios), and where P->MD requests' TTFT went
    (measured in the Router). Unemulated, a floor is built on the same request's same-DC TTFT;
    emulated, on the modeled steps (`modeled_floor`)."""
    from evaluations.loadgen import median, percentile

    same = results.get(SAME)
    base = {(i, *r.key): r.ttft_s for i, run in enumerate(same.runs) for r in run if not r.error} if same else {}
    out: dict[str, dict[str, Any]] = {}
    for name, res in results.items():
        emulated = res.graph.cfg.emulated
        if not (res.graph.cross_site or emulated) or not (emulated or base):
            continue
        lp = link_params(res.graph)
        ttfts, fl, ratios = [], [], []
        for i, run in enumerate(res.runs):
            for r in run:
                b = None if emulated else base.get((i, *r.key))
                if r.error or r.ttft_s is None or (b is None and not emulated):
                    continue
                if emulated:
                    f = modeled_floor(r, res.graph.cfg, lp["link.one_way_latency_s"], lp["link.bandwidth_bps"],
                                      stream_first_token)
                else:
                    f = request_floor(b, r.pdd.get("pipeline", "P-MD"), int(r.pdd.get("wan_bytes") or 0),
                                      lp["link.one_way_latency_s"], lp["link.bandwidth_bps"], stream_first_token)
                ttfts.append(r.ttft_s)
                fl.append(f)
                ratios.append(r.ttft_s / f)
        pmd = [r.pdd for r in res.records if not r.error and r.pdd.get("pipeline") == "P-MD"]
        # md_kv_land_s is the part of md_kv_wait_s until the stream was complete (the rest: the
        # import's wait for MD's engine thread)
        parts = ("decision_s", "prefill_s", "md_kv_wait_s", "md_kv_land_s", "md_step_s", "ttft_s")
        brk = {f"pmd_{k}_p50": median(d.get(k) for d in pmd) for k in parts}
        if brk["pmd_ttft_s_p50"] is not None:
            known = sum(v or 0.0 for k, v in brk.items() if k not in ("pmd_ttft_s_p50", "pmd_md_kv_land_s_p50"))
            brk["pmd_cross_site_rest_s_p50"] = brk["pmd_ttft_s_p50"] - known  # calls to B, tokens back to A
        out[name] = {"ttft_floor_p50_s": median(fl), "ttft_floor_p90_s": percentile(fl, 0.9),
                     "ttft_vs_floor_p50": safe_ratio(median(ttfts), median(fl)),
                     "ttft_over_floor_median": median(ratios), "pmd_requests": len(pmd), **brk}
    return out


def goodput_ratio(p: Mapping[str, Any], base: Mapping[str, Any]) -> tuple[float | None, str | None]:
    """PDD's goodput over a baseline's; when the baseline met the SLA on no request, the ratio of
    SLA-meeting requests against one (a lower bound), with a note saying so. Never null when both ran."""
    r = safe_ratio(p.get("goodput_rps"), base.get("goodput_rps"))
    if r is not None or not base or not p:
        return r, None
    if base.get("sla_ok") == 0 and p.get("sla_ok") is not None and base.get("requests") and p.get("requests"):
        # SLA attainment ratio with the baseline's floored at one request of its n: a lower bound
        att = (p["sla_ok"] / p["requests"]) / (1 / base["requests"])
        return float(att), (f"the baseline met the SLA on 0 of {base['requests']} requests: SLA attainment "
                            f"ratio against one request (a lower bound)")
    return None, None


def headline(summaries: Mapping[str, Mapping[str, Any]], identical: bool, mismatched: int,
             control_latency: bool = False) -> dict[str, Any]:
    """The final JSON line: ratios (PDD over each baseline and its floor), absolute figures, targets met."""
    p, c, n, s = (summaries.get(k, {}) for k in (PDD, CROSS, NAIVE, SAME))
    g_cross, note_cross = goodput_ratio(p, c)
    g_naive, note_naive = goodput_ratio(p, n)
    out: dict[str, Any] = {
        "p50_ttft_vs_floor": p.get("ttft_vs_floor_p50"),
        "p90_ttft_vs_cross_dc": safe_ratio(p.get("ttft_p90_s"), c.get("ttft_p90_s")),
        "p90_ttft_vs_cross_dc_naive": safe_ratio(p.get("ttft_p90_s"), n.get("ttft_p90_s")),
        "p50_ttft_vs_same_dc": safe_ratio(p.get("ttft_p50_s"), s.get("ttft_p50_s")),
        "itl_p99_vs_same_dc": safe_ratio(p.get("itl_p99_s"), s.get("itl_p99_s")),
        "goodput_vs_cross_dc": g_cross,
        "goodput_vs_cross_dc_naive": g_naive,
        "rld_token_share": p.get("rld_token_share"),
        "outputs_identical": identical,
        "control_latency_emulated": control_latency,
        # what PDD could reach at best, with no WAN at all (same-DC over each baseline): a target
        # past these is past the machine's physics, whatever the relay does
        "p90_ttft_vs_cross_dc_floor": safe_ratio(s.get("ttft_p90_s"), c.get("ttft_p90_s")),
        "goodput_vs_cross_dc_ceiling": safe_ratio(s.get("goodput_rps"), c.get("goodput_rps")),
        "p50_ttft_vs_cross_dc": safe_ratio(p.get("ttft_p50_s"), c.get("ttft_p50_s")),
        "p99_ttft_vs_cross_dc": safe_ratio(p.get("ttft_p99_s"), c.get("ttft_p99_s")),
        "cross_dc_p50_ttft_vs_floor": c.get("ttft_vs_floor_p50"),
        "p90_tt2t_vs_cross_dc": safe_ratio(p.get("tt2t_p90_s"), c.get("tt2t_p90_s")),
        "p50_tt2t_vs_same_dc": safe_ratio(p.get("tt2t_p50_s"), s.get("tt2t_p50_s")),
        "p90_e2e_vs_cross_dc": safe_ratio(p.get("e2e_p90_s"), c.get("e2e_p90_s")),
        "goodput_vs_same_dc": safe_ratio(p.get("goodput_rps"), s.get("goodput_rps")),
        "sla_attainment_vs_cross_dc": safe_ratio(p.get("sla_attainment"), c.get("sla_attainment")),
        "bcr_vs_cross_dc": safe_ratio(p.get("bcr_req_per_usd"), c.get("bcr_req_per_usd")),
        "bcr_vs_same_dc": safe_ratio(p.get("bcr_req_per_usd"), s.get("bcr_req_per_usd")),
        "wan_bytes_vs_cross_dc": safe_ratio(p.get("wan_bytes"), c.get("wan_bytes")),
        "mismatched_requests": mismatched,
    }
    if note_cross:
        out["goodput_vs_cross_dc_note"] = note_cross
    if note_naive:
        out["goodput_vs_cross_dc_naive_note"] = note_naive
    for g, summ in summaries.items():
        for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tt2t_p50_s", "tt2t_p90_s", "itl_p50_s", "itl_p90_s", "itl_p99_s",
                  "itl_max_p90_s", "tpot_p50_s", "goodput_rps", "sla_attainment", "bcr_req_per_usd", "wan_bytes",
                  "requests", "errors", "ttft_floor_p50_s", "pmd_decision_s_p50", "pmd_prefill_s_p50",
                  "pmd_md_kv_wait_s_p50", "pmd_md_kv_land_s_p50", "pmd_md_step_s_p50", "pmd_cross_site_rest_s_p50", "planned_hit_mean",
                  "prefix_hit_p_mean", "prefix_hit_md_mean"):
            if k in summ:
                out[f"{g}.{k}"] = summ.get(k)
    met = {}
    for k, (op, target) in TARGETS.items():
        v = out.get(k)
        met[k] = None if v is None else bool(v == target if op == "==" else (v <= target if op == "<=" else v >= target))
    out["targets_met"] = met
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


# The PDD report's margins, the goal an emulated comparison is read against (docs/pdd.md)
REPORT_MARGINS = {"p90_ttft_vs_cross_dc": ("<=", 0.5), "goodput_vs_cross_dc_naive": (">=", 1.278),
                  "bcr_gain_vs_same_dc": (">=", 0.30)}


def emulated_headline(results: Mapping[str, GraphResult], summaries: Mapping[str, dict[str, Any]],
                      cfg: CompareConfig) -> dict[str, Any]:
    """The emulated keys of the JSON line: what was emulated, each ratio's median over repeats and
    its spread, BCR on the emulated chips' prices, and the pacers' overrun per step kind."""

    from evaluations.sim.emulated import cost_per_hour, repeat_ratios, role_chips, spread
    from pdd_serve.emulation.pacer import OVERRUN_WARN_SHARE, PACED_KINDS, merge_stats, overrun_warning

    sc = cfg.emulate
    for name, res in results.items():
        c = cost_per_hour(res.graph.cfg)
        summaries[name]["emulated_cost_per_hour_usd"] = c
        st = merge_stats([p["all"] for p in res.pacer if "all" in p])
        if st.get("prefill_steps") or st.get("decode_steps"):
            summaries[name]["overrun_share_prefill"] = st["overrun_share_prefill"]
            summaries[name]["overrun_share_decode"] = st["overrun_share_decode"]
        summaries[name]["bcr_emulated"] = summaries[name]["goodput_rps"] / c * 3600 if c else None
    per_repeat: list[dict[str, dict[str, Any]]] = []
    for i in range(cfg.repeats):
        rep = {}
        for name, res in results.items():
            if i < len(res.runs):
                s = summarize_run(res.runs[i], cfg.sla)
                c = cost_per_hour(res.graph.cfg)
                s["bcr_emulated"] = s["goodput_rps"] / c * 3600 if c else None
                rep[name] = s
        per_repeat.append(rep)
    out: dict[str, Any] = {"emulated": True, "scenario": sc.name, "time_scale": sc.time_scale,
                           "priced": "every replica whole, and the line",
                           "repeats": cfg.repeats, "emulated_model": sc.model.name,
                           "chips": {n: role_chips(r.graph.cfg) for n, r in results.items()},
                           "emulated_cost_per_hour": {n: cost_per_hour(r.graph.cfg) for n, r in results.items()}}
    for k, vals in repeat_ratios(per_repeat, PDD, CROSS, NAIVE, SAME).items():
        vs = [v for v in vals if v is not None]
        out[k] = statistics.median(vs) if vs else None
        out[f"{k}_spread"] = spread(vs)
        out[f"{k}_per_repeat"] = vals
    stats = merge_stats([p["all"] for r in results.values() for p in r.pacer if "all" in p])
    for kind in PACED_KINDS:  # whole engine calls per kind; KV imports/exports at the NIC's rate
        out[f"emulation_overrun_share_{kind}"] = stats.get(f"overrun_share_{kind}")
        out[f"emulation_{kind}_steps"] = stats.get(f"{kind}_steps")
    out["unpaced_engine_share"] = stats.get("unpaced_engine_share")
    # a run whose counts could not be read (or a replica whose counts were lost) is unknown, not fine
    runs = sum(len(r.runs) for r in results.values())
    read = sum(1 for r in results.values() for p in r.pacer if "all" in p)
    lost = sum(int(p.get("replicas_lost", 0)) for r in results.values() for p in r.pacer)
    out["emulation_runs_without_overrun_counts"] = runs - read
    out["emulation_replicas_lost"] = lost
    known = read == runs and not lost and stats.get("decode_steps")
    out["emulation_overrun_ok"] = (all((stats.get(f"overrun_share_{k}") or 0) <= OVERRUN_WARN_SHARE
                                       for k in PACED_KINDS) if known else None)
    if not known:
        log_err(f"WARNING: the overrun of {runs - read} run(s) and {lost} replica(s) could not be read: "
                "emulation_overrun_ok is unknown")
    clock = Clock(sc.time_scale)
    warn = overrun_warning(stats, clock)
    if warn:
        log_err(f"WARNING: {warn}")
    out["emulation_overrun_warning"] = warn
    # Slow motion divides the real software work (HTTP, Serve calls, the Router, asyncio) by
    # time_scale; on real chips it is not smaller. Measured on same-DC P->MD requests (no link):
    # TTFT less the modeled prefill and first decode step, in REAL ms
    over, n_alone = software_overhead_real_s(results.get(SAME), clock)
    out["software_overhead_ms_p50"] = None if over is None else over * 1e3
    out["software_overhead_requests"] = n_alone
    floor = summaries.get(PDD, {}).get("ttft_floor_p50_s")
    p50 = summaries.get(PDD, {}).get("ttft_p50_s")
    if over is not None and floor and p50 is not None:
        # what PDD's P50 would be with the serving software at full size, against the floor built
        # from the modeled steps, hops and bytes (no software in it): no time_scale flatters PDD.
        # P50 holds the overhead divided back like any time (over x clock.emulated(1)): add the rest
        out["p50_ttft_vs_floor_real_overhead"] = (p50 + over * (1 - clock.emulated(1))) / floor
    out["ttft_floor_from"] = "modeled steps: prefill alone, KV at the line's mean rate, hops, MD's first step alone"
    out["report_margins"] = {k: f"{op} {v}" for k, (op, v) in REPORT_MARGINS.items()}
    return out


def software_overhead_real_s(res: GraphResult | None, clock: Clock) -> tuple[float | None, int]:
    """Median real seconds a same-DC P->MD request spends outside the modeled chip time before its
    first token: TTFT minus the cost model's prefill (256-token chunks past the prefix hit) and
    one decode step, in real seconds on the graph's `clock`. Only requests that had the graph to themselves until their
    first token count (no other request in flight): a queue would read as software time. Returns
    (median, requests it is over)."""

    from pdd_serve.serve.prefill import PREFILL_CHUNK_TOKENS

    if res is None:
        return None, 0
    p, md = build_emulation(res.graph.cfg, "prefill"), build_emulation(res.graph.cfg, "main_decode")
    out = []
    for run in res.runs:
        spans = [(r.t_send_s, r.t_done_s) for r in run if r.t_send_s is not None and r.t_done_s is not None]
        for r in run:
            if r.error or r.ttft_s is None or r.t_send_s is None or r.pdd.get("pipeline") != "P-MD":
                continue
            first = r.t_send_s + r.ttft_s
            if sum(1 for a, b in spans if a < first and b > r.t_send_s) > 1:  # itself, and another
                continue
            out.append(_overhead_of(r, p, md, clock, PREFILL_CHUNK_TOKENS))
    return (statistics.median(out) if out else None), len(out)


def _overhead_of(r: RequestRecord, p: Any, md: Any, clock: Clock, chunk: int) -> float:
    """One request's real seconds outside the modeled prefill chunks and first decode step."""
    modeled = modeled_prefill_s(r.prompt_tokens, r.pdd.get("prefix_hit_p") or 0.0, p, chunk)
    modeled += md.decode_s(1, r.prompt_tokens * md.context_scale)
    return clock.real(r.ttft_s - modeled)


def add_sim_predictions(head: dict[str, Any], sim: Mapping[str, Any]) -> None:
    """The simulator's replay of the same requests beside the measurement: `sim_<ratio>` for each
    headline ratio and the largest relative error over P50/P90 TTFT and goodput of every graph
    with goodput (where goodput is zero, SLA attainment within 0.05 absolute instead)."""
    from evaluations.sim.emulated import repeat_ratios

    pred = {g: v["predicted"] for g, v in sim.items()}
    costs = head.get("emulated_cost_per_hour", {})

    def as_summary(g: str, f: Mapping[str, Any]) -> dict[str, Any]:  # the keys repeat_ratios reads
        c, good = costs.get(g), f.get("goodput_rps")
        return {"ttft_p90_s": f.get("ttft_p90"), "goodput_rps": good,
                "bcr_emulated": good / c * 3600 if c and good is not None and math.isfinite(good) else None}

    # each ratio as the measured one is taken: per repeat, then the median over repeats (a ratio of
    # pooled P90s is another figure: 0.41 against the measured 0.35 in run 20261206-235756, where
    # the per-repeat median is 0.38); records without repeats fall back to the pooled figures
    reps = sorted({r["repeat"] for f in pred.values() for r in f.get("per_run", [])})
    per_repeat = [{g: as_summary(g, r) for g, f in pred.items() for r in f.get("per_run", []) if r["repeat"] == i}
                  for i in reps] or [{g: as_summary(g, f) for g, f in pred.items()}]
    for k, vals in repeat_ratios(per_repeat, PDD, CROSS, NAIVE, SAME).items():
        vs = [v for v in vals if v is not None and math.isfinite(v)]
        head[f"sim_{k}"] = statistics.median(vs) if vs else None
        head[f"sim_{k}_per_repeat"] = vals
    errs, att = [], []
    for v in sim.values():  # where either world's goodput is zero, attainment is the comparable figure
        if (v["measured"].get("goodput_rps") or 0) > 0 and (v["predicted"].get("goodput_rps") or 0) > 0:
            errs += [abs(x) for x in v["rel_error"].values() if x is not None and math.isfinite(x)]
        else:
            att.append(abs(v["predicted"]["attainment"] - v["measured"]["attainment"]))
    head["sim_vs_real_max_rel_err"] = max(errs) if errs else None
    head["sim_vs_real_attainment_abs_err"] = max(att) if att else None
    head["sim_vs_real"] = {g: {k: round(x, 3) for k, x in v["rel_error"].items()} for g, v in sim.items()}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def common_params(workload: Workload, sla: SLA, load: LoadConfig, site_chips: Mapping[str, str],
                  catalog_path: str, repeats: int) -> dict[str, Any]:
    import os

    out = {f"workload.{k}": v for k, v in workload.param_dict().items()}
    out.update({"workload": workload.name, "sla.ttft_s": sla.ttft_s, "sla.tpot_s": sla.tpot_s,
                "ignore_eos": load.ignore_eos, "repeats": repeats, "catalog": catalog_path,
                "machine": f"{platform.machine()} {os.cpu_count()} CPUs", "git_commit": git_commit()})
    out.update({f"chip.{s}": c for s, c in site_chips.items()})
    return out


def emulated_command(cfg: CompareConfig) -> str:
    """The command that reruns an emulated comparison (its table's first line and its JSON): the
    command line as typed, else (called from Python) rebuilt from the config."""
    if cfg.command:
        return cfg.command
    cmd = f"pdd compare --emulate {cfg.emulate.name} --repeats {cfg.repeats}"
    if cfg.naive_once:
        cmd += " --naive-once"
    if cfg.stream_first_token:
        cmd += " --stream-first-token"
    if tuple(cfg.graphs) != tuple(DEFAULT_GRAPHS):
        cmd += f" --graphs {','.join(cfg.graphs)}"
    return cmd


def run_compare(workload: Workload, cfg: CompareConfig = CompareConfig(),
                log: Callable[[str], None] = log_err) -> dict[str, Any]:
    """Run the comparison; print the table and the JSON line; return {summaries, headline, ...}."""
    from evaluations.report import comparison_table, ttft_cdf_plot, write_parquet

    catalog = user_catalog(cfg.catalog)
    site_chips = dict(cfg.site_chips)
    out_dir = Path(cfg.out_dir or f".pdd/eval/{cfg.experiment}-{time.strftime('%Y%m%d-%H%M%S')}")
    graphs = prepare_graphs(cfg.graphs, out_dir / "graphs", cfg.env.http_port, cfg.link, cfg.stream_first_token,
                            emulate=cfg.emulate)
    for g in graphs:
        hardware_cost(g.cfg, site_chips, catalog)  # an unknown chip fails now, not after the runs
    if cfg.emulate is not None:
        from evaluations.sim.emulated import pacer_stats_of_running_graph

        if cfg.load.time_scale != cfg.emulate.time_scale:
            raise EvalError(f"the load runs at time_scale {cfg.load.time_scale}, the scenario at {cfg.emulate.time_scale}")
    tracker = None
    if cfg.mlflow:
        from evaluations.tracking import Tracker

        tracker = Tracker(cfg.tracking_uri, cfg.experiment)  # a bad store fails before the long runs
    results = {g.name: GraphResult(g) for g in graphs}
    log(f"workload {workload.name}: {workload.num_requests} requests in {len(workload.sessions)} sessions "
        f"(+{len(workload.warmup)} warm-up), graphs {', '.join(results)}, {cfg.repeats} repeat(s)")
    fingerprints: set[str] = set()
    with eval_cluster(cfg.env, log) as denv:
        for rep in range(cfg.repeats):
            order = graphs if rep % 2 == 0 else graphs[::-1]
            for g in order:
                if cfg.naive_once and rep and g.name == NAIVE:
                    continue
                fingerprints.add(code_fingerprint())
                t = time.monotonic()
                after = None
                if cfg.emulate is not None:
                    def after(pg: PreparedGraph, denv: dict[str, str] = denv) -> None:
                        app = yaml.safe_load(pg.path.read_text())["applications"][0]["name"]
                        try:
                            results[pg.name].pacer.append(pacer_stats_of_running_graph(app, denv))
                        except Exception as e:  # noqa: BLE001 - the run stands; its overrun is unknown, said so
                            log(f"warning: {pg.name}: {e}")
                gr = for_repeat(g, rep)
                (records,) = run_graph(gr, denv, [workload], cfg.load, cfg.env, log, cfg.progress, after)
                results[g.name].runs.append(records)
                results[g.name].seeds.append(link_seed(gr))
                errs = sum(1 for r in records if r.error)
                log(f"{g.name}: {len(records)} requests, {errs} errors ({time.monotonic() - t:.0f}s with deploy)")
    summaries = {name: summarize_graph(res, cfg.sla, site_chips, catalog) for name, res in results.items()}
    for name, extra in floors(results, cfg.stream_first_token).items():
        summaries[name].update(extra)
    identical, mismatched, examples = outputs_identity(results)
    for e in examples:
        log(f"output mismatch: {e}")
    # every cross-site graph ran with control messages delayed by the link (serve/crosssite.py)
    control = all(link_params(g)["link.one_way_latency_s"] > 0 for g in graphs if g.cross_site) and any(
        g.cross_site for g in graphs)
    head = headline(summaries, identical, mismatched, control)
    if cfg.emulate is not None:
        head.update(emulated_headline(results, summaries, cfg))
        try:  # the simulator replays the same requests on the same scenario (a failure costs only this)
            from evaluations.sim.validate import simulate_records

            rows = [row for res in results.values() for row in res.rows()]
            over = head.get("software_overhead_ms_p50")
            ov_s = Clock(cfg.emulate.time_scale).emulated(over / 1e3) if over is not None else 0.0
            head["sim_request_overhead_s"] = ov_s
            add_sim_predictions(head, simulate_records(cfg.emulate, graphs, rows, out_dir, request_overhead_s=ov_s))
        except Exception as e:  # noqa: BLE001
            log(f"warning: the simulator's prediction failed: {type(e).__name__}: {e}")
            head["sim_vs_real_max_rel_err"] = None
    head["stream_first_token"] = cfg.stream_first_token
    if cfg.emulate is not None:
        head["command"] = emulated_command(cfg)
    head["shaped_link"] = cfg.env.shaped_link
    head["code_fingerprint"] = ",".join(sorted(fingerprints))
    if len(fingerprints) > 1:
        log("WARNING: the serving code (pdd_serve/, graphs/) changed between deployments of this comparison: "
            "the graphs ran different code; rerun when the tree is quiet")

    # local artifacts (also logged to MLflow)
    by_graph = {n: r.records for n, r in results.items()}
    write_parquet([row for res in results.values() for row in res.rows()], out_dir / "requests.parquet")
    cdf = ttft_cdf_plot(by_graph, out_dir / "ttft_cdf.png", f"{workload.name}: TTFT and 2nd-token CDF")
    (out_dir / "summary.json").write_text(json.dumps({"summaries": summaries, "headline": head}, indent=2,
                                                     default=str))
    run_ids: dict[str, str] = {}
    if tracker is not None:
        run_ids = log_compare(tracker, workload, cfg, results, summaries, head, catalog, site_chips, out_dir, cdf)
        log(f"logged to MLflow {tracker.uri}, experiment {cfg.experiment} (parent run {run_ids.get('parent', '')})")
    log(f"artifacts in {out_dir}")
    if cfg.emulate is not None:
        print(f"EMULATED ({cfg.emulate.name}, time_scale {cfg.emulate.time_scale:g}: every time below is an emulated "
              f"time, not a measured GPU time): {head['command']}", flush=True)
    print(comparison_table(summaries), flush=True)
    print_targets(head)
    print(json.dumps(head, sort_keys=False), flush=True)
    return {"summaries": summaries, "headline": head, "results": results, "run_ids": run_ids, "out_dir": out_dir}


def log_compare(tracker: Any, workload: Workload, cfg: CompareConfig, results: Mapping[str, GraphResult],
                 summaries: Mapping[str, Mapping[str, Any]], head: Mapping[str, Any], catalog: Any,
                 site_chips: Mapping[str, str], out_dir: Path, cdf: Path) -> dict[str, str]:
    from evaluations.report import ttft_cdf_plot, write_parquet
    from evaluations.tracking import flat_metrics

    common = {**common_params(workload, cfg.sla, cfg.load, site_chips, cfg.catalog, cfg.repeats),
              "code_fingerprint": head.get("code_fingerprint", ""),
              **(cfg.emulate.params() if cfg.emulate is not None else {"emulated": False})}
    parent = tracker.start(f"compare {workload.name}", tags={"kind": "compare"})
    ids = {"parent": parent}
    try:
        for name, res in results.items():
            g = res.graph
            run = tracker.start(f"{name} {workload.name}", parent=parent, tags={"kind": "graph"})
            ids[name] = run
            cost = hardware_cost(g.cfg, site_chips, catalog)
            params = {**common, "graph": name, "graph_file": str(g.source), **link_params(g),
                      **policy_params(g.cfg), **engine_params(g.cfg), **cost.params()}
            gdir = out_dir / name
            rows = res.rows()
            arts = [write_parquet(rows, gdir / "requests.parquet"),
                    ttft_cdf_plot({name: res.records}, gdir / "ttft_cdf.png", f"{name}: {workload.name}"), g.path]
            tracker.log(run, params, flat_metrics(summaries[name]), arts)
            tracker.finish(run)
        metrics = {k: v for k, v in head.items() if isinstance(v, (int, float)) or isinstance(v, bool)}
        tracker.log(parent, {**common, "graphs": ",".join(results), "link": json.dumps(_first_link(results))},
                    metrics, [cdf, out_dir / "requests.parquet", out_dir / "summary.json"])
        tracker.finish(parent)
    except Exception:
        tracker.finish(parent, ok=False)
        raise
    return ids


def _first_link(results: Mapping[str, GraphResult]) -> Any:
    for res in results.values():
        if res.graph.cross_site:
            return res.graph.link
    return None


def print_targets(head: Mapping[str, Any], out: Callable[[str], None] = log_err) -> None:
    for k, (op, target) in TARGETS.items():
        met = head["targets_met"].get(k)
        shown = f">={head.get(k)}" if head.get(f"{k}_note") else head.get(k)
        out(f"  {k:<26} {shown!s:>9}  target {op} {target}: {'met' if met else ('-' if met is None else 'MISSED')}")


__all__: Sequence[str] = ("CompareConfig", "run_compare", "headline", "outputs_identity", "TARGETS", "EvalError")
