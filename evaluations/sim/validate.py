"""Sim vs real: replay a real run's requests through the simulator and compare.

    python -m evaluations.sim.validate RECORDS [--scenario cpu_validate] [--graph pdd] [--sla-ttft 1 --sla-tpot 0.1]
    python -m evaluations.sim.validate --calibrate          # measure the CPU engine, refit the chip cpu-small
    python -m evaluations.sim.validate --make-synthetic OUT.parquet   # a record file to test the plumbing

RECORDS: Parquet / CSV / JSON / JSONL, one row per request, the columns of
evaluations.loadgen.RequestRecord.as_row() (what `pdd compare` writes to requests.parquet):
  t_send_s (arrival offset, s), prompt_tokens, output_tokens (or max_tokens), ttft_s, tpot_s,
  error, pdd_pipeline, pdd_prefix_hit_p, pdd_prefix_hit_md, pdd_wan_bytes (optional), and `graph`
  when several graphs share the file (a `pdd compare` record directory: its requests.parquet). The requests are replayed at their arrival times with their measured prefix hits (the
  hits are replayed, not re-derived: the caches' contents before the run are unknown), through the
  scenario deployment named like the graph, on the `cpu-small` chip fitted from engine timings.
Prints predicted vs measured TTFT P50/P90 and SLA goodput with relative errors, then one JSON line.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from evaluations.sim.config import SIM_DIR, Scenario, ScenarioError, load_scenario
from evaluations.sim.emulated import EmulatedScenario, sim_scenario_for
from evaluations.sim.emulated import load_scenario as load_emulated
from evaluations.sim.workload import SimRequest, Workload
from pdd_serve.emulation.costmodel import CATALOG_PATH, ChipSpec, ModelShape

# the last calibration's measurements and fit; the chip itself is the catalog's cpu-small
# (pdd_serve/emulation/costmodel.yaml), where a new fit is copied by hand
CPU_FIT = SIM_DIR / "cpu_small.yaml"
REQUIRED = ("prompt_tokens", "ttft_s")


# ---------------------------------------------------------------- records


def read_records(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if path.is_dir():  # a `pdd compare` record directory (.pdd/eval/pdd-compare-*/)
        path = path / "requests.parquet"
    if not path.is_file():
        raise ScenarioError(f"{path}: no such record file")
    suf = path.suffix.lower()
    if suf == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif suf == ".csv":
        with path.open(newline="") as f:
            rows = [{k: _cell(v) for k, v in r.items()} for r in csv.DictReader(f)]
    elif suf in (".json", ".jsonl"):
        text = path.read_text().strip()
        rows = json.loads(text) if text.startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    else:
        raise ScenarioError(f"{path}: unknown record format {suf!r} (parquet, csv, json, jsonl)")
    if not rows:
        raise ScenarioError(f"{path}: holds no records")
    missing = [c for c in REQUIRED if c not in rows[0]]
    if missing:
        raise ScenarioError(f"{path}: missing column(s) {', '.join(missing)}; expected RequestRecord.as_row() columns")
    if "t_send_s" not in rows[0] and "arrival_s" not in rows[0]:
        raise ScenarioError(f"{path}: needs an arrival column (t_send_s or arrival_s)")
    return rows


def _cell(v: str) -> Any:
    if v == "":
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def _f(row: dict[str, Any], *keys: str, default: float | None = None) -> float | None:
    for k in keys:
        v = row.get(k)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            return float(v)
    return default


def _send_time(r: dict[str, Any]) -> float:
    return _f(r, "t_send_s", "arrival_s", default=0.0) or 0.0


def runs_of(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """One list per repeat: `pdd compare --repeats N` runs a graph N times one after the other, each
    with its clock from 0 (replaying them together would double the load)."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(int(_f(r, "repeat", default=0) or 0), []).append(r)
    return [by[k] for k in sorted(by)]


