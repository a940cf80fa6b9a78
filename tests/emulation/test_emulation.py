"""Emulated accelerators: the cost model's arithmetic, the step pacer (fake clock, never a timed
test), overrun per step kind, slow motion reaching the link and the timeouts, config refusals with
the field named, and greedy output unchanged with pacing on."""

from __future__ import annotations

import pytest

from pdd_serve.config import ConfigError, load_config
from pdd_serve.emulation import costmodel
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.pacer import (
    Emulation,
    StepPacer,
    build_emulation,
    kv_scale,
    merge_stats,
    overrun_warning,
)
from pdd_serve.serve.common import graph_link
from pdd_serve.transport.link import LinkModel

CAT = costmodel.load_catalog()
L70 = CAT.model("llama-3-70b")
H100 = CAT.chip("h100-sxm")
H20 = CAT.chip("h20")

EMU = {"model": "llama-3-70b", "a": {"chip": "h100-sxm", "tp": 4}, "b": {"chip": "h20", "tp": 8}}


def _cross(**extra) -> dict:
    return {"link": {"preset": "wan_10g", "jitter": "constant"}, "emulate": EMU, "time_scale": 20, **extra}


# ---------------------------------------------------------------- the roofline, by hand


def test_llama_70b_shape_from_its_heads() -> None:
    assert L70.kv_bytes_per_token == 80 * 8 * 128 * 2 * 2 == 327_680  # 320 KiB per token, bf16
    assert L70.attn_dim == 64 * 128


def test_prefill_step_of_70b_on_8_h100_by_hand() -> None:
    n, tp = 2048, 8
    flops = 2 * 70.6e9 * n + 4 * 80 * 8192 * (n * (n + 1) / 2)  # GEMMs + causal attention
    nbytes = 70.6e9 * 2 + 327_680 * n  # weights once + the chunk's KV written
    compute = flops / (tp * 989e12 * 0.65)
    memory = nbytes / (tp * 3350e9 * 0.72)
    allreduce = 2 * 80 * n * 8192 * 2 * 2 * (tp - 1) / tp / 450e9
    want = max(compute, memory) + 0.002 + allreduce
    assert compute > memory  # a 2K-token chunk is compute-bound
    assert costmodel.prefill_time(H100, L70, tp, [(n, 0)]) == pytest.approx(want, rel=1e-12)


def test_decode_step_of_70b_on_8_h100_by_hand() -> None:
    batch, ctx, tp = 32, 32 * 2048, 8
    flops = 2 * 70.6e9 * batch + 4 * 80 * 8192 * (ctx + batch)
    nbytes = 70.6e9 * 2 + 327_680 * ctx  # all weights + every sequence's KV read
    compute = flops / (tp * 989e12 * 0.65)
    memory = nbytes / (tp * 3350e9 * 0.72)
    allreduce = 2 * 80 * batch * 8192 * 2 * 2 * (tp - 1) / tp / 450e9
    assert memory > compute  # decode is bandwidth-bound
    assert costmodel.decode_step_time(H100, L70, tp, batch, ctx) == pytest.approx(
        max(compute, memory) + 0.002 + allreduce, rel=1e-12)


