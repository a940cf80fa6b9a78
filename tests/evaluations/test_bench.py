"""The engine and transport benchmarks run end to end on tiny inputs and report every key they promise.

Only shape and internal consistency are checked here: performance is measured by running the
benchmarks, never asserted in a test.
"""

from __future__ import annotations

import json

import pytest

from evaluations.bench import engine as bench_engine
from evaluations.bench import transport as bench_transport


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_bench_engine_reports_fair_ratios(model_dir, capsys):
    assert bench_engine.main(["--model", str(model_dir), "--tokens", "3", "--prompt-len", "8", "--long-len", "40",
                              "--batch", "4", "--prefill-len", "32", "--repeats", "1"]) == 0
    out = _last_json(capsys.readouterr().out)
    for key in ("batch16_vs_hf_batch16", "single_vs_hf", "mixed_vs_uniform_batch16", "extend64_vs_64_steps",
                "mixed_floor_vs_uniform"):
        assert out[key] > 0, key
    assert out["batch"] == 4 and out["long_len"] == 40


def test_handoff_message_is_the_serialized_call():
    small, big = bench_transport.handoff_message(10, 151_936), bench_transport.handoff_message(100, 151_936)
    assert big["total"] == big["args"] + big["serve_metadata"]
    assert big["args"] > small["args"] + 90 * 3  # pickled ids of a 152K vocabulary take >= 3 bytes each
    assert big["serve_metadata"] > 0 and big["int32_ids"] == 400


def test_bench_transport_reports_line_utilisation_and_cpu(capsys):
    assert bench_transport.main(["--mb", "2", "--repeats", "1", "--streams", "1,2", "--paced", "1e10",
                                 "--shaped-link", "", "--no-ray", "--batch-blocks", "16"]) == 0
    out = _last_json(capsys.readouterr().out)
    assert set(out["line_util_10g_paced_by_streams"]) == {"1", "2"}
    assert out["line_util_10g_paced"] == max(out["line_util_10g_paced_by_streams"].values())
    assert 0 < out["line_util_10g_paced"] <= 1.05  # the pacer never lets goodput beat the line by much
    assert out["line_util_1g_kernel"] is None and out["kernel_null_reason"]
    assert out["flight_cpu_s_per_gb"] > 0 and out["tcp_cpu_s_per_gb"] > 0 and out["flight_vs_tcp"] > 0
    # CPU is measured on the line it fills, and no run is busier than the machine's cores
    assert out["cpu_s_per_gb_10g_paced"] > 0 and 0 < out["cores_busy_10g_paced"] <= out["max_cores_busy"]
    assert out["cores_to_fill_10g"] == pytest.approx(out["cpu_s_per_gb_10g_paced"] * 1.25, rel=1e-3)
    assert 0 < out["flight_rx_cpu_s_per_gb"] < out["flight_cpu_s_per_gb"]
    assert out["cpu_accounting_ok"] is (out["max_cores_busy"] <= out["cores"] * 1.05)
    assert out["handoff_payload_ratio"] == pytest.approx(out["handoff_payload_bytes"] / out["kv_bytes_100_tokens_50kb"], rel=1e-3)


def test_flight_streams_setting_is_checked():
    from pdd_serve.config import ConfigError, FlightConfig, load_config

    assert load_config({"flight": {"streams": 4}}).flight.streams == 4
    for bad in (0, 17):
        with pytest.raises(ConfigError, match="flight.streams"):
            FlightConfig(streams=bad)
    with pytest.raises(ConfigError, match="flight.send_buffer_bytes"):
        FlightConfig(send_buffer_bytes=0)
