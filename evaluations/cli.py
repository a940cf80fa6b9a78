"""`pdd demo`, `pdd compare`, `pdd sweep hit-rate`, `pdd scale` and `pdd runs`: the evaluation subcommands.

EVAL_COMMANDS is registered with the `pdd` CLI through the entry-point group `pdd_serve.commands`
(pyproject.toml); pdd_serve imports nothing from here. This module stays light at import (argparse
only): the evaluation modules, Ray, MLflow and matplotlib are imported when a command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from pdd_serve.cli import Command, UsageError


def _usage(msg: str) -> Exception:
    return UsageError(msg)


# ---------------------------------------------------------------- shared arguments


def _add_env(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--no-cluster", action="store_true",
                   help="use the running cluster named by RAY_ADDRESS (eval \"$(pdd cluster env)\") instead of "
                        "starting one; its Serve instance is taken over and shut down at the end")
    g.add_argument("--cluster-port", type=int, default=6420, help="GCS port of the cluster started (default: %(default)s)")
    g.add_argument("--state-dir", default=".pdd/eval-cluster", help="its state dir (default: %(default)s)")
    g.add_argument("--http-port", type=int, default=8420, help="Serve HTTP port of the graphs (default: %(default)s)")
    g.add_argument("--keep-cluster", action="store_true", help="leave the started cluster running")


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("graphs and link")
    g.add_argument("--link", default=None,
                   help="the emulated WAN for every cross-site graph: a preset name or a YAML mapping like the "
                        "graphs' `link:` (default: graphs/pdd.yaml's)")
    g = p.add_argument_group("SLA and cost")
    g.add_argument("--sla-ttft", type=float, default=1.0, help="TTFT target, seconds (default: %(default)s)")
    g.add_argument("--sla-tpot", type=float, default=0.1, help="TPOT target, seconds (default: %(default)s)")
    g.add_argument("--chip", action="append", default=[], metavar="SITE=CHIP",
                   help="chip at a site, from the catalog (default: a=cpu b=cpu); repeatable")
    g.add_argument("--catalog", default=None,
                   help="your own chip catalog YAML (pdd_serve/emulation/costmodel.yaml's schema), its entries over the "
                        "shipped catalog's")
    g = p.add_argument_group("tracking and output")
    g.add_argument("--experiment", default=None, help="MLflow experiment name")
    g.add_argument("--tracking-uri", default=None,
                   help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    g.add_argument("--no-mlflow", action="store_true", help="don't log to MLflow")
    g.add_argument("--out", default=None, help="directory for plots/tables (default: .pdd/eval/EXPERIMENT-TIME)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds (default: %(default)s)")
    _add_env(p)


def _chips(items: list[str]) -> tuple[tuple[str, str], ...]:
    chips = {"a": "cpu", "b": "cpu"}
    for it in items:
        site, sep, chip = it.partition("=")
        if not sep or not site or not chip:
            raise _usage(f"--chip expects SITE=CHIP, got {it!r}")
        chips[site] = chip
    return tuple(sorted(chips.items()))


def _common_kwargs(args: argparse.Namespace, default_experiment: str) -> dict[str, Any]:
    from evaluations.harness import EvalEnv, parse_link
    from evaluations.loadgen import SLA, LoadConfig
    from pdd_serve.emulation.costmodel import CATALOG_PATH

    try:
        return {"link": parse_link(args.link), "sla": SLA(args.sla_ttft, args.sla_tpot),
                "load": LoadConfig(timeout_s=args.timeout),
                "env": EvalEnv(args.cluster_port, args.state_dir, args.http_port, args.no_cluster, args.keep_cluster),
                "site_chips": _chips(args.chip), "catalog": args.catalog or str(CATALOG_PATH),
                "experiment": args.experiment or default_experiment, "tracking_uri": args.tracking_uri,
                "mlflow": not args.no_mlflow, "out_dir": args.out, "progress": not args.no_progress}
    except ValueError as e:
        raise _usage(str(e)) from None


def _fail(cmd: str, e: Exception) -> int:
    print(f"pdd {cmd}: {e}", file=sys.stderr)
    return 1


# ---------------------------------------------------------------- demo

DEMO_DESCRIPTION = """\
The main job: start a local two-site Ray cluster (raylets labelled pdd.site=a and pdd.site=b on
this machine), deploy a graph YAML with `serve run --non-blocking`, drive a short agentic workload
(multi-turn sessions sharing a system prompt, a few cold long documents, one anomalous request)
through the OpenAI-compatible API, print what PDD did per pipeline, and tear everything down.
"""


def _add_demo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("torch", "vllm"), default="torch",
                   help="torch (default): our engine, the agentic workload below. vllm: vLLM behind every "
                        "engine (graphs/pdd_vllm.yaml; pip install -e '.[vllm]'), %(prog)s streams --requests "
                        "requests at once through P-MD and P-RLD-MD (one-shot and catch-up) and checks every "
                        "token against vLLM's own single-engine greedy generate")
    p.add_argument("--graph", default=None,
                   help="Serve config to deploy (default: graphs/pdd.yaml; with --backend vllm graphs/pdd_vllm.yaml)")
    p.add_argument("--requests", type=int, default=18, help="--backend vllm: requests in flight at once (default: %(default)s)")
    p.add_argument("--sessions", type=int, default=4, help="agentic sessions (default: %(default)s)")
    p.add_argument("--turns", type=int, default=3, help="turns per session (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="leave the cluster serving afterwards (pdd cluster down stops it)")


def _run_demo(args: argparse.Namespace) -> int:
    from evaluations.demo import run_demo
    from pdd_serve.cluster.deploy import DeployError
    from pdd_serve.cluster.local import ClusterError

    if args.sessions <= 0 or args.turns <= 0:
        raise _usage("pdd demo: error: --sessions and --turns must be > 0")
    if args.requests < 3:
        raise _usage("pdd demo: error: --requests must be >= 3 (one per pipeline and handoff mode)")
    try:
        if args.backend == "vllm":
            from evaluations.vllm_demo import run_vllm_demo

            return run_vllm_demo(args.graph or "graphs/pdd_vllm.yaml", requests=args.requests, keep=args.keep)
        return run_demo(args.graph or "graphs/pdd.yaml", keep=args.keep, sessions=args.sessions, turns=args.turns)
    except (DeployError, ClusterError) as e:
        print(f"pdd demo: {e}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------- compare

COMPARE_DESCRIPTION = """\
Run one workload through pd_same_dc, pd_cross_dc and pdd (graphs/*.yaml) on the same emulated link,
in one invocation on one local two-site cluster: each graph is deployed in turn with `serve run`
(from a private copy of its YAML on --http-port), driven, and shut down. Prints a side-by-side table
and ends with one JSON line: p90_ttft_vs_cross_dc, p50_ttft_vs_same_dc, goodput_vs_cross_dc,
rld_token_share, outputs_identical (greedy token ids identical across graphs for every request),
the same ratios on the time to the 2nd token (*_tt2t_*), BCR ratios and absolute figures.
Every graph run is an MLflow run (params, metrics, TTFT CDF plot, per-request Parquet) under a
parent run for the comparison; `pdd runs` lists them.

Workloads:
  agentic   multi-turn agent sessions with a target prefix-hit distribution (--hit), growing
            contexts, cold documents (hit 0) and a share of anomalous long-input/short-output requests
  mooncake  a slice of a Mooncake-format trace (--trace), hash ids mapped to token ids, token counts
            scaled by --block-tokens/512

Emulated accelerators (--emulate SCENARIO, e.g. emulated_70b): every graph runs the real small model
but each engine step is paced to the scenario's model on its chips (llama-3-70b: prefill on H100s in
site a, decode on H20s in site b; same-DC all H100), KV crosses the link at the emulated size, and
everything runs in slow motion (the scenario's time_scale), so this machine's CPU is a small share of
each step. Times print in emulated seconds and say so; the JSON adds each ratio's median and spread
over --repeats, BCR on the emulated chips' prices, the pacers' overrun per step kind (above 5%: raise
time_scale), the software overhead in real ms, and the simulator's replay of the same requests
(sim_* keys, sim_vs_real_max_rel_err). About 25 minutes for the first repeat here, 15 for each
later one with --naive-once (55 minutes for --repeats 3).
"""


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    from evaluations.workloads import AgenticWorkload, TraceReplay

    a, t = AgenticWorkload(), TraceReplay()
    p.add_argument("--workload", choices=("agentic", "mooncake"), default="agentic", help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"agentic: output tokens per turn (default: {a.max_tokens})")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every graph this many times, alternating the order (default: %(default)s)")
    p.add_argument("--graphs", default=None, help="comma-separated graph YAMLs (default: the three under graphs/)")
    g = p.add_argument_group("agentic workload")
    g.add_argument("--sessions", type=int, default=a.sessions, help="(default: %(default)s)")
    g.add_argument("--turns", type=int, default=a.turns, help="(default: %(default)s)")
    g.add_argument("--system-tokens", type=int, default=a.system_tokens, help="shared system prompt (default: %(default)s)")
    g.add_argument("--hit", default=str(a.hit),
                   help="target prefix-hit distribution, bands W:LO-HI,... or one value (default: %(default)s)")
    g.add_argument("--anomalous-share", type=float, default=a.anomalous_share, help="(default: %(default)s)")
    g.add_argument("--session-rate", type=float, default=a.session_rate, help="sessions per second (default: %(default)s)")
    g.add_argument("--think-s", type=float, default=a.think_s, help="mean pause between turns (default: %(default)s)")
    g = p.add_argument_group("mooncake trace replay")
    g.add_argument("--trace", default=t.path, help="Mooncake-format JSONL (default: %(default)s)")
    g.add_argument("--block-tokens", type=int, default=t.block_tokens,
                   help="tokens per 512-token trace block: the input scale (default: %(default)s)")
    g.add_argument("--output-scale", type=float, default=None, help="output-length scale (default: the input scale)")
    g.add_argument("--max-output-tokens", type=int, default=t.max_output_tokens, help="(default: %(default)s)")
    g.add_argument("--min-output-tokens", type=int, default=t.min_output_tokens, help="(default: %(default)s)")
    g.add_argument("--start-s", type=float, default=0.0, help="trace window start, seconds (default: %(default)s)")
    g.add_argument("--window-s", type=float, default=None, help="trace window length, seconds (default: no limit)")
    g.add_argument("--max-requests", type=int, default=t.max_requests, help="request cap (default: %(default)s)")
    g.add_argument("--arrival", choices=("trace", "poisson"), default="trace",
                   help="trace timestamps or Poisson arrivals (default: %(default)s)")
    g.add_argument("--gap-scale", type=float, default=1.0, help="stretch the trace's gaps (default: %(default)s)")
    g.add_argument("--rate", type=float, default=1.0, help="poisson: requests per second (default: %(default)s)")


def _workload(args: argparse.Namespace) -> Any:
    from evaluations.workloads import (
        AgenticWorkload,
        HitDistribution,
        TraceError,
        TraceReplay,
        agentic_workload,
        trace_workload,
    )

    try:
        if args.workload == "agentic":
            kw = {"max_tokens": args.max_tokens} if args.max_tokens else {}
            return agentic_workload(AgenticWorkload(
                sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                hit=HitDistribution.parse(args.hit), anomalous_share=args.anomalous_share,
                session_rate=args.session_rate, think_s=args.think_s, seed=args.seed, **kw))
        return trace_workload(TraceReplay(
            path=args.trace, block_tokens=args.block_tokens, output_scale=args.output_scale,
            min_output_tokens=args.min_output_tokens, max_output_tokens=args.max_output_tokens,
            start_s=args.start_s, window_s=args.window_s, max_requests=args.max_requests, arrival=args.arrival,
            gap_scale=args.gap_scale, rate=args.rate, seed=args.seed))
    except TraceError as e:
        raise _usage(f"pdd compare: error: {e}") from None
    except ValueError as e:
        raise _usage(f"pdd compare: error: {e}") from None


def _add_compare(p: argparse.ArgumentParser) -> None:
    _add_workload_args(p)
    _add_common(p)
    g = p.add_argument_group("link and first-token convention")
    g.add_argument("--shaped-link", default=None, metavar="RATE[,DELAY,JITTER,LOSS]",
                   help="run on a cluster whose site b sits behind a kernel-shaped veth (root; as `pdd cluster up "
                        "--shaped-link`), with the local-shaped graphs under cluster_configs/graphs/ by default; "
                        "delay the kernel can't shape (no netem) comes from the graphs' application-level link")
    g.add_argument("--stream-first-token", action="store_true",
                   help="every graph streams P's first token at once (default: the PD convention, the first "
                        "token leaves with the decoder's stream); one convention for all graphs either way")
    p.add_argument("--naive-once", action="store_true",
                   help="run pd_cross_dc_naive in the first repeat only (every prompt crosses whole: the slowest "
                        "graph to run); its ratios then have no spread")
    g = p.add_argument_group("emulated accelerators")
    g.add_argument("--emulate", default=None, metavar="SCENARIO",
                   help="run every graph on emulated chips: real tokens, each engine step paced to the scenario's "
                        "model on its chips, KV on the line at the emulated size, in slow motion "
                        "(evaluations/scenarios/NAME.yaml or a path; e.g. emulated_70b). The scenario gives the "
                        "link, the SLA, the workload's shape and time_scale; every figure printed is emulated")
    g.add_argument("--check-blind", action="store_true",
                   help="with --capacity: probe each graph only at the two rates of its blind bracket (met, missed) "
                        "instead of searching: a check of the prediction in two probes per graph, not a capacity")
    g.add_argument("--time-scale", type=float, default=None,
                   help="with --emulate: run in slow motion at this factor instead of the scenario's time_scale "
                        "(lower is faster to run; the JSON's emulation_overrun_share_* say whether this machine "
                        "kept up: above 0.05, raise it)")
    g.add_argument("--capacity", action="store_true",
                   help="with --emulate: BCR the report's way. Each graph's capacity (the highest offered rate at "
                        "which 90%% of requests meet both SLOs; a 503 is a miss), bracketed within 10%% by open-loop "
                        "probes of >= 100 requests whose later turns carry the reference answers; a calibration "
                        "step and the simulator's blind prediction come first. BCR = capacity per $/h of every "
                        "chip (replicas priced whole) and the line, at market and the report's relative prices. "
                        "Default graphs: pd_same_dc, pd_cross_dc, pdd. About 60-75 minutes here at time_scale 20. "
                        "A scenario with `measure:` (report_64k: 1K-token answers) runs every graph at one rate "
                        "instead of searching (0.8 x the strong cross-DC PD's blind capacity unless it sets rate_rps)")


def _run_compare(args: argparse.Namespace) -> int:
    from evaluations.compare import CompareConfig, run_compare
    from evaluations.cost import CatalogError
    from evaluations.harness import DEFAULT_GRAPHS, SHAPED_GRAPHS, EvalError
    from pdd_serve.cluster.local import ClusterError
    from pdd_serve.emulation.costmodel import CostModelError

    scenario = None
    if args.time_scale is not None and not args.emulate:
        raise _usage("pdd compare: error: --time-scale sets an emulated run's slow motion: it needs --emulate SCENARIO")
    if args.emulate:
        from evaluations.sim.emulated import ScenarioError, load_scenario

        try:
            scenario = load_scenario(args.emulate)
        except ScenarioError as e:
            raise _usage(f"pdd compare: error: {e}") from None
        if args.shaped_link:
            raise _usage("pdd compare: error: --emulate paces the link in slow motion; drop --shaped-link")
        if args.time_scale is not None:
            from pdd_serve.emulation.clock import Clock

            try:
                scenario = dataclasses.replace(scenario, time_scale=float(Clock(args.time_scale).time_scale))
            except ValueError as e:
                raise _usage(f"pdd compare: error: --time-scale: {e}") from None
        if scenario.context_scale != 1 and not args.capacity:  # the replay below counts real prompt tokens
            raise _usage(f"pdd compare: error: {scenario.name} runs at context_scale {scenario.context_scale}: "
                         "run it with --capacity (the makespan compare's replay does not scale prompts)")
        from evaluations.workloads import AgenticWorkload

        shape = {f.name for f in dataclasses.fields(AgenticWorkload)}
        for k, v in scenario.workload.items():  # the scenario's workload shape, over the flags' defaults
            if not hasattr(args, k) and args.capacity and k in shape:
                continue  # --capacity builds its probes from the scenario's workload itself (agentic_spec)
            if not hasattr(args, k):
                raise _usage(f"pdd compare: error: {scenario.path}: workload.{k}: unknown agentic workload setting")
            setattr(args, k, v)
        args.link = json.dumps(scenario.link)
        args.sla_ttft, args.sla_tpot = scenario.sla.ttft_s, scenario.sla.tpot_s
    if args.check_blind and not args.capacity:
        raise _usage("pdd compare: error: --check-blind checks a capacity prediction: it needs --capacity")
    if args.capacity:
        return _run_capacity(args, scenario)
    workload = _workload(args)
    default = SHAPED_GRAPHS if args.shaped_link else DEFAULT_GRAPHS
    graphs = tuple(g.strip() for g in args.graphs.split(",") if g.strip()) if args.graphs else default
    try:
        kw = _common_kwargs(args, "pdd-compare")
        if args.shaped_link:
            if kw["env"].use_running_cluster:
                raise ValueError("--shaped-link starts its own cluster: drop --no-cluster")
            kw["env"] = dataclasses.replace(kw["env"], shaped_link=args.shaped_link)
        if scenario is not None:
            kw["load"] = dataclasses.replace(kw["load"], time_scale=scenario.time_scale)
            kw["experiment"] = args.experiment or "pdd-compare-emulated"
        argv = getattr(args, "_argv", None)
        cfg = CompareConfig(graphs=graphs, repeats=args.repeats, stream_first_token=args.stream_first_token,
                            emulate=scenario, naive_once=args.naive_once,
                            command="pdd " + shlex.join(argv) if argv else None, **kw)
    except ValueError as e:
        raise _usage(f"pdd compare: error: {e}") from None
    try:
        res = run_compare(workload, cfg)
    except (EvalError, ClusterError, CatalogError, CostModelError) as e:
        return _fail("compare", e)
    return 1 if res["headline"]["mismatched_requests"] or any(
        s["errors"] for s in res["summaries"].values()) else 0


def _run_capacity(args: argparse.Namespace, scenario: Any) -> int:
    from evaluations.capacity_compare import CAPACITY_GRAPHS, CapacityConfig, run_capacity_compare
    from evaluations.harness import EvalError
    from pdd_serve.cluster.local import ClusterError

    if scenario is None:
        raise _usage("pdd compare: error: --capacity needs --emulate SCENARIO (capacity is searched on emulated chips)")
    if args.repeats != 1 or args.naive_once:
        raise _usage("pdd compare: error: --capacity searches each graph once; drop --repeats/--naive-once")
    graphs = tuple(g.strip() for g in args.graphs.split(",") if g.strip()) if args.graphs else CAPACITY_GRAPHS
    try:
        cap = CapacityConfig.of(scenario.capacity)
        kw = _common_kwargs(args, "pdd-capacity")
        load = dataclasses.replace(kw["load"], time_scale=scenario.time_scale)
    except ValueError as e:
        raise _usage(f"pdd compare: error: {scenario.path}: {e}") from None
    tracker = None
    if kw["mlflow"]:
        from evaluations.tracking import Tracker

        tracker = Tracker(kw["tracking_uri"], kw["experiment"])  # a bad store fails before the long runs
    out_dir = Path(kw["out_dir"] or f".pdd/eval/{kw['experiment']}-{time.strftime('%Y%m%d-%H%M%S')}")
    argv = getattr(args, "_argv", None)
    command = "pdd " + shlex.join(argv) if argv else f"pdd compare --emulate {scenario.name} --capacity"
    try:
        res = run_capacity_compare(scenario, graphs, kw["env"], load, out_dir, tracker, command, cap,
                                   progress=kw["progress"], check_blind=args.check_blind)
    except (EvalError, ClusterError) as e:
        return _fail("compare", e)
    h = res["headline"]
    return 1 if h["errors"] or not h["outputs_identical"] else 0


# ---------------------------------------------------------------- sweep

SWEEP_DESCRIPTION = """\
PDD's benefit over naive cross-DC PD as a function of the prefix-hit rate (docs/pdd.md's bathtub).

  pdd sweep hit-rate [--points 0,0.4,0.7,0.95] [--requests 6]

Each point is a set of independent requests that all hit the given fraction of their prompt (a
warm-up request puts the prefix into both caches first). pd_cross_dc and pdd are each deployed
once and run every point; one MLflow run per point (both graphs' figures and the ratios) under a
parent run with the plot; a table and one final JSON line.
"""


def _add_sweep(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sweep_kind", metavar="KIND")
    h = sub.add_parser("hit-rate", help="benefit vs prefix-hit rate", description=SWEEP_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    from evaluations.sweep import SweepConfig

    d = SweepConfig()
    h.add_argument("--points", default=",".join(f"{x:g}" for x in d.points),
                   help="hit rates, comma-separated (default: %(default)s)")
    h.add_argument("--requests", type=int, default=d.requests, help="requests per point (default: %(default)s)")
    h.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="(default: %(default)s)")
    h.add_argument("--max-tokens", type=int, default=d.max_tokens, help="(default: %(default)s)")
    h.add_argument("--rate", type=float, default=d.rate, help="arrivals per second (default: %(default)s)")
    h.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    _add_common(h)
    h.set_defaults(sweep_parser=h)
    p.set_defaults(sweep_parser=p)


def _run_sweep(args: argparse.Namespace) -> int:
    if getattr(args, "sweep_kind", None) != "hit-rate":
        args.sweep_parser.print_help(sys.stderr)
        return 2
    from evaluations.cost import CatalogError
    from evaluations.harness import EvalError
    from evaluations.sweep import SweepConfig, run_sweep
    from pdd_serve.cluster.local import ClusterError
    from pdd_serve.emulation.costmodel import CostModelError

    try:
        points = tuple(float(x) for x in args.points.split(",") if x.strip())
        cfg = SweepConfig(points=points, requests=args.requests, prompt_tokens=args.prompt_tokens,
                          max_tokens=args.max_tokens, rate=args.rate, seed=args.seed,
                          **_common_kwargs(args, "pdd-sweep-hit-rate"))
    except ValueError as e:
        raise _usage(f"pdd sweep hit-rate: error: {e}") from None
    try:
        res = run_sweep(cfg)
    except (EvalError, ClusterError, CatalogError, CostModelError) as e:
        return _fail("sweep hit-rate", e)
    return 0 if res["final"]["outputs_identical"] else 1


# ---------------------------------------------------------------- scale

SCALE_DESCRIPTION = """\
Ramp the offered load until Serve's autoscaler adds a second MainDecode replica, and show what the
system delivers before and after. Deploys --graph (graphs/pdd.yaml: MainDecode autoscaling_config
min 1, max 2, target_ongoing_requests 4, as written in the graph) on the local two-site cluster and
offers requests (a shared --system-tokens prompt, warmed first, plus --prompt-tokens fresh
tokens; --max-tokens out, greedy, ignore_eos) in four phases:

  probe   target_ongoing_requests clients in a closed loop for --probe-s seconds against the
          graph with MainDecode fixed at one replica calibrate the rates to this machine's speed:
          the probe's throughput is capacity_rps, the offered rate at which the graph holds the
          autoscaling target in flight (Little's law), measured at that load; --rate-before
          defaults to --load-before x capacity_rps (one replica stays under its target),
          --rate-after to --load-after x capacity_rps (past it: Serve adds a replica)
  before  open-loop Poisson, --rate-before req/s for --before-s seconds (one MD replica serves it)
  ramp    --rate-after req/s until Serve reports a 2nd RUNNING MainDecode replica; an error after
          --ramp-timeout seconds, with what was measured (replicas, running sequences on MD,
          Serve's autoscaling log lines)
  after   --rate-after req/s for --after-s more seconds on 2 replicas

The MD replica count is sampled every 0.5 s (serve.status(), the replica actors). Afterwards every
streamed answer is checked against one reference engine's greedy token ids.

Takes ~6-8 minutes with the defaults on a 2-core machine (5 min 41 s measured: cluster start,
the probe's deploy and probe ~1 min, the graph's deploy ~0.5 min, the phases ~3.5 min, the
reference check ~0.5 min);
--control adds ~2 min; giving both --rate-before and --rate-after skips the probe. Prints a table per phase
(offered rate, MD replicas, TTFT/ITL P50/P90, SLA attainment, SLA goodput, requests per MD replica)
and one final JSON line:

  md_replicas_max          most RUNNING MainDecode replicas seen (2 when it scaled)
  scaled_before_ramp       a 2nd replica ran before the ramp (the before phase's load was past
                           the target: the scale-up was not measured; exit status 1)
  tokens_lost              requests that errored or streamed other than exactly --max-tokens ids
  outputs_identical        every answer's token ids equal the reference engine's greedy ids
  goodput_after_vs_before  goodput(after: rate_after, 2 replicas) / goodput(before: rate_before,
                           1 replica); goodput = requests meeting the SLA (TTFT <= --sla-ttft and
                           TPOT <= --sla-tpot) per second of the phase; read it against
                           offered_load_ratio (rate_after / rate_before)
  goodput_after_vs_one_replica   with --control: after's goodput over one fixed MD replica's at
                           the same rate_after (what the 2nd replica bought)
  scale_up_s               ramp start to the 2nd replica RUNNING
  capacity_rps, rate_before, rate_after   the calibration (probe_requests, probe_s,
                           probe_latency_s, probe_md_seqs_mean: what it was computed from)
  PHASE.md_serve_ongoing_mean   MainDecode's ongoing requests as Serve's autoscaler read them
  PHASE.*                  each phase's figures; after.requests_per_md_replica shows the new
                           replica took work

Logged to MLflow, experiment pdd-scale (`pdd runs --experiment pdd-scale`); requests.parquet,
replicas.json (the samples) and summary.json under .pdd/eval/pdd-scale-TIME/. Exit status 1 when a
token was lost, an output differed, MD never scaled or it scaled before the ramp.
"""


def _add_scale(p: argparse.ArgumentParser) -> None:
    from evaluations.scale import ScaleConfig

    d = ScaleConfig()
    p.add_argument("--graph", default=d.graph,
                   help="graph whose MainDecode has an autoscaling_config reaching 2 replicas (default: %(default)s)")
    g = p.add_argument_group("offered load")
    g.add_argument("--rate-before", type=float, default=d.rate_before,
                   help="req/s before the ramp (default: --load-before x the probe's capacity_rps)")
    g.add_argument("--rate-after", type=float, default=d.rate_after,
                   help="req/s from the ramp on (default: --load-after x the probe's capacity_rps)")
    g.add_argument("--load-before", type=float, default=d.load_before,
                   help="calibrated rate_before, as a multiple of capacity_rps, < 1 (default: %(default)s)")
    g.add_argument("--load-after", type=float, default=d.load_after,
                   help="calibrated rate_after, as a multiple of capacity_rps, > 1 (default: %(default)s)")
    g.add_argument("--probe-s", type=float, default=d.probe_s,
                   help="the capacity probe's closed loop, seconds (default: %(default)s)")
    g.add_argument("--before-s", type=float, default=d.before_s, help="before phase, seconds (default: %(default)s)")
    g.add_argument("--after-s", type=float, default=d.after_s,
                   help="after phase (2 replicas running), seconds (default: %(default)s)")
    g.add_argument("--ramp-timeout", type=float, default=d.ramp_timeout_s,
                   help="give up when no 2nd replica runs this long after the ramp starts (default: %(default)s)")
    g.add_argument("--system-tokens", type=int, default=d.system_tokens,
                   help="shared system prompt, warmed into the caches (default: %(default)s)")
    g.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens,
                   help="fresh prompt tokens per request (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output tokens per request (default: %(default)s)")
    g.add_argument("--seed", type=int, default=d.seed, help="(default: %(default)s)")
    g.add_argument("--control", action="store_true",
                   help="afterwards, offer --rate-after for --after-s to the graph with MainDecode fixed at one "
                        "replica (goodput_after_vs_one_replica; ~2 min more)")
    g = p.add_argument_group("link and SLA")
    g.add_argument("--link", default=None, help="the emulated WAN: a preset name or a YAML mapping (default: graphs/pdd.yaml's)")
    g.add_argument("--sla-ttft", type=float, default=1.0, help="TTFT target, seconds (default: %(default)s)")
    g.add_argument("--sla-tpot", type=float, default=0.1, help="TPOT target, seconds (default: %(default)s)")
    g.add_argument("--timeout", type=float, default=300.0, help="per-request timeout, seconds (default: %(default)s)")
    g = p.add_argument_group("tracking and output")
    g.add_argument("--experiment", default="pdd-scale", help="MLflow experiment name (default: %(default)s)")
    g.add_argument("--tracking-uri", default=None,
                   help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    g.add_argument("--no-mlflow", action="store_true", help="don't log to MLflow")
    g.add_argument("--out", default=None, help="directory for the artifacts (default: .pdd/eval/EXPERIMENT-TIME)")
    g.add_argument("--no-progress", action="store_true", help="no progress lines")
    _add_env(p)


def _run_scale(args: argparse.Namespace) -> int:
    from evaluations.harness import EvalEnv, EvalError, parse_link
    from evaluations.loadgen import SLA, LoadConfig
    from evaluations.scale import ScaleConfig, run_scale
    from pdd_serve.cluster.local import ClusterError

    try:
        cfg = ScaleConfig(graph=args.graph, rate_before=args.rate_before, rate_after=args.rate_after,
                          load_before=args.load_before, load_after=args.load_after, probe_s=args.probe_s,
                          before_s=args.before_s, after_s=args.after_s, ramp_timeout_s=args.ramp_timeout,
                          system_tokens=args.system_tokens, prompt_tokens=args.prompt_tokens,
                          max_tokens=args.max_tokens, control=args.control, seed=args.seed,
                          link=parse_link(args.link), sla=SLA(args.sla_ttft, args.sla_tpot),
                          load=LoadConfig(timeout_s=args.timeout),
                          env=EvalEnv(args.cluster_port, args.state_dir, args.http_port, args.no_cluster,
                                      args.keep_cluster),
                          experiment=args.experiment, tracking_uri=args.tracking_uri, mlflow=not args.no_mlflow,
                          out_dir=args.out, progress=not args.no_progress)
    except (ValueError, EvalError) as e:
        raise _usage(f"pdd scale: error: {e}") from None
    try:
        res = run_scale(cfg)
    except (EvalError, ClusterError) as e:
        return _fail("scale", e)
    h = res["headline"]
    return 0 if (h["tokens_lost"] == 0 and h["outputs_identical"] and h["md_replicas_max"] >= 2
                 and not h["scaled_before_ramp"]) else 1


# ---------------------------------------------------------------- runs

RUNS_DESCRIPTION = """\
A summary table of the runs in the MLflow store (--tracking-uri, else $MLFLOW_TRACKING_URI, else
sqlite:///mlflow.db in the working directory), newest first, from every experiment in it (the
experiment column says which; --experiment NAME shows only NAME's): per-graph runs with their
latency, goodput, BCR and RLD share; comparison runs with PDD's ratios to the baselines.

For plots and side-by-side run comparison, browse the same store with
  mlflow ui --backend-store-uri sqlite:///mlflow.db
"""


def _add_runs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experiment", action="append", default=None,
                   help="only this experiment's runs (repeatable; default: every experiment in the store)")
    p.add_argument("--limit", type=int, default=30, help="most recent runs to show (default: %(default)s)")
    p.add_argument("--tracking-uri", default=None, help="MLflow store (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    p.add_argument("--json", action="store_true", help="print the runs as JSON lines instead")


def _no_runs_message(uri: str | None, experiments: list[str] | None, existing: list[str]) -> str:
    """Where `pdd runs` looked, and how to get runs there."""
    from evaluations.tracking import describe_store, sqlite_file, tracking_uri

    store = describe_store(uri)
    db = sqlite_file(tracking_uri(uri))
    if db is not None and not db.exists():
        where = f"no MLflow store at {store}: the file does not exist"
    elif experiments and (missing := [e for e in experiments if e not in existing]):
        where = f"no experiment {', '.join(missing)} in {store}; its experiments: {', '.join(existing) or 'none'}"
    elif experiments:
        where = f"no runs in experiment {', '.join(experiments)} of {store}"
    else:
        where = f"no runs in any experiment of {store}"
    return (f"{where}.\nRuns come from `pdd compare`, `pdd sweep hit-rate`, `pdd plan` and `pdd simulate --mlflow`, "
            f"logged to $MLFLOW_TRACKING_URI when set, else to sqlite:///mlflow.db in the directory they ran in "
            f"(compare and sweep also take --tracking-uri): run `pdd runs` there or give it the same store.")


def _run_runs(args: argparse.Namespace) -> int:
    import json

    from evaluations.report import simple_table
    from evaluations.tracking import RUN_COLUMNS, describe_store, list_experiments, list_runs

    if args.limit <= 0:
        raise _usage("pdd runs: error: --limit must be > 0")
    try:
        rows = list_runs(args.tracking_uri, args.experiment, args.limit)
    except Exception as e:  # an unreachable or foreign store: say so in one line
        return _fail("runs", f"cannot read the MLflow store {describe_store(args.tracking_uri)}: {type(e).__name__}: {e}")
    if not rows:
        print(_no_runs_message(args.tracking_uri, args.experiment, list_experiments(args.tracking_uri)),
              file=sys.stderr)
        return 0
    if args.json:
        for r in rows:
            print(json.dumps(r, default=str))
        return 0
    for r in rows:
        if r.get("workload.workload"):
            r["workload"] = r["workload.workload"]
        if r.get("hit_rate") is not None and not r.get("graph"):  # a sweep point: PDD's figures and ratios
            for k in ("requests", "ttft_p50_s", "ttft_p90_s", "tt2t_p90_s", "tpot_p50_s", "goodput_rps",
                      "bcr_req_per_usd"):
                r.setdefault(k, r.get(f"pdd.{k}"))
            r["graph"] = "pdd vs x-DC"
            r.setdefault("goodput_vs_cross_dc", r.get("goodput_ratio"))
            if r.get("tt2t_p90_speedup"):
                r.setdefault("p90_tt2t_vs_cross_dc", 1 / r["tt2t_p90_speedup"])
        r["run"] = (r["run"] or "")[:32]
    print(simple_table(rows, RUN_COLUMNS))
    return 0


EVAL_COMMANDS: list[Command] = [
    Command("demo", "the main job: local two-site cluster + graphs/pdd.yaml + an agentic workload",
            _add_demo, _run_demo, DEMO_DESCRIPTION),
    Command("compare", "one workload through pd_same_dc, pd_cross_dc and pdd; table, MLflow, JSON line",
            _add_compare, _run_compare, COMPARE_DESCRIPTION),
    Command("sweep", "parameter sweeps: `pdd sweep hit-rate` (PDD's benefit vs prefix-hit rate)",
            _add_sweep, _run_sweep, SWEEP_DESCRIPTION),
    Command("scale", "ramp the load until MainDecode autoscales 1 -> 2; TTFT/ITL and SLA goodput before and after",
            _add_scale, _run_scale, SCALE_DESCRIPTION),
    Command("runs", "summary table of the evaluation runs in the MLflow store", _add_runs, _run_runs,
            RUNS_DESCRIPTION),
]