def records_to_workload(rows: list[dict[str, Any]], block_size: int, sessions: bool = True) -> Workload:
    """One run's requests with their measured prefix hits (replayed, not re-derived: the caches'
    contents before the run are unknown). A session's first turn arrives at its recorded time; with
    `sessions`, each later turn is sent its recorded think time after the simulated answer to the
    previous turn ends, as loadgen does (open-loop sessions, closed-loop turns)."""
    arr = [_send_time(r) for r in rows]
    t0 = min(arr)
    order = sorted(range(len(rows)), key=lambda i: arr[i])
    reqs = []
    prev: dict[str, tuple[int, dict[str, Any]]] = {}  # session -> (rid, row) of its latest turn
    for rid, i in enumerate(order):
        r = rows[i]
        prompt = max(1, int(_f(r, "prompt_tokens", default=1) or 1))
        out = int(_f(r, "output_tokens", default=0) or 0) or int(_f(r, "max_tokens", default=1) or 1)
        hp = _f(r, "pdd_prefix_hit_p", "planned_hit", default=0.0) or 0.0
        hm = _f(r, "pdd_prefix_hit_md", default=hp) or 0.0
        # the KV bytes P really sent to MD say where the Router's view let it start (a P-RLD row
        # sent none: its pipeline decision is replayed from the hits)
        wan = _f(r, "pdd_wan_bytes")
        sent = int(wan) if wan is not None and r.get("pdd_pipeline") not in (None, "", "P-RLD") else None
        req = SimRequest(rid, arr[i] - t0, prompt, max(1, out), (), "record",
                         fixed_hit_p=int(round(hp * prompt)), fixed_hit_md=int(round(hm * prompt)),
                         fixed_wan_bytes=sent)
        sid = r.get("session_id")
        last = prev.get(str(sid)) if sessions and sid is not None else None
        e2e = _f(last[1], "e2e_s") if last is not None else None
        if last is not None and e2e is not None and not last[1].get("error"):
            req.after, req.think_s = last[0], max(0.0, arr[i] - _send_time(last[1]) - e2e)
        if sid is not None:
            prev[str(sid)] = (rid, r)
        reqs.append(req)
    return Workload(reqs, [], block_size, f"{len(reqs)} recorded requests")


def measured(rows: list[dict[str, Any]], ttft_s: float, tpot_s: float) -> dict[str, Any]:
    """The real run's figures, computed like `pdd compare` (compare.summarize_graph): TTFT
    percentiles over every repeat's requests, goodput = SLA-meeting requests over the sum of the
    repeats' makespans (first send to last answer)."""
    ok = [r for r in rows if not r.get("error")]
    ttfts = [float(r["ttft_s"]) for r in ok if r.get("ttft_s") is not None]
    span = 0.0
    for run in runs_of(rows):
        dones = [_send_time(r) + float(r["e2e_s"]) for r in run if not r.get("error") and r.get("e2e_s") is not None]
        span += (max(dones) - min(_send_time(r) for r in run)) if dones else 0.0

    def meets(r: dict[str, Any]) -> bool:
        if r.get("error") or r.get("ttft_s") is None or float(r["ttft_s"]) > ttft_s:
            return False
        return r.get("tpot_s") is None or float(r["tpot_s"]) <= tpot_s

    good = sum(1 for r in rows if meets(r))
    tpots = [float(r["tpot_s"]) for r in ok if r.get("tpot_s") is not None]
    pipes: dict[str, int] = {}
    for r in rows:
        p = r.get("pdd_pipeline") or "?"
        pipes[p] = pipes.get(p, 0) + 1
    pre = [float(r["pdd_prefill_s"]) for r in ok if r.get("pdd_prefill_s") is not None
           and not (isinstance(r["pdd_prefill_s"], float) and math.isnan(r["pdd_prefill_s"]))]
    return {"prefill_p50": float(np.percentile(pre, 50)) if pre else math.nan,
            "prefill_p90": float(np.percentile(pre, 90)) if pre else math.nan,
            "ttft_p50": float(np.percentile(ttfts, 50)) if ttfts else math.nan,
            "ttft_p90": float(np.percentile(ttfts, 90)) if ttfts else math.nan,
            "goodput_rps": good / span if span > 0 else math.nan, "attainment": good / len(rows),
            "tpot_p50": float(np.median(tpots)) if tpots else math.nan, "pipelines": pipes}


def with_link(sc: Scenario, link: str) -> Scenario:
    """Every cross-site deployment on the scenario's link `link` (the same graphs, another wire)."""
    import dataclasses

    if link not in sc.links:
        raise ScenarioError(f"--link {link!r}: not a link of {sc.path} (has {', '.join(sc.links)})")
    deps = {n: dataclasses.replace(d, link=link) if sc.links[d.link].cross_site else d
            for n, d in sc.deployments.items()}
    return dataclasses.replace(sc, deployments=deps)


def with_link_seed(sc: Scenario, graph: str, seed: int, phase_s: float = 0.0) -> Scenario:
    """The scenario with the graph's link jitter drawn from another seed, the line `phase_s` into
    its jitter at the simulation's time 0."""
    import dataclasses

    name = sc.deployments[graph].link
    ls = sc.links[name]
    ov = tuple((k, v) for k, v in ls.link.overrides if k not in ("seed", "phase_s")) + (("seed", seed),)
    if phase_s > 0:
        ov += (("phase_s", phase_s),)
    link = dataclasses.replace(ls.link, overrides=ov)
    return dataclasses.replace(sc, links={**sc.links, name: dataclasses.replace(ls, link=link)})