def test_kv_capacity_is_hbm_minus_weights() -> None:
    want = int((8 * 80e9 * 0.9 - 70.6e9 * 2) // 327_680)
    assert costmodel.kv_capacity_tokens(H100, L70, 8, 0.1) == want
    with pytest.raises(costmodel.CostModelError, match="does not fit"):
        costmodel.check_fits(H100, L70, 1, 0.1)



def test_the_decode_batch_limit_comes_from_the_chips_the_slo_and_the_pool() -> None:
    pool = costmodel.kv_capacity_tokens(H100, L70, 8, 0.1)
    ctx = 4096
    b = costmodel.decode_batch_limit(H100, L70, 8, 0.02, ctx, pool)
    assert 1 <= b < pool // ctx  # the SLO binds: the largest batch within 20 ms a step, the next one over it
    assert costmodel.decode_step_time(H100, L70, 8, b, b * ctx) <= 0.02 < \
        costmodel.decode_step_time(H100, L70, 8, b + 1, (b + 1) * ctx)
    assert costmodel.decode_batch_limit(H100, L70, 8, 1e3, ctx, pool) == pool // ctx  # a loose SLO: the pool binds
    assert costmodel.decode_batch_limit(H100, L70, 8, 0.02, ctx, 10 * ctx) == 10
    assert costmodel.decode_batch_limit(H100, L70, 8, 1e-4, ctx, pool) == 0  # not even one sequence in time
    assert costmodel.decode_batch_limit(H100, L70, 8, 0.02, ctx, ctx - 1) == 0  # nor in the pool
    with pytest.raises(costmodel.CostModelError, match="tpot_s"):
        costmodel.decode_batch_limit(H100, L70, 8, 0.0, ctx, pool)


# ---------------------------------------------------------------- the pacer (fake clock)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s


def test_pacer_holds_each_step_to_its_modeled_time_in_slow_motion() -> None:
    clk = FakeClock()
    p = StepPacer(Emulation(H100, L70, 8), Clock(10), timer=clk, sleep=clk.sleep)
    t0 = p.begin()
    clk.t += 0.05  # the real forward
    p.end("decode", t0, 0.02)  # modeled 20 ms -> 200 ms real
    assert clk.t == pytest.approx(0.2) and clk.slept == [pytest.approx(0.15)]
    st = p.stats()
    assert st["decode_steps"] == 1 and st["decode_overruns"] == 0 and st["decode_modeled_s"] == pytest.approx(0.02)


def test_overrun_is_counted_per_step_kind_and_never_slept_away() -> None:
    clk = FakeClock()
    p = StepPacer(Emulation(H100, L70, 8), Clock(2), timer=clk, sleep=clk.sleep)
    for real, modeled, kind in [(0.5, 0.1, "prefill"), (0.01, 0.1, "prefill"), (0.01, 0.1, "decode"),
                                (0.01, 0.1, "decode"), (0.01, 0.1, "decode"), (0.3, 0.1, "decode")]:
        t0 = p.begin()
        clk.t += real
        p.end(kind, t0, modeled)
    st = p.stats()
    assert (st["prefill_steps"], st["prefill_overruns"]) == (2, 1)
    assert (st["decode_steps"], st["decode_overruns"]) == (4, 1)
    assert st["overrun_share_prefill"] == 0.5 and st["overrun_share_decode"] == 0.25
    assert st["prefill_overrun_s"] == pytest.approx(0.3)  # 0.5 real against 0.2 modeled-in-real
    assert len(clk.slept) == 4  # the overrun steps slept nothing
    assert "raise time_scale (now 2, try 4)" in overrun_warning(st, Clock(2))
    assert "time_scale 500000 can go no slower" in overrun_warning(st, Clock(5e5))  # a warning never raises
    merged = merge_stats([st, st])
    assert merged["decode_steps"] == 8 and merged["overrun_share_decode"] == 0.25


def test_engine_paces_every_forward_and_keeps_greedy_tokens(model_dir) -> None:
    """Pacing sits above the engine seam: the engine reports each forward, PacedEngine holds the
    call to its modeled time; the tokens are the engine's own."""
    from pdd_serve.emulation.pacer import PacedEngine
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.protocol import EngineBackend
    from pdd_serve.engine.sampling import SamplingParams

    ref = Engine.from_pretrained(model_dir)
    prompt = [(i * 7 + 3) % 500 + 10 for i in range(70)]
    want = ref.generate(prompt, 12)
    clk = FakeClock()
    emu = Emulation(H100, L70, 8)
    eng = PacedEngine(Engine.from_pretrained(model_dir), StepPacer(emu, Clock(1000), timer=clk, sleep=clk.sleep))
    assert isinstance(eng, EngineBackend) and isinstance(ref, EngineBackend)
    seq = eng.add("r", prompt, SamplingParams(12))
    eng.prefill(seq)
    while not seq.finished:
        eng.step([seq])
    assert seq.output_ids == want
    st = eng.pacer.stats()
    assert st["prefill_steps"] == 1 and st["decode_steps"] == 11
    # the modeled times are the cost model's for exactly these steps
    assert st["prefill_modeled_s"] == pytest.approx(emu.prefill_s(70, 0))
    assert st["decode_modeled_s"] == pytest.approx(sum(emu.decode_s(1, 70 + k) for k in range(11)))
    assert clk.slept[0] == pytest.approx(emu.prefill_s(70, 0) * 1000)
    assert len(clk.slept) == 12


class _FakeEngine:
    """Reports the forwards a real engine would; records when on_chunk ran (fake clock)."""

    def __init__(self, clk: FakeClock) -> None:
        from pdd_serve.engine.protocol import ForwardWork

        self.clk, self.on_forward, self.events, self.W = clk, None, [], ForwardWork
        self.block_size = 16

    def prefill(self, seq, use_cache=True, chunk_tokens=None, on_chunk=None):  # noqa: ANN001, ANN201
        for start in range(0, 300, chunk_tokens or 300):
            self.clk.t += 0.001  # the real forward
            self.on_forward(self.W("prefill", 1, min(chunk_tokens or 300, 300 - start), start, 0.001))
            if on_chunk is not None:
                on_chunk(seq)
        return 7

    def step(self, seqs):  # noqa: ANN001, ANN201
        self.clk.t += 0.5001  # the real forwards below
        self.on_forward(self.W("decode", 2, 2, 500, 0.5))  # a decode that overran its modeled time
        self.on_forward(self.W("prefill", 1, 40, 0, 0.0001))  # and a resumed (recomputed) request
        return [(s, 1) for s in seqs]


def test_paced_engine_holds_each_chunk_before_its_blocks_leave_and_counts_per_kind() -> None:
    from pdd_serve.emulation.pacer import PacedEngine

    clk = FakeClock()
    emu = Emulation(H100, L70, 8)
    fake = _FakeEngine(clk)
    eng = PacedEngine(fake, StepPacer(emu, Clock(10), timer=clk, sleep=clk.sleep))
    assert eng.block_size == 16  # everything else is the engine's
    left: list[float] = []
    assert eng.prefill("seq", chunk_tokens=100, on_chunk=lambda s: left.append(clk.t)) == 7
    # each chunk's blocks leave when its modeled time is up, not when the CPU finished it
    ends = [sum(emu.prefill_s(100, 100 * k) for k in range(i + 1)) * 10 for i in range(3)]
    assert left == [pytest.approx(e) for e in ends]
    t = clk.t
    eng.step(["a", "b"])
    # the overrun decode takes its real 0.5 s; the resume still takes its own modeled time after it
    assert clk.t - t == pytest.approx(0.5 + emu.prefill_s(40, 0) * 10)
    with pytest.raises(AttributeError, match="reports its forwards to the pacer"):
        eng.on_forward = print
    eng.block_size = 32  # any other attribute is the engine's
    assert fake.block_size == 32
    st = eng.pacer.stats()
    assert (st["prefill_steps"], st["prefill_overruns"]) == (3, 0)  # the chunks; the resume is the step's
    assert (st["decode_steps"], st["decode_overruns"]) == (1, 1)  # 0.5 s real vs a few ms modeled x 10
    assert st["decode_modeled_s"] == pytest.approx(emu.decode_s(2, 500) + emu.prefill_s(40, 0))


class _HostEngine(_FakeEngine):
    """Forwards that fit their modeled time, but host work around them that does not; and KV copies."""

    def step(self, seqs):  # noqa: ANN001, ANN201
        self.clk.t += 0.001
        self.on_forward(self.W("decode", 1, 1, 100, 0.001))
        self.clk.t += 0.3  # sampling, bookkeeping: no cost model knows it
        return [(s, 1) for s in seqs]

    def export_kv(self, seq, start_block=0, end_block=None):  # noqa: ANN001, ANN201
        from types import SimpleNamespace

        self.clk.t += 0.002
        return SimpleNamespace(num_tokens=16 * ((end_block or 64) - start_block))

    def import_kv(self, seq, blocks, verify=True):  # noqa: ANN001, ANN201
        self.clk.t += 0.002

    def match_prefix(self, seq):  # noqa: ANN001, ANN201
        self.clk.t += 0.01
        return 3


def test_overrun_is_counted_over_the_whole_call_not_only_its_forwards() -> None:
    from pdd_serve.emulation.pacer import PacedEngine

    clk = FakeClock()
    emu = Emulation(H100, L70, 8)
    eng = PacedEngine(_HostEngine(clk), StepPacer(emu, Clock(10), timer=clk, sleep=clk.sleep))
    eng.step(["a"])  # its forward: 1 ms real against ~10 ms x 10 modeled; the call: 301 ms
    st = eng.pacer.stats()
    assert emu.decode_s(1, 100) * 10 < 0.301  # the forward alone fit; the call did not
    assert (st["decode_steps"], st["decode_overruns"]) == (1, 1)
    assert st["decode_overrun_s"] == pytest.approx(0.301 - emu.decode_s(1, 100) * 10)


def test_kv_imports_and_exports_are_paced_at_the_nic_and_counted_per_kind() -> None:
    import threading

    from pdd_serve.emulation.pacer import PacedEngine

    clk = FakeClock()
    emu = Emulation(H100, L70, 8)
    fake = _HostEngine(clk)
    eng = PacedEngine(fake, StepPacer(emu, Clock(10), timer=clk, sleep=clk.sleep))
    t = clk.t
    eng.export_kv("seq", 0, 64)  # 1,024 tokens x 320 KiB at one H100's 50 GB/s NIC, x10
    copy = emu.copy_s(1024)
    assert copy == pytest.approx(1024 * L70.kv_bytes_per_token / (H100.interconnect_gb_s * 1e9))
    assert clk.t - t == pytest.approx(copy * 10)
    blocks = fake.export_kv("seq", 0, 8)
    t = clk.t
    eng.import_kv("seq", blocks)
    assert clk.t - t == pytest.approx(emu.copy_s(128) * 10)
    st = eng.pacer.stats()
    assert (st["export_steps"], st["import_steps"]) == (1, 1) and st["export_overruns"] == 0
    # a chunk's blocks handed to the sender inside a prefill overlap its compute: not held, not
    # counted against the chunk, reported as unpaced host work
    eng.prefill("seq", chunk_tokens=100, on_chunk=lambda s: eng.export_kv(s, 0, 8))
    st = eng.pacer.stats()
    assert st["export_steps"] == 1 and st["prefill_overruns"] == 0 and st["unpaced_s"] == pytest.approx(3 * 0.002)
    # other engine calls on the engine thread are unpaced host work too; from the event loop, not the engine's
    assert eng.match_prefix("seq") == 3 and eng.pacer.stats()["unpaced_s"] == pytest.approx(0.006)
    done = []
    th = threading.Thread(target=lambda: done.append(eng.match_prefix("seq")), name="pdd-engine_0")
    th.start()
    th.join()
    st = eng.pacer.stats()
    assert done == [3] and st["unpaced_s"] == pytest.approx(0.016)
    merged = merge_stats([st])
    paced = sum(st[f"{k}_real_s"] for k in ("prefill", "decode", "import", "export"))
    assert merged["unpaced_engine_share"] == pytest.approx(0.016 / (0.016 + paced))


# ---------------------------------------------------------------- slow motion and emulated bytes


def test_time_scale_reaches_link_pacing_latency_and_timeouts(monkeypatch) -> None:
    import pdd_serve.transport.link as link_mod

    clk = FakeClock()
    monkeypatch.setattr(link_mod.time, "sleep", clk.sleep)
    # 100 MB/s line, 5 ms one way; each real byte stands for 10 emulated ones; slow motion x4
    link = LinkModel(clock=Clock(4), timer=clk, byte_scale=10, bandwidth_bps=8e8, one_way_latency_s=0.005)
    link.pace_sync(1_000_000)  # 10 MB emulated: 5 ms + 100 ms emulated = 420 ms real
    assert clk.t == pytest.approx(4 * (0.005 + 0.1), rel=1e-6)
    assert link.now() == pytest.approx(0.105, rel=1e-6)  # the link clock is emulated
    assert link.real_latency_s() == pytest.approx(0.02)  # control messages: 5 ms x 4

    cfg = load_config(_cross(policy={"kv_wait_timeout_s": 3.0}))
    assert cfg.time_scale == 20 and Clock(cfg.time_scale).real(cfg.policy.kv_wait_timeout_s) == 60.0
    real_bpt = 2048
    lm = graph_link(cfg, real_bpt)
    assert lm.clock == Clock(20) and lm.byte_scale == pytest.approx(327_680 / 2048)
    assert lm.bandwidth_bps == 10e9  # the line's own rate: the bytes are already the emulated model's


def test_orchestrator_scales_its_cross_site_waits_once() -> None:
    from pdd_serve.policy import LinkEstimate
    from pdd_serve.serve.orchestrator import Orchestrator

    cfg = load_config(_cross(policy={"kv_wait_timeout_s": 2.0}))
    orch = Orchestrator(cfg, backends=None, block_bytes=1, link=LinkEstimate(1e9, 0.01))
    assert orch.timeout == 40.0
    unemulated = Orchestrator(load_config({}), backends=None, block_bytes=1, link=LinkEstimate(1e9, 0.0))
    assert unemulated.timeout == 30.0


def test_unemulated_graph_is_unchanged() -> None:
    cfg = load_config({"link": "wan_10g"})
    assert not cfg.emulated and cfg.time_scale == 1.0 and kv_scale(cfg, 2048) == 1.0
    assert build_emulation(cfg, "prefill") is None and cfg.emulate_for("prefill") is None
    lm = graph_link(cfg, 2048)
    assert lm.clock == Clock(1) and lm.bandwidth_bps == pytest.approx(10e9 * 2048 / 50_000)


def test_emulation_resolves_role_over_site_over_shared() -> None:
    cfg = load_config(_cross(emulate={**EMU, "relay": {"chip": "h100-sxm", "tp": 8}}))
    p, r, md = (build_emulation(cfg, x) for x in ("prefill", "relay", "main_decode"))
    assert (p.chip.name, p.tp) == ("h100-sxm", 4)
    assert (r.chip.name, r.tp) == ("h100-sxm", 8)
    assert (md.chip.name, md.tp, cfg.time_scale) == ("h20", 8, 20.0)
    assert md.model.name == "llama-3-70b"


@pytest.mark.parametrize("emulate, field", [
    ({**EMU, "b": {"chip": "h21", "tp": 8}}, "emulate.b.chip: unknown chip 'h21'"),
    ({**EMU, "model": "llama-9"}, "emulate.model: unknown model shape 'llama-9'"),
    ({**EMU, "a": {"chip": "h100-sxm", "tp": 3}}, "emulate.a.tp: tp 3 does not divide"),
    ({**EMU, "a": {"chip": "h100-sxm", "tp": 1}}, "emulate.a.chip: llama-3-70b (141 GB of weights) on 1 x h100-sxm"),
    ({**EMU, "time_scale": 20}, "emulate.time_scale: time_scale is one key for the whole graph now: write "
                                "`time_scale: 20` at the top of the graph's args, beside `emulate:`"),
    ({**EMU, "b": {"chip": "h20", "tp": 8, "time_scale": 5}}, "emulate.b.time_scale: time_scale is one key"),
    ({"model": "llama-3-70b", "a": {"chip": "h100-sxm", "tp": 4}}, "the main_decode engine has no chip"),
    ({**EMU, "c": {"chip": "h20"}}, "emulate.c is neither a role"),
    ({**EMU, "b": {"chip": "h20", "tp": 8, "model": "llama-3-8b"}}, "emulate.model must be one for the whole graph"),
    ({**EMU, "b": {"chip": "h20", "tp": 8, "bogus": 1}}, "unknown key(s) emulate.b.bogus"),
    ([1, 2], "emulate must be a mapping"),
])
def test_bad_emulate_block_is_refused_at_load_with_the_field_named(emulate, field) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_cross(emulate=emulate))
    assert field in str(e.value)


