"""`pdd scale`'s pure parts: phase metrics from fabricated request records, tokens lost, output
identity, the JSON line's fields, ScaleConfig's checks, the CLI registration. No cluster."""

from __future__ import annotations

import json
import math

import pytest

from evaluations.harness import EvalError
from evaluations.loadgen import SLA, RequestRecord
from evaluations.scale_parts import (
    JSON_KEYS,
    Sample,
    ScaleConfig,
    ScaleRecord,
    calibrate,
    compare_outputs,
    headline,
    phase_metrics,
    phase_table,
    tokens_lost,
)

N = 8  # max_tokens of the fabricated requests


def _rec(phase: str, i: int, ttft: float, gap: float, replica: str = "r1", n: int = N, error: str = "") -> ScaleRecord:
    ids = list(range(100 + i, 100 + i + n))
    r = RequestRecord(f"{phase}-{i}", 0, "scale", 10, None, N, t_send_s=float(i), error=error)
    if not error:
        r.token_ids = ids
        r.output_tokens = n
        r.ttft_s = ttft
        r.itl_s = [gap] * (n - 1)
        r.tpot_s = gap
        r.itl_max_s = gap
        r.e2e_s = ttft + gap * (n - 1)
        r.pdd = {"md_replica": replica, "pipeline": "P-MD"}
    return ScaleRecord(phase, [1, 2, 3, i], r)


def _records() -> list[ScaleRecord]:
    before = [_rec("before", i, 0.2 + 0.1 * i, 0.02) for i in range(5)]  # TTFT 0.2..0.6, all meet
    ramp = [_rec("ramp", i, 2.0, 0.05) for i in range(3)]  # TTFT 2 s: none meets
    after = ([_rec("after", i, 0.5, 0.03, "r1") for i in range(6)]
             + [_rec("after", 6 + i, 0.5, 0.2, "r2") for i in range(3)]  # TPOT 0.2 > 0.1: missed
             + [_rec("after", 9, 0.5, 0.03, error="HTTP 500: boom")])
    return before + ramp + after


def test_phase_metrics_from_records():
    sla = SLA(1.0, 0.1)
    samples = [Sample(t, 1 if t < 20 else 2, 2, 2, {"r1": 3, "r2": 2} if t % 2 == 0 else None)
               for t in range(0, 40)]
    b = phase_metrics(_records(), "before", 10.0, sla, 0.3, samples, (0.0, 10.0))
    assert b["requests"] == 5 and b["errors"] == 0 and b["sla_ok"] == 5
    assert b["sla_attainment"] == 1.0 and b["goodput_rps"] == pytest.approx(0.5)  # 5 per 10 s window
    assert b["ttft_p50_s"] == pytest.approx(0.4) and b["ttft_p90_s"] == pytest.approx(0.56)
    assert b["itl_p50_s"] == pytest.approx(0.02) and b["itl_p90_s"] == pytest.approx(0.02)
    assert b["md_replicas_min"] == b["md_replicas_max"] == 1 and b["md_running_seqs_mean"] == 5
    assert b["offered_rps"] == 0.3 and b["sent_rps"] == pytest.approx(0.5)

    a = phase_metrics(_records(), "after", 5.0, sla, 1.5, samples, (25.0, 30.0))
    assert a["requests"] == 10 and a["errors"] == 1 and a["sla_ok"] == 6
    assert a["sla_attainment"] == pytest.approx(0.6) and a["goodput_rps"] == pytest.approx(1.2)
    assert a["requests_per_md_replica"] == {"r1": 6, "r2": 3}  # errors have no replica
    assert a["md_replicas_max"] == 2
    # pooled ITL: 6 requests x 7 gaps of 0.03 and 3 x 7 of 0.2
    assert a["itl_p50_s"] == pytest.approx(0.03) and a["itl_p90_s"] == pytest.approx(0.2)

    r = phase_metrics(_records(), "ramp", 3.0, sla, 1.5)
    assert r["sla_ok"] == 0 and r["goodput_rps"] == 0 and "md_replicas_max" not in r
    empty = phase_metrics(_records(), "control", 5.0, sla, 1.5)
    assert empty["requests"] == 0 and empty["goodput_rps"] == 0.0


def test_tokens_lost_and_output_identity():
    recs = _records()
    assert tokens_lost(recs, N) == 1  # the error
    recs[0].rec.token_ids = recs[0].rec.token_ids[:-1]  # one token short
    assert tokens_lost(recs, N) == 2
    expected = [list(range(100 + int(s.rec.session_id.split("-")[1]), 100 + int(s.rec.session_id.split("-")[1]) + N))
                for s in recs]
    same, bad, ex = compare_outputs(recs, expected)
    assert not same and bad == 1 and "first difference at token 7" in ex[0]
    recs[0].rec.token_ids = expected[0]
    assert compare_outputs(recs, expected)[:2] == (True, 0)  # the errored request is tokens_lost's, not here
    expected[3] = [0] * N
    assert compare_outputs(recs, expected)[:2] == (False, 1)
    assert compare_outputs([recs[-1]], [expected[-1]])[0] is False  # nothing answered: not identical


