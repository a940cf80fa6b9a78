"""`pdd plan`: search P / RLD / MD counts, chip assignments and the pipeline policy for the
highest BCR.

For each assignment (a site-A chip for P and RLD, a site-B chip for MD), start from roofline
capacity estimates, grow the role the SLA misses point at until the load meets the SLA in
simulation, then shrink each role while it still does; then, at the best assignment, sweep the
policy's knobs (`wan_budget_s`, the relay pool's size). The load is either the scenario's synthetic
workload at a target rate (BCR from an SLA-goodput bisection) or a user's trace replayed at its
own arrival times (BCR = SLA-meeting requests per second of the trace / cost per hour).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from evaluations.sim.config import DeploymentSpec, RoleSpec, Scenario, ScenarioError
from evaluations.sim.line import line_model
from evaluations.sim.report import goodput_of, requests_for, simulate
from evaluations.sim.workload import FRESH_ID_BASE, Workload, build_workload, synthetic
from pdd_serve.emulation.costmodel import decode_step_time, kv_capacity_tokens, prefill_time
from pdd_serve.policy import LinkEstimate, choose_pipeline

ROLES = ("prefill", "relay", "main_decode")


@dataclass
class Candidate:
    chip_a: str
    chip_b: str
    counts: dict[str, int]
    cost: float
    summary: dict[str, Any]
    feasible: bool
    why: str = ""
    wan_budget_s: float = 0.5
    goodput_rps: float = 0.0  # SLA-meeting requests per second in this simulation

    @property
    def bcr(self) -> float:
        return self.goodput_rps / self.cost

    def row(self) -> dict[str, Any]:
        s = self.summary
        return {"chip_a": self.chip_a, "chip_b": self.chip_b, **{f"n_{k}": v for k, v in self.counts.items()},
                "wan_budget_s": self.wan_budget_s, "cost_per_hour": round(self.cost, 3), "feasible": self.feasible,
                "goodput_rps": round(self.goodput_rps, 4), "bcr": round(self.bcr, 6),
                "attainment": round(s["attainment"], 4),
                "ttft_p90": round(s["ttft_p90"], 3), "tpot_p90": round(s["tpot_p90"], 4),
                "rld_token_share": round(s["rld_token_share"], 4), "why": self.why}


@dataclass
class PlanResult:
    target_rps: float
    best: Candidate | None
    best_goodput_rps: float = 0.0
    best_bcr: float = 0.0
    candidates: list[Candidate] = field(default_factory=list)
    reference: dict[str, Any] = field(default_factory=dict)
    trace: str | None = None  # the trace replayed (None: the synthetic workload at target_rps)
    seq_tokens: int | None = None  # mean prompt + output tokens (sizes the relay's admission)


def planned_deployment(sc: Scenario, template: DeploymentSpec, link: str, chip_a: str, chip_b: str,
                       counts: dict[str, int], wan_budget_s: float | None = None,
                       seq_tokens: int | None = None) -> DeploymentSpec:
    """The template's policy with the relay admission sized to the pool (sequences of `seq_tokens`)."""
    relay_cap = kv_capacity_tokens(sc.chips[chip_a], sc.model, 1, sc.scheduler.mem_reserve_fraction)
    per_relay = max(1, relay_cap // (seq_tokens or sc.workload.input_tokens + sc.workload.output_tokens))
    pol = dataclasses.replace(template.policy, relay_max_running=max(1, counts["relay"] * per_relay),
                              wan_budget_s=template.policy.wan_budget_s if wan_budget_s is None else wan_budget_s)
    return DeploymentSpec(f"plan-{chip_a}-{chip_b}", RoleSpec(chip_a, counts["prefill"]),
                          RoleSpec(chip_b, counts["main_decode"]), link, RoleSpec(chip_a, counts["relay"]), pol)


def initial_counts(sc: Scenario, template: DeploymentSpec, link: str, chip_a: str, chip_b: str,
                   target: float, trace: Workload | None = None) -> dict[str, int]:
    """Roofline estimates: prefill and decode capacity per instance, relay concurrency. A trace's
    prefix hits are unknown before its caches are simulated: it starts from no hits (too many P,
    which the search then shrinks)."""
    m, sched, sla = sc.model, sc.scheduler, sc.sla
    wl = trace or synthetic(sc.workload, rate_rps=target, requests=300)
    reqs = wl.requests[:: max(1, len(wl.requests) // 300)]
    ca, cb = sc.chips[chip_a], sc.chips[chip_b]
    chunk = sched.prefill_chunk_tokens

    def cached_blocks(r: Any) -> int:
        return 0 if trace is not None else sum(1 for b in r.blocks if b < FRESH_ID_BASE)

    t_pre = []
    for r in reqs:
        hit = min(cached_blocks(r) * wl.block_size, r.prompt - 1)
        done, t = 0, 0.0
        while done < r.prompt - hit:
            n = min(chunk, r.prompt - hit - done)
            t += prefill_time(ca, m, 1, [(n, hit + done)])
            done += n
        t_pre.append(t)
    n_p = math.ceil(target * float(np.mean(t_pre)) * 1.15)
    p_in = int(np.mean([r.prompt for r in reqs]))
    out = max(1, int(np.mean([r.output for r in reqs])))
    L = p_in + out
    seqs = max(1, min(sched.decode_max_batch, kv_capacity_tokens(cb, m, 1, sched.mem_reserve_fraction) // L))
    step = decode_step_time(cb, m, 1, seqs, seqs * (p_in + out // 2))
    while seqs > 1 and step > 0.9 * sla.tpot_s:
        seqs -= 1
        step = decode_step_time(cb, m, 1, seqs, seqs * (p_in + out // 2))
    per_md = seqs / (out * step)
    n_md = math.ceil(target * 1.1 / per_md)
    ls = sc.links[link]
    lm = line_model(ls, m.kv_bytes_per_token)
    est = LinkEstimate(lm.bandwidth_bps / 8 if lm.bandwidth_bps else math.inf, lm.config.one_way_latency_s)
    bb = wl.block_size * m.kv_bytes_per_token
    busy = []
    for r in reqs:
        missing = (math.ceil(r.prompt / wl.block_size) - cached_blocks(r)) * bb
        d = choose_pipeline(r.prompt, r.output, missing, est, 0, template.policy)
        busy.append(d.transfer_s + 1.0 if d.pipeline != "P-MD" else 0.0)
    relay_cap = kv_capacity_tokens(ca, m, 1, sched.mem_reserve_fraction) // L
    n_r = max(1, math.ceil(target * float(np.mean(busy)) * 1.5 / max(1, relay_cap)))
    return {"prefill": max(1, n_p), "relay": n_r, "main_decode": max(1, n_md)}


def _bottleneck(reqs_summary: dict[str, Any], sim: Any, sc: Scenario) -> str:
    """The role the SLA misses point at: TPOT misses -> MD; TTFT misses from queueing at P -> P;
    the rest of TTFT (KV wait, relay admission) -> RLD, or MD when MD admission is the wait."""
    from evaluations.sim.metrics import tpot, ttft

    sla = sc.sla
    reqs = sim.wl.requests
    tp_miss = sum(1 for r in reqs if tpot(r, sla) > sla.tpot_s)
    tt = [r for r in reqs if ttft(r, sla) > sla.ttft_s]
    if tp_miss >= len(tt):
        return "main_decode"
    pre = sum(r.t_prefill_done - r.arrival for r in tt)
    post = sum(ttft(r, sla) - (r.t_prefill_done - r.arrival) for r in tt if math.isfinite(ttft(r, sla)))
    if pre >= post:
        return "prefill"
    relay_waits = sum(1 for r in tt if r.pipeline != "P-MD" or "relay saturated" in r.reason)
    return "relay" if relay_waits * 2 >= len(tt) else "main_decode"


def trace_window(sc: Scenario, trace: str, window_s: float | None) -> Workload:
    """The trace's first `window_s` seconds of arrivals (all of it with None)."""
    spec = dataclasses.replace(sc.workload, kind="trace", trace_path=trace)
    full = build_workload(spec)
    n = sum(1 for r in full.requests if window_s is None or r.arrival <= window_s)
    return build_workload(spec, limit=max(2, n))


def plan(sc: Scenario, target_rps: float | None = None, max_steps: int | None = None, progress: bool = True,
         pairs: list[tuple[str, str]] | None = None, trace: str | None = None,
         window_s: float | None = None) -> PlanResult:
    p = sc.plan
    if not p:
        raise ScenarioError(f"{sc.path}: plan: the scenario has no plan section")
    link = p.get("link", "inter_dc")
    if link not in sc.links:
        raise ScenarioError(f"{sc.path}: plan.link: unknown link {link!r}")
    template = sc.deployments[p.get("policy_from", sc.compare.get("subject", "pdd"))]
    site_a = list(p.get("chips_site_a", [template.prefill.chip]))
    site_b = list(p.get("chips_site_b", [template.main_decode.chip]))
    for key, lst in (("chips_site_a", site_a), ("chips_site_b", site_b)):
        for c in lst:
            if c not in sc.chips:
                raise ScenarioError(f"{sc.path}: plan.{key}: unknown chip {c!r}")
    horizon = float(p.get("horizon_s", sc.goodput.get("horizon_s", 240.0)))
    seq_tokens = None
    if trace is not None:  # the user's own load: the trace at its own arrival times
        wl0 = trace_window(sc, trace, window_s or p.get("window_s"))
        span = wl0.requests[-1].arrival - wl0.requests[0].arrival
        target = (len(wl0.requests) - 1) / max(span, 1e-9)
        warm = float(p.get("warmup_s", min(60.0, span / 5)))
        seq_tokens = int(np.mean([r.prompt + r.output for r in wl0.requests]))
        n_req = len(wl0.requests)

        def workload() -> Workload:
            return build_workload(dataclasses.replace(sc.workload, kind="trace", trace_path=trace), limit=n_req)
    else:
        target = float(target_rps or p.get("target_rps", sc.workload.rate_rps))
        warm = float(sc.goodput.get("warmup_s", 60.0))
        n_req = requests_for(target, horizon)

        def workload() -> Workload:
            return synthetic(sc.workload, rate_rps=target, requests=n_req)
    steps = int(max_steps or p.get("max_steps", 40))
    pairs = pairs or [(a, b) for a in site_a for b in site_b]
    res = PlanResult(target, None, trace=trace, seq_tokens=seq_tokens)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="plan", unit="sim", leave=False)
    cache: dict[tuple, Candidate] = {}

    def evaluate(a: str, b: str, counts: dict[str, int], why: str, budget: float | None = None) -> Candidate:
        budget = template.policy.wan_budget_s if budget is None else budget
        key = (a, b, counts["prefill"], counts["relay"], counts["main_decode"], budget)
        if key in cache:
            return cache[key]
        dep = planned_deployment(sc, template, link, a, b, counts, budget, seq_tokens)
        s, sim = simulate(sc, dep, workload(), warmup_s=warm)
        c = Candidate(a, b, dict(counts), sc.cost_per_hour(dep), s, s["attainment"] >= sc.sla.attainment, why,
                      budget, s["goodput_rps_at_load"])
        c.summary["_bottleneck"] = None if c.feasible else _bottleneck(s, sim, sc)
        cache[key] = c
        res.candidates.append(c)
        if bar is not None:
            bar.update(1)
        return c

    for a, b in pairs:
        counts = initial_counts(sc, template, link, a, b, target, workload() if trace else None)
        cur = evaluate(a, b, counts, "roofline start")
        n = 0
        while not cur.feasible and n < steps:  # grow what the misses point at
            role = cur.summary["_bottleneck"]
            counts = dict(counts)
            counts[role] += max(1, round(0.1 * counts[role]))
            cur = evaluate(a, b, counts, f"grow {role}")
            n += 1
        if not cur.feasible:
            continue
        for role in ("main_decode", "prefill", "relay"):  # shrink while the SLA holds
            step = max(1, counts[role] // 8)
            while step >= 1 and n < steps:
                if counts[role] - step < 1:
                    step //= 2
                    continue
                trial = dict(counts)
                trial[role] -= step
                c = evaluate(a, b, trial, f"shrink {role}")
                n += 1
                if c.feasible:
                    counts, cur = trial, c
                else:
                    step //= 2
        if res.best is None or cur.cost < res.best.cost:
            res.best = cur
    if res.best is not None and any(x in template.policy.pipelines for x in ("P-RLD-MD", "P-RLD")):
        res.best = sweep_policy(res.best, evaluate, [float(x) for x in p.get("wan_budgets", [0.25, 0.5, 1.0, 2.0])])
    if bar is not None:
        bar.close()
    if res.best is None:
        return res
    b = res.best
    ref = sc.deployments.get(sc.compare.get("subject", "pdd"))
    if trace is not None:  # the trace's load is fixed: BCR = its SLA-meeting request rate / cost
        res.best_goodput_rps = b.goodput_rps
        res.best_bcr = b.bcr
        if ref is not None:
            s, _ = simulate(sc, ref, workload(), warmup_s=warm)
            cost = sc.cost_per_hour(ref)
            res.reference = {"name": ref.name, "cost_per_hour": cost, "goodput_rps": s["goodput_rps_at_load"],
                             "bcr": s["goodput_rps_at_load"] / cost, "attainment": s["attainment"],
                             "counts": {k: r.count for k, r in ref.roles().items()}}
        return res
    dep = planned_deployment(sc, template, link, b.chip_a, b.chip_b, b.counts, b.wan_budget_s)
    g = goodput_of(sc, dep, horizon_s=horizon, iterations=5)
    res.best_goodput_rps = g.rate
    res.best_bcr = g.rate / b.cost
    if ref is not None:
        gr = goodput_of(sc, ref, horizon_s=horizon, iterations=5)
        res.reference = {"name": ref.name, "cost_per_hour": sc.cost_per_hour(ref), "goodput_rps": gr.rate,
                         "bcr": gr.rate / sc.cost_per_hour(ref),
                         "counts": {k: r.count for k, r in ref.roles().items()}}
    return res


def sweep_policy(best: Candidate, evaluate: Any, budgets: list[float]) -> Candidate:
    """At the best counts: the WAN budget (which requests go through the relay) x the relay pool
    (one fewer, as many, one more). At a given load every feasible candidate serves it, so the
    cheapest has the highest BCR; among equally cheap ones, the one with the most SLA-meeting requests."""
    found = [best]
    for budget in budgets:
        for dr in (-1, 0, 1):
            counts = {**best.counts, "relay": best.counts["relay"] + dr}
            if counts["relay"] >= 1:
                found.append(evaluate(best.chip_a, best.chip_b, counts, f"policy wan_budget_s={budget:g}", budget))
    ok = [c for c in found if c.feasible]
    return min(ok, key=lambda c: (round(c.cost, 9), -c.goodput_rps)) if ok else best


# ---------------------------------------------------------------- outputs


def graph_yaml(sc: Scenario, res: PlanResult, template_path: str | Path) -> str:
    """A Serve config in graphs/pdd.yaml's shape with the planned replica counts and policy."""
    import yaml

    if res.best is None:
        raise ValueError("no feasible plan")
    doc = yaml.safe_load(Path(template_path).read_text())
    app = doc["applications"][0]
    args = app["args"]
    b = res.best
    template = sc.deployments[sc.plan.get("policy_from", sc.compare.get("subject", "pdd"))]
    dep = planned_deployment(sc, template, sc.plan.get("link", "inter_dc"), b.chip_a, b.chip_b, b.counts,
                             b.wan_budget_s, res.seq_tokens)
    pol = dep.policy
    args["policy"].update({"pipelines": list(pol.pipelines), "wan_budget_s": pol.wan_budget_s,
                           "handoff_token_threshold": pol.handoff_token_threshold,
                           "relay_max_running": pol.relay_max_running, "kv_wait_timeout_s": pol.kv_wait_timeout_s})
    args["sites"].update({"prefill_replicas": b.counts["prefill"], "relay_replicas": b.counts["relay"],
                          "main_decode_replicas": b.counts["main_decode"]})
    ls = sc.links[sc.plan.get("link", "inter_dc")]
    args["link"] = {"preset": ls.link.preset,
                    **{k: (list(v) if isinstance(v, tuple) else v) for k, v in ls.link.overrides}}
    if sc.plan.get("model_path"):
        args["model"]["path"] = sc.plan["model_path"]
    # the planned counts are fixed: each planned deployment's entry says `num_replicas` (and drops the
    # template's autoscaling_config); MainDecode is one deployment (a template's older per-replica
    # entries, one per MD, fold into it)
    planned = {"Prefill": b.counts["prefill"], "Relay": b.counts["relay"], "MainDecode": b.counts["main_decode"]}
    deps: list[dict[str, Any]] = []
    for d in app.get("deployments", []):
        name = "MainDecode" if str(d.get("name", "")).startswith("MainDecode") else d.get("name")
        if name in planned:
            if any(x.get("name") == name for x in deps):
                continue
            rest = {k: v for k, v in d.items() if k not in ("name", "num_replicas", "autoscaling_config")}
            d = {"name": name, "num_replicas": planned[name], **rest}
        deps.append(d)
    app["deployments"] = deps
    load = (f"the trace {Path(res.trace).name} ({res.target_rps:.2f} req/s)" if res.trace
            else f"{res.target_rps:g} req/s")
    head = (f"# Planned by `pdd plan --scenario {sc.name}`: highest BCR at {load} under the SLA\n"
            f"# (TTFT <= {sc.sla.ttft_s:g} s, TPOT <= {sc.sla.tpot_s * 1e3:g} ms, {sc.sla.attainment:.0%} attained).\n"
            f"# P: {b.counts['prefill']} x {b.chip_a}, RLD: {b.counts['relay']} x {b.chip_a} (site a), "
            f"MD: {b.counts['main_decode']} x {b.chip_b} (site b); cost {b.cost:.2f}/h,\n"
            f"# simulated SLA goodput {res.best_goodput_rps:.2f} req/s, BCR {res.best_bcr:.4f}.\n"
            f"# model.path must name the served checkpoint (the plan used the simulator's spec {sc.model.name});\n"
            f"# the line's aggregate capacity ({sc.links[sc.plan.get('link', 'inter_dc')].line_gbps} Gb/s) is rented, not configured here.\n")
    return head + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)


def cluster_nodes(sc: Scenario, res: PlanResult) -> dict[str, Any]:
    """Node counts per site and chip, for a Ray cluster launcher config (pdd.site labels)."""
    b = res.best
    if b is None:
        raise ValueError("no feasible plan")
    per_node = int(sc.plan.get("chips_per_node", 8))
    a_chips = b.counts["prefill"] + b.counts["relay"]
    nodes = {
        f"site_a_{b.chip_a}": {"min_workers": math.ceil(a_chips / per_node), "max_workers": math.ceil(a_chips / per_node),
                               "resources": {b.chip_a: per_node}, "labels": {"pdd.site": "a"}},
        f"site_b_{b.chip_b}": {"min_workers": math.ceil(b.counts["main_decode"] / per_node),
                               "max_workers": math.ceil(b.counts["main_decode"] / per_node),
                               "resources": {b.chip_b: per_node}, "labels": {"pdd.site": "b"}},
    }
    return {"chips_per_node": per_node,
            "sites": {"a": {b.chip_a: {"prefill": b.counts["prefill"], "relay": b.counts["relay"], "chips": a_chips}},
                      "b": {b.chip_b: {"main_decode": b.counts["main_decode"], "chips": b.counts["main_decode"]}}},
            "available_node_types": nodes}


def log_mlflow(sc: Scenario, res: PlanResult, files: list[Path], experiment: str = "pdd-plan") -> str:
    """One MLflow run per search: params, the winner's metrics, the candidate table and outputs as
    artifacts. Embedded default store: sqlite:///mlflow.db unless MLFLOW_TRACKING_URI is set."""
    import os
    import tempfile

    import mlflow

    mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db")
    mlflow.set_experiment(experiment)
    with mlflow.start_run(run_name=f"plan-{sc.name}-{res.target_rps:g}rps") as run:
        mlflow.log_params({"scenario": sc.name, "target_rps": res.target_rps, "trace": res.trace or "",
                           "sla_ttft_s": sc.sla.ttft_s,
                           "sla_tpot_s": sc.sla.tpot_s, "sla_attainment": sc.sla.attainment, "model": sc.model.name,
                           "candidates": len(res.candidates)})
        for i, c in enumerate(res.candidates):
            mlflow.log_metrics({"cost_per_hour": c.cost, "attainment": c.summary["attainment"], "bcr": c.bcr,
                                "wan_budget_s": c.wan_budget_s, "feasible": float(c.feasible),
                                **{f"n_{k}": float(v) for k, v in c.counts.items()}}, step=i)
        if res.best is not None:
            mlflow.log_params({"best_chip_a": res.best.chip_a, "best_chip_b": res.best.chip_b,
                               "best_wan_budget_s": res.best.wan_budget_s,
                               **{f"best_n_{k}": v for k, v in res.best.counts.items()}})
            mlflow.log_metrics({"best_cost_per_hour": res.best.cost, "best_goodput_rps": res.best_goodput_rps,
                                "best_bcr": res.best_bcr})
        if res.reference:
            mlflow.log_metrics({"reference_bcr": res.reference["bcr"], "reference_goodput_rps": res.reference["goodput_rps"]})
        with tempfile.TemporaryDirectory() as d:
            import csv

            path = Path(d) / "candidates.csv"
            rows = [c.row() for c in res.candidates]
            with path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["empty"])
                w.writeheader()
                w.writerows(rows)
            mlflow.log_artifact(str(path))
        for f in files:
            mlflow.log_artifact(str(f))
        return run.info.run_id


def plot_knobs(res: PlanResult, path: str | Path) -> Path:
    """BCR of every simulated candidate against each knob the search turned (P, RLD and MD counts,
    wan_budget_s); the chosen plan ringed, candidates that miss the SLA hollow."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    knobs = (("prefill", "P instances"), ("relay", "RLD instances"), ("main_decode", "MD instances"),
             ("wan_budget_s", "wan_budget_s (s)"))
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6), sharey=True)
    pairs = sorted({(c.chip_a, c.chip_b) for c in res.candidates})
    colors = {p: f"C{i}" for i, p in enumerate(pairs)}

    def value(c: Candidate, k: str) -> float:
        return c.wan_budget_s if k == "wan_budget_s" else c.counts[k]

    for ax, (k, label) in zip(axes, knobs):
        for c in res.candidates:
            col = colors[(c.chip_a, c.chip_b)]
            ax.scatter(value(c, k), c.bcr, s=22, color=col, facecolors=col if c.feasible else "none")
        if res.best is not None:
            ax.scatter(value(res.best, k), res.best.bcr, s=160, facecolors="none", edgecolors="k", linewidths=1.5)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("BCR: SLA-meeting req/s per cost/h")
    for p, col in colors.items():
        axes[-1].scatter([], [], color=col, label=f"P/RLD {p[0]}, MD {p[1]}")
    axes[-1].legend(fontsize=7, loc="best")
    load = Path(res.trace).name if res.trace else f"{res.target_rps:g} req/s"
    fig.suptitle(f"pdd plan: BCR of {len(res.candidates)} simulated candidates ({load}); hollow = misses the SLA, ringed = chosen")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
