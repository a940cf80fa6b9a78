"""`pdd compare --emulate SCENARIO --capacity`: BCR the report's way (issue 40).

Each graph's capacity is the highest offered rate at which 90% of requests meet both SLOs (a 503
at the door is a miss), bracketed within 10% by open-loop probes of at least 100 requests
(evaluations/capacity.py, evaluations/open_loop.py). BCR is capacity per dollar-hour of every chip,
every replica priced whole, plus the inter-DC line, at the catalog's market prices and at the
report's relative prices (B at 1.2x and 1.3x A).

Order of a run:
1. the same-DC graph is deployed and a calibration step sends lone requests: the serving
   software's time per request, which the chips' cost model can't know;
2. the simulator predicts every graph's capacity blind (evaluations/sim/blind.py) from the
   scenario, the probes' requests and that one overhead, and the prediction is printed;
3. each graph is deployed once and stays deployed across its probes; PDD and the strong cross-DC
   PD first run the common-rate probe (0.8 x the cross-DC PD's blind capacity, fixed before any
   probe), then the search starts at the blind capacity.

Every graph runs on the same link draw (one seed; a graph's later probes meet later stretches of
the same realisation). Probe k of every graph sends the same requests (seed k), so every answer
is checked against one engine's greedy output.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from evaluations.capacity import CapacitySearch, Probe, SearchIncomplete, bracket, probe_of, search_capacity
from evaluations.cost import bcr  # capacity per dollar: req/s within the SLA x 3600 / USD per hour
from evaluations.harness import (
    EvalEnv,
    EvalError,
    PreparedGraph,
    deployed,
    eval_cluster,
    for_repeat,
    link_seed,
    log_err,
)
from evaluations.loadgen import LoadConfig, RequestRecord, drive, summarize_run
from evaluations.open_loop import (
    ProbeLoad,
    at_rate,
    mismatches,
    probe_load,
    reference_generator,
    sessions_for,
    turn_gap_s,
)
from evaluations.workloads import AgenticWorkload, HitDistribution, fresh_tokens

SAME, CROSS, PDD = "pd_same_dc", "pd_cross_dc", "pdd"
CAPACITY_GRAPHS = ("graphs/pd_same_dc.yaml", "graphs/pd_cross_dc.yaml", "graphs/pdd.yaml")
RELATIVE_PRICES = (1.2, 1.3)  # docs/pdd.md: B costs 20-30% more than A
COMMON_RATE_FRACTION = 0.8  # of the cross-DC PD's blind capacity: where P90 TTFT is compared
# the report's margins (docs/pdd.md), printed beside what this deployment measured and simulated
REPORT_MARGINS = {"bcr_gain_vs_same_dc": 0.375, "p90_ttft_vs_cross_dc_at_rate": 0.5, "rld_token_share": 0.15}


@dataclass(frozen=True)
class CapacityConfig:
    search: CapacitySearch = field(default_factory=lambda: CapacitySearch(step=1.25))
    requests: int = 100  # per probe (at least search.min_requests)
    calibration_requests: int = 6  # lone same-DC requests before the probes: the software overhead
    draws: int = 5  # other link seeds the blind prediction also runs (how capacity moves with the line)
    start_rps: float | None = None  # first probe; None: the blind prediction

    def __post_init__(self) -> None:
        if self.requests < self.search.min_requests:
            raise ValueError(f"capacity.requests ({self.requests}) must be >= the search's min_requests "
                             f"({self.search.min_requests})")
        if self.calibration_requests < 1 or self.draws < 0:
            raise ValueError("capacity.calibration_requests must be >= 1 and draws >= 0")
        if self.start_rps is not None and not self.start_rps > 0:
            raise ValueError(f"capacity.start_rps must be > 0, got {self.start_rps}")

    @classmethod
    def of(cls, doc: Mapping[str, Any]) -> CapacityConfig:
        """From a scenario's `capacity:` block (requests, calibration_requests, draws, start_rps,
        attainment, max_gap, step, max_probes)."""
        doc = dict(doc)
        s = {k: doc.pop(k) for k in ("attainment", "max_gap", "step", "max_probes") if k in doc}
        unknown = set(doc) - {f.name for f in dataclasses.fields(cls)} | ({"search"} & set(doc))
        if unknown:
            raise ValueError(f"capacity.{sorted(unknown)[0]}: unknown key")
        search = CapacitySearch(**{"step": 1.25, **s, "min_requests": min(100, doc.get("requests", 100))})
        return cls(search=search, **doc)


def probe_requests(sc: Any, cap: CapacityConfig, rate: float) -> int:
    """Requests in a probe at `rate`: at least `cap.requests`, and enough sessions that their
    starts span a session's own length (turns x the turn gap), so the offered load is steady at
    `rate` rather than a burst of first turns followed by a lull."""
    turns = int(sc.workload.get("turns", AgenticWorkload().turns))
    return max(cap.requests, math.ceil(rate * turns * gap_s(sc)))


def agentic_spec(sc: Any, requests: int, seed: int) -> AgenticWorkload:
    """The scenario's agentic shape, enough sessions for `requests`, seed `seed`."""
    kw = dict(sc.workload)
    kw.pop("session_rate", None)  # the probe's rate sets the arrivals
    if "hit" in kw:
        kw["hit"] = HitDistribution.parse(str(kw["hit"]))
    w = AgenticWorkload(seed=seed, **kw)
    return dataclasses.replace(w, sessions=sessions_for(requests, w))