@pytest.mark.parametrize("args, field", [
    (_cross(time_scale=0), "time_scale must be a number in (0, 1e6), got 0"),
    (_cross(time_scale=-2), "time_scale must be a number in (0, 1e6), got -2"),
    (_cross(time_scale=True), "time_scale must be a number in (0, 1e6), got True"),
    ({"time_scale": 5}, "time_scale 5 slows an emulated graph, and this graph has no emulate: block"),
    (_cross(link={"preset": "wan_10g", "time_scale": 20}), "link.time_scale: time_scale is one key for the whole "
                                                           "graph now: write `time_scale: 20` at the top"),
])
def test_time_scale_is_one_graph_wide_key(args, field) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert field in str(e.value)


def test_the_clock_is_the_one_place_slow_motion_is_applied() -> None:
    clock = Clock(20)
    assert clock.real(0.5) == 10.0 and clock.emulated(10.0) == 0.5 and clock.slower() == Clock(40)
    assert Clock().real(3.0) == 3.0 == Clock().emulated(3.0)  # unemulated: real time is emulated time
    assert load_config(_cross()).time_scale == 20.0 and load_config({}).time_scale == 1.0
    with pytest.raises(ValueError, match=r"time_scale must be a number in \(0, 1e6\)"):
        Clock(0)
    assert Clock(4e5).slower() == Clock(8e5) and Clock(5e5).slower() == Clock(5e5)  # never past the bound


