"""The load generator against a fake OpenAI server (httpx MockTransport), and the figures it reports."""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

import httpx
import pytest

from evaluations.compare import TARGETS, first_token_hops, headline, outputs_identity, request_floor
from evaluations.cost import CatalogError, bcr, hardware_cost
from evaluations.harness import prepare_graphs
from evaluations.loadgen import SLA, LoadConfig, RequestRecord, run_workload, summarize_run
from evaluations.workloads import Session, Turn
from pdd_serve.emulation.costmodel import CostModelError, load_catalog, user_catalog


def _fake_server(calls: list[dict]) -> httpx.MockTransport:
    """Answers each streamed completion with token ids 1000+len(prompt), ..., like the router does:
    a first chunk, one chunk per token, a final chunk with the pdd object, usage, [DONE]."""
    return httpx.MockTransport(lambda request: _answer(request, calls))


def _answer(request: httpx.Request, calls: list[dict]) -> httpx.Response:
    body = json.loads(request.content)
    calls.append(body)
    n, base = body["max_tokens"], 1000 + len(body["prompt"]) % 500
    chunks = [{"choices": [{"text": f"t{i}", "token_ids": [base + i], "finish_reason": None}]} for i in range(n)]
    chunks.append({"choices": [{"text": "", "token_ids": [], "finish_reason": "length"}],
                   "pdd": {"pipeline": "P-RLD-MD", "eager_tokens": 2, "wan_bytes": 4096, "handoff_mode": "one-shot",
                           "prefix_hit_p": 0.5, "prefix_hit_md": 0.75}})
    chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})


def test_sessions_send_token_ids_and_carry_answers_into_the_next_turn():
    calls: list[dict] = []
    s = Session("s0", (Turn((5, 6, 7), 3), Turn((8,), 2, think_s=0.01), Turn((9, 9), 2, reset_to=2)))
    recs = asyncio.run(run_workload("http://fake", [s], transport=_fake_server(calls)))
    assert [c["prompt"] for c in calls] == [[5, 6, 7], [5, 6, 7, 1003, 1004, 1005, 8], [5, 6, 9, 9]]
    assert all(c["return_token_ids"] and c["stream"] and c["ignore_eos"] and c["temperature"] == 0 for c in calls)
    r = recs[0]
    assert r.token_ids == [1003, 1004, 1005] and r.output_tokens == 3 and r.finish_reason == "length"
    assert r.pdd["pipeline"] == "P-RLD-MD" and not r.error
    assert 0 <= r.ttft_s <= r.tt2t_s <= r.e2e_s and r.tpot_s >= 0 and r.itl_max_s >= 0
    assert [x.prompt_tokens for x in recs] == [3, 7, 4]


def test_a_closed_loop_keeps_its_clients_busy_and_no_more():
    """`clients` sessions at a time, each client starting the next when its own ended (start_s
    ignored), each session's turns in order as in the open loop."""
    calls: list[dict] = []
    live, peak = [0], [0]

    async def handler(request: httpx.Request) -> httpx.Response:
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        await asyncio.sleep(0.01)  # the others arrive meanwhile
        live[0] -= 1
        return _answer(request, calls)

    sessions = [Session(f"s{i}", (Turn((i + 5,), 2), Turn((8,), 2)), start_s=100.0) for i in range(5)]
    t0 = time.monotonic()
    recs = asyncio.run(run_workload("http://fake", sessions, LoadConfig(clients=2),
                                    transport=httpx.MockTransport(handler)))
    assert time.monotonic() - t0 < 10 and peak[0] == 2 and len(recs) == 10 and not any(r.error for r in recs)
    assert [c["prompt"] for c in calls if c["prompt"][0] == 9] == [[9], [9, 1001, 1002, 8]]  # the last session
    with pytest.raises(ValueError, match="clients"):
        LoadConfig(clients=0)


def test_a_failed_turn_skips_the_rest_of_its_session():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, json={"error": {"message": "overloaded"}})

    s = Session("s0", (Turn((5,), 3), Turn((8,), 2)))
    recs = asyncio.run(run_workload("http://fake", [s], transport=httpx.MockTransport(handler)))
    assert recs[0].error.startswith("HTTP 503") and recs[1].error == "skipped: turn 0 failed"


def _rec(sid: str, ttft: float, tpot: float, out: int = 10, eager: int = 0, t_send: float = 0.0, e2e: float = 1.0,
         tt2t: float | None = None, ids: list[int] | None = None, **pdd) -> RequestRecord:
    return RequestRecord(sid, 0, "agentic", 100, 0.9, out, t_send, 200, ttft_s=ttft, tt2t_s=tt2t or ttft, tpot_s=tpot,
                         e2e_s=e2e, output_tokens=out, token_ids=ids or list(range(out)),
                         pdd={"eager_tokens": eager, "wan_bytes": 1000, "pipeline": "P-MD", **pdd})