def recorded_link(run: list[dict[str, Any]], request_overhead_s: float = 0.0) -> tuple[int, float] | None:
    """(seed, phase) of the line one run met, from its records: the seed it was deployed with
    (`link_seed`) and where Prefill's link clock stood when each request reached it
    (`pdd_link_t_s`) against the request's send time. None when the records don't say (then the
    jitter's phase is unknown and the prediction averages over seeds)."""
    seed = _f(run[0], "link_seed") if run else None
    t0 = min(_send_time(r) for r in run) if run else 0.0
    at = [lt - (_send_time(r) - t0) - request_overhead_s for r in run
          if (lt := _f(r, "pdd_link_t_s")) is not None and math.isfinite(lt)]
    if seed is None or not at:
        return None
    return int(seed), max(0.0, float(np.median(at)))


def predicted(sc: Scenario, graph: str, rows: list[dict[str, Any]], ttft_s: float, tpot_s: float,
              draws: int = 1, sessions: bool = True) -> dict[str, Any]:
    """Replay every repeat of one graph. A cross-site repeat whose records give the line's draw
    (`recorded_link`: the seed it was deployed with, Prefill's link clock per request) is replayed
    on that draw; otherwise `draws` times with a different link seed each, and the prediction is
    the mean over draws (min and max kept)."""
    from evaluations.sim.metrics import tpot, ttft
    from evaluations.sim.simulator import Simulation

    cross = sc.links[sc.deployments[graph].link].cross_site
    runs = runs_of(rows)
    # a run whose records say which draw of the line it met is replayed on that draw, once
    met = [recorded_link(run, sc.scheduler.request_overhead_s) if cross else None for run in runs]
    per_draw: list[dict[str, float]] = []
    per_run: list[list[dict[str, float]]] = [[] for _ in runs]  # each repeat alone, one entry per draw
    pipes: dict[str, int] = {}
    wall = 0.0
    for k in range(draws if cross and None in met else 1):
        tt: list[float] = []
        tp: list[float] = []
        pre: list[float] = []
        good, span = 0, 0.0
        for j, (run, m) in enumerate(zip(runs, met)):
            sck = sc if not cross else with_link_seed(sc, graph, *m) if m is not None else with_link_seed(sc, graph, k)
            sim = Simulation(sck, sck.deployments[graph], records_to_workload(run, sc.workload.block_size, sessions))
            reqs = sim.run()
            wall += sim.wall_s
            ok = [r for r in reqs if not r.fallback.startswith("failed")]  # a failed request is an error row
            run_tt = [ttft(r, sck.sla) for r in ok]
            tt += run_tt
            pre += [r.t_prefill_done - r.arrival - sck.scheduler.request_overhead_s for r in ok if r.t_prefill_done >= 0]
            tp += [tpot(r, sck.sla) for r in ok if r.output > 1]
            run_good = sum(1 for r in ok if ttft(r, sck.sla) <= ttft_s and (r.output <= 1 or tpot(r, sck.sla) <= tpot_s))
            run_span = (max(r.t_done for r in ok) - min(r.arrival for r in reqs)) if ok else 0.0
            good += run_good
            span += run_span
            per_run[j].append({"ttft_p50": float(np.percentile(run_tt or [math.inf], 50)),
                               "ttft_p90": float(np.percentile(run_tt or [math.inf], 90)),
                               "goodput_rps": run_good / run_span if run_span > 0 else math.nan,
                               "attainment": run_good / len(run)})
            if k == 0:
                for r in reqs:
                    pipes[r.pipeline] = pipes.get(r.pipeline, 0) + 1
        tt = tt or [math.inf]
        pre = pre or [math.nan]
        per_draw.append({"prefill_p50": float(np.percentile(pre, 50)), "prefill_p90": float(np.percentile(pre, 90)),
                         "ttft_p50": float(np.percentile(tt, 50)), "ttft_p90": float(np.percentile(tt, 90)),
                         "goodput_rps": good / span if span > 0 else math.nan, "attainment": good / len(rows),
                         "tpot_p50": float(np.median(tp)) if tp else math.nan})
    out: dict[str, Any] = {k: float(np.mean([d[k] for d in per_draw])) for k in per_draw[0]}
    out["range"] = {k: (min(d[k] for d in per_draw), max(d[k] for d in per_draw)) for k in per_draw[0]}
    out.update(pipelines=pipes, draws=len(per_draw), sim_seconds=wall,
               runs_on_recorded_link=sum(m is not None for m in met),
               # per repeat (keyed by the records' repeat index), so ratios can be taken per repeat
               per_run=[{"repeat": int(_f(run[0], "repeat", default=0) or 0),
                         **{k: float(np.mean([d[k] for d in ds])) for k in ds[0]}} for run, ds in zip(runs, per_run)])
    return out


