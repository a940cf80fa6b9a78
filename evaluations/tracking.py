"""MLflow logging for evaluations: one experiment per question, one run per graph run, read back by
`pdd runs`.

The store is `$MLFLOW_TRACKING_URI` when set (e.g. a shared `http://mlflow:5000`), else an embedded
SQLite file in the working directory, `sqlite:///mlflow.db`, with artifacts in `./mlruns/` beside
it. Browse it with `mlflow ui --backend-store-uri sqlite:///mlflow.db`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_URI = "sqlite:///mlflow.db"
PARENT_TAG = "mlflow.parentRunId"
MAX_PARAM_CHARS = 6000  # MLflow's limit on a param value


def tracking_uri(uri: str | None = None) -> str:
    """Explicit > $MLFLOW_TRACKING_URI > sqlite:///mlflow.db (in the working directory)."""
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_URI


def sqlite_file(uri: str) -> Path | None:
    """The file of a `sqlite:///PATH` store, absolute (PATH is relative to the working directory
    unless it starts with /); None for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    return Path(uri[len("sqlite:///"):].split("?", 1)[0]).expanduser().absolute()


def describe_store(uri: str | None = None) -> str:
    """The store as a user should read it: the URI, and for SQLite the file it means."""
    uri = tracking_uri(uri)
    db = sqlite_file(uri)
    return f"{uri} ({db})" if db is not None and str(db) not in uri else uri


def _artifact_root(uri: str, experiment: str) -> str | None:
    """Artifacts beside a SQLite file, mlruns/EXPERIMENT, as an absolute file URI (so `mlflow ui`
    finds them from anywhere); a tracking server decides for itself."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///"):]).expanduser()
    return (db.absolute().parent / "mlruns" / experiment).as_uri()


def _client(uri: str) -> Any:
    import logging

    from mlflow.tracking import MlflowClient

    logging.getLogger("alembic").setLevel(logging.WARNING)  # first use migrates the SQLite schema
    return MlflowClient(tracking_uri=uri)


def _clean_params(params: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for k, v in params.items():
        s = "" if v is None else str(v)
        out[str(k)] = s[:MAX_PARAM_CHARS]
    return out


def _clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            v = float(v)
        if isinstance(v, (int, float)) and math.isfinite(float(v)):
            out[str(k)] = float(v)
    return out


@dataclass
class Tracker:
    """Thin wrapper over MlflowClient: create runs, log everything in batches, finish them."""

    uri: str
    experiment: str

    def __post_init__(self) -> None:
        self.uri = tracking_uri(self.uri)
        self.client = _client(self.uri)
        exp = self.client.get_experiment_by_name(self.experiment)
        if exp is None:
            self.experiment_id = self.client.create_experiment(self.experiment,
                                                               artifact_location=_artifact_root(self.uri, self.experiment))
        else:
            self.experiment_id = exp.experiment_id

    def start(self, name: str, parent: str | None = None, tags: Mapping[str, str] | None = None) -> str:
        t = dict(tags or {})
        if parent:
            t[PARENT_TAG] = parent
        return self.client.create_run(self.experiment_id, run_name=name, tags=t).info.run_id

    def log(self, run_id: str, params: Mapping[str, Any] | None = None, metrics: Mapping[str, Any] | None = None,
            artifacts: Iterable[Path] = (), tags: Mapping[str, str] | None = None) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        ps = [Param(k, v) for k, v in _clean_params(params or {}).items()]
        ms = [Metric(k, v, now, 0) for k, v in _clean_metrics(metrics or {}).items()]
        ts = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
        for i in range(0, max(len(ps), len(ms), len(ts), 1), 100):  # log_batch takes <= 100 params
            self.client.log_batch(run_id, metrics=ms[i:i + 100], params=ps[i:i + 100], tags=ts[i:i + 100])
        for a in artifacts:
            self.client.log_artifact(run_id, str(a))

    def finish(self, run_id: str, ok: bool = True) -> None:
        self.client.set_terminated(run_id, "FINISHED" if ok else "FAILED")


def flat_metrics(summary: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric summary figures as MLflow metrics; pipelines and handoffs become counts per key."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        if isinstance(v, Mapping):
            label = {"pipelines": "pipeline", "handoffs": "handoffs"}.get(k, k)
            for kk, vv in v.items():
                out[f"{prefix}{label}_{kk}".replace("-", "_")] = vv
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"{prefix}{k}"] = v
    return _clean_metrics(out)


# ---------------------------------------------------------------- reading back (`pdd runs`)


RUN_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("started", "started", "s"),
    ("experiment", "experiment", "s"),
    ("run", "run", "s"),
    ("graph", "graph", "s"),
    ("workload", "workload", "s"),
    ("req", "requests", ".0f"),
    ("TTFT p50", "ttft_p50_s", ".3f"),
    ("TTFT p90", "ttft_p90_s", ".3f"),
    ("TT2T p90", "tt2t_p90_s", ".3f"),
    ("TPOT p50", "tpot_p50_s", ".4f"),
    ("goodput", "goodput_rps", ".3f"),
    ("BCR", "bcr_req_per_usd", ".0f"),
    ("RLD share", "rld_token_share", ".3f"),
    ("p90 TTFT/x-DC", "p90_ttft_vs_cross_dc", ".2f"),
    ("p90 TT2T/x-DC", "p90_tt2t_vs_cross_dc", ".3f"),
    ("goodput/x-DC", "goodput_vs_cross_dc", ".2f"),
    ("identical", "outputs_identical", ".0f"),
)


def _store_missing(uri: str) -> bool:
    """A SQLite store whose file doesn't exist yet: reading it must not create it."""
    db = sqlite_file(uri)
    return db is not None and not db.exists()


def list_experiments(uri: str | None = None) -> list[str]:
    """Names of the store's active experiments ([] for a SQLite file that doesn't exist)."""
    uri = tracking_uri(uri)
    if _store_missing(uri):
        return []
    return sorted(e.name for e in _client(uri).search_experiments())


def list_runs(uri: str | None = None, experiments: Sequence[str] | None = None, limit: int = 30) -> list[dict[str, Any]]:
    """The `limit` most recent runs of every experiment in the store (or of the named ones only),
    newest first, as flat dicts with the experiment's name under "experiment". A SQLite store
    whose file doesn't exist has no runs (and is not created)."""
    uri = tracking_uri(uri)
    if _store_missing(uri):
        return []
    client = _client(uri)
    exps = client.search_experiments()
    wanted = [e for e in exps if not experiments or e.name in experiments]
    if not wanted:
        return []
    names = {e.experiment_id: e.name for e in wanted}
    runs = client.search_runs(list(names), order_by=["attributes.start_time DESC"], max_results=limit)
    out = []
    for r in runs:
        row: dict[str, Any] = {"run_id": r.info.run_id, "run": r.info.run_name, "experiment": names[r.info.experiment_id],
                               "status": r.info.status,
                               "started": time.strftime("%m-%d %H:%M", time.localtime(r.info.start_time / 1000)),
                               "parent": r.data.tags.get(PARENT_TAG), **r.data.params, **r.data.metrics}
        out.append(row)
    return out
