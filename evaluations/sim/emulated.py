"""Emulated-accelerator comparisons (`pdd compare --emulate SCENARIO`): the scenario file, the
`emulate:` block each graph gets, the emulated cost of a deployment, and the pacers' overrun.

A scenario (evaluations/scenarios/*.yaml) pins what a run emulates: the model shape, the chips and
`tp` per graph and site, the link, the SLA, the workload and `time_scale`. Every
duration in it is in emulated seconds; the load generator stretches arrivals, think times and
timeouts by `time_scale` and divides every measured time back, so the tables read in emulated
seconds. It is a scenario like the simulator's (config.BaseScenario: name, model, SLA, read the
same way), and `sim_scenario_for` turns it into the simulator's own for sim-vs-real.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from evaluations.loadgen import SLA
from evaluations.sim.config import (
    BaseScenario,
    ScenarioError,
    read_yaml,
    resolve_scenario_path,
    scenario_model,
)
from pdd_serve.config import MEM_RESERVE_FRACTION, PDDConfig
from pdd_serve.emulation import costmodel
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.pacer import build_emulation, decode_batch_cap, merge_stats

SCENARIO_DIR = Path(__file__).resolve().parents[1] / "scenarios"  # evaluations/scenarios, not sim/scenarios
ENGINE_DEPLOYMENTS = {"prefill": "Prefill", "relay": "Relay", "main_decode": "MainDecode"}
_KEYS = {"name", "description", "time_scale", "context_scale", "batch_context_tokens", "model", "chips", "link", "sla", "workload", "capacity",
         "measure"}
# a report-scale relay is shared by many prefill instances, but this deployment rents its relay
# replica whole, and BCR prices what is deployed (issue 40)
_REMOVED = {"relay_cost_fraction": "every replica is priced whole now; to amortise a relay, deploy N Prefill : 1 Relay "
                                   "(sites.prefill_replicas) and it is priced as deployed"}


@dataclass(frozen=True, kw_only=True)
class EmulatedScenario(BaseScenario):
    time_scale: float
    chips: dict[str, dict[str, dict[str, Any]]]  # graph -> site -> {chip, tp}: each graph's `emulate:`
    link: dict[str, Any]
    workload: dict[str, Any] = field(default_factory=dict)
    # the capacity search's knobs (evaluations/capacity_compare.py): requests per probe, ...
    capacity: dict[str, Any] = field(default_factory=dict)
    # one real prompt token for this many emulated ones (PDDConfig.context_scale): the report's
    # 64K prompts on the small model's 4K positions
    context_scale: int = 1
    # a scenario too long to search here is measured at one rate instead: {rate_rps, requests}
    measure: dict[str, Any] = field(default_factory=dict)
    # every graph's decoders size their batch cap for this context (emulated tokens; the emulate
    # block's batch_context_tokens): the workload's longest request, as a vLLM user sets
    # --max-model-len. None: the engine's context limit x context_scale
    batch_context_tokens: int | None = None

    def emulate_block(self, graph: str) -> dict[str, Any]:
        """The `emulate:` mapping a graph is deployed with (beside it, the graph-wide `time_scale`)."""
        if graph not in self.chips:
            raise ScenarioError(f"{self.path}: chips.{graph}: the scenario gives no chips for graph {graph!r} "
                                f"(it has {', '.join(sorted(self.chips))})")
        top = {"batch_context_tokens": self.batch_context_tokens} if self.batch_context_tokens else {}
        return {"model": self.model.name, **top, **{s: dict(v) for s, v in self.chips[graph].items()}}

    def params(self) -> dict[str, Any]:
        return {"emulated": True, "scenario": self.name, "time_scale": self.time_scale,
                "context_scale": self.context_scale, "batch_context_tokens": self.batch_context_tokens,
                "emulate.model": self.model.name, "emulate.chips": json.dumps(self.chips, sort_keys=True),
                "priced": "every replica whole, and the line"}

    def relative_prices(self, b_over_a: float) -> dict[str, float]:
        """The report's relative price (docs/pdd.md: B costs 20-30% more than A): PDD's site-b chip
        at `b_over_a` x its site-a chip's catalog price, every other chip at its own."""
        pdd = self.chips.get("pdd") or next(iter(self.chips.values()))
        a, b = pdd["a"]["chip"], pdd["b"]["chip"]
        return {b: b_over_a * costmodel.load_catalog().chip(a).price_per_hour}


