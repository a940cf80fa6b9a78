"""Evaluation workloads: the hit distribution is what was asked, contexts grow, traces parse (and a bad
line names its file and line), everything is reproducible from its seed."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from evaluations.workloads import (
    DEFAULT_TRACE,
    TOKEN_HI,
    TOKEN_LO,
    AgenticWorkload,
    BlockTokens,
    ChatWorkload,
    HitDistribution,
    SweepWorkload,
    TraceError,
    TraceReplay,
    agentic_workload,
    chat_workload,
    hit_stats,
    read_trace,
    simulate_hits,
    sweep_workload,
    trace_workload,
)


def test_default_hit_distribution_is_skewed_like_pdd_md():
    d = HitDistribution()
    assert 0.88 <= d.mean <= 0.92  # docs/pdd.md: average hit ~90%
    assert 0.70 <= d.share_above(0.95) <= 0.80  # docs/pdd.md: 70-80% of requests hit > 95%
    assert HitDistribution.parse(str(d)) == d
    assert HitDistribution.parse("0.5") == HitDistribution.point(0.5)
    for bad in ("0.5:x", "1:0.2-1.5", "-1:0.1", "0.5:0.9-0.8"):
        with pytest.raises(ValueError):
            HitDistribution.parse(bad)


@pytest.mark.parametrize("seed", [0, 1])
def test_agentic_requests_realize_the_asked_hit_distribution(seed):
    w = AgenticWorkload(sessions=80, turns=5, seed=seed)
    wl = agentic_workload(w)
    turns = list(wl.turns())
    agentic = [t for t in turns if t.kind != "anomalous"]
    stats = hit_stats([t.planned_hit for t in agentic])
    assert stats["requests"] == 400
    assert abs(stats["mean"] - w.hit.mean) < 0.03, stats
    assert 0.70 <= stats["above_0.95"] <= 0.80, stats
    assert 0.01 <= stats["zero"] <= 0.08, stats  # the cold band (4%) opens new documents
    # the planned hits are what a radix cache would really serve, recomputed from the token ids
    assert simulate_hits(wl) == pytest.approx([t.planned_hit for t in turns], abs=1e-9)
    # a small share of ultra-long-input, very-short-output requests
    anomalous = [t for t in turns if t.kind == "anomalous"]
    assert len(anomalous) == round(0.03 * 400)
    assert all(len(t.tokens) >= 2048 and t.max_tokens <= 8 for t in anomalous)


def test_agentic_contexts_grow_by_answer_and_tool_output_and_fit_the_model():
    w = AgenticWorkload(sessions=20, turns=6, seed=3)
    wl = agentic_workload(w)
    appended = 0
    for s in wl.sessions:
        ctx = 0
        for i, t in enumerate(s.turns):
            assert all(TOKEN_LO <= x < TOKEN_HI for x in t.tokens)
            kept = ctx if t.reset_to is None else t.reset_to
            prompt = kept + len(t.tokens)
            assert prompt + t.max_tokens <= w.max_context_tokens
            if i and t.reset_to is None:  # the context grew by the answer and a tool output
                appended += 1
                assert prompt > ctx and t.think_s > 0
            ctx = prompt + t.max_tokens
    assert appended >= 0.6 * sum(len(s.turns) - 1 for s in wl.sessions if s.session_id.startswith("agent"))
    starts = [s.start_s for s in wl.sessions]
    assert starts == sorted(starts)
    # every session's first turn shares the system prompt that the warm-up caches
    system = wl.warmup[0].turns[0].tokens
    firsts = [s.turns[0].tokens for s in wl.sessions if s.turns[0].kind == "agentic"]
    assert firsts and all(f[: len(system)] == system for f in firsts)


def test_workloads_are_reproducible_from_their_seed():
    a, b = agentic_workload(AgenticWorkload(seed=5)), agentic_workload(AgenticWorkload(seed=5))
    assert a == b
    assert agentic_workload(AgenticWorkload(seed=6)) != a
    assert dict(a.params)["seed"] == 5 and a.param_dict()["requests"] == a.num_requests


def test_bad_agentic_shapes_are_refused():
    with pytest.raises(ValueError, match="max_context_tokens"):
        AgenticWorkload(system_tokens=3000)
    with pytest.raises(ValueError, match="anomalous_share"):
        AgenticWorkload(anomalous_share=1.5)


def test_chat_conversations_share_the_system_prompt_and_nothing_else():
    w = chat_workload(ChatWorkload(conversations=3, turns=4, system_tokens=800, context_tokens=300, turn_tokens=120,
                                   max_tokens=48))
    assert w.num_requests == 12 and not w.warmup and dict(w.params)["system_tokens"] == 800
    firsts = [s.turns[0].tokens for s in w.sessions]
    assert all(len(t) == 1220 for t in firsts) and all(t[:800] == firsts[0][:800] for t in firsts)
    assert len({t[800:816] for t in firsts}) == 3  # each conversation's own context after it
    assert all(len(t.tokens) == 120 and t.max_tokens == 48 and t.reset_to is None
               for s in w.sessions for t in s.turns[1:])  # appended to the context and its answers
    assert chat_workload(ChatWorkload(seed=1)) != chat_workload(ChatWorkload(seed=2))
    with pytest.raises(ValueError, match="turn_tokens"):
        ChatWorkload(turn_tokens=0)


@pytest.mark.parametrize("hit", [0.0, 0.4, 0.95])
def test_sweep_points_hit_what_they_say(hit):
    wl = sweep_workload(SweepWorkload(hit, requests=5, prompt_tokens=1000))
    planned = [t.planned_hit for t in wl.turns()]
    assert all(abs(h - hit) < 0.02 for h in planned), planned
    assert simulate_hits(wl) == pytest.approx(planned)
    assert len(wl.warmup) == (0 if hit == 0 else 5)
    other = sweep_workload(SweepWorkload(0.5, requests=5, prompt_tokens=1000))
    assert not {t.tokens[:16] for t in wl.turns()} & {t.tokens[:16] for t in other.turns()}
    assert [s.start_s for s in wl.sessions] == [s.start_s for s in other.sessions]  # same arrivals per point


# ---------------------------------------------------------------- Mooncake traces


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _line(ts: int, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


@pytest.mark.parametrize("bad, msg", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}), "missing field"),
    (_line(-5, 600, 10, [1, 2]), "timestamp must be an integer"),
    (_line(0, 600, 10, [1]), "1 hash_ids for input_length 600"),
    (_line(0, 600, 10, [1, "x"]), "hash_ids must be a non-empty list"),
    (_line(0, 0, 10, [1]), "input_length must be an integer >= 1"),
])
def test_a_bad_trace_line_names_the_file_and_line(tmp_path, bad, msg):
    p = _write(tmp_path, [_line(0, 600, 10, [0, 1]), "", bad, _line(5, 100, 4, [0])])
    with pytest.raises(TraceError, match=msg) as e:
        list(read_trace(p))
    assert f"{p}:3:" in str(e.value)
    with pytest.raises(TraceError, match=f"{p}:3:"):
        trace_workload(TraceReplay(path=str(p), max_requests=None))
    assert len(list(read_trace(p, limit=1))) == 1  # lines before the bad one are fine


def test_missing_trace_file_is_named(tmp_path):
    with pytest.raises(TraceError, match="nope.jsonl"):
        list(read_trace(tmp_path / "nope.jsonl"))


def test_trace_replay_scales_tokens_shares_real_prefixes_and_keeps_time(tmp_path):
    lines = [_line(0, 1024, 320, [0, 1]), _line(1000, 1500, 160, [0, 1, 2]), _line(2500, 700, 3, [0, 9]),
             _line(4000, 5000, 100, list(range(20, 30))), _line(9000, 600, 10, [0, 1])]
    p = _write(tmp_path, lines)
    r = TraceReplay(path=str(p), block_tokens=32, gap_scale=2.0, max_requests=None, max_context_tokens=300)
    wl = trace_workload(r)
    params = dict(wl.params)
    assert params["input_scale"] == 32 / 512 and params["skipped_too_long"] == 1  # 5000 * 32/512 = 312 > 300
    turns = [s.turns[0] for s in wl.sessions]
    assert [len(t.tokens) for t in turns] == [64, 94, 44, 38]  # round(input_length * 32 / 512)
    assert [t.max_tokens for t in turns] == [20, 10, 8, 8]  # output scaled too, at least min_output_tokens
    assert [s.start_s for s in wl.sessions] == [0.0, 2.0, 5.0, 18.0]  # trace time x gap_scale
    # equal hash ids are equal token ids: request 2 starts with request 1's two blocks
    assert turns[1].tokens[:64] == turns[0].tokens and turns[2].tokens[:32] == turns[0].tokens[:32]
    assert turns[3].tokens == turns[0].tokens[:38]
    assert [t.planned_hit for t in turns] == pytest.approx([0.0, 64 / 94, 32 / 44, 32 / 38])
    assert simulate_hits(wl) == pytest.approx([t.planned_hit for t in turns])
    # the window and the cap
    assert len(trace_workload(TraceReplay(path=str(p), start_s=1.0, window_s=2.0)).sessions) == 2
    assert len(trace_workload(TraceReplay(path=str(p), max_requests=2)).sessions) == 2
    pois = trace_workload(TraceReplay(path=str(p), arrival="poisson", rate=2.0, max_requests=None))
    assert pois == trace_workload(TraceReplay(path=str(p), arrival="poisson", rate=2.0, max_requests=None))
    with pytest.raises(TraceError, match="no replayable request"):
        trace_workload(TraceReplay(path=str(p), start_s=100.0))


def test_block_tokens_are_reproducible_per_hash_id():
    a, b = BlockTokens(32, seed=0), BlockTokens(32, seed=0)
    assert a(7) == b(7) and len(a(7)) == 32 and a(7) != a(8)
    assert BlockTokens(32, seed=1)(7) != a(7)
    assert all(TOKEN_LO <= t < TOKEN_HI for t in a(123))


@pytest.mark.skipif(not DEFAULT_TRACE.is_file(), reason="the shared Mooncake trace is not on this machine")
def test_the_mooncake_conversation_trace_replays():
    wl = trace_workload(TraceReplay(max_requests=200))
    assert len(wl.sessions) == 200
    lens = [len(s.turns[0].tokens) for s in wl.sessions]
    assert 300 <= statistics.median(lens) <= 600  # the trace's median input 6,909 tokens x 32/512
    assert 0.05 < hit_stats([t.planned_hit for t in wl.turns()])["mean"] < 0.5
