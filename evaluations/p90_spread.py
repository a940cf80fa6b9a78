"""How much a P90 ratio between two graphs moves from one draw of the line to the next, from an
emulated compare's own records: the simulator replays one repeat of each graph on many draws of
the line, and on longer repeats made of back-to-back copies of it (the same load, more requests),
and reports the ratio's distribution and the spread three repeats would show.

    python -m evaluations.p90_spread .pdd/eval/pdd-compare-emulated-<time> [--draws 30] [--tiles 1,4,16]

It is the evidence for what a `--repeats 3` spread of the P90 ratio can be on a jittered line
(README, "EMULATED chips"): a property of the link and the run's length, not of the measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from evaluations.sim.config import Scenario, load_scenario
from evaluations.sim.metrics import ttft
from evaluations.sim.simulator import Simulation
from evaluations.sim.validate import read_records, records_to_workload, with_link_seed
from pdd_serve.emulation.clock import Clock


def tiled(rows: list[dict[str, Any]], k: int, gap_s: float = 2.0) -> list[dict[str, Any]]:
    """k back-to-back copies of one repeat's requests (each copy starts after the previous ends)."""
    t0 = min(r["t_send_s"] for r in rows)
    span = max(r["t_send_s"] - t0 + (r.get("e2e_s") or 0.0) for r in rows) + gap_s
    return [{**r, "t_send_s": r["t_send_s"] + c * span, "session_id": f"{r.get('session_id')}-{c}"}
            for c in range(k) for r in rows]


def p90_ttft(sc: Scenario, graph: str, rows: list[dict[str, Any]], seed: int) -> float:
    s = with_link_seed(sc, graph, seed, 0.0)
    reqs = Simulation(s, s.deployments[graph], records_to_workload(rows, sc.workload.block_size)).run()
    return float(np.percentile([ttft(r, s.sla) for r in reqs], 90))


def p90_ratio_spread(sc: Scenario, rows: list[dict[str, Any]], num: str = "pdd", den: str = "pd_cross_dc",
                     draws: int = 30, tiles: tuple[int, ...] = (1, 4, 16), repeats: int = 3,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Per tile count: the P90 ratio num/den over `draws` draws of the line (median, p10, p90) and
    the spread ((max - min) / median) of `repeats` draws picked at random, median and P(<= 0.10)."""
    rng = random.Random(seed)
    first = {g: [r for r in rows if r.get("graph") == g and int(r.get("repeat") or 0) == 0] for g in (num, den)}
    out = []
    for k in tiles:
        a, b = tiled(first[num], k), tiled(first[den], k)
        ratios = [p90_ttft(sc, num, a, d) / p90_ttft(sc, den, b, d) for d in range(draws)]
        spreads = []
        for _ in range(2000):
            x = rng.sample(ratios, repeats)
            spreads.append((max(x) - min(x)) / statistics.median(x))
        out.append({"requests_per_repeat": len(a), "ratio_median": statistics.median(ratios),
                    "ratio_p10": float(np.percentile(ratios, 10)), "ratio_p90": float(np.percentile(ratios, 90)),
                    "spread_median": statistics.median(spreads),
                    "p_spread_le_0_10": float(np.mean([s <= 0.10 for s in spreads]))})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluations.p90_spread", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="an emulated compare's output directory (requests.parquet, "
                                               "sim_scenario.yaml)")
    ap.add_argument("--draws", type=int, default=30, help="draws of the line per repeat length (default 30)")
    ap.add_argument("--tiles", default="1,4,16", help="repeat lengths, in copies of one repeat (default 1,4,16)")
    ap.add_argument("--overhead-ms", type=float, default=None,
                    help="software overhead per request, real ms (default: the run's summary.json)")
    args = ap.parse_args(argv)
    for f in ("requests.parquet", "sim_scenario.yaml"):
        if not (args.run_dir / f).is_file():
            ap.error(f"{args.run_dir / f} is missing: give the directory `pdd compare --emulate` printed")
    if args.draws < 3:
        ap.error("--draws must be >= 3")
    sc = load_scenario(args.run_dir / "sim_scenario.yaml")
    head = json.loads((args.run_dir / "summary.json").read_text())["headline"] if (args.run_dir / "summary.json").is_file() else {}
    ov = (Clock(head.get("time_scale", 1.0)).emulated(args.overhead_ms / 1e3) if args.overhead_ms is not None
          else head.get("sim_request_overhead_s", 0.0))
    sc = dataclasses.replace(sc, scheduler=dataclasses.replace(sc.scheduler, request_overhead_s=ov))
    try:
        tiles = tuple(int(x) for x in args.tiles.split(","))
    except ValueError:
        ap.error(f"--tiles: comma-separated integers, got {args.tiles!r}")
    rows = read_records(args.run_dir / "requests.parquet")
    for g in ("pdd", "pd_cross_dc"):
        if not any(r.get("graph") == g and int(r.get("repeat") or 0) == 0 for r in rows):
            ap.error(f"{args.run_dir}: no repeat-0 records of graph {g!r}: the run must include pdd and pd_cross_dc")
    res = p90_ratio_spread(sc, rows, draws=args.draws, tiles=tiles)
    print("requests/repeat  P90 ratio median [p10, p90]  spread of 3 (median)  P(spread <= 0.10)")
    for r in res:
        print(f"{r['requests_per_repeat']:>15}  {r['ratio_median']:.3f} [{r['ratio_p10']:.3f}, {r['ratio_p90']:.3f}]"
              f"  {r['spread_median']:>20.2f}  {r['p_spread_le_0_10']:>17.2f}")
    print(json.dumps({"simulated": True, "draws": args.draws, "rows": res}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