def fit_platform(sc: Scenario, graph: str, rows: list[dict[str, Any]], ttft_s: float, tpot_s: float,
                 sessions: bool = True) -> tuple[Scenario, dict[str, Any]]:
    """Fit the serving platform on ONE graph's records (in sample); the other graphs are then
    predicted out of sample. Three scheduler parameters the engine timings can't see, none of them
    a chip property, each fitted by a grid on log errors:
    - request_overhead_s: Serve RPCs, object-store puts, HTTP before a request's prefill, and
      compute_slowdown: every forward slowed by the machine's other tenants (the replicas share
      2 cores), together on TTFT P50 and P90;
    - decode_step_overhead_ms: the serving loop around each decode forward (asyncio, streaming each
      step's tokens through Serve), on TPOT P50 (fitted first, refitted after the other two);
    - with the records' TTFT breakdown (pdd_ttft_s, pdd_prefill_s), each on its own measurement
      instead: request_overhead_s = the client's side of TTFT, compute_slowdown on the Router's
      prefill time, md_call_overhead_s (each Router -> MD call's handling) on TTFT P50 and P90."""
    import dataclasses

    ok_rows = [r for r in rows if not r.get("error")]
    meas = measured(ok_rows, ttft_s, tpot_s)

    def loss(base: Scenario, keys: tuple[str, ...], **fields: float) -> float:
        sc2 = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, **fields))
        pred = predicted(sc2, graph, ok_rows, ttft_s, tpot_s, 1, sessions)
        return sum(math.log(pred[k] / meas[k]) ** 2 for k in keys if pred[k] > 0 and meas[k] > 0)

    def fit_step(base: Scenario) -> Scenario:
        step = min(np.linspace(0.0, 40.0, 81), key=lambda v: loss(base, ("tpot_p50",), decode_step_overhead_ms=float(v)))
        return dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, decode_step_overhead_ms=float(step)))

    sc2 = fit_step(sc)
    client = [float(r["ttft_s"]) - float(r["pdd_ttft_s"]) for r in ok_rows
              if r.get("ttft_s") is not None and r.get("pdd_ttft_s") is not None]
    if client and math.isfinite(meas["prefill_p50"]):
        # the records' own breakdown (since commit e23cef8): the client's side of TTFT (HTTP in,
        # first chunk out) is the request overhead; the Router's prefill time (queue + prefill, as
        # it saw it) fits the compute slowdown; what TTFT has beyond both is the Router -> MD calls'
        # handling (md_call_overhead_s). Each on its own measurement, so they don't trade off.
        ov = max(0.0, float(np.median(client)))
        sc2 = dataclasses.replace(sc2, scheduler=dataclasses.replace(sc2.scheduler, request_overhead_s=ov))
        slow = float(min(np.linspace(1.0, 4.0, 31),
                         key=lambda k: loss(sc2, ("prefill_p50", "prefill_p90"), compute_slowdown=float(k))))
        sc2 = dataclasses.replace(sc2, scheduler=dataclasses.replace(sc2.scheduler, compute_slowdown=slow))
        call = float(min(np.linspace(0.0, 0.5, 51),
                         key=lambda c: loss(sc2, ("ttft_p50", "ttft_p90"), md_call_overhead_s=float(c))))
        sc2 = fit_step(dataclasses.replace(sc2, scheduler=dataclasses.replace(sc2.scheduler, md_call_overhead_s=call)))
    else:  # older records: no breakdown, overhead and slowdown together on TTFT
        # wide enough for a machine under 4-8x load (2 cores shared by several Ray clusters)
        grid = [(float(ov), float(k)) for ov in np.linspace(0.0, 0.8, 41) for k in np.linspace(1.0, 4.0, 16)]
        ov, slow = min(grid, key=lambda g: loss(sc2, ("ttft_p50", "ttft_p90"), request_overhead_s=g[0],
                                                compute_slowdown=g[1]))
        sc2 = fit_step(dataclasses.replace(sc2, scheduler=dataclasses.replace(sc2.scheduler, request_overhead_s=ov,
                                                                              compute_slowdown=slow)))
    return sc2, {"request_overhead_s": round(sc2.scheduler.request_overhead_s, 4),
                 "compute_slowdown": round(sc2.scheduler.compute_slowdown, 3),
                 "md_call_overhead_s": round(sc2.scheduler.md_call_overhead_s, 4),
                 "decode_step_overhead_ms": round(sc2.scheduler.decode_step_overhead_ms, 2), "fit_graph": graph}


