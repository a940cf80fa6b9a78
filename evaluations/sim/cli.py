"""`pdd simulate` and `pdd plan`: SIM_COMMANDS is registered with the `pdd` CLI through the
entry-point group `pdd_serve.commands` (pyproject.toml).
Argument parsing stays import-light; the simulator loads inside `run`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from pdd_serve.cli import Command, UsageError

_SIM_DIR = Path(__file__).resolve().parent

_SIMULATE_DESCRIPTION = """\
Simulate PDD deployments at cluster scale with the real system's policy code (pdd_serve.policy,
transport.link.LinkModel, engine.radix_cache.RadixCache) and a roofline chip model. Every
assumption (chips, prices, model, workload, SLA, link) is in a scenario YAML, not in code.

Modes:
  pdd simulate --scenario report         the report's comparison: SLA goodput per deployment
                                         (bisection on the arrival rate), BCR = goodput / cost,
                                         latency at a common load, headline ratios vs docs/pdd.md
  pdd simulate --scenario report --rate 15
                                         one run per deployment at 15 req/s (quick look)
  pdd simulate --trace FILE.jsonl        replay a Mooncake-format trace at its own arrival times
                                         (default scenario: mooncake); JSON has sim_seconds
  pdd simulate --bathtub                 benefit (BCR) vs hit rate; writes a PNG (slow)
  pdd simulate --tail-curve              one prefill instance vs hit rate per tail-chunk mode (fast)
  pdd simulate --capacity-of emulated_70b
                                         blind prediction of an emulated scenario: each graph's
                                         capacity and BCR before `pdd compare --capacity` runs it