def test_inline_model_shape() -> None:
    shape = {"name": "dense-13b", "params_b": 13, "layers": 40, "hidden": 5120, "heads": 40, "kv_heads": 40,
             "head_dim": 128}
    cfg = load_config(_cross(emulate={**EMU, "model": shape, "a": {"chip": "h100-sxm", "tp": 1},
                                      "b": {"chip": "h20", "tp": 1}}))
    assert build_emulation(cfg, "main_decode").kv_bytes_per_token == 40 * 40 * 128 * 2 * 2


# ---------------------------------------------------------------- the emulated comparison's pieces


def test_a_decoders_batch_cap_is_the_graphs_or_its_chips() -> None:
    """`decode_batch_cap`: a max_batch the graph sets wins; unemulated, the default; emulated, what
    the chips step within the TPOT SLO and hold (no SLO: the pool alone), never below one."""
    from pdd_serve.config import DEFAULT_MAX_BATCH
    from pdd_serve.emulation.pacer import Emulation, decode_batch_cap

    e = Emulation(H20, L70, 8)
    pool = e.kv_capacity_tokens
    assert decode_batch_cap(e, 7, 0.05, 4096, pool) == 7
    assert decode_batch_cap(None, None, 0.05, 4096, pool) == DEFAULT_MAX_BATCH
    slo = decode_batch_cap(e, None, 0.05, 4096, pool)
    assert slo == costmodel.decode_batch_limit(H20, L70, 8, 0.05, 4096, pool) > DEFAULT_MAX_BATCH
    assert decode_batch_cap(e, None, None, 4096, pool) == DEFAULT_MAX_BATCH  # no SLO to size it by: the default
    assert decode_batch_cap(e, None, None, 4096, 10 * 4096) == 10  # ... no larger than the pool holds
    assert decode_batch_cap(e, None, 1e-6, 4096, pool) == 1  # an SLO no batch meets: one at a time