def load_scenario(name_or_path: str | Path) -> EmulatedScenario:
    p = resolve_scenario_path(name_or_path, SCENARIO_DIR)
    doc = read_yaml(p)
    for k in ("time_scale", "model", "chips", "link", "sla"):
        if k not in doc:
            raise ScenarioError(f"{p}: {k}: required")
    for k, why in _REMOVED.items():
        if k in doc:
            raise ScenarioError(f"{p}: {k}: removed: {why}")
    unknown = set(doc) - _KEYS
    if unknown:
        raise ScenarioError(f"{p}: {sorted(unknown)[0]}: unknown key; valid: {', '.join(sorted(_KEYS))}")
    try:
        ts = Clock(doc["time_scale"]).time_scale
    except ValueError as e:
        raise ScenarioError(f"{p}: {e}") from None
    if not isinstance(doc["model"], str):  # each graph's emulate: names it
        raise ScenarioError(f"{p}: model: must name a model shape of {costmodel.CATALOG_PATH}")
    model = scenario_model(doc["model"], p, costmodel.load_catalog())
    if not isinstance(doc.get("capacity") or {}, dict):
        raise ScenarioError(f"{p}: capacity: must be a mapping (requests, start_rps, ...)")
    if not isinstance(doc["sla"], dict):
        raise ScenarioError(f"{p}: sla: must be a mapping (ttft_s, tpot_s)")
    for k in ("ttft_s", "tpot_s"):  # no silent defaults: the SLA is what the comparison is judged by
        if k not in doc["sla"]:
            raise ScenarioError(f"{p}: sla.{k}: required")
    try:
        sla = SLA(**doc["sla"])
    except (ValueError, TypeError) as e:
        raise ScenarioError(f"{p}: sla: {e}") from None
    k = doc.get("context_scale", 1)
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise ScenarioError(f"{p}: context_scale: must be an int >= 1, got {k!r}")
    wl = dict(doc.get("workload") or {})
    if k > 1 and wl.get("turns") != 1:  # an answer fed back would be counted as k tokens a token
        raise ScenarioError(f"{p}: workload.turns: a scenario at context_scale {k} sends single-turn requests "
                            "(turns: 1): a later turn's prompt would carry generated tokens, which count 1:1")
    measure = doc.get("measure") or {}
    if not isinstance(measure, dict) or set(measure) - {"rate_rps", "requests"}:
        raise ScenarioError(f"{p}: measure: a mapping of rate_rps and requests (one measured rate)")
    return EmulatedScenario(name=str(doc.get("name", p.stem)), path=str(p), model=model, sla=sla,
                            description=str(doc.get("description", "")).strip(), time_scale=float(ts),
                            chips=doc["chips"], link=dict(doc["link"]), workload=wl,
                            capacity=dict(doc.get("capacity") or {}), context_scale=k, measure=dict(measure),
                            batch_context_tokens=doc.get("batch_context_tokens"))


def role_chips(cfg: PDDConfig) -> dict[str, str]:
    """Each deployed engine role's emulated accelerator, e.g. {'prefill': '4 x h100-sxm', ...}."""
    return {r: f"{e.tp} x {e.chip.name}" for r in cfg.engine_roles() if (e := build_emulation(cfg, r)) is not None}


def cost_per_hour(cfg: PDDConfig, prices: Mapping[str, float] | None = None) -> float:
    """What a graph rents per hour on its emulated chips: every replica whole (replicas x tp x the
    chip's price, per role) and the inter-DC line when Prefill and Main decode are at different
    sites (the catalog's `links.cross_dc`). `prices`: chip name -> price per chip-hour over the
    catalog's (the report's relative prices). The Routers are CPU frontends and are not counted."""
    prices = prices or {}
    cat = costmodel.load_catalog()
    total = 0.0
    for role in cfg.engine_roles():
        e = build_emulation(cfg, role)
        total += _replicas(cfg, role) * e.tp * prices.get(e.chip.name, e.chip.price_per_hour)
    return total + cat.link_price(cfg.sites.prefill != cfg.sites.main_decode)


def pacer_stats_of_running_graph(app: str, denv: Mapping[str, str], timeout_s: float = 120.0) -> dict[str, Any]:
    """`collect_pacer_stats` from a driver process of its own on the cluster (`denv`: the
    cluster's driver environment), so the comparison's process never joins the cluster."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "evaluations.sim.emulated", app], env={**os.environ, **denv},
                       capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        raise RuntimeError(f"reading the emulated engines' stats failed: {r.stderr.strip()[-400:]}")
    return json.loads(lines[-1])


def _replicas(cfg: PDDConfig, role: str) -> int:
    """A role's configured replicas (`sites.<role>_replicas`)."""
    return getattr(cfg.sites, f"{role}_replicas")