Prints a table, then ONE final JSON line (bcr_gain, ttft_reduction, goodput_gain,
rld_token_share, ...). Scenarios: evaluations/sim/scenarios/*.yaml; chips and model shapes:
pdd_serve/emulation/costmodel.yaml.
"""

_PLAN_DESCRIPTION = """\
Search P / RLD / MD counts and chip assignments (a site-A chip for P and RLD, a site-B chip for
MD, from the scenario's `plan` section and the chip catalog with prices), then the pipeline policy
(wan_budget_s, relay pool size), for the highest BCR under the scenario's SLA, by simulation.
The load: a Mooncake-format trace at its own arrival times (--trace; scenario `mooncake`: the
report's chips, model, link and SLA) or the scenario's synthetic workload at --target-rps.
  pdd plan --trace ../shared/traces/mooncake_conversation_trace.jsonl --out-dir DIR
  pdd plan --trace T.jsonl --site-a h100-sxm,a100-80g --site-b h20,h200 [--catalog MY_CHIPS.yaml]
Writes, under --out-dir:
  graph.yaml          a Serve config in graphs/pdd.yaml's shape with the planned replica counts
  cluster_nodes.yaml  node counts per site and chip (pdd.site labels) for a Ray cluster config
  candidates.csv      every configuration simulated
  bcr_knobs.png       BCR of every candidate against the knobs (P, RLD, MD counts, wan_budget_s)
and logs the search to MLflow (one run; embedded default store sqlite:///mlflow.db in the working
directory unless MLFLOW_TRACKING_URI is set). Ends with one JSON line.
"""


def _add_simulate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default=None,
                   help="built-in name (report, mooncake, ...) or a YAML path (default: report; mooncake with --trace)")
    p.add_argument("--trace", default=None, metavar="FILE", help="Mooncake-format JSONL trace to replay")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N trace requests")
    p.add_argument("--rate", type=float, default=None, help="one run per deployment at this arrival rate (req/s)")
    p.add_argument("--deployments", default=None, help="comma-separated subset of the scenario's deployments")
    p.add_argument("--bathtub", action="store_true", help="sweep a constant hit rate; plot BCR vs hit (slow: a goodput search per point)")
    p.add_argument("--tail-curve", action="store_true",
                   help="one saturated prefill instance vs hit rate for each tail-chunk mode (fast); plot it")
    p.add_argument("--tail-chunk", default=None,
                   help="override scheduler.tail_chunk: alone|packed|padded (comma-separated with --bathtub)")
    p.add_argument("--hits", default=None,
                   help="--bathtub's hit rates, comma-separated (a reduced grid; default: the scenario's bathtub.hits)")
    p.add_argument("--horizon", type=float, default=None, help="seconds of arrivals per goodput probe (override)")
    p.add_argument("--rate-range", default=None, metavar="LO,HI",
                   help="goodput bisection bracket, req/s (override goodput.lo_rps/hi_rps)")
    p.add_argument("--iterations", type=int, default=None, help="goodput bisection steps (override)")
    p.add_argument("--prefill-count", type=int, default=None,
                   help="P instances of every deployment (e.g. a prefill-bound bathtub: fewer than the load needs)")
    p.add_argument("--capacity-of", default=None, metavar="SCENARIO",
                   help="blind prediction for an emulated scenario (evaluations/scenarios/NAME.yaml or a path, e.g. "
                        "emulated_70b): each graph's capacity (highest rate with 90%% of requests within the SLA) "
                        "and BCR (every replica priced whole, and the line; market and the report's relative "
                        "prices), from the scenario alone: what `pdd compare --emulate NAME --capacity` then measures")
    p.add_argument("--report-scale", action="store_true",
                   help="with --capacity-of: the same blind prediction at the report's chip budgets (88 A for "
                        "same-DC; 43 A + 32 B + one line for PDD and the cross-DC PD), each graph's best split of "
                        "its replicas between roles, the line grown with the MDs; BCR, P90 TTFT at a common rate "
                        "and the RLD token share beside the report's figures (evaluations/report_scale.py)")
    p.add_argument("--overhead-ms", type=float, default=0.0,
                   help="with --capacity-of: the serving software's time per request in REAL ms (the compare "
                        "measures its own in a calibration step; default: %(default)s)")
    p.add_argument("--mlflow", action="store_true",
                   help="log the result (params, JSON, plot) to MLflow, experiment pdd-simulate")
    p.add_argument("--plot", default=None,
                   help="PNG path (default: evaluations/sim/bathtub.png, or bathtub_prefill.png with --tail-curve)")
    p.add_argument("--out", default=None, metavar="JSON", help="also write the full result as JSON here")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", default=None,
                   help="built-in name or YAML path with a `plan` section (default: mooncake with --trace, else report)")
    p.add_argument("--trace", default=None, metavar="FILE", help="plan for this Mooncake-format trace (JSONL)")
    p.add_argument("--window", type=float, default=None,
                   help="replay the trace's first S seconds of arrivals (default: plan.window_s; 0: all of it)")
    p.add_argument("--catalog", default=None, metavar="YAML",
                   help="your own catalog (pdd_serve/emulation/costmodel.yaml's schema), its entries over the shipped "
                        "catalog's, as a scenario's `catalog:` (for a scenario that names none)")
    p.add_argument("--site-a", default=None, help="candidate chips for P and RLD, comma-separated (default: plan.chips_site_a)")
    p.add_argument("--site-b", default=None, help="candidate chips for MD, comma-separated (default: plan.chips_site_b)")
    p.add_argument("--target-rps", type=float, default=None, help="load to plan for, req/s (default: plan.target_rps)")
    p.add_argument("--pairs", default=None, help="only these chip assignments, e.g. chip-a:chip-b,chip-c:chip-b")
    p.add_argument("--max-steps", type=int, default=None, help="simulations per assignment (default: plan.max_steps)")
    p.add_argument("--out-dir", default="plan_out", help="where to write graph.yaml etc. (default: %(default)s)")
    p.add_argument("--template", default=None, help="graph YAML to fill (default: graphs/pdd.yaml of this checkout)")
    p.add_argument("--no-mlflow", action="store_true", help="skip MLflow logging")
    p.add_argument("--experiment", default="pdd-plan", help="MLflow experiment (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _load(name: str, catalog: str | None = None):  # -> Scenario
    from evaluations.sim.config import ScenarioError, load_scenario

    try:
        return load_scenario(name, catalog)
    except ScenarioError as e:
        raise UsageError(f"pdd: error: {e}") from None


def _num(v: Any) -> Any:
    if isinstance(v, float):
        return None if math.isnan(v) else (v if math.isfinite(v) else str(v))
    if isinstance(v, dict):
        return {k: _num(x) for k, x in v.items() if not str(k).startswith("_")}
    if isinstance(v, (list, tuple)):
        return [_num(x) for x in v]
    return v


def _json_line(d: dict[str, Any]) -> str:
    return json.dumps(_num(d), separators=(",", ":"))


def _run_blind(args: argparse.Namespace) -> int:
    import tempfile

    from evaluations.capacity_compare import blind_report
    from evaluations.sim.emulated import ScenarioError, load_scenario
    from pdd_serve.emulation.clock import Clock

    if not (args.overhead_ms >= 0 and math.isfinite(args.overhead_ms)):
        raise UsageError("pdd simulate: error: --overhead-ms must be >= 0")
    try:
        sc = load_scenario(args.capacity_of)
        overhead = Clock(sc.time_scale).emulated(args.overhead_ms / 1e3)
        if args.report_scale:
            from evaluations.report_scale import report_scale, report_table

            out = report_scale(sc, overhead, Path(tempfile.mkdtemp(prefix="pdd-report-scale-")))
            print(report_table(out))
            if args.out:
                Path(args.out).write_text(json.dumps(out, indent=2))
            print(_json_line(out))
            return 0
        out = blind_report(sc, overhead, Path(tempfile.mkdtemp(prefix="pdd-blind-")))
    except (ScenarioError, ValueError) as e:
        raise UsageError(f"pdd simulate: error: {e}") from None
    print(f"BLIND PREDICTION for {sc.name} (simulated, from the scenario file alone):")
    for g, r in out["graphs"].items():
        d = r.get("capacity_over_draws")
        spread = f"  other link draws {d['min']:.3g}-{d['max']:.3g}" if d else ""
        print(f"  {g:<12} capacity {r['capacity_rps']:.3g} req/s  $/h {r['cost_per_hour']['market']:.2f}  "
              f"BCR {r['bcr']['market']:.1f} req/$" + spread)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    print(_json_line(out))
    return 0


def _run_simulate(args: argparse.Namespace) -> int:
    import dataclasses

    if args.capacity_of:
        return _run_blind(args)
    if args.report_scale:
        raise UsageError("pdd simulate: error: --report-scale goes with --capacity-of SCENARIO")

    modes = sum(bool(x) for x in (args.trace, args.rate is not None, args.bathtub, args.tail_curve))
    if modes > 1:
        raise UsageError("pdd simulate: error: --trace, --rate, --bathtub and --tail-curve are separate modes; pick one")
    if args.rate is not None and not (args.rate > 0 and math.isfinite(args.rate)):
        raise UsageError("pdd simulate: error: --rate must be > 0")
    if args.limit is not None and args.limit <= 0:
        raise UsageError("pdd simulate: error: --limit must be > 0")
    if args.horizon is not None and args.horizon <= 0:
        raise UsageError("pdd simulate: error: --horizon must be > 0")
    if args.trace and not Path(args.trace).is_file():
        raise UsageError(f"pdd simulate: error: --trace {args.trace}: no such file")
    from evaluations.sim.config import TAIL_CHUNK_MODES, ScenarioError
    from evaluations.sim.report import (
        chips_label,
        format_report,
        format_trace,
        plot_bathtub,
        run_bathtub,
        run_report,
        run_trace,
        simulate,
        with_tail_mode,
    )
    from evaluations.sim.workload import synthetic

    sc = _load(args.scenario or ("mooncake" if args.trace else "report"))
    tails = args.tail_chunk.split(",") if args.tail_chunk else []
    bad = [t for t in tails if t not in TAIL_CHUNK_MODES]
    if bad or (len(tails) > 1 and not (args.bathtub or args.tail_curve)):
        raise UsageError(f"pdd simulate: error: --tail-chunk must be one of {', '.join(TAIL_CHUNK_MODES)}"
                         + (" (several only with --bathtub)" if not bad else f", got {bad[0]!r}"))
    if len(tails) == 1:
        sc = with_tail_mode(sc, tails[0])
    deps = args.deployments.split(",") if args.deployments else None
    for d in deps or []:
        if d not in sc.deployments:
            raise UsageError(f"pdd simulate: error: --deployments: {d!r} is not in {sc.path} "
                             f"(has {', '.join(sc.deployments)})")
    if args.rate_range or args.iterations:
        try:
            lo, hi = (float(x) for x in args.rate_range.split(",")) if args.rate_range else (
                sc.goodput.get("lo_rps", 1.0), sc.goodput.get("hi_rps", 20.0))
        except ValueError:
            raise UsageError(f"pdd simulate: error: --rate-range takes LO,HI req/s, got {args.rate_range!r}") from None
        if not (0 < lo < hi) or (args.iterations is not None and args.iterations < 1):
            raise UsageError("pdd simulate: error: --rate-range needs 0 < LO < HI and --iterations >= 1")
        it = {"iterations": args.iterations} if args.iterations else {}
        sc = dataclasses.replace(sc, goodput={**sc.goodput, "lo_rps": lo, "hi_rps": hi, **it},
                                 bathtub={**sc.bathtub, **it})
    if args.prefill_count is not None:
        if args.prefill_count < 1:
            raise UsageError("pdd simulate: error: --prefill-count must be >= 1")
        sc = dataclasses.replace(sc, deployments={
            k: dataclasses.replace(d, prefill=dataclasses.replace(
                d.prefill, count=args.prefill_count * d.prefill.chips_per_instance)) for k, d in sc.deployments.items()})
    if args.horizon:
        sc = dataclasses.replace(sc, goodput={**sc.goodput, "horizon_s": args.horizon},
                                 bathtub={**sc.bathtub, "horizon_s": args.horizon})
    progress = not args.no_progress
    try:
        hits = [float(h) for h in args.hits.split(",")] if args.hits else None
    except ValueError:
        raise UsageError(f"pdd simulate: error: --hits must be comma-separated numbers, got {args.hits!r}") from None
    if hits is not None and not all(0 <= h <= 1 for h in hits):
        raise UsageError("pdd simulate: error: --hits must lie in [0, 1]")
    try:
        if args.trace:
            res = run_trace(sc, args.trace, args.limit, progress, deps)
            print(format_trace(res))
            rows = res["rows"]
            out = {"scenario": sc.name, "trace": args.trace, "requests": res["requests"],
                   "sim_seconds": round(res["sim_seconds"], 2)}
            out.update(_ratios(sc, rows))
            out["deployments"] = {n: _brief(s) for n, s in rows.items()}
        elif args.rate is not None:
            rows = {}
            warm = float(sc.goodput.get("warmup_s", 0.0))
            from evaluations.sim.report import requests_for

            n = requests_for(args.rate, float(sc.goodput.get("horizon_s", 240.0)))
            for name in deps or list(sc.deployments):
                s, _ = simulate(sc, sc.deployments[name], synthetic(sc.workload, rate_rps=args.rate, requests=n),
                                progress=progress, warmup_s=warm)
                s["cost_per_hour"] = sc.cost_per_hour(sc.deployments[name])
                s["chips"] = chips_label(sc, sc.deployments[name])
                rows[name] = s
            res = {"rows": rows, "label": f"{sc.name} at {args.rate:g} req/s, {n} requests", "sim_seconds":
                   sum(s["sim_seconds"] for s in rows.values()), "requests": n, "span_s": n / args.rate}
            print(format_trace(res))
            out = {"scenario": sc.name, "rate_rps": args.rate, **_ratios(sc, rows),
                   "sim_seconds": round(res["sim_seconds"], 2), "deployments": {k: _brief(s) for k, s in rows.items()}}
        elif args.tail_curve:
            from evaluations.sim.report import plot_tail_curve, prefill_tail_curve

            hits = [i / 200 for i in range(200)]
            res = prefill_tail_curve(sc, hits, tuple(tails) or ("alone", "packed", "padded"))
            png = plot_tail_curve(res, args.plot or _SIM_DIR / "bathtub_prefill.png",
                                  f"{sc.name}: one prefill instance, {sc.workload.input_tokens}-token prompts, "
                                  f"chunk {sc.scheduler.prefill_chunk_tokens}")
            print(_format_tail(res))
            out = {"scenario": sc.name, "plot": str(png), "drops": _drops(res)}
        elif args.bathtub:
            curves = {}
            for mode in tails or [sc.scheduler.tail_chunk]:
                curves[f"tail {mode}"] = run_bathtub(with_tail_mode(sc, mode), progress, hits=hits, deployments=deps)
            n_p = sc.deployments[(deps or list(sc.deployments))[0]].prefill.instances
            png = plot_bathtub(curves, args.plot or _SIM_DIR / "bathtub.png", f"{sc.name}: benefit vs hit rate "
                               f"({n_p} P instances, chunk {sc.scheduler.prefill_chunk_tokens} tokens)")
            print(_format_bathtub(curves))
            res = {"curves": curves}
            out = {"scenario": sc.name, "plot": str(png),
                   "bathtub": {label: [{"hit": r["hit"], **{d: round(r[d]["bcr"], 5) for d in c["deployments"]}}
                                       for r in c["rows"]] for label, c in curves.items()}}
        else:
            if deps:
                sc = dataclasses.replace(sc, deployments={k: v for k, v in sc.deployments.items() if k in deps})
                for k in ("subject", "cost_baseline", "latency_baseline"):
                    if sc.compare.get(k) not in sc.deployments:
                        raise UsageError(f"pdd simulate: error: --deployments must keep compare.{k} "
                                         f"({sc.compare.get(k)}) for the report")
            res = run_report(sc, progress)
            print(format_report(res))
            out = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in res["headline"].items()}
            out["reference"] = res["reference"]
    except ScenarioError as e:
        raise UsageError(f"pdd simulate: error: {e}") from None
    if args.out:
        Path(args.out).write_text(json.dumps(_num(res), indent=1, default=str))
    if args.mlflow:
        out["mlflow_run_id"] = _log_simulate(args, sc, out)
    print(_json_line(out))
    return 0


def _log_simulate(args: argparse.Namespace, sc: Any, out: dict[str, Any]) -> str:
    """One MLflow run: the command's knobs as params, the JSON line as an artifact, the plot."""
    import os
    import tempfile

    import mlflow

    mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db")
    mlflow.set_experiment("pdd-simulate")
    mode = "bathtub" if args.bathtub else "tail-curve" if args.tail_curve else "trace" if args.trace else "report"
    with mlflow.start_run(run_name=f"{sc.name}-{mode}") as run:
        mlflow.log_params({"scenario": sc.name, "mode": mode, "tail_chunk": args.tail_chunk or sc.scheduler.tail_chunk,
                           "prefill_count": args.prefill_count or "scenario", "hits": args.hits or "scenario",
                           "horizon_s": args.horizon or "scenario", "deployments": args.deployments or "all",
                           "rate_range": args.rate_range or "scenario", "iterations": args.iterations or "scenario",
                           "chunk_tokens": sc.scheduler.prefill_chunk_tokens})
        for k, v in out.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                mlflow.log_metric(k, float(v))
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "result.json"
            f.write_text(json.dumps(_num(out), indent=1, default=str))
            mlflow.log_artifact(str(f))
        if out.get("plot"):
            mlflow.log_artifact(str(out["plot"]))
        return run.info.run_id


def _brief(s: dict[str, Any]) -> dict[str, Any]:
    keys = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p90", "attainment", "rld_token_share", "hit_p", "hit_md",
            "wan_gb", "sim_seconds", "pipelines")
    return {k: (round(s[k], 4) if isinstance(s[k], float) else s[k]) for k in keys if k in s}


def _ratios(sc: Any, rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Latency ratios at one load (goodput and BCR need the report's rate search)."""
    c = sc.compare
    sub, lat = rows.get(c.get("subject", "pdd")), rows.get(c.get("latency_baseline", "cross_dc_pd"))
    out: dict[str, Any] = {}
    if sub is not None:
        out["rld_token_share"] = round(sub["rld_token_share"], 4)
    if sub is not None and lat is not None and lat["ttft_p90"] > 0:
        out["ttft_reduction"] = round(1 - sub["ttft_p90"] / lat["ttft_p90"], 4)
    return out


def _drops(res: dict[str, Any], min_jump: float = 0.08) -> dict[str, list[dict[str, float]]]:
    """Discontinuities: hit rates where throughput jumps by more than min_jump between neighbouring
    points. A jump up at h means a drop just below h: the hits where a nearly empty tail chunk
    (still a whole forward) appears."""
    out = {}
    for mode, rows in res["modes"].items():
        out[mode] = [{"hit": round(b["hit"], 3), "change": round(b["uncached_tok_s"] / a["uncached_tok_s"] - 1, 4)}
                     for a, b in zip(rows, rows[1:]) if abs(b["uncached_tok_s"] / a["uncached_tok_s"] - 1) > min_jump]
    return out


def _format_tail(res: dict[str, Any]) -> str:
    modes = list(res["modes"])
    lines = [f"{'hit':>6}" + "".join(f"{m + ' ktok/s':>18}" for m in modes)]
    for i in range(0, len(res["hits"]), 10):
        lines.append(f"{res['hits'][i]:>6.2f}" + "".join(f"{res['modes'][m][i]['uncached_tok_s'] / 1e3:>18.2f}" for m in modes))
    for m, d in _drops(res).items():
        lines.append(f"jumps (> 8% between hit steps of 0.005) with tail {m}: "
                     + (", ".join(f"{x['hit']:.3f} ({x['change']:+.0%})" for x in d) or "none"))
    return "\n".join(lines)


def _format_bathtub(curves: dict[str, dict[str, Any]]) -> str:
    lines = []
    for label, c in curves.items():
        deps = c["deployments"]
        lines.append(f"bathtub, {label}: BCR = SLA goodput (req/s) per cost/h")
        lines.append(f"{'hit':>6}" + "".join(f"{d + ' rps':>16}{d + ' BCR':>14}" for d in deps)
                     + (f"{'gain':>9}" if len(deps) >= 2 else ""))
        for r in c["rows"]:
            line = f"{r['hit']:>6.2f}" + "".join(f"{r[d]['goodput_rps']:>16.2f}{r[d]['bcr']:>14.4f}" for d in deps)
            if len(deps) >= 2 and r[deps[1]]["bcr"] > 0:
                line += f"{r[deps[0]]['bcr'] / r[deps[1]]['bcr'] - 1:>+9.1%}"
            lines.append(line)
    return "\n".join(lines)


def _run_plan(args: argparse.Namespace) -> int:
    import yaml

    if args.target_rps is not None and not (args.target_rps > 0 and math.isfinite(args.target_rps)):
        raise UsageError("pdd plan: error: --target-rps must be > 0")
    if args.max_steps is not None and args.max_steps <= 0:
        raise UsageError("pdd plan: error: --max-steps must be > 0")
    if args.trace and not Path(args.trace).is_file():
        raise UsageError(f"pdd plan: error: --trace {args.trace}: no such file")
    if args.window is not None and args.window < 0:
        raise UsageError("pdd plan: error: --window must be >= 0")
    import dataclasses

    from evaluations.sim.config import ScenarioError
    from evaluations.sim.planner import cluster_nodes, graph_yaml, log_mlflow, plan, plot_knobs

    sc = _load(args.scenario or ("mooncake" if args.trace else "report"), args.catalog)
    for opt, key in ((args.site_a, "chips_site_a"), (args.site_b, "chips_site_b")):
        if opt:
            chips = [c.strip() for c in opt.split(",") if c.strip()]
            unknown = [c for c in chips if c not in sc.chips]
            if unknown:
                raise UsageError(f"pdd plan: error: unknown chip {unknown[0]!r}; catalog: {', '.join(sc.chips)}")
            sc = dataclasses.replace(sc, plan={**sc.plan, key: chips})
    pairs = None
    if args.pairs:
        try:
            pairs = [tuple(x.split(":")) for x in args.pairs.split(",")]
            assert all(len(p) == 2 for p in pairs)
        except AssertionError:
            raise UsageError("pdd plan: error: --pairs takes SITE_A_CHIP:SITE_B_CHIP[,...]") from None
        for a, b in pairs:
            for c in (a, b):
                if c not in sc.chips:
                    raise UsageError(f"pdd plan: error: --pairs: unknown chip {c!r}; catalog: {', '.join(sc.chips)}")
    template = Path(args.template) if args.template else Path(__file__).resolve().parents[2] / "graphs" / "pdd.yaml"
    if not template.is_file():
        raise UsageError(f"pdd plan: error: --template {template}: no such file")
    try:
        res = plan(sc, args.target_rps, args.max_steps, not args.no_progress, pairs,  # type: ignore[arg-type]
                   args.trace, args.window if args.window != 0 else float("inf"))
    except ScenarioError as e:
        raise UsageError(f"pdd plan: error: {e}") from None
    print(f"{'chip A':<10}{'chip B':<10}{'P':>4}{'RLD':>5}{'MD':>5}{'budget':>7}{'cost/h':>9}{'attain':>8}"
          f"{'BCR':>9}{'TTFT p90':>10}{'TPOT p90':>10}  step")
    for c in res.candidates:
        r = c.row()
        print(f"{r['chip_a']:<10}{r['chip_b']:<10}{r['n_prefill']:>4}{r['n_relay']:>5}{r['n_main_decode']:>5}"
              f"{r['wan_budget_s']:>7.2f}{r['cost_per_hour']:>9.2f}{r['attainment']:>8.1%}{r['bcr']:>9.4f}"
              f"{r['ttft_p90']:>9.2f}s{r['tpot_p90'] * 1e3:>8.1f}ms  {r['why']}{'' if r['feasible'] else '  (misses SLA)'}")
    out: dict[str, Any] = {"scenario": sc.name, "trace": args.trace, "target_rps": round(res.target_rps, 4),
                           "candidates": len(res.candidates)}
    if res.best is None:
        print("no configuration met the SLA within --max-steps", file=sys.stderr)
        print(_json_line({**out, "best": None}))
        return 1
    od = Path(args.out_dir)
    od.mkdir(parents=True, exist_ok=True)
    g = od / "graph.yaml"
    g.write_text(graph_yaml(sc, res, template))
    n = od / "cluster_nodes.yaml"
    n.write_text("# Node counts for a Ray cluster launcher config (merge node_config per cloud).\n"
                 + yaml.safe_dump(cluster_nodes(sc, res), sort_keys=False))
    csv_path = od / "candidates.csv"
    import csv

    with csv_path.open("w", newline="") as f:
        rows = [c.row() for c in res.candidates]
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    png = plot_knobs(res, od / "bcr_knobs.png")
    b = res.best
    pol = yaml.safe_load(g.read_text())["applications"][0]["args"]["policy"]
    print(f"\nbest (BCR): site a: {b.counts['prefill']} P + {b.counts['relay']} RLD on {b.chip_a}; "
          f"site b: {b.counts['main_decode']} MD on {b.chip_b}; cost {b.cost:.2f}/h; "
          f"SLA goodput {res.best_goodput_rps:.2f} req/s; BCR {res.best_bcr:.4f}")
    print(f"pipeline policy: wan_budget_s {pol['wan_budget_s']:g}, relay pool {b.counts['relay']} "
          f"(relay_max_running {pol['relay_max_running']}), handoff_token_threshold {pol['handoff_token_threshold']}")
    if res.reference:
        print(f"scenario's {res.reference['name']}: cost {res.reference['cost_per_hour']:.2f}/h, "
              f"goodput {res.reference['goodput_rps']:.2f} req/s, BCR {res.reference['bcr']:.4f}")
    print(f"wrote {g}, {n}, {csv_path}")
    run_id = None
    if not args.no_mlflow:
        run_id = log_mlflow(sc, res, [g, n, csv_path, png], args.experiment)
    out.update({"best": {"site_a": {"chip": b.chip_a, "prefill": b.counts["prefill"], "relay": b.counts["relay"]},
                         "site_b": {"chip": b.chip_b, "main_decode": b.counts["main_decode"]}},
                "policy": {"wan_budget_s": pol["wan_budget_s"], "relay_replicas": b.counts["relay"],
                           "relay_max_running": pol["relay_max_running"]},
                "cost_per_hour": round(b.cost, 3),
                "goodput_rps": round(res.best_goodput_rps, 3), "bcr": round(res.best_bcr, 5),
                "reference_bcr": round(res.reference.get("bcr", float("nan")), 5) if res.reference else None,
                "bcr_gain_vs_reference": (round(res.best_bcr / res.reference["bcr"] - 1, 4)
                                          if res.reference and res.reference["bcr"] > 0 else None),
                "graph_yaml": str(g), "cluster_nodes": str(n), "plot": str(png), "mlflow_run_id": run_id})
    print(_json_line(out))
    return 0


SIM_COMMANDS: list[Command] = [
    Command("simulate", "cluster-scale simulation: the report's comparison, a trace, or the bathtub curve",
            _add_simulate, _run_simulate, _SIMULATE_DESCRIPTION),
    Command("plan", "search P/RLD/MD counts and chips for the highest BCR; write a graph YAML",
            _add_plan, _run_plan, _PLAN_DESCRIPTION),
]
