"""The cluster-scale simulator and planner (evaluations/sim): roofline numbers, event ordering and
conservation, the real policy in the loop, config errors, planner feasibility, CLI, validation."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from evaluations.sim import simulator as simmod
from evaluations.sim.config import ScenarioError, load_scenario
from evaluations.sim.instances import PrefillJob
from evaluations.sim.metrics import max_goodput, summarize
from evaluations.sim.simulator import Simulation
from evaluations.sim.workload import SimRequest, Workload, mooncake_trace, synthetic
from pdd_serve import policy
from pdd_serve.emulation.costmodel import (
    ChipSpec,
    ModelShape,
    decode_series,
    decode_step_time,
    kv_capacity_tokens,
    prefill_time,
    weight_bytes_read,
)

# the scenario's own chips, a user's catalog beside it (`catalog:`), read by the one loader
TINY_CHIPS = """\
chips:
  a: {peak_tflops: 100, mem_gb: 40, mem_bw_gb_s: 1000, interconnect_gb_s: 25, price_per_hour: 1.0, forward_overhead_ms: 2}
  b: {peak_tflops: 30, mem_gb: 80, mem_bw_gb_s: 2000, interconnect_gb_s: 25, price_per_hour: 1.2, forward_overhead_ms: 2}
"""
TINY = """\
name: tiny
catalog: tiny_chips.yaml
model: {name: tiny, params_b: 7, layers: 32, hidden: 4096, attn_dim: 4096, kv_bytes_per_token: 65536, bytes_per_param: 1}
workload: {kind: synthetic, requests: 200, rate_rps: 4, input_tokens: 4096, output_tokens: 64, block_size: 256,
           families: 20, hit_mixture: [[0.7, 0.9, 1.0], [0.3, 0.0, 0.6]], anomalous_fraction: 0.05,
           anomalous_output_tokens: 4}
sla: {ttft_s: 3, tpot_s: 0.08, attainment: 0.9}
scheduler: {prefill_chunk_tokens: 2048, tail_chunk: alone, prefix_cache_gb: 100}
links:
  same_dc: same_dc
  wan: {preset: pdd_report, line_gbps: 50, price_per_hour: 0.3}
deployments:
  same_dc: {prefill: {chip: a, count: 2}, main_decode: {chip: a, count: 2}, link: same_dc,
            policy: {pipelines: [P-MD], drc: false}}
  pdmd: {prefill: {chip: a, count: 2}, main_decode: {chip: b, count: 2}, link: wan, policy: {pipelines: [P-MD]}}
  pdd:
    prefill: {chip: a, count: 2}
    relay: {chip: a, count: 1}
    main_decode: {chip: b, count: 2}
    link: wan
    policy: {pipelines: [P-MD, P-RLD-MD, P-RLD], wan_budget_s: 0.1, relay_max_running: 32,
             anomalous_min_input_tokens: 2048, anomalous_max_output_tokens: 8, anomalous_min_transfer_s: 0.1}