def test_the_simulator_caps_each_decoder_as_its_replica_does(tmp_path) -> None:
    from evaluations.sim.emulated import load_scenario, sim_scenario_for
    from pdd_serve.emulation.pacer import decode_batch_cap

    sc = load_scenario("emulated_70b")
    sim = sim_scenario_for(sc, out_dir=tmp_path)
    pdd = sim.deployments["pdd"]
    for spec in (pdd.main_decode, pdd.relay):
        from pdd_serve.emulation.pacer import Emulation

        e = Emulation(CAT.chip(spec.chip), L70, spec.chips_per_instance)
        assert spec.max_batch == decode_batch_cap(e, None, sc.sla.tpot_s, 4096, e.kv_capacity_tokens)
    assert pdd.main_decode.max_batch != pdd.relay.max_batch  # 8 x H20 and 4 x H100 differ


def test_shipped_scenario_deploys_every_graph_emulated(tmp_path) -> None:
    from evaluations.harness import DEFAULT_GRAPHS, prepare_graphs
    from evaluations.sim.emulated import cost_per_hour, load_scenario, role_chips

    sc = load_scenario("emulated_70b")
    graphs = prepare_graphs(DEFAULT_GRAPHS, tmp_path, 8999, sc.link, emulate=sc)
    by = {g.name: g.cfg for g in graphs}
    assert all(c.emulated and c.time_scale == sc.time_scale for c in by.values())
    assert role_chips(by["pdd"]) == {"prefill": "4 x h100-sxm", "relay": "4 x h100-sxm", "main_decode": "8 x h20"}
    assert set(role_chips(by["pd_same_dc"]).values()) == {"4 x h100-sxm"}  # homogeneous: the BCR baseline
    # PDD rents a relay replica more than strong cross-DC PD, on the same chips
    assert cost_per_hour(by["pdd"]) == pytest.approx(cost_per_hour(by["pd_cross_dc"]) + 4 * 3.0)


def test_unknown_scenario_names_the_shipped_ones() -> None:
    from evaluations.sim.emulated import ScenarioError, load_scenario

    with pytest.raises(ScenarioError, match="emulated_70b"):
        load_scenario("no_such_scenario")


def test_load_generator_reads_records_in_emulated_seconds() -> None:
    from evaluations.loadgen import LoadConfig, RequestRecord, to_emulated

    rec = RequestRecord("s", 0, "warm", 10, 0.5, 4, 40.0)
    rec.ttft_s, rec.e2e_s, rec.itl_s = 2.0, 8.0, [1.0, 3.0]
    to_emulated(rec, Clock(20.0))
    assert (rec.t_send_s, rec.ttft_s, rec.e2e_s, rec.itl_s) == (2.0, 0.1, 0.4, [0.05, 0.15])
    with pytest.raises(ValueError, match="time_scale"):
        LoadConfig(time_scale=0)