def test_headline_json_fields():
    sla = SLA(1.0, 0.1)
    cfg = ScaleConfig(rate_before=0.5, rate_after=2.0)
    samples = [Sample(0, 1, 1, 1), Sample(30, 2, 2, 2)]
    recs = _records()
    phases = {"before": phase_metrics(recs, "before", 10.0, sla, 0.5, samples, (0, 10)),
              "ramp": phase_metrics(recs, "ramp", 3.0, sla, 2.0, samples, (10, 13)),
              "after": phase_metrics(recs, "after", 5.0, sla, 2.0, samples, (13, 18))}
    h = headline(phases, samples, 12.5, tokens_lost(recs, N), True, 0, cfg)
    assert set(JSON_KEYS) <= set(h)
    assert h["md_replicas_max"] == 2 and h["tokens_lost"] == 1 and h["outputs_identical"] is True
    assert h["goodput_after_vs_before"] == pytest.approx(1.2 / 0.5)
    assert h["offered_load_ratio"] == 4.0 and h["rate_before"] == 0.5 and h["rate_after"] == 2.0
    assert h["scale_up_s"] == 12.5 and h["errors"] == 1 and h["requests"] == 18
    assert h["scaled_before_ramp"] is False  # the 2nd replica came in the ramp, not before it
    # a 2nd replica still starting inside the before phase: the autoscaler already decided to scale
    starting = [Sample(0, 1, 1, 1), Sample(5, 1, 2, 2), Sample(30, 2, 2, 2)]
    early = {**phases, "before": phase_metrics(recs, "before", 10.0, sla, 0.5, starting, (0, 10))}
    assert headline(early, starting, 12.5, 0, True, 0, cfg)["scaled_before_ramp"] is True
    assert h["md_replicas_that_served_after"] == 2
    assert h["after.requests_per_md_replica"] == {"r1": 6, "r2": 3}
    assert "goodput_after_vs_one_replica" not in h and "goodput(after" in h["goodput_after_vs_before_def"]
    json.loads(json.dumps(h))  # one JSON line, no NaN
    phases["control"] = phase_metrics(recs, "after", 5.0, sla, 2.0)  # pretend: same figures
    phases["before"]["goodput_rps"] = math.nan
    h = headline(phases, samples, None, 0, False, 3, cfg)
    assert h["goodput_after_vs_one_replica"] == 1.0 and h["goodput_after_vs_before"] is None
    assert h["scale_up_s"] is None and h["mismatched_requests"] == 3
    assert "NaN" not in json.dumps(h)
    table = phase_table(phases)
    assert "before" in table and "1 (fixed)" in table and "goodput r/s" in table


@pytest.mark.parametrize("kw", [
    {"rate_before": 0},
    {"rate_after": 0.2, "rate_before": 0.3},  # the ramp must raise the load
    {"load_before": 1.0}, {"load_after": 0.9}, {"probe_s": 0},
    {"before_s": 0}, {"after_s": -1}, {"ramp_timeout_s": 0}, {"sample_s": 0}, {"sample_s": 30},
    {"prompt_tokens": 0}, {"max_tokens": 1}, {"system_tokens": -1},
    {"system_tokens": 4000, "prompt_tokens": 64, "max_tokens": 128},  # past the model's positions
])
def test_scale_config_checks(kw):
    with pytest.raises(ValueError):
        ScaleConfig(**kw)


def test_scale_config_defaults_are_valid():
    d = ScaleConfig()
    assert d.graph == "graphs/pdd.yaml" and d.experiment == "pdd-scale"
    assert d.rate_before is None and d.rate_after is None  # calibrated by the probe on the machine it runs on


def test_calibration_is_the_probes_throughput_at_the_target():
    # 4 clients (the target) in a closed loop, 30 requests in 20 s: 1.5 req/s holds 4 in flight
    c = calibrate(30, 20.0, 4, ScaleConfig(), 3.0)
    assert c["capacity_rps"] == 1.5 and c["probe_latency_s"] == pytest.approx(2.6667, abs=1e-4)
    assert (c["rate_before"], c["rate_after"]) == (0.75, 2.25) and c["calibrated"] == ["rate_before", "rate_after"]
    assert c["probe_clients"] == 4 and c["probe_md_seqs_mean"] == 3.0
    slow = calibrate(15, 20.0, 4, ScaleConfig())  # a busier machine gets lower rates
    assert slow["capacity_rps"] == 0.75 and slow["rate_after"] == 1.125 and slow["probe_md_seqs_mean"] is None
    kept = calibrate(30, 20.0, 4, ScaleConfig(rate_after=9.0))
    assert kept["rate_after"] == 9.0 and kept["rate_before"] == 0.75 and kept["calibrated"] == ["rate_before"]
    with pytest.raises(EvalError, match="rate_after"):
        calibrate(30, 20.0, 4, ScaleConfig(rate_after=0.5))
    with pytest.raises(EvalError, match="probe"):
        calibrate(2, 20.0, 4, ScaleConfig())


def test_scale_is_a_registered_command():
    from evaluations.cli import EVAL_COMMANDS

    (cmd,) = [c for c in EVAL_COMMANDS if c.name == "scale"]
    assert "goodput_after_vs_before" in cmd.description and "md_replicas_max" in cmd.description