compare: {subject: pdd, cost_baseline: same_dc, latency_baseline: pdmd}
goodput: {horizon_s: 40, warmup_s: 5, lo_rps: 1, hi_rps: 8, iterations: 4}
plan: {target_rps: 3, chips_site_a: [a], chips_site_b: [b], link: wan, horizon_s: 40, max_steps: 12}
"""


def _write(tmp_path: Path, scenario: str = TINY, chips: str = TINY_CHIPS, name: str = "tiny.yaml") -> Path:
    (tmp_path / "tiny_chips.yaml").write_text(chips)
    p = tmp_path / name
    p.write_text(scenario)
    return p


@pytest.fixture
def tiny(tmp_path: Path):
    return load_scenario(_write(tmp_path))


def _chip(**kw) -> ChipSpec:
    d = dict(name="t", peak_tflops=1.0, mem_gb=2.0, mem_bw_gb_s=1.0, interconnect_gb_s=1.0, price_per_hour=1.0,
             mfu=1.0, mbu=1.0, forward_overhead_ms=0.0)
    d.update(kw)
    return ChipSpec(**d)


def _model(**kw) -> ModelShape:
    d = dict(name="m", params_b=1.0, layers=2, hidden=8, attn_dim=4, kv_bytes_per_token=10, bytes_per_param=1.0)
    d.update(kw)
    return ModelShape(**d)


# ---------------------------------------------------------------- roofline


def test_roofline_hand_computed() -> None:
    c, m = _chip(), _model()  # 1e12 FLOP/s, 1e9 B/s; 1e9 params of 1 byte; 2 layers x attn 4; 10 B KV/token
    # decode, batch 1, 100 tokens of context: bytes 1e9 + 10*100 over 1e9 B/s -> memory-bound
    assert decode_step_time(c, m, 1, 1, 100) == pytest.approx(1.000001)
    # prefill 1000 new tokens: FLOPs 2e9*1000 + 4*2*4*(1000*1001/2) over 1e12 -> compute-bound
    assert prefill_time(c, m, 1, [(1000, 0)]) == pytest.approx(2.000016016)
    # the same with 500 cached tokens before them: keys + 1000*500, KV touched 1500 tokens
    assert prefill_time(c, m, 1, [(1000, 500)]) == pytest.approx((2e12 + 32 * (500_500 + 500_000)) / 1e12)
    # a forward overhead and two chips: time halves, overhead doesn't, TP all-reduce adds
    c2 = _chip(forward_overhead_ms=5.0)
    ar = 2 * 2 * 1000 * 8 * 2.0 * 2 * 1 / 2 / 1e9  # 2 layers x 1000 tokens x hidden 8 x 2 B x 2 x (n-1)/n
    assert prefill_time(c2, m, 2, [(1000, 0)]) == pytest.approx(2.000016016 / 2 + 0.005 + ar)
    # MoE: a forward of few tokens reads only the experts it touches
    moe = _model(active_params_b=0.1)
    assert weight_bytes_read(moe, 1) == pytest.approx(1e8)
    assert weight_bytes_read(moe, 20) == pytest.approx(1e9)
    # capacity: 2 GB - 1 GB of weights at 10 B/token
    assert kv_capacity_tokens(c, m, 1, 0.0) == 100_000_000
    assert kv_capacity_tokens(c, m, 1, 0.25) == 50_000_000


def test_step_series_sums_each_step() -> None:
    c, m = _chip(peak_tflops=0.001), _model(active_params_b=0.5)  # compute- and memory-bound arms cross
    b, ctx = 8, 4000
    s = decode_series(c, m, 1, b, ctx)
    steps = [decode_step_time(c, m, 1, b, ctx + b * k) for k in range(300)]
    for n in (0, 1, 7, 150, 300):
        assert s.time(n) == pytest.approx(sum(steps[:n]), rel=1e-9)
    assert s.steps_within(sum(steps[:42]) + 1e-9, 300) == 42
    assert s.steps_within(sum(steps[:42]) - 1e-6, 300) == 41


# ---------------------------------------------------------------- the simulation


def _check_run(sim: Simulation, reqs: list[SimRequest]) -> None:
    assert sim.backsteps == 0  # time never went backwards
    assert all(r.finished == 1 for r in reqs)  # every request finished exactly once
    assert sim.completed == len(reqs)
    for r in reqs:
        assert 1 + r.rld_tokens + r.md_tokens == r.output or r.fallback, r  # every token made exactly once
        assert r.arrival <= r.t_prefill_done <= r.t_done
        assert r.t_first_decoder >= r.t_prefill_done
    assert all(inst.assigned == 0 for inst in sim.mds + sim.relays)  # everything released
    assert sim.relay_running == 0


def test_conservation_and_ordering(tiny) -> None:
    for name, dep in tiny.deployments.items():
        sim = Simulation(tiny, dep, synthetic(tiny.workload, rate_rps=6, requests=300))
        reqs = sim.run()
        _check_run(sim, reqs)
        s = summarize(reqs, tiny.sla)
        assert s["finished"] == 300
        if name == "pdd":
            assert set(s["pipelines"]) == {"P-MD", "P-RLD-MD", "P-RLD"}
            assert s["handoff_modes"] and 0 < s["rld_token_share"] < 0.5


def test_overload_still_conserves(tiny) -> None:
    sim = Simulation(tiny, tiny.deployments["pdd"], synthetic(tiny.workload, rate_rps=60, requests=400))
    _check_run(sim, sim.run())


def test_simulator_uses_the_real_policy(tiny) -> None:
    # the same function objects, imported unchanged from pdd_serve.policy
    for fn in ("choose_pipeline", "pick_md", "plan_handoff", "catchup_done", "wan_backlog"):
        assert getattr(simmod, fn) is getattr(policy, fn)
    dep = tiny.deployments["pdd"]
    only_pmd = dataclasses.replace(dep, policy=dataclasses.replace(dep.policy, pipelines=("P-MD",)))
    reqs = Simulation(tiny, only_pmd, synthetic(tiny.workload, rate_rps=4, requests=150)).run()
    assert {r.pipeline for r in reqs} == {"P-MD"}
    assert all(r.relay == -1 and r.rld_tokens == 0 for r in reqs)
    # handoff modes follow plan_handoff: catch-up only when more eager tokens than the threshold
    thr = dataclasses.replace(dep.policy, handoff_token_threshold=10_000)
    reqs = Simulation(tiny, dataclasses.replace(dep, policy=thr), synthetic(tiny.workload, rate_rps=4, requests=150)).run()
    modes = {r.handoff_mode for r in reqs if r.pipeline == "P-RLD-MD"}  # none: RLD finished first
    assert "one-shot" in modes and "catch-up" not in modes


def test_prefill_tail_chunks(tiny) -> None:
    """A long prompt's tail chunk runs alone (docs/pdd.md) unless packing is on."""
    for mode, forwards in (("alone", 3), ("packed", 2), ("padded", 3)):
        sc = dataclasses.replace(tiny, scheduler=dataclasses.replace(tiny.scheduler, tail_chunk=mode))
        sim = Simulation(sc, sc.deployments["same_dc"], Workload([], [], 256))
        p = sim.ps[0]
        a = SimRequest(0, 0.0, 2148, 2, ())
        b = SimRequest(1, 0.0, 500, 2, ())
        sim.prefill_done = lambda job, inst: None  # type: ignore[method-assign]  # prefill only
        p.submit(PrefillJob(a, 2148, 0))
        p.submit(PrefillJob(b, 500, 0))
        sim.run()
        assert p.forwards == forwards, mode
        assert p.backlog == 0