def test_the_simulator_reads_the_same_scenario(tmp_path) -> None:
    from evaluations.sim.emulated import load_scenario, sim_scenario_for

    sim = sim_scenario_for(load_scenario("emulated_70b"), out_dir=tmp_path)
    assert set(sim.deployments) == {"pd_same_dc", "pd_cross_dc", "pd_cross_dc_naive", "pdd"}
    pdd = sim.deployments["pdd"]
    assert (pdd.prefill.chip, pdd.prefill.chips_per_instance) == ("h100-sxm", 4)
    assert (pdd.main_decode.chip, pdd.main_decode.chips_per_instance) == ("h20", 8)
    assert sim.model.kv_bytes_per_token == L70.kv_bytes_per_token
    assert sim.chips["h20"] == CAT.chip("h20")  # one catalog: the same ChipSpec in both worlds
    assert sim.links[pdd.link].cross_site and not sim.links[sim.deployments["pd_same_dc"].link].cross_site


def test_every_replica_is_priced_whole_with_the_line(tmp_path) -> None:
    from evaluations.sim.emulated import ScenarioError, cost_per_hour, load_scenario
    from pdd_serve.emulation.costmodel import load_catalog

    cfg = load_config(_cross())
    line = load_catalog().link_price(True)
    assert line > 0  # the report counts its inter-DC line; so do we
    # prefill and relay: 4 x h100-sxm at 3.0 $/h each, whole; main decode 8 x h20 at 1.3 $/h
    assert cost_per_hour(cfg) == pytest.approx(2 * 4 * 3.0 + 8 * 1.3 + line)
    sc = load_scenario("emulated_70b")
    assert cost_per_hour(cfg, sc.relative_prices(1.2)) == pytest.approx(2 * 4 * 3.0 + 8 * 1.2 * 3.0 + line)
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(sc.path).read() + "relay_cost_fraction: 0.075\n")
    with pytest.raises(ScenarioError, match="relay_cost_fraction: removed: every replica is priced whole"):
        load_scenario(bad)


@pytest.mark.parametrize("old,new,where", [
    ("sla: {ttft_s: 1.0, tpot_s: 0.05}", "sla: {ttft_s: 1.0}", "sla.tpot_s: required"),  # no silent default
    ("sla: {ttft_s: 1.0, tpot_s: 0.05}", "sla: {tpot_s: 0.05}", "sla.ttft_s: required"),
    ("\ntime_scale:", "\ntime_scale: true\n_was:", "time_scale"),  # the Clock's checks: not a bool
    ("\ntime_scale:", "\ntime_scale: 1.0e+7\n_was:", "time_scale"),  # nor beyond its bound
])
def test_emulated_scenario_errors_name_file_and_key(tmp_path, old: str, new: str, where: str) -> None:
    from evaluations.sim.emulated import ScenarioError, load_scenario

    text = open(load_scenario("emulated_70b").path).read()
    assert old in text
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace(old, new, 1).replace("\n_was:", "\n# was:"))
    with pytest.raises(ScenarioError) as e:
        load_scenario(bad)
    assert str(bad) in str(e.value) and where in str(e.value), str(e.value)


def test_each_repeat_draws_its_own_line_the_same_for_every_graph(tmp_path) -> None:
    """Repeat k deploys every cross-site graph with the link's seed + k: the repeats are k draws of
    the line's jitter, not one draw seen k times; same-DC has no line and is deployed as prepared."""
    from evaluations.harness import DEFAULT_GRAPHS, for_repeat, link_seed, prepare_graphs
    from evaluations.sim.emulated import load_scenario

    sc = load_scenario("emulated_70b")
    by = {g.name: g for g in prepare_graphs(DEFAULT_GRAPHS, tmp_path, 8999, sc.link, emulate=sc)}
    base = link_seed(by["pdd"])
    assert for_repeat(by["pdd"], 0) is by["pdd"] and link_seed(by["pd_same_dc"]) is None
    assert for_repeat(by["pd_same_dc"], 2) is by["pd_same_dc"]
    for name in ("pdd", "pd_cross_dc", "pd_cross_dc_naive"):
        g2 = for_repeat(by[name], 2)
        assert link_seed(g2) == base + 2 and g2.path != by[name].path and g2.cfg.emulated
        seeded = g2.cfg.link.line(2048, raw=True)
        assert seeded.bandwidth_bps == by[name].cfg.link.line(2048, raw=True).bandwidth_bps


