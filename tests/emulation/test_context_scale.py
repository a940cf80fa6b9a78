"""context_scale (issue 40, item 5): one real prompt token stands for k emulated tokens in every
cost; a generated token for one. The report's 64K prompts on the small model's 4K positions."""

from __future__ import annotations

import pytest

from pdd_serve.config import ConfigError, load_config
from pdd_serve.emulation import costmodel
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.pacer import Emulation, StepPacer, build_emulation, decode_batch_cap, kv_scale
from pdd_serve.engine.protocol import ForwardWork, prompt_split

CAT = costmodel.load_catalog()
L70 = CAT.model("llama-3-70b")
H100, H20 = CAT.chip("h100-sxm"), CAT.chip("h20")
K = 32
EMU = {"model": "llama-3-70b", "a": {"chip": "h100-sxm", "tp": 4}, "b": {"chip": "h20", "tp": 8}}


class FakeClock:
    """The pacer's timer and sleep: sleeping advances it (nothing waits for real)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_a_prompt_token_costs_k_tokens_and_a_generated_token_one() -> None:
    e, one = Emulation(H100, L70, 4, K), Emulation(H100, L70, 4)
    # a 256-token prompt chunk after 1,024 prompt tokens: the simulator's 8,192-token chunk after 32,768
    w = ForwardWork("prefill", 1, 256, 1024, 0.0, prompt_new=256, prompt_context=1024)
    assert e.forward_s(w) == pytest.approx(one.prefill_s(256 * K, 1024 * K))
    # an extend of 10 tokens, 4 of them the prompt's tail, after the whole prompt minus 4
    w = ForwardWork("prefill", 1, 10, 96, 0.0, prompt_new=4, prompt_context=96)
    assert e.forward_s(w) == pytest.approx(one.prefill_s(4 * K + 6, 96 * K))
    # a decode step of two sequences: 2,000 prompt tokens and 100 generated ones of context
    w = ForwardWork("decode", 2, 2, 2100, 0.0, prompt_context=2000)
    assert e.forward_s(w) == pytest.approx(one.decode_s(2, 2000 * K + 100))
    # KV: a real token's bytes on the line, in copies and in the pool are k emulated tokens'
    assert e.kv_bytes_per_token == K * L70.kv_bytes_per_token
    assert e.copy_s(16) == pytest.approx(one.copy_s(16 * K))
    assert e.real_pool_tokens == e.kv_capacity_tokens // K and one.real_pool_tokens == one.kv_capacity_tokens
    # k = 1 is the unscaled emulation, whatever the split says
    w = ForwardWork("prefill", 1, 256, 1024, 0.0, prompt_new=256, prompt_context=1024)
    assert one.forward_s(w) == pytest.approx(one.prefill_s(256, 1024))


def test_a_forward_reports_its_prompt_tokens_within_its_tokens() -> None:
    assert prompt_split(100, 0, 64) == (64, 0)
    assert prompt_split(100, 64, 110) == (36, 64)  # the prompt's tail and the first generated tokens
    assert prompt_split(100, 100, 101) == (0, 100)  # a decode step
    with pytest.raises(ValueError, match="prompt tokens"):
        ForwardWork("prefill", 1, 10, 0, 0.0, prompt_new=11)
    with pytest.raises(ValueError, match="prompt tokens"):
        ForwardWork("decode", 1, 1, 10, 0.0, prompt_context=11)


def test_the_engine_reports_its_prompt_split_and_is_paced_by_it(model_dir) -> None:
    """The torch engine tells which tokens of each forward are the prompt's: prefill chunks all,
    decode steps none of the new and the prompt of the context, an extend of generated tokens (a
    catch-up handoff) none. Paced at k = 32, the prefill costs 32 x the prompt; tokens unchanged."""
    from pdd_serve.emulation.pacer import PacedEngine
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.sampling import SamplingParams

    ref = Engine.from_pretrained(model_dir)
    prompt = [(i * 7 + 3) % 500 + 10 for i in range(40)]
    want = ref.generate(prompt, 6)
    raw = Engine.from_pretrained(model_dir)
    seen: list[ForwardWork] = []
    raw.on_forward = seen.append
    seq = raw.add("r", prompt, SamplingParams(6))
    raw.prefill(seq, chunk_tokens=16)
    assert [(w.new_tokens, w.prompt_new, w.context_tokens, w.prompt_context) for w in seen] == [
        (16, 16, 0, 0), (16, 16, 16, 16), (8, 8, 32, 32)]
    seen.clear()
    raw.step([seq])
    raw.step([seq])
    assert [(w.prompt_new, w.context_tokens, w.prompt_context) for w in seen] == [(0, 40, 40), (0, 41, 40)]
    # main decode's catch-up: the prompt's KV arrived, the generated tokens are extended
    md = Engine.from_pretrained(model_dir)
    got: list[ForwardWork] = []
    md.on_forward = got.append
    s2 = md.add("r2", prompt, SamplingParams(6))
    md.prefill(s2)
    got.clear()
    md.extend(s2, list(seq.output_ids[1:3]))
    (w,) = got
    assert (w.new_tokens, w.prompt_new, w.context_tokens, w.prompt_context) == (3, 0, 40, 40)

    clk = FakeClock()
    emu = Emulation(H100, L70, 8, K)
    eng = PacedEngine(Engine.from_pretrained(model_dir), StepPacer(emu, Clock(1000), timer=clk, sleep=clk.sleep))
    s3 = eng.add("r3", prompt, SamplingParams(6))
    eng.prefill(s3)
    while not s3.finished:
        eng.step([s3])
    assert s3.output_ids == want
    st = eng.pacer.stats()
    one = Emulation(H100, L70, 8)
    assert st["prefill_modeled_s"] == pytest.approx(one.prefill_s(40 * K, 0))
    assert st["decode_modeled_s"] == pytest.approx(sum(one.decode_s(1, 40 * K + j) for j in range(5)))


def _cross(**extra) -> dict:
    return {"link": {"preset": "wan_10g", "jitter": "constant"}, "emulate": EMU, "time_scale": 20, **extra}


def test_context_scale_is_checked_at_load_with_the_field_named() -> None:
    cfg = load_config(_cross(context_scale=K))
    assert cfg.context_scale == K and build_emulation(cfg, "prefill").context_scale == K
    assert kv_scale(cfg, 2048) == pytest.approx(K * 327_680 / 2048)  # every crossing block is a prompt's
    assert load_config(_cross()).context_scale == 1
    with pytest.raises(ConfigError, match="no emulate"):
        load_config({"context_scale": K})
    for bad in (0, 1.5, "32", True):
        with pytest.raises(ConfigError, match="context_scale must be an int"):
            load_config(_cross(context_scale=bad))
    # one request at the engine's context limit must fit the chips' KV room in emulated tokens:
    # 4 x H100 hold ~448K tokens of a 70B's KV, under 4,096 x 200
    with pytest.raises(ConfigError, match="KV room"):
        load_config(_cross(context_scale=200))


def test_the_batch_cap_counts_the_context_in_emulated_tokens() -> None:
    e = Emulation(H20, L70, 8, K)
    pool = e.real_pool_tokens
    assert decode_batch_cap(e, None, 0.05, 4096, pool) == costmodel.decode_batch_limit(
        H20, L70, 8, 0.05, 4096 * K, pool * K)
    sized = Emulation(H20, L70, 8, K, batch_context_tokens=66_560)  # the workload's longest request
    cap = decode_batch_cap(sized, None, 0.05, 4096, pool)
    assert cap == costmodel.decode_batch_limit(H20, L70, 8, 0.05, 66_560, pool * K)
    assert cap > decode_batch_cap(e, None, 0.05, 4096, pool)
    assert decode_batch_cap(sized, 5, 0.05, 4096, pool) == 5  # the graph's own max_batch still wins


def test_the_simulator_counts_a_prompt_token_k_times() -> None:
    from evaluations.sim.blind import sim_workload
    from evaluations.workloads import Session, Turn, Workload

    toks = tuple(range(100, 140))
    wl = Workload("t", (Session("a#0", (Turn(toks, 8, "agentic"),), 0.0),), (), ())
    sw = sim_workload(wl, 16, None, K)
    (r,) = sw.requests
    assert r.prompt == 40 * K and r.output == 8 and len(r.blocks) == 2 and sw.block_size == 16 * K
    with pytest.raises(ValueError, match="single-turn"):
        sim_workload(wl, 16, {("a", 0): [1, 2]}, K)


def test_report_64k_is_the_reports_regime(tmp_path) -> None:
    from evaluations.harness import prepare_graphs
    from evaluations.sim.emulated import decode_caps, load_scenario, sim_scenario_for

    sc = load_scenario("report_64k")
    assert sc.context_scale == K and sc.model.name == "llama-3.1-70b" and sc.workload["turns"] == 1
    assert sc.batch_context_tokens == 2048 * K + 1024
    graphs = prepare_graphs(["graphs/pdd.yaml"], tmp_path / "g", 8999, sc.link, emulate=sc)
    cfg = graphs[0].cfg
    assert cfg.context_scale == K and build_emulation(cfg, "main_decode").batch_context_tokens == sc.batch_context_tokens
    e = build_emulation(cfg, "main_decode")
    assert decode_caps(cfg)["main_decode"] == decode_batch_cap(e, None, sc.sla.tpot_s, 4096, e.real_pool_tokens)
    sim = sim_scenario_for(sc, graphs, tmp_path)
    assert sim.scheduler.prefill_chunk_tokens == 256 * K  # the simulator's report units
    assert sim.workload.block_size == 16 * K


def test_a_scaled_scenario_sends_single_turn_requests(tmp_path) -> None:
    from evaluations.sim.emulated import ScenarioError, load_scenario

    src = (load_scenario("report_64k").path)
    text = open(src).read().replace("turns: 1,", "turns: 3,")
    p = tmp_path / "s.yaml"
    p.write_text(text)
    with pytest.raises(ScenarioError, match="workload.turns"):
        load_scenario(p)
    p.write_text(open(src).read().replace("context_scale: 32", "context_scale: 0"))
    with pytest.raises(ScenarioError, match="context_scale"):
        load_scenario(p)


def test_report_scale_splits_each_sites_replicas_and_grows_the_relay_pool(tmp_path) -> None:
    from evaluations.harness import prepare_graphs
    from evaluations.report_scale import (
        best_split,
        coarse,
        scaled_scenario,
        site_replicas,
        splits,
        with_counts,
    )
    from evaluations.sim.emulated import load_scenario

    sc = load_scenario("report_64k")
    assert site_replicas(sc, "pd_same_dc") == {"a": 22}  # 88 A at tp 4
    assert site_replicas(sc, "pdd") == {"a": 10, "b": 4}  # 43 A at tp 4, 32 B at tp 8
    assert splits("pd_cross_dc", {"a": 10, "b": 4}) == [{"prefill": 10, "main_decode": 4}]
    pdd = splits("pdd", {"a": 10, "b": 4})
    assert len(pdd) == 9 and all(c["prefill"] + c["relay"] == 10 and c["main_decode"] == 4 for c in pdd)
    assert [c["prefill"] for c in splits("pd_same_dc", {"a": 22})] == list(range(1, 22))
    few = coarse(pdd, 4)
    assert len(few) == 4 and few[0] == 0 and few[-1] == len(pdd) - 1
    # the best split: a coarse pass, then every split between the best one's neighbours
    opts = splits("pd_same_dc", {"a": 22})
    peak = {o["prefill"]: 10 - abs(o["prefill"] - 7) for o in opts}  # unimodal, best at P = 7
    seen: list[int] = []
    tried, best = best_split(opts, lambda o: seen.append(o["prefill"]) or peak[o["prefill"]], keep=6)
    assert tried[best][1]["prefill"] == 7 and tried[best][0] == 10
    assert len(seen) == len(set(seen)) < len(opts)  # each split simulated once, not all of them
    (g,) = prepare_graphs(["graphs/pdd.yaml"], tmp_path, 8999, sc.link, emulate=sc)
    big = with_counts(g, {"prefill": 4, "relay": 6, "main_decode": 4})
    assert (big.cfg.sites.prefill_replicas, big.cfg.sites.relay_replicas, big.cfg.sites.main_decode_replicas) == (4, 6, 4)
    assert big.cfg.policy.relay_max_running == 6 * g.cfg.policy.relay_max_running // g.cfg.sites.relay_replicas
    assert scaled_scenario(sc, 4).link["bandwidth_bps"] == 4 * sc.link["bandwidth_bps"]
    assert scaled_scenario(sc, 4, deployed_md=2).link["bandwidth_bps"] == 2 * sc.link["bandwidth_bps"]


def test_the_calibration_and_the_floor_model_a_scaled_prompt() -> None:
    """The compare's calibration subtracts the modeled prefill and first step from a lone request's
    TTFT: at k = 32 they are the emulated prompt's, or the software overhead would absorb them."""
    from evaluations.compare import modeled_prefill_s

    e, one = Emulation(H100, L70, 4, K), Emulation(H100, L70, 4)
    want = one.prefill_s(256 * K, 500 * K) + one.prefill_s(244 * K, 756 * K)
    assert modeled_prefill_s(1000, 0.5, e, 256) == pytest.approx(want)