def validate(sc: Scenario, rows: list[dict[str, Any]], ttft_s: float, tpot_s: float,
             graphs: list[str] | None = None, draws: int = 1, sessions: bool = True) -> dict[str, Any]:
    by_graph: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_graph.setdefault(str(r.get("graph") or (graphs[0] if graphs else "pdd")), []).append(r)
    out: dict[str, Any] = {}
    for g, grows in by_graph.items():
        if graphs and g not in graphs:
            continue
        if g not in sc.deployments:
            raise ScenarioError(f"graph {g!r} of the records has no deployment in {sc.path} "
                                 f"(has {', '.join(sc.deployments)}); pass --graph")
        meas = measured(grows, ttft_s, tpot_s)
        pred = predicted(sc, g, grows, ttft_s, tpot_s, draws, sessions)
        err = {k: _rel(pred[k], meas[k]) for k in ("ttft_p50", "ttft_p90", "goodput_rps")}
        out[g] = {"requests": len(grows), "repeats": len(runs_of(grows)), "measured": meas, "predicted": pred,
                  "rel_error": err}
    return out


def simulate_records(sc: EmulatedScenario, graphs: list[Any], rows: list[dict[str, Any]], out_dir: Path,
                     draws: int = 3, request_overhead_s: float = 0.0) -> dict[str, Any]:
    """Replay an emulated run's measured requests (arrivals, lengths, prefix hits) through the
    simulator on the same scenario (`pdd compare --emulate`'s sim_* figures); per graph:
    predicted vs measured TTFT P50/P90 and goodput, relative errors. `request_overhead_s`: the
    serving software's time per request in emulated seconds (measured on same-DC requests that
    were alone: compare.software_overhead_real_s, on the emulated clock), which the chips' cost
    model cannot know."""
    import dataclasses

    sim = sim_scenario_for(sc, graphs, out_dir)
    sim = dataclasses.replace(sim, scheduler=dataclasses.replace(sim.scheduler, request_overhead_s=request_overhead_s))
    return validate(sim, rows, sc.sla.ttft_s, sc.sla.tpot_s, draws=draws)


def _rel(pred: float, meas: float) -> float:
    if not (math.isfinite(pred) and math.isfinite(meas)):
        return math.nan
    if meas == 0:  # nothing met the SLA: a relative error is undefined (the table shows the absolute one)
        return 0.0 if pred == 0 else math.nan
    return (pred - meas) / meas


def format_validation(res: dict[str, Any], tol: float) -> str:
    lines = [f"{'graph':<19}{'metric':<14}{'measured':>10}{'predicted':>11}{'rel err':>9}  {'link draws min..max':<19}"]
    for g, r in res.items():
        for k, label in (("ttft_p50", "TTFT P50 (s)"), ("ttft_p90", "TTFT P90 (s)"), ("goodput_rps", "goodput rps")):
            e = r["rel_error"][k]
            lo, hi = r["predicted"]["range"][k]
            spread = f"{lo:.3f}..{hi:.3f}" if r["predicted"]["draws"] > 1 else ""
            flag = "" if not math.isfinite(e) or abs(e) <= tol else "  > tolerance"
            err = f"{e:>+9.1%}" if math.isfinite(e) else f"{'n/a':>9}"  # measured 0: see the absolute values
            lines.append(f"{g:<19}{label:<14}{r['measured'][k]:>10.3f}{r['predicted'][k]:>11.3f}{err}  "
                         f"{spread:<19}{flag}")
        lines.append(f"{'':<19}pipelines measured {r['measured']['pipelines']} / simulated {r['predicted']['pipelines']}")
    return "\n".join(lines)


# ---------------------------------------------------------------- calibration