def test_the_emulated_floor_is_built_from_the_modeled_steps(tmp_path) -> None:
    """An emulated request's TTFT floor: its prefill alone on the prefill chip past its prefix hit;
    on P->MD also the KV no faster than the line's mean rate (overlapping the prefill), a hop
    each way and MD's first step alone; a relay pipeline's first token is P's."""
    from evaluations.compare import modeled_floor, modeled_prefill_s
    from evaluations.harness import DEFAULT_GRAPHS, prepare_graphs
    from evaluations.loadgen import RequestRecord
    from evaluations.sim.emulated import load_scenario
    from pdd_serve.serve.prefill import PREFILL_CHUNK_TOKENS

    sc = load_scenario("emulated_70b")
    cfg = {g.name: g.cfg for g in prepare_graphs(DEFAULT_GRAPHS, tmp_path, 8999, sc.link, emulate=sc)}["pdd"]
    p, md = build_emulation(cfg, "prefill"), build_emulation(cfg, "main_decode")
    assert PREFILL_CHUNK_TOKENS == 256
    pre = p.prefill_s(256, 500) + p.prefill_s(244, 756)  # 1000 tokens, half cached: 500 past the hit, 2 chunks
    assert modeled_prefill_s(1000, 0.5, p, 256) == pytest.approx(pre)
    r = RequestRecord("s", 0, "warm", 1000, pdd={"pipeline": "P-MD", "prefix_hit_p": 0.5, "wan_bytes": 0})
    assert modeled_floor(r, cfg, 0.02, 2.5e9) == pytest.approx(pre + 0.04 + md.decode_s(1, 1000))
    r.pdd["wan_bytes"] = 500 * 320 * 1024  # 164 MB: 0.52 s on 2.5 Gb/s, longer than the prefill
    assert modeled_floor(r, cfg, 0.02, 2.5e9) == pytest.approx(500 * 320 * 1024 * 8 / 2.5e9 + 0.04 + md.decode_s(1, 1000))
    r.pdd["pipeline"] = "P-RLD-MD"
    assert modeled_floor(r, cfg, 0.02, 2.5e9) == pytest.approx(pre)


def test_the_emulated_compare_reads_its_runs_back_offline(tmp_path) -> None:
    """Everything the emulated compare does after its runs, on records shaped like a real run's
    (no cluster): modeled floors for every graph, the ratios with spreads over repeats, BCR with the
    relay priced at the scenario's share and whole, and the simulator replaying each repeat on the
    draw of the line the records say it met."""
    from evaluations.compare import (
        PDD,
        SAME,
        CompareConfig,
        GraphResult,
        add_sim_predictions,
        emulated_command,
        emulated_headline,
        floors,
        summarize_graph,
    )
    from evaluations.harness import DEFAULT_GRAPHS, for_repeat, link_seed, prepare_graphs
    from evaluations.loadgen import SLA, RequestRecord
    from evaluations.sim.emulated import load_scenario
    from evaluations.sim.validate import simulate_records

    sc = load_scenario("emulated_70b")
    graphs = prepare_graphs(DEFAULT_GRAPHS, tmp_path, 8999, sc.link, emulate=sc)
    results = {}
    for g in graphs:
        res = GraphResult(g)
        for rep in range(2):
            run = []
            for k in range(4):
                cross = g.cross_site
                run.append(RequestRecord(
                    f"s{k}", 0, "warm", 600, 0.9, 16, t_send_s=1.0 * k, status=200, token_ids=list(range(16)),
                    ttft_s=0.15 + 0.05 * k + (0.1 if cross else 0.0), tpot_s=0.01, e2e_s=0.4, output_tokens=16,
                    pdd={"pipeline": "P-MD", "prefix_hit_p": 0.9, "prefix_hit_md": 0.9 if cross else 0.0,
                         "wan_bytes": 60 * 320 * 1024 if cross else 0, "md_kv_wait_s": 0.02, "md_kv_land_s": 0.015, "ttft_s": 0.1,
                         **({"link_t_s": 30.0 + 3 * rep + k} if cross else {})}))
            res.runs.append(run)
            res.seeds.append(link_seed(for_repeat(g, rep)))
        results[g.name] = res
    cfg = CompareConfig(sla=SLA(sc.sla.ttft_s, sc.sla.tpot_s), repeats=2, emulate=sc, mlflow=False)
    # the table's first line and the JSON name the exact command that reruns it
    assert emulated_command(cfg) == "pdd compare --emulate emulated_70b --repeats 2"
    assert emulated_command(CompareConfig(repeats=3, naive_once=True, emulate=sc, graphs=("graphs/pdd.yaml",))) == (
        "pdd compare --emulate emulated_70b --repeats 3 --naive-once --graphs graphs/pdd.yaml")
    typed = "pdd compare --emulate emulated_70b --repeats 3 --naive-once --seed 7"  # as the cli passes it
    assert emulated_command(CompareConfig(emulate=sc, command=typed)) == typed
    summaries = {n: summarize_graph(r, cfg.sla, dict(cfg.site_chips), costmodel.user_catalog(cfg.catalog))
                 for n, r in results.items()}
    fl = floors(results)
    assert set(fl) == set(results)  # emulated: every graph, same-DC included, has a modeled floor
    for n, extra in fl.items():
        assert 0 < extra["ttft_floor_p50_s"] < summaries[n]["ttft_p50_s"] + 1e-9
        # the KV's landing is a part of MD's KV wait: the breakdown counts it once
        assert extra["pmd_md_kv_land_s_p50"] == 0.015
        assert extra["pmd_cross_site_rest_s_p50"] == pytest.approx(0.1 - 0.02)
        summaries[n].update(extra)
    head = emulated_headline(results, summaries, cfg)
    assert head["emulated"] and head["repeats"] == 2 and head["p90_ttft_vs_cross_dc_spread"] is not None
    assert head["priced"] == "every replica whole, and the line" and "bcr_gain_vs_same_dc_whole_relay" not in head
    rows = [row for r in results.values() for row in r.rows()]
    assert {row["link_seed"] for row in rows if row["graph"] == PDD} == {link_seed(for_repeat(results[PDD].graph, 0)),
                                                                        link_seed(for_repeat(results[PDD].graph, 1))}
    assert {row["link_seed"] for row in rows if row["graph"] == SAME} == {None}
    sim = simulate_records(sc, graphs, rows, tmp_path)
    assert sim[PDD]["predicted"]["runs_on_recorded_link"] == 2 and sim[PDD]["predicted"]["draws"] == 1
    add_sim_predictions(head, sim)
    assert head["sim_vs_real_max_rel_err"] is not None and head["sim_p90_ttft_vs_cross_dc"] is not None
    # each simulated ratio is taken as the measured one is: per repeat, then the median
    per = head["sim_p90_ttft_vs_cross_dc_per_repeat"]
    assert len(per) == 2 and head["sim_p90_ttft_vs_cross_dc"] == pytest.approx(sorted(per)[0] / 2 + sorted(per)[1] / 2)
    # the P90 ratio's spread over draws of the line, from the same records (evaluations.p90_spread)
    from evaluations.p90_spread import p90_ratio_spread
    from evaluations.sim.config import load_scenario as load_sim

    spread_rows = p90_ratio_spread(load_sim(tmp_path / "sim_scenario.yaml"), rows, draws=4, tiles=(1, 2))
    assert [r["requests_per_repeat"] for r in spread_rows] == [4, 8]
    assert all(0 < r["ratio_p10"] <= r["ratio_median"] <= r["ratio_p90"] and r["spread_median"] >= 0
               for r in spread_rows)