def test_summary_percentiles_goodput_and_rld_share():
    recs = [_rec(f"s{i}", ttft=0.1 * (i + 1), tpot=0.01, eager=2 if i < 5 else 0, t_send=i, e2e=1.0) for i in range(10)]
    recs[9].tpot_s = 0.5  # misses the TPOT target
    s = summarize_run(recs, SLA(ttft_s=0.85, tpot_s=0.1))
    assert s["ttft_p50_s"] == pytest.approx(0.55) and s["ttft_p90_s"] == pytest.approx(0.91)
    assert s["sla_ok"] == 8 and s["makespan_s"] == pytest.approx(10.0) and s["goodput_rps"] == pytest.approx(0.8)
    assert s["rld_token_share"] == pytest.approx(10 / 100) and s["wan_bytes"] == 10_000
    assert s["pipelines"] == {"P-MD": 10}
    assert math.isnan(summarize_run([], SLA())["goodput_rps"])


def test_headline_ratios_targets_and_output_identity():
    from evaluations.compare import GraphResult

    def summ(ttft50, ttft90, good, share=0.0, ok=10, floor=None):
        return {"ttft_p50_s": ttft50, "ttft_p90_s": ttft90, "tt2t_p50_s": ttft50, "tt2t_p90_s": ttft90,
                "goodput_rps": good, "rld_token_share": share, "bcr_req_per_usd": good, "wan_bytes": 1,
                "e2e_p90_s": 1, "sla_ok": ok, "requests": 20, "itl_p99_s": 0.05, "ttft_vs_floor_p50": floor}

    graphs = {"pd_same_dc": summ(0.2, 0.3, 1.0), "pd_cross_dc": summ(0.3, 4.0, 0.5),
              "pd_cross_dc_naive": summ(0.5, 8.0, 0.25), "pdd": summ(0.24, 1.0, 0.8, 0.06, floor=1.1)}
    head = headline(graphs, True, 0, control_latency=True)
    assert head["p90_ttft_vs_cross_dc"] == 0.25 and head["p50_ttft_vs_same_dc"] == 1.2
    assert head["p90_ttft_vs_cross_dc_naive"] == 0.125 and head["goodput_vs_cross_dc_naive"] == 3.2
    assert head["goodput_vs_cross_dc"] == 1.6 and head["rld_token_share"] == 0.06 and head["outputs_identical"]
    assert head["p50_ttft_vs_floor"] == 1.1 and head["itl_p99_vs_same_dc"] == 1.0
    assert head["targets_met"] == dict.fromkeys(TARGETS, True)
    assert json.loads(json.dumps(head)) == head
    # a baseline that met the SLA on no request: SLA-meeting requests against one, a number with a note
    zero = headline({**graphs, "pd_cross_dc": summ(5.0, 9.0, 0.0, ok=0)}, True, 0, control_latency=True)
    # PDD met 10 of 20, the baseline 0 of 20: (10/20) / (1/20)
    assert zero["goodput_vs_cross_dc"] == 10.0 and zero["targets_met"]["goodput_vs_cross_dc"] is True
    assert "lower bound" in zero["goodput_vs_cross_dc_note"]
    assert headline(graphs, True, 0)["targets_met"]["control_latency_emulated"] is False

    a = GraphResult(None, [[_rec("x", 0.1, 0.01, ids=[1, 2]), _rec("y", 0.1, 0.01, ids=[3])]])
    b = GraphResult(None, [[_rec("x", 0.2, 0.01, ids=[1, 2]), _rec("y", 0.1, 0.01, ids=[3])]])
    c = GraphResult(None, [[_rec("x", 0.2, 0.01, ids=[1, 9]), _rec("y", 0.1, 0.01, ids=[3])]])
    assert outputs_identity({"a": a, "b": b})[:2] == (True, 0)
    ok, n, examples = outputs_identity({"a": a, "b": b, "c": c})
    assert not ok and n == 1 and "x turn 0" in examples[0]
    # --naive-once: a graph that ran the first repeat only is compared there, not counted missing later
    rep2 = [_rec("x", 0.1, 0.01, ids=[1, 2]), _rec("y", 0.1, 0.01, ids=[3])]
    two_a, two_b = GraphResult(None, [*a.runs, rep2]), GraphResult(None, [*b.runs, list(rep2)])
    assert outputs_identity({"a": two_a, "b": two_b, "once": b})[:2] == (True, 0)
    assert outputs_identity({"a": two_a, "b": two_b, "once": c})[:2] == (False, 1)
    # ... but a request missing from a repeat a graph did run still is
    short = GraphResult(None, [*b.runs, rep2[:1]])
    ok, n, examples = outputs_identity({"a": two_a, "b": short})
    assert not ok and n == 1 and "repeat 1 y" in examples[0]