def collect_pacer_stats(app: str) -> dict[str, Any]:
    """Every live engine replica's pacer counts, merged per role and over the graph (from the
    replicas' `stats`, before the graph is shut down)."""
    from pdd_serve.serve.pinning import pinned_handle, replica_actors

    per_role: dict[str, list[dict]] = {}
    for role, dep in ENGINE_DEPLOYMENTS.items():
        for rid in sorted(replica_actors(app, dep)):
            try:
                st = pinned_handle(app, dep, rid).stats.remote().result(timeout_s=30)
            except Exception:  # noqa: BLE001 - a replica that went away: its counts are lost, said below
                per_role.setdefault(role, []).append({"lost": 1})
                continue
            emu = dict((st.extra or {}).get("emulation") or {})
            per_role.setdefault(role, []).append({k: v for k, v in emu.items() if isinstance(v, (int, float))})
    out: dict[str, Any] = {role: merge_stats([p for p in parts if "lost" not in p]) for role, parts in per_role.items()}
    out["all"] = merge_stats([p for parts in per_role.values() for p in parts if "lost" not in p])
    out["replicas_lost"] = sum(1 for parts in per_role.values() for p in parts if "lost" in p)
    return out


def spread(values: list[float]) -> float | None:
    """(max - min) / median over repeats (None with fewer than two)."""
    import statistics

    vals = [v for v in values if v is not None]
    if len(vals) < 2:
        return None
    med = statistics.median(vals)
    return (max(vals) - min(vals)) / med if med else None


def ratio(a: Any, b: Any) -> float | None:
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def repeat_ratios(per_repeat: list[Mapping[str, Mapping[str, Any]]], pdd: str, cross: str, naive: str,
                  same: str) -> dict[str, list[float | None]]:
    """Each headline ratio, once per repeat (the spread is taken over these)."""
    out: dict[str, list[float | None]] = {"p90_ttft_vs_cross_dc": [], "goodput_vs_cross_dc": [],
                                          "goodput_vs_cross_dc_naive": [], "bcr_gain_vs_same_dc": []}
    for s in per_repeat:
        p, c, n, sd = s.get(pdd, {}), s.get(cross, {}), s.get(naive, {}), s.get(same, {})
        out["p90_ttft_vs_cross_dc"].append(ratio(p.get("ttft_p90_s"), c.get("ttft_p90_s")))
        out["goodput_vs_cross_dc"].append(ratio(p.get("goodput_rps"), c.get("goodput_rps")))
        out["goodput_vs_cross_dc_naive"].append(ratio(p.get("goodput_rps"), n.get("goodput_rps")))
        b = ratio(p.get("bcr_emulated"), sd.get("bcr_emulated"))
        out["bcr_gain_vs_same_dc"].append(None if b is None else b - 1)
    return out


# ---------------------------------------------------------------- the simulator's world


def decode_caps(cfg: PDDConfig) -> dict[str, int]:
    """Each emulated decoder role's batch cap, as its replica computes it (serve/common.batch_cap):
    its chips, the TPOT SLO, the engine's context limit and the pool its chips hold."""
    from pdd_serve.checkpoints import resolve_model
    from pdd_serve.engine.model import ModelArgs

    out = {}
    for role in cfg.engine_roles():
        e, m = build_emulation(cfg, role), cfg.engine_for(role)
        if role == "prefill" or e is None:
            continue
        ctx = m.max_model_len or ModelArgs.from_checkpoint(resolve_model(m.path)).max_position_embeddings
        out[role] = decode_batch_cap(e, m.max_batch, cfg.policy.tpot_slo_s, ctx, e.real_pool_tokens)
    return out