def test_mooncake_trace(tmp_path: Path, tiny) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'
                 '{"timestamp": 2500, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]}\n')
    spec = dataclasses.replace(tiny.workload, kind="trace", trace_path=str(f), block_size=512)
    wl = mooncake_trace(spec)
    assert [r.arrival for r in wl.requests] == [0.0, 1.5]
    assert [r.blocks for r in wl.requests] == [(1,), (1, 2)]  # full blocks only, ids + 1 (0 is the root)
    shared = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
    if shared.exists():
        sc = load_scenario("mooncake")
        wl = mooncake_trace(sc.workload, limit=300)
        sim = Simulation(sc, sc.deployments["pdd"], wl)
        reqs = sim.run()
        _check_run(sim, reqs)
        assert summarize(reqs, sc.sla)["hit_p"] > 0.02  # the trace's prefixes hit the P caches


# ---------------------------------------------------------------- config errors


@pytest.mark.parametrize("old,new,where", [
    ("main_decode: {chip: b, count: 2}, link: wan, policy: {pipelines: [P-MD]}}",
     "main_decode: {chip: b, count: 0}, link: wan, policy: {pipelines: [P-MD]}}", "deployments.pdmd.main_decode.count"),
    ("main_decode: {chip: b, count: 2}, link: wan, policy: {pipelines: [P-MD]}}",
     "main_decode: {chip: zz, count: 2}, link: wan, policy: {pipelines: [P-MD]}}", "deployments.pdmd.main_decode.chip"),
    ("sla: {ttft_s: 3,", "sla: {ttft_z: 3,", "sla.ttft_z"),
    ("sla: {ttft_s: 3,", "sla: {ttft_s: -3,", "sla.ttft_s"),
    ("mem_bw_gb_s: 1000,", "mem_bw_gb_s: 0,", "chips.a.mem_bw_gb_s"),
    ("kv_bytes_per_token: 65536", "kv_bytes_per_token: -1", "model.kv_bytes_per_token"),
    ("tail_chunk: alone", "tail_chunk: sideways", "scheduler.tail_chunk"),
    ("line_gbps: 50", "line_gbps: 50, jitter: wobbly", "links.wan.preset"),
    ("params_b: 7,", "params_b: 700,", "deployments.same_dc.prefill"),  # weights don't fit the chip
    ("wan_budget_s: 0.1", "wan_budget_s: -1", "deployments.pdd.policy"),
])
def test_config_errors_name_file_and_field(tmp_path: Path, old: str, new: str, where: str) -> None:
    assert old in TINY + TINY_CHIPS
    p = _write(tmp_path, TINY.replace(old, new, 1), TINY_CHIPS.replace(old, new, 1), "bad.yaml")
    with pytest.raises(ScenarioError) as e:
        load_scenario(p)
    assert str(p) in str(e.value) and where in str(e.value), str(e.value)


def test_a_users_catalog_is_a_scenarios_catalog(tmp_path: Path) -> None:
    """`pdd plan --catalog FILE` reads FILE as a scenario's `catalog:`: over the shipped catalog, and
    refused beside a scenario's own."""
    (tmp_path / "mine.yaml").write_text(TINY_CHIPS.replace("price_per_hour: 1.2", "price_per_hour: 1.7"))
    sc = load_scenario(_write(tmp_path, TINY.replace("catalog: tiny_chips.yaml\n", "")), tmp_path / "mine.yaml")
    assert sc.chips["b"].price_per_hour == 1.7 and "h20" in sc.chips
    with pytest.raises(ScenarioError, match="names its own catalog"):
        load_scenario(_write(tmp_path), tmp_path / "mine.yaml")


def test_builtin_scenarios_load() -> None:
    for name in ("report", "mooncake", "cpu_validate"):
        sc = load_scenario(name)
        assert sc.deployments and sc.chips
    with pytest.raises(ScenarioError, match="unknown scenario"):
        load_scenario("no-such-scenario")


# ---------------------------------------------------------------- goodput, planner


def test_goodput_bisection() -> None:
    def run_at(rate: float) -> dict:
        return {"attainment": 1.0 if rate <= 5.3 else 0.5}

    g = max_goodput(run_at, 0.9, 1.0, 2.0, iterations=10)
    assert 5.2 < g.rate <= 5.3
    assert max_goodput(lambda r: {"attainment": 0.0}, 0.9, 1.0, 2.0, 3).rate == 0.0