def _engine_timings(repeats: int = 5) -> dict[str, list[tuple[Any, float]]]:
    """Prefill (chunked like pdd_serve's Prefill), decode steps vs batch, extends. One torch thread
    (a replica's budget, serve/common.py); the minimum over repeats, because this machine is shared
    and the least-disturbed run is the best estimate of the engine's own cost."""
    import torch

    torch.set_num_threads(1)
    from pdd_serve.checkpoints import default_model_path
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.sampling import SamplingParams

    eng = Engine.from_pretrained(default_model_path(), enable_prefix_cache=False)
    g = torch.Generator().manual_seed(0)
    vocab = eng.args.vocab_size

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    def timed(fn: Any) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    out: dict[str, list[tuple[Any, float]]] = {"prefill": [], "decode": [], "extend": []}
    eng.generate(prompt(64), 4)  # warm-up
    for n in (128, 256, 512, 1024, 1536):
        ts = []
        for _ in range(repeats):
            s = eng.add("p", prompt(n), SamplingParams(1))
            ts.append(timed(lambda s=s: eng.prefill(s, use_cache=False, chunk_tokens=256)))
            eng.release(s)
        out["prefill"].append((n, min(ts)))
    for b in (1, 2, 4, 8, 16, 32):
        ts = []
        for _ in range(repeats):
            seqs = [eng.add(f"d{i}", prompt(256), SamplingParams(40, ignore_eos=True)) for i in range(b)]
            for s in seqs:
                eng.prefill(s, use_cache=False)
            ts.append(timed(lambda seqs=seqs: [eng.decode_step(seqs) for _ in range(16)]) / 16)
            for s in seqs:
                eng.release(s)
        out["decode"].append((b, min(ts)))
    for n in (8, 32, 128):
        ts = []
        for _ in range(repeats):
            s = eng.add("e", prompt(256), SamplingParams(n + 4, ignore_eos=True))
            eng.prefill(s, use_cache=False)
            ids = prompt(n)
            ts.append(timed(lambda s=s, ids=ids: eng.extend(s, ids)))
            eng.release(s)
        out["extend"].append((n, min(ts)))
    return out


def _predict(chip: ChipSpec, m: ModelShape, kind: str, x: int) -> float:
    from pdd_serve.emulation.costmodel import decode_step_time, prefill_time

    if kind == "prefill":
        t, done = 0.0, 0
        while done < x:
            n = min(256, x - done)
            t += prefill_time(chip, m, 1, [(n, done)])
            done += n
        return t
    if kind == "decode":
        return decode_step_time(chip, m, 1, x, x * 264)
    return prefill_time(chip, m, 1, [(x, 256)])


def fit_chip(timings: dict[str, list[tuple[Any, float]]], m: ModelShape, base: ChipSpec) -> tuple[ChipSpec, float]:
    """Least squares in log time over (peak FLOP/s, bandwidth, per-forward overhead), mfu = mbu = 1."""
    from scipy.optimize import minimize

    pts = [(k, x, t) for k, v in timings.items() for x, t in v]

    def chip(theta: np.ndarray) -> ChipSpec:
        return ChipSpec(base.name, float(np.exp(theta[0])), base.mem_gb, float(np.exp(theta[1])),
                        base.interconnect_gb_s, base.price_per_hour, 1.0, 1.0, float(np.exp(theta[2])), base.description)

    def loss(theta: np.ndarray) -> float:
        c = chip(theta)
        return float(sum((math.log(_predict(c, m, k, x)) - math.log(t)) ** 2 for k, x, t in pts))

    best = None
    for start in ([math.log(0.05), math.log(5.0), math.log(2.0)], [math.log(0.5), math.log(50.0), math.log(0.5)]):
        r = minimize(loss, np.array(start), method="Nelder-Mead", options={"maxiter": 4000, "xatol": 1e-4, "fatol": 1e-8})
        if best is None or r.fun < best.fun:
            best = r
    return chip(best.x), math.sqrt(best.fun / len(pts))


