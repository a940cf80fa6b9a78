"""`pdd sweep hit-rate`: PDD's benefit over cross-DC PD against the prefix-hit rate (docs/pdd.md's bathtub).

Each graph is deployed once and runs every point in turn (each point's prefixes are its own, so a
point starts from cold caches); one MLflow run per point (both graphs' figures and the benefit
ratios) under a parent run that carries the plot.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evaluations.compare import (
    CROSS,
    PDD,
    GraphResult,
    common_params,
    outputs_identity,
    safe_ratio,
    summarize_graph,
)
from evaluations.cost import hardware_cost
from evaluations.harness import (
    EvalEnv,
    EvalError,
    code_fingerprint,
    engine_params,
    eval_cluster,
    link_params,
    log_err,
    policy_params,
    prepare_graphs,
    run_graph,
)
from evaluations.loadgen import SLA, LoadConfig
from evaluations.workloads import SweepWorkload, sweep_workload
from pdd_serve.emulation.costmodel import CATALOG_PATH, user_catalog

SWEEP_GRAPHS = ("graphs/pd_cross_dc.yaml", "graphs/pdd.yaml")


@dataclass(frozen=True)
class SweepConfig:
    points: tuple[float, ...] = (0.0, 0.4, 0.7, 0.95)
    requests: int = 6  # per point
    prompt_tokens: int = 1536
    max_tokens: int = 64
    rate: float = 0.5
    seed: int = 0
    graphs: tuple[str, ...] = SWEEP_GRAPHS
    link: Any = None
    sla: SLA = field(default_factory=SLA)
    load: LoadConfig = field(default_factory=LoadConfig)
    env: EvalEnv = field(default_factory=EvalEnv)
    site_chips: tuple[tuple[str, str], ...] = (("a", "cpu"), ("b", "cpu"))
    catalog: str = str(CATALOG_PATH)  # a user's own catalog over the shipped one (user_catalog)
    experiment: str = "pdd-sweep-hit-rate"
    tracking_uri: str | None = None
    mlflow: bool = True
    out_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.points or any(not 0.0 <= p < 1.0 for p in self.points):
            raise ValueError(f"SweepConfig.points must be hit rates in [0, 1), got {self.points}")
        if len(set(self.points)) != len(self.points):
            raise ValueError("SweepConfig.points must be distinct")
        for p in self.points:  # surfaces a bad workload shape before any cluster starts
            SweepWorkload(p, self.requests, self.prompt_tokens, self.max_tokens, self.rate, seed=self.seed)

    def workload(self, hit: float) -> Any:
        return sweep_workload(SweepWorkload(hit, self.requests, self.prompt_tokens, self.max_tokens, self.rate,
                                            seed=self.seed))


def point_row(hit: float, summaries: Mapping[str, Mapping[str, Any]], identical: bool) -> dict[str, Any]:
    p, c = summaries.get(PDD, {}), summaries.get(CROSS, {})
    return {
        "hit_rate": hit,
        "pdd_tt2t_p90_s": p.get("tt2t_p90_s"), "cross_tt2t_p90_s": c.get("tt2t_p90_s"),
        "pdd_ttft_p90_s": p.get("ttft_p90_s"), "cross_ttft_p90_s": c.get("ttft_p90_s"),
        "pdd_e2e_p90_s": p.get("e2e_p90_s"), "cross_e2e_p90_s": c.get("e2e_p90_s"),
        "tt2t_p90_speedup": safe_ratio(c.get("tt2t_p90_s"), p.get("tt2t_p90_s")),
        "ttft_p90_speedup": safe_ratio(c.get("ttft_p90_s"), p.get("ttft_p90_s")),
        "e2e_p90_speedup": safe_ratio(c.get("e2e_p90_s"), p.get("e2e_p90_s")),
        "pdd_goodput_rps": p.get("goodput_rps"), "cross_goodput_rps": c.get("goodput_rps"),
        "goodput_ratio": safe_ratio(p.get("goodput_rps"), c.get("goodput_rps")),  # None when x-DC's is 0
        "bcr_ratio": safe_ratio(p.get("bcr_req_per_usd"), c.get("bcr_req_per_usd")),
        "wan_ratio": safe_ratio(p.get("wan_bytes"), c.get("wan_bytes")),
        "rld_token_share": p.get("rld_token_share"),
        "pdd_prefix_hit_md": p.get("prefix_hit_md_mean"),
        "pdd_pipelines": " ".join(f"{k}:{v}" for k, v in p.get("pipelines", {}).items()),
        "outputs_identical": identical,
    }


COLUMNS = (("hit", "hit_rate", ".2f"), ("MD hit", "pdd_prefix_hit_md", ".2f"),
           ("x-DC TT2T p90", "cross_tt2t_p90_s", ".3f"), ("PDD TT2T p90", "pdd_tt2t_p90_s", ".3f"),
           ("TT2T speedup", "tt2t_p90_speedup", ".2f"), ("TTFT speedup", "ttft_p90_speedup", ".2f"),
           ("e2e speedup", "e2e_p90_speedup", ".2f"), ("x-DC goodput", "cross_goodput_rps", ".3f"),
           ("PDD goodput", "pdd_goodput_rps", ".3f"), ("goodput x", "goodput_ratio", ".2f"),
           ("BCR x", "bcr_ratio", ".2f"), ("WAN x", "wan_ratio", ".3f"), ("RLD share", "rld_token_share", ".3f"),
           ("PDD pipelines", "pdd_pipelines", "s"), ("identical", "outputs_identical", "s"))


def run_sweep(cfg: SweepConfig = SweepConfig(), log: Callable[[str], None] = log_err) -> dict[str, Any]:
    from evaluations.report import record_rows, simple_table, sweep_plot, write_parquet

    catalog = user_catalog(cfg.catalog)
    site_chips = dict(cfg.site_chips)
    out_dir = Path(cfg.out_dir or f".pdd/eval/{cfg.experiment}-{time.strftime('%Y%m%d-%H%M%S')}")
    graphs = prepare_graphs(cfg.graphs, out_dir / "graphs", cfg.env.http_port, cfg.link)
    if {g.name for g in graphs} != {CROSS, PDD}:
        raise EvalError(f"the sweep compares {PDD} with {CROSS}; got graphs {[g.name for g in graphs]}")
    for g in graphs:
        hardware_cost(g.cfg, site_chips, catalog)
    tracker = None
    if cfg.mlflow:
        from evaluations.tracking import Tracker

        tracker = Tracker(cfg.tracking_uri, cfg.experiment)
    workloads = [cfg.workload(h) for h in cfg.points]
    per_point: dict[float, dict[str, GraphResult]] = {h: {g.name: GraphResult(g) for g in graphs} for h in cfg.points}
    log(f"hit-rate sweep: points {list(cfg.points)}, {cfg.requests} requests of {cfg.prompt_tokens} tokens each")
    fingerprints: set[str] = set()
    with eval_cluster(cfg.env, log) as denv:
        for g in graphs:
            fingerprints.add(code_fingerprint())
            runs = run_graph(g, denv, workloads, cfg.load, cfg.env, log, cfg.progress)
            for h, records in zip(cfg.points, runs):
                per_point[h][g.name].runs.append(records)
    rows, summaries_by_point = [], {}
    for h in cfg.points:
        summ = {n: summarize_graph(r, cfg.sla, site_chips, catalog) for n, r in per_point[h].items()}
        identical, _, examples = outputs_identity(per_point[h])
        for e in examples:
            log(f"hit {h}: output mismatch: {e}")
        summaries_by_point[h] = summ
        rows.append(point_row(h, summ, identical))
    plot = sweep_plot(rows, out_dir / "hit_rate_sweep.png",
                      f"PDD vs pd_cross_dc: {cfg.requests} x {cfg.prompt_tokens}-token prompts per point")
    (out_dir / "sweep.json").write_text(json.dumps(rows, indent=2, default=str))
    if tracker is not None:
        _log_sweep(tracker, cfg, graphs, workloads, per_point, summaries_by_point, rows, plot, out_dir,
                   site_chips, catalog, record_rows, write_parquet)
        log(f"logged to MLflow {tracker.uri}, experiment {cfg.experiment}")
    log(f"artifacts in {out_dir}")
    print(simple_table(rows, COLUMNS))
    final = {"hit_rates": list(cfg.points),
             **{k: [None if r[k] is None else round(r[k], 4) for r in rows]
                for k in ("tt2t_p90_speedup", "ttft_p90_speedup", "e2e_p90_speedup", "goodput_ratio",
                          "rld_token_share")},
             "outputs_identical": all(r["outputs_identical"] for r in rows),
             "code_fingerprint": ",".join(sorted(fingerprints))}
    if len(fingerprints) > 1:
        log("WARNING: the serving code (pdd_serve/, graphs/) changed between the two deployments: rerun")
    print(json.dumps(final), flush=True)
    return {"rows": rows, "summaries": summaries_by_point, "final": final, "out_dir": out_dir}


def _log_sweep(tracker: Any, cfg: SweepConfig, graphs: Any, workloads: Any, per_point: Any, summaries: Any,
               rows: Any, plot: Path, out_dir: Path, site_chips: Any, catalog: Any, record_rows: Any,
               write_parquet: Any) -> None:
    from evaluations.tracking import flat_metrics

    parent = tracker.start("sweep hit-rate", tags={"kind": "sweep"})
    cross = next(g for g in graphs if g.cross_site)
    shared = {"points": ",".join(f"{h:g}" for h in cfg.points), "graphs": ",".join(g.name for g in graphs),
              **link_params(cross)}
    try:
        for h, w, row in zip(cfg.points, workloads, rows):
            run = tracker.start(f"hit {h:g}", parent=parent, tags={"kind": "sweep-point"})
            params = {**common_params(w, cfg.sla, cfg.load, site_chips, cfg.catalog, 1), **shared, "hit_rate": h}
            metrics: dict[str, Any] = {k: v for k, v in row.items() if isinstance(v, (int, float))}
            for g in graphs:
                params.update({f"{g.name}.{k}": v for k, v in {**policy_params(g.cfg), **engine_params(g.cfg),
                                                               **hardware_cost(g.cfg, site_chips, catalog).params()}.items()})
                metrics.update(flat_metrics(summaries[h][g.name], prefix=f"{g.name}."))
            table = write_parquet([row for n, res in per_point[h].items() for row in record_rows(res.records, graph=n)],
                                  out_dir / f"hit-{h:g}" / "requests.parquet")
            tracker.log(run, params, metrics, [table])
            tracker.finish(run)
        tracker.log(parent, shared, {}, [plot, out_dir / "sweep.json"])
        tracker.finish(parent)
    except Exception:
        tracker.finish(parent, ok=False)
        raise
