"""Open-loop probes (issue 40): send times fixed before a probe, later turns carry the reference
answers, every answer checked against them."""

from __future__ import annotations

import pytest

from evaluations.loadgen import SLA, RequestRecord
from evaluations.open_loop import answer_of, at_rate, mismatches, probe_load, sessions_for, turn_gap_s
from evaluations.workloads import AgenticWorkload


def fake_generate(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """A deterministic stand-in for one engine's greedy generate: the answer depends on the prompt."""
    return [[(sum(p) + 7 * i) % 2000 + 3 for i in range(n)] for p, n in zip(prompts, max_tokens)]


W = AgenticWorkload(sessions=6, turns=3, max_tokens=8, system_tokens=64, cold_tokens=(64, 128),
                    anomalous_tokens=(256, 300), max_context_tokens=1024, think_s=0.5, seed=3)


def test_later_turns_carry_the_reference_answer_of_the_turn_before() -> None:
    pl = probe_load(W, fake_generate)
    grew = 0
    for s in pl.workload.sessions:
        for k in range(1, len(s.turns)):
            prev = pl.prompts[(s.session_id, k - 1)] + pl.answers[(s.session_id, k - 1)]
            t = s.turns[k]
            kept = prev if t.reset_to is None else prev[: t.reset_to]
            assert pl.prompts[(s.session_id, k)] == kept + list(t.tokens)
            grew += t.reset_to is None
    assert grew, "some turn appends to the whole context (answer included)"
    assert all(pl.answers[key] == fake_generate([p], [8])[0] for key, p in pl.prompts.items()
               if key[0].startswith("agent"))


def test_send_times_are_fixed_and_scale_with_the_rate() -> None:
    pl = probe_load(W, fake_generate)
    gap = turn_gap_s(SLA(ttft_s=1.0, tpot_s=0.05), 8, 0.5)
    assert gap == pytest.approx(1.0 + 7 * 0.05 + 0.5)
    slow, fast = at_rate(pl, 1.0, gap), at_rate(pl, 4.0, gap)
    assert slow.num_requests == fast.num_requests == pl.requests
    assert all(len(s.turns) == 1 and s.turns[0].reset_to is None for s in slow.sessions)  # whole prompts
    t_slow = {s.session_id: s.start_s for s in slow.sessions}
    t_fast = {s.session_id: s.start_s for s in fast.sessions}
    for sid, t in t_slow.items():
        base, _, k = sid.rpartition("#")
        if k != "0":  # turn k leaves k gaps after the session's first, whatever the rate
            assert t - t_slow[f"{base}#0"] == pytest.approx(int(k) * gap)
            assert t_fast[sid] - t_fast[f"{base}#0"] == pytest.approx(int(k) * gap)
    for sid in t_slow:  # sessions start 4x closer at 4x the rate
        if sid.endswith("#0"):
            assert t_fast[sid] == pytest.approx(t_slow[sid] / 4.0)
    with pytest.raises(ValueError, match="rate must be > 0"):
        at_rate(pl, 0.0, gap)


def test_every_answer_is_checked_against_its_reference_and_a_503_is_not_a_mismatch() -> None:
    pl = probe_load(W, fake_generate)
    wl = at_rate(pl, 2.0, 1.0)
    recs = []
    for s in wl.sessions:
        r = RequestRecord(s.session_id, 0, s.turns[0].kind, len(s.turns[0].tokens), None, 8, s.start_s)
        r.status = 200
        r.token_ids = list(answer_of(r, pl.answers))
        recs.append(r)
    assert mismatches(recs, pl.answers) == []
    recs[0].token_ids = recs[0].token_ids[:-1] + [recs[0].token_ids[-1] + 1]
    recs[1].status, recs[1].error, recs[1].token_ids = 503, "HTTP 503: overloaded", []
    bad = mismatches(recs, pl.answers)
    assert len(bad) == 1 and recs[0].session_id in bad[0] and "first difference at 7" in bad[0]


def test_sessions_for_gives_at_least_the_requests_asked() -> None:
    for n in (1, 20, 100, 101):
        s = sessions_for(n, W)
        w = AgenticWorkload(**{**W.__dict__, "sessions": s})
        assert w.sessions * w.turns + w.anomalous >= n
        assert (s - 1) * W.turns < n  # and not a session more than needed