def calibrate(out: Path = CPU_FIT, repeats: int = 5, scenario: str = "cpu_validate") -> dict[str, Any]:
    """Time the CPU engine, fit the catalog's cpu-small to it and write the fit with its
    measurements to `out` (the catalog is not rewritten: copy the `fitted` entry there)."""
    import yaml

    sc = load_scenario(scenario)
    base = sc.chips["cpu-small"]
    t = _engine_timings(repeats)
    chip, rmse = fit_chip(t, sc.model, base)
    pred = {k: [(x, _predict(chip, sc.model, k, x)) for x, _ in v] for k, v in t.items()}
    head = ("# cpu-small: the embedded 4-layer Llama (pdd_serve.checkpoints.default_model_path(), fp32) on this\n"
            "# machine's CPU, as one replica sees it. FITTED, not assumed: `python -m evaluations.sim.validate\n"
            f"# --calibrate` timed the engine directly on {time.strftime('%Y-%m-%d %H:%M')} (min of {repeats}) and fitted\n"
            "# peak_tflops, mem_bw_gb_s and forward_overhead_ms (mfu = mbu = 1) by least squares in log time;\n"
            f"# rms log error {rmse:.3f}. mem_gb = weights + graphs/*.yaml's kv_cache_bytes (256 MiB).\n"
            "# The chip the simulator uses is pdd_serve/emulation/costmodel.yaml's cpu-small: `fitted` is\n"
            "# what this calibration would put there.\n")
    doc = {"fitted": {"cpu-small": {"description": base.description, "peak_tflops": round(chip.peak_tflops, 6),
                                   "mem_gb": base.mem_gb, "mem_bw_gb_s": round(chip.mem_bw_gb_s, 4),
                                   "interconnect_gb_s": base.interconnect_gb_s, "mfu": 1.0, "mbu": 1.0,
                                   "forward_overhead_ms": round(chip.forward_overhead_ms, 4),
                                   "price_per_hour": base.price_per_hour}},
           "measurements": {k: [{"x": x, "measured_s": round(tm, 6), "fitted_s": round(p, 6)}
                                for (x, tm), (_, p) in zip(v, pred[k])] for k, v in t.items()},
           "fit_rms_log_error": round(rmse, 4)}
    out.write_text(head + yaml.safe_dump(doc, sort_keys=False))
    return doc


# ---------------------------------------------------------------- a synthetic record file