def placeholder_answers(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Stand-in answers for the simulator: only which blocks are shared matters to its caches, and
    a placeholder shares exactly as the real answer does (the real one is fed back in the compare)."""
    import random

    return [list(fresh_tokens(random.Random(hash(tuple(p[-16:])) ^ len(p)), n)) for p, n in zip(prompts, max_tokens)]


# ---------------------------------------------------------------- the blind prediction


def blind(sc: Any, graphs: list[PreparedGraph], cap: CapacityConfig, overhead_s: float, out_dir: Path,
          log: Callable[[str], None] = log_err) -> dict[str, dict[str, Any]]:
    """Every graph's capacity from the scenario alone (evaluations/sim/blind.py), on the link seed
    each graph is deployed with."""
    from evaluations.sim.blind import predict_capacity, sim_workload, with_overhead
    from evaluations.sim.emulated import sim_scenario_for

    sim = with_overhead(sim_scenario_for(sc, graphs, out_dir), overhead_s)
    bs = graphs[0].cfg.model.block_size
    gap = gap_s(sc)
    loads: dict[tuple[int, int], ProbeLoad] = {}
    out: dict[str, dict[str, Any]] = {}
    for g in graphs:
        calls = iter(range(10_000))

        def probe_at(rate: float, calls: Iterator[int] = calls) -> Any:
            key = (next(calls), probe_requests(sc, cap, rate))  # probe k of a search sends load k, as the compare does
            if key not in loads:
                loads[key] = probe_load(agentic_spec(sc, key[1], key[0]), placeholder_answers)
            answers = loads[key].answers if sc.context_scale == 1 else None  # single-turn: nothing fed back
            return sim_workload(at_rate(loads[key], rate, gap), bs, answers, sc.context_scale)

        start = cap.start_rps or first_guess(sc)
        # simulated probes cost seconds: walk out faster and allow more of them than the measured search
        search = dataclasses.replace(cap.search, step=2.0, max_probes=max(20, cap.search.max_probes))
        out[g.name] = predict_capacity(sim, g.name, probe_at, search, start,
                                       link_seed(g) if g.cross_site else None, cap.draws if g.cross_site else 0)
        log(f"blind: {g.name}: capacity {out[g.name]['capacity_rps']} req/s, bracket {out[g.name]['capacity_bracket']}")
    return out


def blind_report(sc: Any, overhead_s: float, out_dir: Path, cap: CapacityConfig | None = None,
                 graph_paths: tuple[str, ...] = CAPACITY_GRAPHS, log: Callable[[str], None] = log_err) -> dict[str, Any]:
    """`pdd simulate --capacity-of SCENARIO`: the blind prediction alone, with BCR at market and
    relative prices, every replica priced whole and the line (no cluster, no run)."""
    from evaluations.harness import prepare_graphs
    from evaluations.sim.emulated import cost_per_hour, role_chips

    cap = cap or CapacityConfig.of(sc.capacity)
    graphs = [for_repeat(g, 0) for g in prepare_graphs(graph_paths, out_dir / "graphs", 8000, sc.link, False, emulate=sc)]
    pred = blind(sc, graphs, cap, overhead_s, out_dir, log)
    prices = price_sets(sc)
    rows: dict[str, Any] = {}
    for g in graphs:
        p = pred[g.name]
        cost = {k: cost_per_hour(g.cfg, v) for k, v in prices.items()}
        rows[g.name] = {"chips": role_chips(g.cfg), "capacity_rps": p["capacity_rps"],
                        "capacity_bracket": p["capacity_bracket"], "capacity_over_draws": p.get("capacity_over_draws"),
                        "cost_per_hour": cost, "bcr": {k: bcr(p["capacity_rps"], c) for k, c in cost.items()}}
    head: dict[str, Any] = {"blind": True, "emulated_scenario": sc.name, "software_overhead_s_emulated": overhead_s,
                            "priced": "every replica whole, and the inter-DC line", "graphs": rows}
    head.update(bcr_gains(rows, prices, "blind_"))
    return rounded(head)


def price_sets(sc: Any) -> dict[str, dict[str, float]]:
    """Every price BCR is quoted at: the catalog's market prices, and the report's relative ones."""
    return {"market": {}, **{f"b_{r:g}x_a": sc.relative_prices(r) for r in RELATIVE_PRICES}}


def bcr_gains(rows: Mapping[str, Mapping[str, Any]], prices: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """PDD's BCR gain over same-DC and the strong cross-DC PD at each price set, from rows that
    hold each graph's `bcr` per price set."""
    out: dict[str, Any] = {}
    for k in prices:
        sfx = "" if k == "market" else f"_{k}"
        b = {n: rows[n]["bcr"][k] for n in rows}
        out[f"{prefix}bcr_gain_vs_same_dc{sfx}"] = gain(b.get(PDD), b.get(SAME))
        out[f"{prefix}bcr_gain_vs_cross_dc{sfx}"] = gain(b.get(PDD), b.get(CROSS))
    return out


def first_guess(sc: Any) -> float:
    """Where the blind search starts: one request per decode-bound answer time at the SLA's TPOT
    times a nominal batch of 8 (the bracket search walks from there)."""
    mt = int(sc.workload.get("max_tokens", 96))
    return 8.0 / (sc.sla.ttft_s + mt * sc.sla.tpot_s)


def gap_s(sc: Any) -> float:
    return turn_gap_s(sc.sla, int(sc.workload.get("max_tokens", 96)), float(sc.workload.get("think_s", 1.0)))


# ---------------------------------------------------------------- the measured search


@dataclass
class GraphProbes:
    graph: PreparedGraph
    probes: list[Probe] = field(default_factory=list)
    records: dict[float, list[RequestRecord]] = field(default_factory=dict)  # rate -> its records
    mismatched: list[str] = field(default_factory=list)
    pacer: dict[str, Any] = field(default_factory=dict)
    common_rate: list[RequestRecord] | None = None


def calibrate_overhead(url: str, g: PreparedGraph, sc: Any, n: int, load: LoadConfig,
                       generate: Callable[..., list[list[int]]], log: Callable[[str], None]) -> tuple[float, int]:
    """Real seconds a lone same-DC request spends outside its modeled prefill and first decode
    step, median over `n` requests sent one at a time (a seed no probe uses)."""
    from evaluations.compare import GraphResult, software_overhead_real_s

    # two output tokens: the overhead is read off the first token, and a long answer only costs time
    pl = probe_load(dataclasses.replace(agentic_spec(sc, n, seed=10_000), sessions=n, anomalous_share=0.0, turns=1,
                                        max_tokens=2), generate)
    wl = at_rate(pl, 1.0, gap_s(sc))
    recs = drive(url, wl, dataclasses.replace(load, clients=1), desc=f"{g.name} calibration", log=log, progress=False)
    res = GraphResult(g, runs=[recs])
    over, used = software_overhead_real_s(res, load.clock)
    if over is None:
        raise EvalError(f"calibration: none of {n} lone same-DC requests answered: {recs[0].error if recs else ''}")
    return over, used


def run_capacity(sc: Any, graphs: list[PreparedGraph], cap: CapacityConfig, env: EvalEnv, load: LoadConfig,
                 out_dir: Path, log: Callable[[str], None] = log_err, progress: bool = True,
                 check_blind: bool = False, probe_names: Collection[str] | None = None) -> dict[str, Any]:
    """Calibrate, predict blind, then search each of `graphs`' capacity on the cluster (with
    `check_blind`: probe each at its blind bracket's two rates instead: a check, not a search).
    `graphs` holds every graph the prediction covers (same-DC, which calibrates, among them);
    those not in `probe_names` (None: all) are predicted only."""
    from evaluations.harness import settle_for
    from evaluations.sim.emulated import pacer_stats_of_running_graph
    from pdd_serve.checkpoints import resolve_model
    from pdd_serve.emulation.clock import Clock

    graphs = [for_repeat(g, 0) for g in graphs]  # one link seed for every graph and every rate
    calib = next((g for g in graphs if g.name == SAME), None)
    if calib is None:
        raise EvalError("--capacity needs graphs/pd_same_dc.yaml: its lone requests calibrate the software "
                        "overhead the blind prediction uses")
    ref = calib.cfg.model
    generate = reference_generator(str(resolve_model(ref.path)), block_size=ref.block_size)
    loads: dict[tuple[int, int], ProbeLoad] = {}

    def load_k(k: int, rate: float, n: int | None = None) -> ProbeLoad:
        key = (k, n or probe_requests(sc, cap, rate))
        if key not in loads:
            t = time.monotonic()
            loads[key] = probe_load(agentic_spec(sc, key[1], k), generate)
            log(f"probe load {k}: {loads[key].requests} requests, reference answers in {time.monotonic() - t:.0f}s")
        return loads[key]

    probed = [g for g in graphs if probe_names is None or g.name in probe_names]
    order = [calib] + [g for g in probed if g is not calib]
    out: dict[str, GraphProbes] = {g.name: GraphProbes(g) for g in probed}
    gap = gap_s(sc)
    measure = dict(getattr(sc, "measure", None) or {})
    head: dict[str, Any] = {"mode": ("check: each graph probed at its blind bracket's two rates (not a search)"
                                     if check_blind else
                                     f"measure: every graph at one rate, {measure.get('requests', cap.requests)} "
                                     "requests (the scenario's `measure:`; not a search)" if measure else
                                     "search: bracket within max_gap")}
    predicted: dict[str, dict[str, Any]] = {}
    with eval_cluster(env, log) as denv:
        for g in order:
            with deployed(g, denv, env, log) as url:
                if g is calib:  # 1. calibration, 2. the blind prediction, before any probe
                    over, used = calibrate_overhead(url, g, sc, cap.calibration_requests, load, generate, log)
                    over_s = Clock(sc.time_scale).emulated(over)
                    head["calibration"] = {"software_overhead_ms_real": over * 1e3,
                                           "software_overhead_s_emulated": over_s, "requests": used}
                    log(f"calibration: {over * 1e3:.1f} ms real per request ({over_s * 1e3:.1f} ms emulated), "
                        f"over {used} lone requests")
                    predicted = blind(sc, graphs, cap, over_s, out_dir, log)
                    print_blind(predicted)
                    common = (predicted.get(CROSS, {}).get("capacity_rps") or 0) * COMMON_RATE_FRACTION
                    head["common_rate_rps"] = common or None
                    if g not in probed:
                        continue
                gp = out[g.name]
                calls = iter(range(10_000))

                def probe(rate: float, gp: GraphProbes = gp, url: str = url, g: PreparedGraph = g,
                          calls: Iterator[int] = calls, n: int | None = None) -> Probe:
                    pl = load_k(next(calls), rate, n)
                    recs = drive(url, at_rate(pl, rate, gap), load, desc=f"{g.name} @{rate:.3g}/s", log=log,
                                 progress=progress, settle_s=settle_for(g))
                    gp.records[rate] = recs
                    gp.mismatched += mismatches(recs, pl.answers)
                    p = probe_of(rate, recs, sc.sla)
                    gp.probes.append(p)
                    log(f"{g.name}: probe {len(gp.probes)}: {rate:.3g} req/s, n={p.n}, attainment "
                        f"{p.attainment:.3f}, shed {p.shed_503}")
                    return p

                pred = predicted.get(g.name, {})
                if measure and not check_blind:  # one rate, fixed before the run: the scenario's, else the common rate
                    rate = float(measure.get("rate_rps") or head.get("common_rate_rps") or 0.0)
                    if rate <= 0:
                        raise EvalError("measure: no rate (set measure.rate_rps: the cross-DC PD's blind capacity was 0)")
                    head["measured_rate_rps"] = rate
                    probe(rate, n=int(measure.get("requests", cap.requests)))
                    if g.name in (PDD, CROSS):
                        gp.common_rate = gp.records[rate]
                elif check_blind:
                    for rate in pred.get("capacity_bracket") or []:
                        if rate:
                            probe(rate)
                else:
                    first: list[Probe] = []
                    if g.name in (PDD, CROSS) and head.get("common_rate_rps"):
                        r = head["common_rate_rps"]
                        first.append(probe(r))
                        gp.common_rate = gp.records[r]
                    start = cap.start_rps or pred.get("capacity_rps") or first_guess(sc)
                    try:
                        search_capacity(probe, cap.search, start, initial=first)
                    except SearchIncomplete as e:
                        log(f"WARNING: {g.name}: {e}")
                app = yaml.safe_load(g.path.read_text())["applications"][0]["name"]
                try:
                    gp.pacer = pacer_stats_of_running_graph(app, denv)
                except Exception as e:  # noqa: BLE001 - the probes stand; the overrun is unknown, said so
                    log(f"warning: {g.name}: pacer counts: {e}")
    head.update(capacity_headline(sc, out, predicted, cap, graphs))
    if measure and not check_blind:
        one_rate(head, out, sc)
    return {"graphs": out, "blind": predicted, "headline": head}


def one_rate(h: dict[str, Any], out: Mapping[str, GraphProbes], sc: Any) -> None:
    """A `measure:` run probed each graph once: what was measured at that rate replaces the
    capacity keys, which one probe can't give (a bracket needs a rate met and one missed), and the
    measured BCR gains with them; the blind prediction's stay, labelled blind."""
    for name, gp in out.items():
        v = h["graphs"][name]
        recs = [r for rs in gp.records.values() for r in rs]
        s = summarize_run(recs, sc.sla) if recs else {}
        p = gp.probes[0] if gp.probes else None
        v["at_rate"] = rounded({"rate_rps": p.rate if p else None, "n": p.n if p else 0,
                               "attainment": p.attainment if p else None, "met_sla": p.met(sc.sla.attainment) if p else None,
                               "shed_503": p.shed_503 if p else 0, "ttft_p50_s": s.get("ttft_p50_s"),
                               "ttft_p90_s": s.get("ttft_p90_s"), "tpot_p90_s": s.get("tpot_p90_s"),
                               "rld_token_share": s.get("rld_token_share"), "pipelines": s.get("pipelines")})
        v.update(capacity_rps=None, capacity_bracket=[None, None], bracket_tight=False, bcr=None,
                 bcr_relative=dict.fromkeys(v["bcr_relative"]), blind_rel_err=None)
    for k in [k for k in h if k.startswith(("bcr_gain_vs_", "blind_capacity_max_rel_err"))]:
        h[k] = None
    h["min_requests_per_probe"] = min((gp.probes[0].n for gp in out.values() if gp.probes), default=0)


# ---------------------------------------------------------------- figures


def gain(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b or math.isnan(a) or math.isnan(b) else a / b - 1


def capacity_headline(sc: Any, out: Mapping[str, GraphProbes], predicted: Mapping[str, Mapping[str, Any]],
                      cap: CapacityConfig, graphs: list[PreparedGraph] | None = None) -> dict[str, Any]:
    """The JSON line's keys (issue 40's list). `out`: the probed graphs; `graphs`: every graph
    predicted (default: the probed ones), whose blind BCR gains are priced the same way."""
    from evaluations.sim.blind import rel_err_to_bracket
    from evaluations.sim.emulated import cost_per_hour, decode_caps, role_chips
    from pdd_serve.emulation.pacer import PACED_KINDS, build_emulation, merge_stats

    prices = price_sets(sc)
    h: dict[str, Any] = {"emulated": True, "scenario": sc.name, "time_scale": sc.time_scale,
                         "context_scale": getattr(sc, "context_scale", 1),
                         "priced": "every replica whole, and the inter-DC line",
                         # below 100 (a scenario's smaller `capacity.requests`) a probe can't tell 85% from 90%
                         "min_requests_per_probe": cap.search.min_requests, "deployments": {}}
    per: dict[str, dict[str, Any]] = {}
    errors, answered = 0, 0
    for name, gp in out.items():
        cfg = gp.graph.cfg
        b = bracket(gp.probes, cap.search.attainment)
        recs = [r for rs in gp.records.values() for r in rs]
        errors += sum(1 for r in recs if r.error and r.status != 503)
        answered += sum(1 for r in recs if r.token_ids)
        pred = predicted.get(name, {})
        cost = {k: cost_per_hour(cfg, p) for k, p in prices.items()}
        met_recs = gp.records.get(b.met, []) if b.met is not None else []
        per[name] = {
            "capacity_rps": b.capacity, "capacity_bracket": [b.met, b.missed],
            "bracket_tight": b.tight(cap.search.max_gap),
            "probes": [{"rate": round(p.rate, 4), "n": p.n, "attainment": round(p.attainment, 4), "shed_503": p.shed_503}
                       for p in gp.probes],
            "cost_per_hour": cost["market"], "cost_per_hour_relative": {k: v for k, v in cost.items() if k != "market"},
            "bcr": bcr(b.capacity, cost["market"]),
            "bcr_relative": {k: bcr(b.capacity, v) for k, v in cost.items() if k != "market"},
            "blind_capacity_rps": pred.get("capacity_rps"), "blind_capacity_bracket": pred.get("capacity_bracket"),
            "blind_capacity_over_draws": pred.get("capacity_over_draws"),
            "blind_rel_err": rel_err_to_bracket(pred.get("capacity_rps"), b.met, b.missed),
            # secondary, named as such: SLA-meeting requests over the makespan of the highest probe that met
            "goodput_over_makespan_rps_secondary": summarize_run(met_recs, sc.sla)["goodput_rps"] if met_recs else None,
            "pool_tokens_emulated": {r: build_emulation(cfg, r).kv_capacity_tokens for r in cfg.engine_roles()},
            "mismatched": len(gp.mismatched),
        }
        h["deployments"][name] = {"replicas": {r: getattr(cfg.sites, f"{r}_replicas") for r in cfg.engine_roles()},
                                  "chips": role_chips(cfg), "decode_batch_cap": decode_caps(cfg),
                                  "line": (f"{sc.link.get('bandwidth_bps', 0) / 1e9:g} Gb/s, "
                                           f"{sc.link.get('one_way_latency_s', 0) * 1e3:g} ms one way")
                                  if gp.graph.cross_site else None}
    h["graphs"] = per
    every = {g.name: g for g in (graphs or [gp.graph for gp in out.values()])}
    h["blind"] = {n: {"capacity_rps": predicted.get(n, {}).get("capacity_rps"),
                      "capacity_bracket": predicted.get(n, {}).get("capacity_bracket"),
                      "capacity_over_draws": predicted.get(n, {}).get("capacity_over_draws"),
                      "cost_per_hour": cost_per_hour(g.cfg)} for n, g in every.items()}
    per_cfg = {n: gp.graph.cfg for n, gp in out.items()}
    for k, pr in prices.items():
        def b_of(g: str, blind_: bool = False, pr: Mapping[str, float] = pr) -> float | None:
            if blind_:
                return bcr(predicted.get(g, {}).get("capacity_rps"), cost_per_hour(every[g].cfg, pr)) if g in every else None
            return bcr(per[g]["capacity_rps"], cost_per_hour(per_cfg[g], pr)) if g in per else None

        sfx = "" if k == "market" else f"_{k}"
        h[f"bcr_gain_vs_same_dc{sfx}"] = gain(b_of(PDD), b_of(SAME))
        h[f"bcr_gain_vs_cross_dc{sfx}"] = gain(b_of(PDD), b_of(CROSS))
        h[f"blind_bcr_gain_vs_same_dc{sfx}"] = gain(b_of(PDD, True), b_of(SAME, True))
        h[f"blind_bcr_gain_vs_cross_dc{sfx}"] = gain(b_of(PDD, True), b_of(CROSS, True))
    errs = [v["blind_rel_err"] for v in per.values() if v["blind_rel_err"] is not None]
    h["blind_capacity_max_rel_err"] = max(errs) if errs else None
    p, c = out.get(PDD), out.get(CROSS)
    if p and c and p.common_rate and c.common_rate:
        sp, scx = summarize_run(p.common_rate, sc.sla), summarize_run(c.common_rate, sc.sla)
        h["p90_ttft_vs_cross_dc_at_rate"] = (sp["ttft_p90_s"] / scx["ttft_p90_s"]
                                             if sp.get("ttft_p90_s") and scx.get("ttft_p90_s") else None)
    else:
        h["p90_ttft_vs_cross_dc_at_rate"] = None
    if p:
        h["rld_token_share"] = summarize_run([r for rs in p.records.values() for r in rs], sc.sla)["rld_token_share"]
    stats = merge_stats([gp.pacer["all"] for gp in out.values() if "all" in gp.pacer])
    known = bool(stats) and all("all" in gp.pacer for gp in out.values())
    for kind in PACED_KINDS:  # over whole engine calls; imports and exports at the NIC's rate
        h[f"emulation_overrun_share_{kind}"] = stats.get(f"overrun_share_{kind}") if known else None
        h[f"emulation_{kind}_calls"] = stats.get(f"{kind}_steps") if known else None
    h["unpaced_engine_share"] = stats.get("unpaced_engine_share") if known else None
    # the prompt KV Prefill put into the object store for a relay, per request, by pipeline (emulated bytes)
    h["object_store_bytes_per_request"] = {
        name: {pipe: sum(v) / len(v) for pipe, v in _by_pipeline(gp, "relay_kv_bytes").items()}
        for name, gp in out.items()}
    h["outputs_identical"] = answered > 0 and not any(v["mismatched"] for v in per.values())
    h["errors"] = errors
    h["report_margins"] = REPORT_MARGINS
    return {k: rounded(v) for k, v in h.items()}


def _by_pipeline(gp: GraphProbes, key: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for recs in gp.records.values():
        for r in recs:
            if not r.error:
                out.setdefault(r.pdd.get("pipeline") or "?", []).append(int(r.pdd.get(key) or 0))
    return out


def rounded(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 4) if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: rounded(x) for k, x in v.items()}
    if isinstance(v, list):
        return [rounded(x) for x in v]
    return v


def print_blind(pred: Mapping[str, Mapping[str, Any]]) -> None:
    print("BLIND PREDICTION (simulator, from the scenario and the calibration only; printed before any probe):",
          flush=True)
    for g, p in pred.items():
        d = p.get("capacity_over_draws")
        spread = f", over {d['draws']} other link draws {d['min']:.3g}-{d['max']:.3g}" if d else ""
        print(f"  {g:<12} capacity {p['capacity_rps']} req/s (bracket {p['capacity_bracket']}){spread}", flush=True)


def capacity_table(h: Mapping[str, Any]) -> str:
    from evaluations.report import simple_table

    rows = []
    for g, v in h["graphs"].items():
        rel = v["bcr_relative"]
        rows.append({"graph": g, "chips": ", ".join(f"{r}: {c}" for r, c in h["deployments"][g]["chips"].items()),
                     "cost": v["cost_per_hour"], "capacity": v["capacity_rps"],
                     "bracket": _bracket_text(*v["capacity_bracket"]),
                     "blind": v["blind_capacity_rps"], "probes": len(v["probes"]),
                     "bcr": v["bcr"], **{f"bcr {k}": x for k, x in rel.items()}})
    cols = [("graph", "graph", "s"), ("chips", "chips", "s"), ("$/h", "cost", ".2f"), ("capacity req/s", "capacity", ".3g"),
            ("bracket", "bracket", "s"), ("blind", "blind", ".3g"), ("probes", "probes", "d"), ("BCR req/$", "bcr", ".1f")]
    cols += [(f"BCR {k[4:]}", k, ".1f") for k in rows[0] if k.startswith("bcr ")] if rows else []
    return simple_table(rows, cols)


def one_rate_table(h: Mapping[str, Any]) -> str:
    from evaluations.report import simple_table

    rows = [{"graph": g, **v["at_rate"], "cost": v["cost_per_hour"]} for g, v in h["graphs"].items() if "at_rate" in v]
    cols = [("graph", "graph", "s"), ("$/h", "cost", ".2f"), ("rate req/s", "rate_rps", ".3g"), ("n", "n", "d"),
            ("attainment", "attainment", ".2f"), ("P50 TTFT s", "ttft_p50_s", ".2f"), ("P90 TTFT s", "ttft_p90_s", ".2f"),
            ("P90 TPOT s", "tpot_p90_s", ".3f"), ("RLD tokens", "rld_token_share", ".3f"), ("503", "shed_503", "d")]
    return simple_table(rows, cols)


def _bracket_text(met: float | None, missed: float | None) -> str:
    """'met-missed', with an open side said as such (no probe met: below the lowest; none missed:
    at least the highest)."""
    if met is None:
        return f"< {missed:.3g} (none met)" if missed is not None else "-"
    return f"{met:.3g}-{missed:.3g}" if missed is not None else f">= {met:.3g} (none missed)"


def write_probe_records(out: Mapping[str, GraphProbes], path: Path) -> Path:
    from evaluations.report import record_rows, write_parquet

    rows = [row for gp in out.values() for rate, recs in gp.records.items()
            for row in record_rows(recs, graph=gp.graph.name, rate=rate)]
    return write_parquet(rows, path)


def attainment_plot(h: Mapping[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for g, v in h["graphs"].items():
        pts = sorted((p["rate"], p["attainment"]) for p in v["probes"])
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", label=g)
    ax.axhline(0.9, color="grey", ls="--", lw=1)
    ax.set_xlabel("offered rate (req/s, emulated)")
    ax.set_ylabel("share meeting TTFT and TPOT SLOs")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def run_capacity_compare(sc: Any, graph_paths: tuple[str, ...], env: EvalEnv, load: LoadConfig, out_dir: Path,
                         tracker: Any = None, command: str = "", cap: CapacityConfig | None = None,
                         log: Callable[[str], None] = log_err, progress: bool = True,
                         check_blind: bool = False) -> dict[str, Any]:
    """`graph_paths` are probed; the blind prediction covers them and the three capacity graphs
    (same-DC calibrates; its and the cross-DC PD's predictions price the blind BCR gains)."""
    from evaluations.harness import prepare_graphs

    cap = cap or CapacityConfig.of(sc.capacity)
    paths = list(dict.fromkeys([*CAPACITY_GRAPHS, *graph_paths]))
    graphs = prepare_graphs(paths, out_dir / "graphs", env.http_port, sc.link, False, emulate=sc)
    probe_names = {g.name for g, p in zip(graphs, paths) if p in graph_paths}
    t0 = time.monotonic()
    res = run_capacity(sc, graphs, cap, env, load, out_dir, log, progress, check_blind, probe_names)
    head = res["headline"]
    head["command"] = command
    head["wall_s"] = round(time.monotonic() - t0)
    arts = [write_probe_records(res["graphs"], out_dir / "requests.parquet"),
            attainment_plot(head, out_dir / "attainment.png")]
    (out_dir / "capacity.json").write_text(json.dumps(head, indent=2, default=str))
    arts.append(out_dir / "capacity.json")
    if tracker is not None:
        from evaluations.tracking import flat_metrics

        run = tracker.start(f"capacity {sc.name}", tags={"kind": "capacity"})
        params = {**sc.params(), "probe_requests": cap.requests,
                  "search.attainment": cap.search.attainment, "search.max_gap": cap.search.max_gap, "command": command}
        metrics = flat_metrics({k: v for k, v in head.items() if k not in ("deployments", "report_margins")})
        tracker.log(run, params, metrics, arts)
        tracker.finish(run)
    log(f"artifacts in {out_dir}")
    print(f"EMULATED ({sc.name}, time_scale {sc.time_scale:g}: every time and rate is emulated, not a measured GPU "
          f"figure): {command}", flush=True)
    print(one_rate_table(head) if head.get("measured_rate_rps") else capacity_table(head), flush=True)
    for k, v in REPORT_MARGINS.items():
        print(f"  {k:<30} measured {head.get(k)!s:>8}   report {v}", flush=True)
    print(json.dumps(head), flush=True)
    res["out_dir"] = out_dir
    return res


__all__ = ["CAPACITY_GRAPHS", "CapacityConfig", "blind", "capacity_headline", "run_capacity", "run_capacity_compare"]
