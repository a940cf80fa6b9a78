"""`pdd compare` end to end on the session's two-site cluster: a tiny agentic workload through the
three graphs (deployed in turn with `serve run`), the JSON line, and the MLflow runs it logged."""

from __future__ import annotations

import json
import socket

import pytest

from evaluations.compare import TARGETS, CompareConfig, run_compare
from evaluations.harness import EvalEnv
from evaluations.loadgen import LoadConfig
from evaluations.workloads import AgenticWorkload, HitDistribution, agentic_workload

pytestmark = pytest.mark.cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_compare_four_graphs_on_the_running_cluster(ray_two_sites, tmp_path, capsys):
    w = agentic_workload(AgenticWorkload(
        sessions=2, turns=2, system_tokens=256, max_tokens=8, hit=HitDistribution(((0.5, 0.95, 0.99), (0.5, 0.0, 0.0))),
        cold_tokens=(64, 128), anomalous_share=0.0, session_rate=2.0, think_s=0.2, seed=1))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = CompareConfig(env=EvalEnv(http_port=_free_port(), use_running_cluster=True), load=LoadConfig(timeout_s=120),
                        tracking_uri=uri, experiment="pdd-compare-test", out_dir=str(tmp_path / "out"), progress=False)
    res = run_compare(w, cfg, log=lambda m: None)

    lines = capsys.readouterr().out.strip().splitlines()
    head = json.loads(lines[-1])  # the run ends with one JSON line
    assert head == res["headline"]
    for k in (*TARGETS, "p90_tt2t_vs_cross_dc", "pdd.ttft_p90_s", "pd_cross_dc.goodput_rps", "targets_met"):
        assert k in head
    assert head["outputs_identical"] is True and head["mismatched_requests"] == 0
    summ = res["summaries"]
    assert list(summ) == ["pd_same_dc", "pd_cross_dc", "pd_cross_dc_naive", "pdd"]
    assert all(s["requests"] == 4 and s["errors"] == 0 for s in summ.values())
    assert summ["pd_same_dc"]["wan_bytes"] >= 0 and summ["pd_cross_dc"]["eager_tokens"] == 0
    assert summ["pd_cross_dc_naive"]["prefix_hit_md_mean"] == 0  # no decode-side cache in the naive baseline
    assert summ["pd_cross_dc"]["wan_bytes"] < summ["pd_cross_dc_naive"]["wan_bytes"]  # the DRC saves bytes
    assert head["control_latency_emulated"] is True and head["p50_ttft_vs_floor"] is not None
    assert isinstance(head["goodput_vs_cross_dc"], float) and isinstance(head["goodput_vs_cross_dc_naive"], float)
    assert any("TTFT p90 s" in line for line in lines)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("pdd-compare-test")
    runs = client.search_runs([exp.experiment_id])
    by_graph = {r.data.params.get("graph"): r for r in runs}
    assert set(by_graph) == {"pd_same_dc", "pd_cross_dc", "pd_cross_dc_naive", "pdd", None}  # None: the parent comparison run
    pdd = by_graph["pdd"]
    assert pdd.data.params["chip.a"] == "cpu" and "relay:1" in pdd.data.params["replicas.a"]
    assert pdd.data.params["link"] == by_graph["pd_cross_dc"].data.params["link"]  # the same emulated link
    assert "ttft_p90_s" in pdd.data.metrics and "bcr_req_per_usd" in pdd.data.metrics
    assert {a.path for a in client.list_artifacts(pdd.info.run_id)} >= {"requests.parquet", "ttft_cdf.png"}
    assert by_graph[None].data.metrics["outputs_identical"] == 1.0