def test_the_emulated_compare_is_told_the_command_line_that_ran_it(monkeypatch) -> None:
    """`pdd compare ...` hands its own command line to the comparison, which prints it first."""
    from evaluations import compare
    from pdd_serve import cli

    seen = {}

    def fake_run(workload, cfg):  # noqa: ANN001, ANN202 - stands in for the cluster run
        seen["command"] = compare.emulated_command(cfg)
        return {"headline": {"mismatched_requests": 0}, "summaries": {}}

    monkeypatch.setattr(compare, "run_compare", fake_run)
    argv = ["compare", "--emulate", "emulated_70b", "--repeats", "2", "--naive-once", "--no-mlflow"]
    assert cli.main(argv) == 0
    assert seen["command"] == "pdd compare --emulate emulated_70b --repeats 2 --naive-once --no-mlflow"


# ---------------------------------------------------------------- pools sized by the emulated chips


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_each_role_pool_is_what_its_emulated_chips_hold_and_costs_only_what_it_fills(model_dir) -> None:
    """(HBM x chips - weights) / emulated KV per token, per role, in real blocks; the real memory is
    mapped on first touch, so a 70B's pool on 8 x H20 doesn't cost this host its gigabytes."""
    from pdd_serve.checkpoints import resolve_model
    from pdd_serve.config import DEFAULT_MAX_BATCH
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.sampling import SamplingParams
    from pdd_serve.serve.common import batch_cap, load_engine

    cfg = load_config({**_cross(), "model": {"path": str(model_dir)}, "policy": {"tpot_slo_s": 0.05}})
    for role in ("prefill", "main_decode"):
        emu = build_emulation(cfg, role)
        before = _rss_bytes()
        eng = load_engine(cfg.engine_for(role), emulation=emu, clock=Clock(cfg.time_scale))
        inner = eng.inner
        assert inner.pool.num_blocks == emu.kv_capacity_tokens * inner.layout.bytes_per_token // inner.layout.block_bytes
        if role == "main_decode":  # 8 x H20: past the 256 MiB default (kv_cache_bytes), yet mapped, not touched
            assert inner.pool.data.nbytes > 256 << 20
            assert _rss_bytes() - before < inner.pool.data.nbytes // 4
        assert float(inner.pool.data[-1].abs().sum()) == 0.0  # and reads as zeros
        # the batch cap is the chips' too: prefill keeps the default, a decoder the largest batch its
        # chips step within the TPOT SLO with every sequence at the model's 4K positions, in its pool
        cap = batch_cap(cfg, role, eng)
        ctx = inner.args.max_position_embeddings
        assert cap == (DEFAULT_MAX_BATCH if role == "prefill" else
                       costmodel.decode_batch_limit(emu.chip, emu.model, emu.tp, 0.05, ctx,
                                                    inner.pool.num_blocks * inner.block_size))
        if role == "main_decode":
            assert cap > DEFAULT_MAX_BATCH  # 8 x H20 step far more than 32 sequences within 50 ms
            assert emu.decode_s(cap, cap * ctx) <= 0.05 < emu.decode_s(cap + 1, (cap + 1) * ctx)
    # the tokens are the engine's own with a lazily mapped pool
    ref = Engine.from_pretrained(resolve_model(str(model_dir)))
    prompt = [(i * 5 + 3) % 400 + 10 for i in range(40)]
    seq = inner.add("r", prompt, SamplingParams(6))
    inner.prefill(seq)
    while not seq.finished:
        inner.step([seq])
    assert seq.output_ids == ref.generate(prompt, 6)