def test_planner_meets_sla_in_simulation(tiny, tmp_path: Path) -> None:
    from evaluations.sim.planner import cluster_nodes, graph_yaml, plan
    from evaluations.sim.report import requests_for, simulate

    res = plan(tiny, progress=False)
    assert res.best is not None and res.best.feasible
    b = res.best
    assert b.counts["prefill"] >= 1 and b.counts["relay"] >= 1 and b.counts["main_decode"] >= 1
    # feasible means: the SLA holds at the target load when simulated again
    from evaluations.sim.planner import planned_deployment

    dep = planned_deployment(tiny, tiny.deployments["pdd"], "wan", b.chip_a, b.chip_b, b.counts)
    s, _ = simulate(tiny, dep, synthetic(tiny.workload, rate_rps=3, requests=requests_for(3, 40)), warmup_s=5)
    assert s["attainment"] >= tiny.sla.attainment
    # cheaper than every other feasible candidate
    assert all(c.cost >= b.cost for c in res.candidates if c.feasible)
    import yaml

    root = Path(__file__).resolve().parents[2]
    g = yaml.safe_load(graph_yaml(tiny, res, root / "graphs" / "pdd.yaml"))
    sites = g["applications"][0]["args"]["sites"]
    assert (sites["prefill_replicas"], sites["relay_replicas"], sites["main_decode_replicas"]) == (
        b.counts["prefill"], b.counts["relay"], b.counts["main_decode"])
    deps = {d["name"]: d for d in g["applications"][0]["deployments"]}
    assert [n for n in deps if n.startswith("MainDecode")] == ["MainDecode"]  # one deployment, N replicas
    assert (deps["Prefill"]["num_replicas"], deps["Relay"]["num_replicas"], deps["MainDecode"]["num_replicas"]) == (
        b.counts["prefill"], b.counts["relay"], b.counts["main_decode"])
    assert "autoscaling_config" not in deps["MainDecode"]
    nodes = cluster_nodes(tiny, res)
    assert nodes["sites"]["a"]["a"]["chips"] == b.counts["prefill"] + b.counts["relay"]


# ---------------------------------------------------------------- CLI and validation