def test_hardware_cost_and_bcr_from_the_catalog(tmp_path):
    cat = load_catalog()
    root = Path(__file__).resolve().parents[2] / "graphs"
    graphs = {g.name: g for g in prepare_graphs([root / "pd_same_dc.yaml", root / "pd_cross_dc.yaml",
                                                 root / "pdd.yaml"], tmp_path, 18420)}
    chips = {"a": "cpu", "b": "h20"}
    same = hardware_cost(graphs["pd_same_dc"].cfg, chips, cat)
    pdd = hardware_cost(graphs["pdd"].cfg, chips, cat)
    assert [r[0] for r in pdd.roles] == ["prefill", "relay", "main_decode"]
    assert pdd.per_hour == pytest.approx(2 * cat.chip("cpu").price_per_hour + cat.chip("h20").price_per_hour
                                         + cat.link_price(True))
    assert same.link_per_hour == 0 and same.params()["chip.a"] == "cpu"
    assert bcr(0.5, 1.8) == pytest.approx(1000.0) and math.isnan(bcr(0.5, 0.0))
    # the cross-site graphs get the same link and a private HTTP port
    assert graphs["pd_cross_dc"].link == graphs["pdd"].link and graphs["pd_cross_dc"].cross_site
    assert "port: 18420" in graphs["pdd"].path.read_text()
    with pytest.raises(CatalogError, match="not in the catalog"):
        hardware_cost(graphs["pdd"].cfg, {"a": "tpu9", "b": "cpu"}, cat)
    # a user's own catalog comes in through the one loader, with its schema; errors name the file
    bad = tmp_path / "chips.yaml"
    bad.write_text("chips:\n  x: {peak_tflops: 1, mem_gb: 1, mem_bw_gb_s: 1, interconnect_gb_s: 1, price_per_hour: -1}\n")
    with pytest.raises(CostModelError, match=f"{bad}: chips.x.price_per_hour"):
        load_catalog(bad)
    old = tmp_path / "old.yaml"  # the retired price catalog's fields are refused by name
    old.write_text("chips:\n  x: {price_per_hour: 1, memory_gb: 80}\n")
    with pytest.raises(CostModelError, match="chips.x.memory_gb: unknown field"):
        load_catalog(old)


def test_a_users_catalog_adds_to_the_shipped_one(tmp_path):
    """`--catalog FILE` and a scenario's `catalog:` come in one way: the shipped catalog with the
    file's entries over it."""
    assert user_catalog(None) == load_catalog()
    own = tmp_path / "own.yaml"
    own.write_text("chips:\n  h20: {peak_tflops: 1, mem_gb: 1, mem_bw_gb_s: 1, interconnect_gb_s: 1, price_per_hour: 9}\n"
                   "  x: {peak_tflops: 1, mem_gb: 1, mem_bw_gb_s: 1, interconnect_gb_s: 1, price_per_hour: 2}\n"
                   "links:\n  cross_dc: {price_per_hour: 0.5}\n")
    cat, shipped = user_catalog(own), load_catalog()
    assert cat.chip("h20").price_per_hour == 9 and cat.chip("x").price_per_hour == 2  # yours win, and add
    assert cat.chip("cpu") == shipped.chip("cpu") and cat.models == shipped.models  # the shipped ones stay
    assert cat.link_price(True) == 0.5 and cat.link_price(False) == shipped.link_price(False)


def test_request_floor_counts_the_hops_and_bytes_the_first_token_needs():
    # P->MD under the PD convention: the KV crosses (latency + bytes at the line rate), the token returns
    assert request_floor(0.2, "P-MD", 1_000_000, 0.05, 8e6) == pytest.approx(0.2 + 0.1 + 1.0)
    # the relay pipelines (and stream_first_token) send P's own token from site A: the same-DC floor
    assert request_floor(0.2, "P-RLD-MD", 1_000_000, 0.05, 8e6) == 0.2
    assert request_floor(0.2, "P-MD", 1_000_000, 0.05, 8e6, stream_first_token=True) == 0.2
    assert first_token_hops("P-MD", False) == 2 and first_token_hops("P-RLD", False) == 0


def test_itl_is_pooled_over_every_gap():
    recs = [_rec("a", 0.1, 0.01), _rec("b", 0.1, 0.01)]
    recs[0].itl_s, recs[1].itl_s = [0.01] * 98 + [1.0], [0.01]
    s = summarize_run(recs, SLA())
    assert s["itl_p50_s"] == pytest.approx(0.01) and s["itl_p99_s"] > 0.01


def test_slow_motion_stretches_arrivals_and_think_times_and_reads_back_emulated_seconds(monkeypatch):
    """time_scale 50: a session starting at 0.02 emulated s, thinking 0.01 s between turns, sleeps
    1.0 s and 0.5 s of real time; its records read in emulated seconds (sleeps are recorded, not waited)."""
    import evaluations.loadgen as lg
    from evaluations.loadgen import LoadConfig

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def fake_sleep(s: float) -> None:
        slept.append(s)
        await real_sleep(0)

    monkeypatch.setattr(lg.asyncio, "sleep", fake_sleep)
    s = Session("s0", (Turn((5, 6, 7), 2), Turn((8,), 2, think_s=0.01)), start_s=0.02)
    recs = asyncio.run(run_workload("http://fake", [s], LoadConfig(time_scale=50), transport=_fake_server([])))
    # asyncio.sleep is patched module-wide: another task's 0.1 s poll may come first (seen in CI)
    assert any(x == pytest.approx(1.0, abs=0.05) for x in slept) and 0.5 in slept, slept
    assert all(r.ttft_s is not None and r.ttft_s < 0.05 for r in recs)  # a real ms or so, /50