def test_a_mixed_step_is_costed_by_its_sequences() -> None:
    """vLLM steps prefill chunks and decodes together: the step attends per sequence (a chunk over
    its own context, each decode over its own), not the summed chunk over the summed context."""
    e, one = Emulation(H100, L70, 4, K), Emulation(H100, L70, 4)
    parts = ((256, 1024, 256, 1024), (1, 2000, 0, 1900), (1, 3000, 0, 2900))
    w = ForwardWork("prefill", 3, 258, 6024, 0.0, 256, 5824, parts)
    want = costmodel.prefill_time(H100, L70, 4, [(256 * K, 1024 * K), (1, 1900 * K + 100), (1, 2900 * K + 100)])
    assert e.forward_s(w) == pytest.approx(want)
    lumped = ForwardWork("prefill", 3, 258, 6024, 0.0, 256, 5824)
    assert e.forward_s(w) < e.forward_s(lumped)  # the summed piece attends every new token to every context
    assert one.forward_s(ForwardWork("prefill", 1, 256, 1024, 0.0, parts=((256, 1024, 0, 0),))) == pytest.approx(
        one.prefill_s(256, 1024))
    with pytest.raises(ValueError, match="parts"):
        ForwardWork("prefill", 2, 258, 6024, 0.0, 256, 5824, parts)  # three parts for two sequences
    with pytest.raises(ValueError, match="parts"):
        ForwardWork("prefill", 3, 258, 6024, 0.0, 256, 5824, ((256, 1024, 256, 1024),) * 3)