def test_cli_simulate(tiny, tmp_path: Path, capsys) -> None:
    from pdd_serve.cli import main

    rc = main(["simulate", "--scenario", tiny.path, "--rate", "3", "--no-progress"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    js = json.loads(out[-1])
    assert 0 <= js["rld_token_share"] < 1 and "ttft_reduction" in js and js["sim_seconds"] >= 0
    for bad in (["simulate", "--rate", "-1"], ["simulate", "--scenario", "nope"], ["simulate", "--tail-chunk", "x"],
                ["simulate", "--trace", "/no/such/file"], ["plan", "--target-rps", "0"], ["simulate", "--wat"]):
        assert main(bad) == 2, bad
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error" in err


def test_validate_synthetic_records(tmp_path: Path) -> None:
    from evaluations.sim.validate import main, make_synthetic, read_records, validate

    p = make_synthetic(tmp_path / "records.jsonl", graphs=("pdd", "pd_cross_dc"), requests=80, noise=0.05)
    rows = read_records(p)
    sc = load_scenario("cpu_validate")
    res = validate(sc, rows, 60.0, 5.0)  # loose bounds: goodput > 0 whatever the fitted chip
    assert set(res) == {"pdd", "pd_cross_dc"}
    for r in res.values():
        for k, e in r["rel_error"].items():
            assert math.isfinite(e) and abs(e) < 0.2, (k, e)
    csv_path = make_synthetic(tmp_path / "records.csv", requests=40)
    assert main([str(csv_path)]) == 0
    assert main([str(tmp_path / "missing.parquet")]) == 2


class _Clock:
    """The simulation's event clock, as SharedPacer uses it (`now`, `at`), run to the end."""

    now = 0.0

    def __init__(self) -> None:
        self.ev: list[tuple[float, Any, tuple]] = []

    def at(self, t: float, fn: Any, *args: Any) -> None:
        self.ev.append((t, fn, args))
        self.ev.sort(key=lambda e: e[0])

    def run(self) -> None:
        while self.ev:
            t, fn, args = self.ev.pop(0)
            self.now = t
            fn(*args)


def test_shared_pacer_is_processor_sharing() -> None:
    """pdd_serve's line pacer interleaves concurrent streams batch by batch: two equal flows
    started together both end when 2x the bytes have crossed, and a small flow joining a big one
    is not queued behind it."""
    from evaluations.sim.line import SharedPacer
    from pdd_serve.transport.link import LinkModel

    sim = _Clock()
    pacer = SharedPacer(sim, LinkModel(bandwidth_bps=8e6))  # type: ignore[arg-type]
    done: dict[str, float] = {}
    pacer.add(1, 1_000_000, lambda t: done.__setitem__("a", t))
    pacer.add(2, 1_000_000, lambda t: done.__setitem__("b", t))
    sim.at(0.5, pacer.add, 3, 100_000, lambda t: done.__setitem__("small", t))
    sim.run()
    assert done["small"] == pytest.approx(0.5 + 0.3)  # a third of 1 MB/s for 100 KB
    assert done["a"] == pytest.approx(2.1) and done["b"] == pytest.approx(2.1)


def test_shared_pacer_shares_the_line_per_stream() -> None:
    """A push runs on up to `streams` parallel Flight streams, one batch each, and the pacer shares
    the line per stream: a one-batch delta beside a large push gets a third at 2 streams, not half."""
    from evaluations.sim.line import SharedPacer
    from pdd_serve.transport.link import LinkModel

    sim = _Clock()
    pacer = SharedPacer(sim, LinkModel(bandwidth_bps=8e6), streams=2, unit_bytes=100_000)  # type: ignore[arg-type]
    assert (pacer.streams_for(1), pacer.streams_for(100_000), pacer.streams_for(100_001)) == (1, 1, 2)
    done: dict[str, float] = {}
    pacer.add(1, 1_000_000, lambda t: done.__setitem__("big", t))
    sim.at(0.5, pacer.add, 2, 100_000, lambda t: done.__setitem__("small", t))
    sim.at(0.6, lambda: done.__setitem__("backlog", sorted(pacer.backlog())))
    sim.run()
    assert done["small"] == pytest.approx(0.5 + 0.3)  # a third of 1 MB/s for 100 KB
    assert done["big"] == pytest.approx(1.1)  # 500 KB alone, 200 KB beside it, 300 KB alone
    assert done["backlog"] == [pytest.approx(66_667, abs=2), pytest.approx(433_333, abs=2)]


def test_a_decoders_first_token_comes_after_its_first_step(tiny) -> None:
    """A request joining a decode batch has its first token when the batch's first step ends,
    not when it joins (MD's first step is part of a P->MD TTFT)."""
    from evaluations.sim.instances import Member

    sim = Simulation(tiny, tiny.deployments["pdmd"], Workload([], [], 256))
    md = sim.mds[0]
    got: list[float] = []
    md.join(Member(SimRequest(0, 0.0, 1000, 8, ()), 8, 1000, lambda m, t: got.append(t)))
    sim.run()
    assert got == [pytest.approx(decode_series(md.chip, sim.model, md.n, 1, 1000).time(1))] and got[0] > 0


def test_validate_replays_the_draw_of_the_line_each_repeat_met(tiny) -> None:
    """Records that carry their run's link seed and Prefill's link clock are replayed on that very
    draw (one simulation per run, the line's phase from the clock); without them the prediction
    averages over seeds."""
    from evaluations.sim.validate import predicted, recorded_link, runs_of

    rows = [{"repeat": rep, "session_id": f"s{k}", "turn": 0, "t_send_s": 2.0 * k, "e2e_s": 1.0, "ttft_s": 0.5,
             "tpot_s": 0.01, "prompt_tokens": 4096, "output_tokens": 8, "error": "", "pdd_pipeline": "P-MD",
             "link_seed": 10 + rep, "pdd_link_t_s": 30.0 + 5 * rep + 2.0 * k + 0.01 * k}
            for rep in (0, 1) for k in range(4)]
    runs = runs_of(rows)
    assert recorded_link(runs[0]) == (10, pytest.approx(30.015))
    assert recorded_link(runs[1], request_overhead_s=0.015) == (11, pytest.approx(35.0))
    exact = predicted(tiny, "pdmd", rows, 3.0, 0.08, draws=4)
    assert exact["draws"] == 1 and exact["runs_on_recorded_link"] == 2
    later = predicted(tiny, "pdmd", [{**r, "pdd_link_t_s": r["pdd_link_t_s"] + 17.0} for r in rows], 3.0, 0.08)
    assert later["ttft_p50"] != pytest.approx(exact["ttft_p50"])  # the phase reaches the replayed line
    blind = predicted(tiny, "pdmd", [{k: v for k, v in r.items() if k != "pdd_link_t_s"} for r in rows], 3.0, 0.08,
                      draws=4)
    assert blind["draws"] == 4 and blind["runs_on_recorded_link"] == 0
    assert predicted(tiny, "same_dc", rows, 3.0, 0.08, draws=4)["draws"] == 1  # no line, nothing to draw


def test_validate_replays_repeats_and_sessions() -> None:
    from evaluations.sim.validate import measured, records_to_workload, runs_of

    rows = [{"repeat": rep, "session_id": "s0", "turn": k, "t_send_s": t, "e2e_s": 1.0, "ttft_s": 0.2, "tpot_s": 0.01,
             "prompt_tokens": 64, "output_tokens": 8, "error": ""}
            for rep in (0, 1) for k, t in enumerate((0.0, 1.5))]
    assert [len(r) for r in runs_of(rows)] == [2, 2]  # one run per repeat, each from its own clock
    wl = records_to_workload(runs_of(rows)[0], 16)
    assert wl.requests[1].after == 0 and wl.requests[1].think_s == pytest.approx(0.5)  # sent 0.5 s after the answer
    assert records_to_workload(runs_of(rows)[0], 16, sessions=False).requests[1].after == -1
    assert measured(rows, 1.0, 0.1)["goodput_rps"] == pytest.approx(4 / (2.5 + 2.5))  # sum of the makespans


# ---------------------------------------------------------------- the Router's critical path (issue 16)


def _one_md(sc, name: str, **pol: Any):
    """The deployment with one MD (so the view and the DRC of that MD decide) and policy changes."""
    dep = sc.deployments[name]
    return dataclasses.replace(dep, main_decode=dataclasses.replace(dep.main_decode, count=1),
                               policy=dataclasses.replace(dep.policy, **pol))


def _session(sim: Simulation, blocks0: int, extra: int, think_s: float) -> tuple[SimRequest, SimRequest]:
    """Turn 0 (blocks 1..blocks0), then turn 1 extending it by `extra` blocks, sent think_s after."""
    bs = sim.bs
    r0 = SimRequest(0, 0.0, blocks0 * bs + 1, 4, tuple(range(1, blocks0 + 1)))
    r1 = SimRequest(1, 0.0, (blocks0 + extra) * bs + 1, 4, tuple(range(1, blocks0 + extra + 1)))
    r1.after, r1.think_s = 0, think_s
    sim.wl.requests[:] = [r0, r1]
    return r0, r1


def test_p_md_first_token_pays_the_decode_call_and_the_chunk_back(tiny) -> None:
    """P->MD: the Router calls MD's decode after prefill returns (one latency), MD's first chunk
    crosses back (one latency); a graph whose control messages don't cross pays neither."""
    ttft = {}
    for ctl in (True, False):
        links = {**tiny.links, "wan": dataclasses.replace(tiny.links["wan"], control_latency=ctl)}
        sc = dataclasses.replace(tiny, links=links)
        sim = Simulation(sc, _one_md(sc, "pdmd"), Workload([], [], 256))
        r0, _ = _session(sim, 4, 1, 1.0)
        sim.wl.requests[:] = [r0]
        sim.run()
        assert r0.pipeline == "P-MD" and r0.t_first_decoder >= r0.t_kv_md
        ttft[ctl] = r0.t_first_decoder - r0.arrival
        if ctl:
            assert r0.t_first_decoder - r0.t_prefill_done >= 2 * sim.lat - 1e-9
    assert ttft[True] - ttft[False] >= 0.9 * Simulation(tiny, tiny.deployments["pdmd"], Workload([], [], 256)).lat


def test_stale_view_sends_what_the_view_lacked(tiny) -> None:
    """The Router plans from its last poll of MD's DRC: a turn sent before the view shows the
    previous turn's blocks sends the whole prompt (bytes, not tokens); a fresh view sends the delta."""
    sent = {}
    for period in (30.0, 0.01):
        sim = Simulation(tiny, _one_md(tiny, "pdmd", drc_view_period_s=period), Workload([], [], 256))
        r0, r1 = _session(sim, 6, 1, 0.5)
        sim.run()
        assert r1.hit_md == 6 * sim.bs and not r1.index_miss  # MD really held turn 0 both times
        sent[period] = r1.wan_bytes // sim.block_bytes
        assert r1.t_done > 0 and r1.fallback == ""
    assert sent == {30.0: 8, 0.01: 2}  # 8 blocks = the whole prompt; 2 = the new block + the last token's


def test_index_miss_resends_the_gap_and_may_switch_to_the_relay_late(tiny) -> None:
    """MD evicted the session after the Router's last poll: P started from the view's block, MD's
    prepare reply shows the real (larger) delta, P resends the gap (an index miss), and at the end
    of prefill the request switches P->MD to P->RLD->MD because the real delta is over budget."""
    dep = _one_md(tiny, "pdd", drc_view_period_s=0.01)
    sim = Simulation(tiny, dep, Workload([], [], 256))
    r0, r1 = _session(sim, 6, 1, 0.5)
    r1.fixed_hit_p = 0  # P recomputes the whole prompt: its prefill outlasts MD's prepare round trip
    orig = sim._finish

    def finish_then_evict(r: SimRequest, t: float) -> None:
        orig(r, t)
        if r.rid == 0:  # MD loses turn 0 just before turn 1 arrives, after the view last saw it
            sim.at(t + 0.5 - 0.2 * sim.ctl, lambda: sim.mds[0].cache.clear())

    sim._finish = finish_then_evict  # type: ignore[method-assign]
    small = policy.choose_pipeline(r1.prompt, 4, 2 * sim.block_bytes, sim.est, 0, dep.policy)
    whole = policy.choose_pipeline(r1.prompt, 4, 8 * sim.block_bytes, sim.est, 0, dep.policy)
    assert small.pipeline == "P-MD" and whole.pipeline == "P-RLD-MD"  # the premise of the late switch
    sim.run()
    assert r1.index_miss and sim.index_misses == 1 and r1.real_blocks == 0 and r1.planned_blocks == 6
    assert r1.wan_bytes == 8 * sim.block_bytes  # 2 blocks from the planned start + the 6-block gap
    assert r1.pipeline == "P-RLD-MD" and r1.reason.startswith("late") and sim.late_switches == 1
    assert r1.finished == 1 and r1.t_done > r1.t_prefill_done and r1.fallback == ""


def test_catchup_passes_the_previous_gap(tiny, monkeypatch) -> None:
    """Catch-up ends when a round no longer shrinks the gap: the simulator hands catchup_done the
    previous round's gap, as the orchestrator does."""
    seen: list[tuple[int, int | None]] = []

    def spy(remaining: int, pol: Any, previous: int | None = None) -> bool:
        seen.append((remaining, previous))
        return policy.catchup_done(remaining, pol, previous)

    monkeypatch.setattr(simmod, "catchup_done", spy)
    dep = tiny.deployments["pdd"]
    pol = dataclasses.replace(dep.policy, handoff_mode="catch-up", handoff_batch_tokens=1)
    wl = synthetic(dataclasses.replace(tiny.workload, output_tokens=400, hit_mixture=((1.0, 0.0, 0.2),)),
                   rate_rps=2, requests=20)
    reqs = Simulation(tiny, dataclasses.replace(dep, policy=pol), wl).run()
    assert any(r.handoff_mode == "catch-up" for r in reqs)
    assert seen and seen[0][1] is None and any(p is not None for _, p in seen)
    for (rem, prev) in seen:  # a round that did not shrink the gap ended catch-up
        if prev is not None and rem >= prev:
            assert policy.catchup_done(rem, pol, prev)


def test_naive_baseline_sends_every_prompt_whole(tiny) -> None:
    """Strong cross-DC PD (DRC, prefix affinity) sends the blocks MD lacks; the naive one the whole
    prompt. Both P->MD only."""
    wl = lambda: synthetic(tiny.workload, rate_rps=3, requests=120)  # noqa: E731
    strong = Simulation(tiny, tiny.deployments["pdmd"], wl()).run()
    naive_dep = _one_md(tiny, "pdmd", drc=False)
    naive_dep = dataclasses.replace(naive_dep, main_decode=tiny.deployments["pdmd"].main_decode)
    naive = Simulation(tiny, naive_dep, wl()).run()
    bb = 256 * tiny.model.kv_bytes_per_token
    assert all(r.wan_bytes == -(-r.prompt // 256) * bb for r in naive if r.pipeline == "P-MD")
    assert sum(r.wan_bytes for r in strong) < 0.6 * sum(r.wan_bytes for r in naive)
    assert sum(r.hit_md for r in strong) > 0 and all(r.hit_md == 0 for r in naive)


def test_plan_for_a_trace_writes_a_servable_graph(tiny, tmp_path: Path, capsys) -> None:
    """`pdd plan --trace`: the user's trace at its own arrival times, the counts and the pipeline
    policy searched, a graph YAML pdd_serve's loader accepts, node counts, the BCR plot."""
    import yaml

    from pdd_serve.cli import main
    from pdd_serve.config import load_graph_yaml

    trace = tmp_path / "t.jsonl"
    lines = []
    for i in range(90):  # 18 sessions x 5 turns over 45 s, each turn extending its session
        s, turn = i % 18, i // 18
        ids = [s * 1000 + j for j in range(4 + 2 * turn)]
        lines.append(json.dumps({"timestamp": 500 * i, "input_length": 256 * len(ids) + 100,
                                 "output_length": 48, "hash_ids": ids}))
    trace.write_text("\n".join(lines) + "\n")
    sc_path = _write(tmp_path, TINY.replace("plan: {target_rps: 3,", "plan: {warmup_s: 5, wan_budgets: [0.05, 1.0],"),
                     name="tiny_trace.yaml")
    out = tmp_path / "plan"
    rc = main(["plan", "--scenario", str(sc_path), "--trace", str(trace), "--out-dir", str(out), "--no-mlflow",
               "--no-progress"])
    text = capsys.readouterr().out
    assert rc == 0, text
    js = json.loads(text.strip().splitlines()[-1])
    assert js["trace"] == str(trace) and abs(js["target_rps"] - 89 / 44.5) < 1e-3
    assert "pipeline policy: wan_budget_s" in text and js["policy"]["wan_budget_s"] in (0.05, 0.1, 1.0)
    best = js["best"]
    cfg = load_graph_yaml(out / "graph.yaml")  # what `serve run` loads (build_app's config)
    assert (cfg.sites.prefill_replicas, cfg.sites.relay_replicas, cfg.sites.main_decode_replicas) == (
        best["site_a"]["prefill"], best["site_a"]["relay"], best["site_b"]["main_decode"])
    assert cfg.policy.wan_budget_s == js["policy"]["wan_budget_s"]
    doc = yaml.safe_load((out / "graph.yaml").read_text())
    app = doc["applications"][0]
    assert app["import_path"] == "pdd_serve.serve.app:build_app"
    mds = [d for d in app["deployments"] if d["name"].startswith("MainDecode")]
    assert [(d["name"], d["num_replicas"]) for d in mds] == [("MainDecode", best["site_b"]["main_decode"])]
    assert "autoscaling_config" not in mds[0]  # the plan's count is fixed
    from pdd_serve.launch.configs import graph_demands

    _, demands = graph_demands(out / "graph.yaml")  # what the cluster-config check reads agrees
    assert {d.deployment: d.replicas for d in demands}["MainDecode"] == best["site_b"]["main_decode"]
    assert (out / "bcr_knobs.png").stat().st_size > 0 and (out / "cluster_nodes.yaml").exists()
    rows = list(__import__("csv").DictReader((out / "candidates.csv").open()))
    assert {float(r["wan_budget_s"]) for r in rows} >= {0.05, 1.0}  # the policy was searched too
    cheapest = min(float(r["cost_per_hour"]) for r in rows if r["feasible"] == "True")
    assert js["cost_per_hour"] == pytest.approx(cheapest, abs=1e-3)


def test_kernel_shaped_wire_caps_the_paced_link() -> None:
    """`--shaped-link`: the LinkModel's pacing under a tbf wire never gets more than the wire's
    goodput, and exactly the model's rate where the model offers less; validate's --link swaps
    every cross-site graph onto it."""
    from evaluations.sim.line import line_model
    from evaluations.sim.validate import with_link

    sc = load_scenario("cpu_validate")
    paced, shaped = line_model(sc.links["wan"], 2048), line_model(sc.links["wan_shaped"], 2048)
    cap = 1.6e7 * sc.links["wan_shaped"].wire_goodput / 8
    e = paced.config.epoch_s
    below = 0
    for k in range(40):
        a, b = k * e, (k + 1) * e
        got, model = shaped.capacity_bytes(a, b), paced.capacity_bytes(a, b)
        assert got == pytest.approx(min(model, cap * e), rel=1e-9)
        below += model < cap * e
    assert 0 < below < 40  # the lognormal epochs fall on both sides of the wire's rate
    t = shaped.arrival_end(1.0, 4e6)
    assert shaped.capacity_bytes(1.0, t) == pytest.approx(4e6, rel=1e-9)
    sw = with_link(sc, "wan_shaped")
    assert {n: d.link for n, d in sw.deployments.items()} == {
        "pd_same_dc": "same_dc", "pd_cross_dc": "wan_shaped", "pd_cross_dc_naive": "wan_shaped", "pdd": "wan_shaped"}
    with pytest.raises(ScenarioError, match="not a link"):
        with_link(sc, "nope")


def test_router_ledger_counts_transfers_still_queued_at_prefill() -> None:
    """pdd_serve's Router puts a transfer on its ledger at its decision, before P has produced a
    block: a second cold prompt right behind the first plans with the first one's bytes as backlog
    (wan_backlog), so it takes the relay although alone it would fit P->MD's budget."""
    sc = load_scenario("cpu_validate")
    dep = sc.deployments["pdd"]
    pol = dataclasses.replace(dep.policy, wan_budget_s=1.0)
    sim = Simulation(sc, dataclasses.replace(dep, policy=pol), Workload([], [], 16))
    a = SimRequest(0, 0.0, 801, 32, tuple(range(1, 51)))
    b = SimRequest(1, 0.01, 801, 32, tuple(range(1001, 1051)))
    sim.wl.requests[:] = [a, b]
    alone = policy.choose_pipeline(801, 32, 51 * sim.block_bytes, sim.est, 0, pol)
    assert alone.pipeline == "P-MD"  # 1.7 MB at 2 MB/s fits a 1 s budget, alone
    sim.run()
    assert a.pipeline == "P-MD" and b.pipeline == "P-RLD-MD", (a.reason, b.reason)
    # one RLD finished first stays until it should have crossed, then the next look drops it
    assert not sim._line().backlog and not sim.ledger


def test_two_prefill_replicas_share_the_one_line() -> None:
    """One line per site pair (pdd_serve's `Line` deployment): two cold transfers from two Prefill
    replicas at once share its rate, as two from one replica would; a second replica brings no
    second line."""
    sc = load_scenario("cpu_validate")
    dep = sc.deployments["pd_cross_dc"]
    two = dataclasses.replace(dep, prefill=dataclasses.replace(dep.prefill, count=2 * dep.prefill.chips_per_instance))

    def kv_landed(d: Any, n: int) -> tuple[Simulation, list[SimRequest]]:
        sim = Simulation(sc, d, Workload([], [], 16))
        sim.wl.requests[:] = [SimRequest(i, 0.0, 801, 4, tuple(range(1 + 1000 * i, 51 + 1000 * i))) for i in range(n)]
        sim.run()
        return sim, sim.wl.requests

    _, (alone,) = kv_landed(dep, 1)
    sim, both = kv_landed(two, 2)
    assert sim.ps[0].pacer is sim.ps[1].pacer
    assert {r.p for r in both} == {0, 1} and all(r.pipeline == "P-MD" for r in both)
    # 2 x 1.6 MB on the line at once: each lands near twice as late as alone (on a line each: as late)
    assert min(r.t_kv_md for r in both) > 1.6 * alone.t_kv_md


def test_prefill_pays_its_copy_of_the_prompt_for_the_relay() -> None:
    """pdd_serve's Prefill copies the prompt's KV out for the relay on its engine thread (paced at
    the NIC) before the prefill returns: on the relay pipelines, and on P->MD where a late switch
    may still take it. The simulator charges the same copy; a graph without a relay pays none."""
    from pdd_serve.emulation.costmodel import kv_copy_time

    sc = load_scenario("cpu_validate")
    dep = sc.deployments["pdd"]

    def done_at(d: Any) -> tuple[Simulation, SimRequest]:
        sim = Simulation(sc, d, Workload([], [], 16))
        r = SimRequest(0, 0.0, 97, 4, tuple(range(1, 8)))  # short: its KV fits P->MD's budget
        sim.wl.requests[:] = [r]
        sim.run()
        return sim, r

    sim, with_copy = done_at(dep)
    _, without = done_at(dataclasses.replace(dep, policy=dataclasses.replace(dep.policy, late_relay=False)))
    copy = kv_copy_time(97 * sim.model.kv_bytes_per_token, sim.ps[0].chip, sim.ps[0].chip)
    assert with_copy.pipeline == without.pipeline == "P-MD" and copy > 0
    assert with_copy.t_prefill_done == pytest.approx(without.t_prefill_done + copy)
    assert sim.relay_export_s(dataclasses.replace(with_copy, pipeline="P-RLD-MD"), sim.ps[0]) == pytest.approx(copy)
    cross = Simulation(sc, sc.deployments["pd_cross_dc"], Workload([], [], 16))
    assert cross.relay_export_s(with_copy, cross.ps[0]) == 0.0  # no relay: nothing to copy for
