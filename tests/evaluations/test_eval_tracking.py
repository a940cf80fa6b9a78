"""MLflow logging round trip: a graph run logged to a SQLite store in tmp_path is read back from the
store (params, metrics, artifacts), and `pdd runs` lists it."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from evaluations.loadgen import SLA, RequestRecord, summarize_run
from evaluations.report import comparison_table, record_rows, ttft_cdf_plot, write_parquet
from evaluations.tracking import Tracker, flat_metrics, list_runs, tracking_uri
from pdd_serve.cli import main


def _records() -> list[RequestRecord]:
    out = []
    for i in range(6):
        out.append(RequestRecord(f"agent-{i}", 0, "agentic", 500, 0.95, 8, float(i), 200, token_ids=[7] * 8,
                                 ttft_s=0.1 + 0.01 * i, tt2t_s=0.2 + i, tpot_s=0.02, itl_max_s=0.05, e2e_s=1.0,
                                 output_tokens=8, pdd={"pipeline": "P-RLD-MD" if i % 2 else "P-MD",
                                                       "eager_tokens": 2 * (i % 2), "wan_bytes": 1000 * i,
                                                       "handoff_mode": "one-shot" if i % 2 else "none",
                                                       "prefix_hit_md": 0.9 if i else 0, "kv_ready_s": None}))
    return out


def test_tracking_uri_defaults_to_sqlite_in_the_working_dir_and_env_overrides(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri() == "sqlite:///mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert tracking_uri() == "http://mlflow.internal:5000"
    assert tracking_uri("sqlite:///x.db") == "sqlite:///x.db"


def test_a_logged_run_is_read_back_from_the_store(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    recs = _records()
    summary = summarize_run(recs, SLA(ttft_s=0.5, tpot_s=0.1))
    parquet = write_parquet(record_rows(recs, graph="pdd"), tmp_path / "out" / "requests.parquet")
    plot = ttft_cdf_plot({"pdd": recs}, tmp_path / "out" / "ttft_cdf.png")
    tr = Tracker(uri, "pdd-test")
    run = tr.start("pdd agentic test")
    params = {"graph": "pdd", "link": '{"preset": "pdd_report"}', "chip.a": "cpu", "chip.a.price_per_hour": 0.05,
              "replicas.a": "prefill:1,relay:1", "workload.hit": "0.76:0.95-0.995"}
    tr.log(run, params, {**flat_metrics(summary), "bcr_req_per_usd": 123.0}, [parquet, plot])
    tr.finish(run)

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    got = client.get_run(run)
    assert got.info.status == "FINISHED" and got.info.run_name == "pdd agentic test"
    assert {k: got.data.params[k] for k in params} == {k: str(v) for k, v in params.items()}
    m = got.data.metrics
    assert m["ttft_p90_s"] == pytest.approx(summary["ttft_p90_s"])
    assert m["goodput_rps"] == pytest.approx(summary["goodput_rps"]) and m["bcr_req_per_usd"] == 123.0
    assert m["rld_token_share"] == pytest.approx(6 / 48)
    assert m["pipeline_P_RLD_MD"] == 3 and m["handoffs_one_shot"] == 3
    arts = {a.path for a in client.list_artifacts(run)}
    assert arts == {"requests.parquet", "ttft_cdf.png"}
    local = client.download_artifacts(run, "requests.parquet", str(tmp_path / "dl"))
    table = pq.read_table(local).to_pylist()
    assert len(table) == 6 and table[1]["pdd_pipeline"] == "P-RLD-MD" and table[0]["token_ids"] == [7] * 8
    assert str(tmp_path / "mlruns" / "pdd-test") in client.get_experiment_by_name("pdd-test").artifact_location

    rows = list_runs(uri)
    assert [r["run_id"] for r in rows] == [run] and rows[0]["graph"] == "pdd"
    assert main(["runs", "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    assert "pdd agentic test" in out and "pdd-test" in out
    assert "pdd" in comparison_table({"pdd": {**summary, "cost_per_hour_usd": 0.1, "bcr_req_per_usd": 1.0,
                                              "wan_mb": 0.0}})


def test_runs_on_a_missing_store_says_where_it_looked_and_does_not_create_it(tmp_path, capsys):
    db = tmp_path / "empty.db"
    assert main(["runs", "--tracking-uri", f"sqlite:///{db}"]) == 0
    err = capsys.readouterr().err
    assert f"no MLflow store at sqlite:///{db}" in err and "does not exist" in err
    assert "pdd compare" in err and "MLFLOW_TRACKING_URI" in err  # how to make some
    assert not db.exists()


def test_runs_on_an_empty_store_says_where_it_looked(tmp_path, capsys, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    MlflowClient(tracking_uri="sqlite:///mlflow.db").search_experiments()  # creates the store, no runs
    assert main(["runs"]) == 0
    err = capsys.readouterr().err
    assert f"no runs in any experiment of sqlite:///mlflow.db ({tmp_path / 'mlflow.db'})" in err
    assert "pdd compare" in err


def _log(uri: str, experiment: str, name: str, graph: str) -> str:
    tr = Tracker(uri, experiment)
    run = tr.start(name)
    tr.log(run, {"graph": graph}, {"ttft_p90_s": 0.5, "requests": 3})
    tr.finish(run)
    return run


def test_runs_lists_every_experiment_by_default_and_filters_by_experiment(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    a = _log(uri, "pdd-compare", "pdd agentic", "pdd")
    b = _log(uri, "my-study", "custom run", "pd_cross_dc")  # a user's --experiment NAME: not pdd-*
    c = _log(uri, "Default", "plain run", "pdd")

    assert {r["run_id"]: r["experiment"] for r in list_runs(uri)} == {a: "pdd-compare", b: "my-study", c: "Default"}
    assert [r["run_id"] for r in list_runs(uri, limit=2)] == [c, b]  # newest first
    assert [r["run_id"] for r in list_runs(uri, ["my-study"])] == [b]

    assert main(["runs", "--tracking-uri", uri]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header[:3] == ["started", "experiment", "run"]
    assert "my-study" in out and "custom run" in out and "pdd-compare" in out and "plain run" in out

    assert main(["runs", "--tracking-uri", uri, "--experiment", "my-study", "--experiment", "Default"]) == 0
    out = capsys.readouterr().out
    assert "custom run" in out and "plain run" in out and "pdd agentic" not in out

    assert main(["runs", "--tracking-uri", uri, "--experiment", "nope"]) == 0
    err = capsys.readouterr().err
    assert "no experiment nope in" in err and "Default, my-study, pdd-compare" in err