def make_synthetic(path: str | Path, scenario: str = "cpu_validate", graphs: tuple[str, ...] = ("pdd",),
                   requests: int = 120, rate: float = 2.0, noise: float = 0.1, seed: int = 0) -> Path:
    """Records in RequestRecord.as_row() shape from a simulated run, times perturbed by lognormal
    noise: they test the plumbing (reading, replay, metrics), not the model."""
    from evaluations.sim.metrics import tpot, ttft
    from evaluations.sim.simulator import Simulation
    from evaluations.sim.workload import synthetic

    sc = load_scenario(scenario)
    rng = np.random.default_rng(seed)
    rows = []
    for g in graphs:
        wl = synthetic(sc.workload, rate_rps=rate, requests=requests)
        for r in Simulation(sc, sc.deployments[g], wl).run():
            k = float(np.exp(noise * rng.standard_normal()))
            t1, tp = ttft(r, sc.sla) * k, tpot(r, sc.sla) * k
            rows.append({"graph": g, "session_id": f"s{r.rid}", "turn": 0, "kind": r.kind, "prompt_tokens": r.prompt,
                         "max_tokens": r.output, "t_send_s": r.arrival, "status": 200,
                         "error": r.fallback if r.fallback.startswith("failed") else "", "ttft_s": t1,
                         "tpot_s": tp if r.output > 1 else None, "e2e_s": t1 + tp * (r.output - 1),
                         "output_tokens": r.output, "pdd_pipeline": r.pipeline,
                         "pdd_prefix_hit_p": r.hit_p / r.prompt, "pdd_prefix_hit_md": r.hit_md / r.prompt})
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        keys = list(rows[0])
        pq.write_table(pa.table({k: [row[k] for row in rows] for k in keys}), path)
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluations.sim.validate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="?", help="per-request records of a real run (parquet/csv/json/jsonl)")
    ap.add_argument("--scenario", default="cpu_validate", help="scenario with one deployment per graph (default: %(default)s)")
    ap.add_argument("--emulated", metavar="SCENARIO", default=None,
                    help="records of `pdd compare --emulate SCENARIO`: replay them on that emulated scenario "
                         "(evaluations/scenarios/NAME.yaml: its model, chips, link and SLA), not --scenario")
    ap.add_argument("--graph", default=None, help="only this graph (or the graph of a file without a graph column)")
    ap.add_argument("--sla-ttft", type=float, default=None, help="SLA TTFT bound, s (default: the scenario's)")
    ap.add_argument("--sla-tpot", type=float, default=None, help="SLA TPOT bound, s (default: the scenario's)")
    ap.add_argument("--fit-platform", metavar="GRAPH", default=None,
                    help="fit the control-plane overhead on this graph's records (e.g. pd_same_dc), "
                         "then predict the other graphs out of sample")
    ap.add_argument("--draws", type=int, default=8,
                    help="link-jitter seeds per cross-site graph; the prediction is their mean (default: %(default)s)")
    ap.add_argument("--ttft-from", choices=("client", "prefill"), default=None,
                    help="TTFT convention of the records: client (P->MD's first token leaves with MD's first "
                         "chunk: pdd_serve's default) or prefill (stream_first_token runs); default: the scenario's")
    ap.add_argument("--open-loop", action="store_true",
                    help="replay every request at its recorded send time (default: a session's later turns "
                         "follow the simulated answers, as loadgen sends them)")
    ap.add_argument("--link", default=None,
                    help="replay every cross-site graph on this scenario link (e.g. wan_shaped for a "
                         "`--shaped-link` record; default: each deployment's own)")
    ap.add_argument("--tolerance", type=float, default=0.2, help="relative error flagged (default: %(default)s)")
    ap.add_argument("--calibrate", action="store_true",
                    help="time the CPU engine and fit the chip cpu-small (written to cpu_small.yaml)")
    ap.add_argument("--repeats", type=int, default=5, help="calibration repetitions (default: %(default)s)")
    ap.add_argument("--make-synthetic", metavar="OUT", default=None, help="write a synthetic record file and exit")
    args = ap.parse_args(argv)
    try:
        if args.calibrate:
            doc = calibrate(repeats=args.repeats, scenario=args.scenario)
            c = doc["fitted"]["cpu-small"]
            for k, v in doc["measurements"].items():
                for p in v:
                    print(f"{k:<8}{p['x']:>6}  measured {p['measured_s'] * 1e3:8.2f} ms  fitted {p['fitted_s'] * 1e3:8.2f} ms")
            print(json.dumps({"calibrated": str(CPU_FIT), **c, "fit_rms_log_error": doc["fit_rms_log_error"]}))
            print(f"copy `fitted` into {CATALOG_PATH}'s cpu-small to simulate with it", file=sys.stderr)
            return 0
        if args.make_synthetic:
            p = make_synthetic(args.make_synthetic, args.scenario)
            print(json.dumps({"records": str(p)}))
            return 0
        if not args.records:
            ap.error("give a record file (or --calibrate / --make-synthetic)")
        if args.emulated:
            sc = sim_scenario_for(load_emulated(args.emulated))
        else:
            sc = load_scenario(args.scenario)
        if args.link:
            sc = with_link(sc, args.link)
        if args.draws < 1:
            raise ScenarioError(f"--draws must be >= 1, got {args.draws}")
        if args.ttft_from:
            import dataclasses

            sc = dataclasses.replace(sc, sla=dataclasses.replace(sc.sla, ttft_from=args.ttft_from))
        sessions = not args.open_loop
        rows = read_records(args.records)
        ttft_s = args.sla_ttft or sc.sla.ttft_s
        tpot_s = args.sla_tpot or sc.sla.tpot_s
        platform = None
        if args.fit_platform:
            fit_rows = [r for r in rows if str(r.get("graph") or args.fit_platform) == args.fit_platform]
            if not fit_rows or args.fit_platform not in sc.deployments:
                raise ScenarioError(f"--fit-platform {args.fit_platform}: no such graph in the records/scenario")
            sc, platform = fit_platform(sc, args.fit_platform, fit_rows, ttft_s, tpot_s, sessions)
            print(f"platform fitted on {args.fit_platform} (in sample): request overhead "
                  f"{platform['request_overhead_s']:.3f} s, compute x{platform['compute_slowdown']:.2f}, MD call overhead "
                  f"{platform['md_call_overhead_s']:.3f} s, decode step overhead "
                  f"{platform['decode_step_overhead_ms']:.1f} ms; the other graphs are out of sample")
        res = validate(sc, rows, ttft_s, tpot_s, [args.graph] if args.graph else None, args.draws, sessions)
    except ScenarioError as e:
        print(f"validate: error: {e}", file=sys.stderr)
        return 2
    print(format_validation(res, args.tolerance))
    held = {g: r for g, r in res.items() if platform is None or g != platform["fit_graph"]}
    worst = max((abs(e) for r in held.values() for e in r["rel_error"].values() if math.isfinite(e)), default=math.nan)
    print(json.dumps({"records": args.records, "sla_ttft_s": ttft_s, "sla_tpot_s": tpot_s, "platform": platform,
                      "max_abs_rel_error_out_of_sample" if platform else "max_abs_rel_error": worst,
                      "within_tolerance": bool(worst <= args.tolerance),
                      "graphs": {g: {"rel_error": r["rel_error"], "measured": {k: r["measured"][k] for k in
                                 ("ttft_p50", "ttft_p90", "goodput_rps")},
                                     "predicted": {k: r["predicted"][k] for k in ("ttft_p50", "ttft_p90", "goodput_rps")}}
                                 for g, r in res.items()}}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
