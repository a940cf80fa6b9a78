"""`pdd demo`: the main job. A local two-site cluster serving a graph YAML, driven by a short
agentic workload, with a summary of what PDD did per pipeline."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from pdd_serve.config import ConfigError, load_graph_yaml


class DemoError(RuntimeError):
    """The demo could not run; the message says what to do."""


def graph_http(path: Path) -> tuple[str, int]:
    import yaml

    doc = yaml.safe_load(path.read_text()) or {}
    http = doc.get("http_options") or {}
    return str(http.get("host", "127.0.0.1")), int(http.get("port", 8000))


def deploy_graph(path: Path, env: dict[str, str], timeout_s: float = 600.0, log: Any = print) -> str:
    """`serve run FILE --non-blocking` against the cluster, then wait until the router answers."""
    import httpx

    load_graph_yaml(path)  # a bad graph fails here, with the file and field named
    host, port = graph_http(path)
    url = f"http://{host}:{port}"
    serve_exe = str(Path(sys.executable).with_name("serve"))
    log(f"deploying {path} (serve run --non-blocking) ...")
    t = time.monotonic()
    proc = subprocess.run([serve_exe, "run", str(path), "--non-blocking"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise DemoError(f"serve run {path} failed:\n{proc.stderr[-3000:]}")
    while time.monotonic() - t < timeout_s:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                log(f"graph {path.name} is serving at {url} ({time.monotonic() - t:.0f}s)")
                return url
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise DemoError(f"{path} did not become healthy within {timeout_s:.0f}s; see `serve status` and the ray logs")


def shutdown_serve(env: dict[str, str], timeout_s: float = 120.0) -> None:
    """Delete every Serve app and the controller. `serve shutdown` talks to the dashboard, which the
    local cluster runs without, so this goes through a driver (the Python API) instead."""
    code = "import ray; from ray import serve; ray.init(logging_level='error'); serve.shutdown()"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise DemoError(f"serve shutdown failed: {proc.stderr[-2000:]}")


def summarize(records: list[Any]) -> list[dict[str, Any]]:
    """Per-pipeline rows: requests, TTFT P50/P90, eager tokens, WAN bytes, handoffs."""
    from evaluations.loadgen import percentile

    by: dict[str, list[Any]] = defaultdict(list)
    for r in records:
        by[r.pdd.get("pipeline") or ("error" if r.error else "?")].append(r)
    rows = []
    for pipeline in sorted(by):
        rs = by[pipeline]
        ttfts = [r.ttft_s for r in rs if r.ttft_s is not None]
        modes = defaultdict(int)
        for r in rs:
            if r.pdd.get("handoff_mode", "none") != "none":
                modes[r.pdd["handoff_mode"]] += 1
        rows.append({
            "pipeline": pipeline, "requests": len(rs),
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
            "eager_tokens": sum(r.pdd.get("eager_tokens", 0) for r in rs),
            "output_tokens": sum(r.output_tokens for r in rs),
            "wan_bytes": sum(r.pdd.get("wan_bytes", 0) for r in rs),
            "handoffs": dict(modes), "errors": sum(1 for r in rs if r.error),
        })
    return rows


def print_summary(rows: list[dict[str, Any]]) -> None:
    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f}"

    print(f"\n{'pipeline':<10}{'requests':>9}{'TTFT p50 s':>12}{'TTFT p90 s':>12}{'eager tok':>11}"
          f"{'out tok':>9}{'WAN MB':>9}  handoffs")
    for r in rows:
        print(f"{r['pipeline']:<10}{r['requests']:>9}{f(r['ttft_p50_s']):>12}{f(r['ttft_p90_s']):>12}"
              f"{r['eager_tokens']:>11}{r['output_tokens']:>9}{r['wan_bytes'] / 1e6:>9.2f}  "
              f"{', '.join(f'{k}: {v}' for k, v in r['handoffs'].items()) or '-'}")


def run_demo(graph: str = "graphs/pdd.yaml", keep: bool = False, sessions: int = 4, turns: int = 3,
             log: Any = print) -> int:
    from evaluations.loadgen import drive
    from evaluations.workloads import AgenticWorkload, agentic_workload
    from pdd_serve.cluster import LocalClusterConfig, cluster_down, cluster_up, driver_env

    path = Path(graph)
    if not path.is_file():
        raise DemoError(f"{graph} not found: run from the repository root or pass --graph PATH")
    try:
        load_graph_yaml(path)
    except ConfigError as e:
        raise DemoError(str(e)) from None
    ccfg = LocalClusterConfig()
    log("starting the local two-site cluster (site a: prefill + relay, site b: main decode) ...")
    info = cluster_up(ccfg, log=log)
    env = driver_env(ccfg)
    ok = False
    try:
        url = deploy_graph(path, env, log=log)
        w = AgenticWorkload(sessions=sessions, turns=turns)
        wl = agentic_workload(w)
        log(f"driving {wl.num_requests} requests: {sessions} agentic sessions x {turns} turns (target prefix hit "
            f"{w.hit}, mean {w.hit.mean:.2f}, hit-0 turns open a cold document), {w.anomalous} anomalous "
            f"(long input, {w.anomalous_max_tokens} output tokens)")
        records = drive(url, wl, log=log)
        rows = summarize(records)
        print_summary(rows)
        errors = [r for r in records if r.error]
        for r in errors[:5]:
            log(f"error in {r.session_id} turn {r.turn}: {r.error}")
        ok = not errors
        if keep:
            log(f"\nleft serving at {url} (cluster address {info.address}); stop with: pdd cluster down")
    finally:
        if not keep:
            shutdown_serve(env)
            cluster_down(ccfg)
            log("cluster torn down")
    return 0 if ok else 1