def sim_scenario_doc(sc: EmulatedScenario, graphs: list[Any]) -> dict[str, Any]:
    """The same scenario as the simulator reads it (evaluations/sim/config.py's schema): the
    emulated model, chips of the one catalog by name, each graph's deployment with its policy and
    replicas x tp chips, the scenario's link, SLA and pdd_serve's scheduler (one request per
    prefill forward in 256-token chunks, each decoder's batch cap from its chips and the TPOT SLO
    (`decode_batch_cap`), each role's prefix cache half
    the pool its emulated chips hold, as the engines size it). `graphs`: the prepared graphs (evaluations.harness.PreparedGraph)."""
    import dataclasses

    from pdd_serve.serve.common import kv_bytes_per_token
    from pdd_serve.serve.prefill import PREFILL_CHUNK_TOKENS

    shape = sc.model
    model = {k: v for k, v in dataclasses.asdict(shape).items() if k not in ("name",) and v is not None}
    model["name"] = shape.name
    first = graphs[0].cfg
    real_bpt = kv_bytes_per_token(first.engine_for("prefill"))

    def prefix_gb(role: str) -> float:
        """A role's prefix cache as its engine sizes it (serve/common.load_engine): half the pool
        the emulated chips hold, or the graph's prefix_cache_bytes (real bytes) when smaller."""
        m, e = first.engine_for(role), build_emulation(first, role)
        tokens = e.kv_capacity_tokens // 2  # emulated tokens
        if m.prefix_cache_bytes is not None:  # real bytes: each real token stands for context_scale
            tokens = min(tokens, m.prefix_cache_bytes // real_bpt * first.context_scale)
        return tokens * shape.kv_bytes_per_token / 1e9
    deployments: dict[str, Any] = {}
    for g in graphs:
        cfg = g.cfg
        dep: dict[str, Any] = {}
        for role in cfg.engine_roles():
            e = build_emulation(cfg, role)
            dep[role] = {"chip": e.chip.name, "count": _replicas(cfg, role) * e.tp, "chips_per_instance": e.tp}
        for role, cap in decode_caps(cfg).items():  # each decoder's batch cap as its replica computes it
            dep[role]["max_batch"] = cap
        dep["link"] = "wan" if g.cross_site else "same_dc"
        pol = dataclasses.asdict(cfg.policy)
        pol["pipelines"] = list(pol["pipelines"])
        # the routers poll the MD views every drc_view_period_s of REAL time: in emulated time that
        # is time_scale times more often, and the simulator is told so
        pol["drc_view_period_s"] = Clock(cfg.time_scale).emulated(cfg.policy.drc_view_period_s)
        dep["policy"] = pol
        deployments[g.name] = dep
    link = {k: v for k, v in sc.link.items()}
    # a push runs on flight.streams parallel streams, each sending one batch at a time; a batch
    # never spans two prefill chunks' blocks (serve/prefill.py feeds the sender chunk by chunk)
    fl = next((g.cfg.flight for g in graphs if g.cross_site), first.flight)
    bs, k = first.model.block_size, first.context_scale  # the simulator counts emulated tokens: k per real one
    unit_blocks = min(fl.batch_blocks, max(1, PREFILL_CHUNK_TOKENS // bs))
    link.update(scale_to_model=False, paced_line=True, streams=fl.streams,
                stream_unit_bytes=unit_blocks * bs * k * shape.kv_bytes_per_token,
                price_per_hour=costmodel.load_catalog().link_price(True))  # priced as cost_per_hour prices it
    return {
        "name": f"{sc.name} (simulated)",
        "model": model,
        "workload": {"kind": "synthetic", "block_size": bs * k},
        "sla": {"ttft_s": sc.sla.ttft_s, "tpot_s": sc.sla.tpot_s, "attainment": sc.sla.attainment,
                "ttft_from": sc.sla.ttft_from},
        "scheduler": {"prefill_chunk_tokens": PREFILL_CHUNK_TOKENS * k, "prefill_batch_requests": False,
                      "tail_chunk": "packed",
                      "mem_reserve_fraction": MEM_RESERVE_FRACTION,
                      "prefix_cache_gb": prefix_gb("main_decode"), "prefix_cache_gb_prefill": prefix_gb("prefill"),
                      "prefix_cache_gb_main_decode": prefix_gb("main_decode")},
        "links": {"same_dc": {"preset": "same_dc"}, "wan": link},
        "deployments": deployments,
    }


def sim_scenario_for(sc: EmulatedScenario, graphs: list[Any] | None = None, out_dir: Path | None = None):
    """The simulator's Scenario for an emulated scenario (`graphs`: prepared graphs; default the
    four under graphs/ with the scenario's chips), written to `out_dir/sim_scenario.yaml`."""
    import tempfile

    from evaluations.harness import DEFAULT_GRAPHS, prepare_graphs
    from evaluations.sim.config import load_scenario as load_sim_scenario

    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="pdd-emulated-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    if graphs is None:
        graphs = prepare_graphs(DEFAULT_GRAPHS, out_dir / "graphs", 8000, sc.link, emulate=sc)
    path = out_dir / "sim_scenario.yaml"
    path.write_text("# the emulated scenario as the simulator reads it (evaluations/sim/emulated.py)\n"
                    + yaml.safe_dump(sim_scenario_doc(sc, graphs), sort_keys=False))
    return load_sim_scenario(path)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    ap = argparse.ArgumentParser(
        prog="python -m evaluations.sim.emulated",
        description="Print one JSON line: the pacer counts of every live engine replica of a running emulated "
                    "graph, merged per role and over the graph (steps, overruns and overrun shares per kind: "
                    "prefill, decode, import, export; the unpaced share). Run it beside a long probe to see "
                    "whether the run still measures the emulated chips (every overrun share under 5%) or "
                    "this machine's CPU. The cluster is RAY_ADDRESS (with RAY_AUTH_MODE=token and its "
                    "RAY_AUTH_TOKEN_PATH: `eval \"$(pdd cluster env)\"`; a compare's own cluster keeps its "
                    "state in .pdd/eval-cluster).")
    ap.add_argument("app", help="the Serve application's name (a compare deploys each graph as `pdd`)")
    args = ap.parse_args(argv)
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS"), logging_level="error", log_to_driver=False)
    print(json.dumps(collect_pacer_stats(args.app)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
