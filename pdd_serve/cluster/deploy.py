"""Deploy a graph YAML onto a running cluster with `serve run --non-blocking` and wait until it
answers; shut Serve down again. `pdd demo` (evaluations/demo.py), the evaluations' harness and the
soak use these."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdd_serve.config import load_graph_yaml


class DeployError(RuntimeError):
    """A graph could not be deployed or shut down (the demos raise it too when they cannot run);
    the message says what to do."""


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
        raise DeployError(f"serve run {path} failed:\n{proc.stderr[-3000:]}")
    checked = time.monotonic()
    while time.monotonic() - t < timeout_s:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                log(f"graph {path.name} is serving at {url} ({time.monotonic() - t:.0f}s)")
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() - checked > 10:  # a replica that can't start (a model its engine can't
            checked = time.monotonic()      # load) fails the deploy with its reason, not a long wait
            failed = deploy_failures(serve_status(env))
            if failed:
                raise DeployError(f"deploying {path} failed:\n" + "\n".join(failed))
        time.sleep(1.0)
    raise DeployError(f"{path} did not become healthy within {timeout_s:.0f}s; see `serve status` and the ray logs")


def serve_status(env: dict[str, str], timeout_s: float = 60.0) -> dict:
    """Serve's application and deployment statuses, through a driver (no dashboard needed)."""
    code = ("import json, ray; from ray import serve; ray.init(logging_level='error'); st = serve.status(); "
            "print(json.dumps({n: {'status': str(a.status), 'message': a.message, 'deployments': "
            "{d: {'status': str(x.status), 'message': x.message} for d, x in a.deployments.items()}} "
            "for n, a in st.applications.items()}))")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        return {}
    return json.loads(proc.stdout.strip().splitlines()[-1] or "{}")


def deploy_failures(status: dict) -> list[str]:
    """'app/deployment: message' for every deployment Serve gave up on (DEPLOY_FAILED)."""
    out = []
    for app, a in status.items():
        for name, d in (a.get("deployments") or {}).items():
            if "DEPLOY_FAILED" in d.get("status", ""):
                out.append(f"{app}/{name}: {d.get('message', '')[-2000:]}")
        if "DEPLOY_FAILED" in a.get("status", "") and not out:
            out.append(f"{app}: {a.get('message', '')[-2000:]}")
    return out


def shutdown_serve(env: dict[str, str], timeout_s: float = 120.0) -> None:
    """Delete every Serve app and the controller. `serve shutdown` talks to the dashboard, which the
    local cluster runs without, so this goes through a driver (the Python API) instead."""
    code = "import ray; from ray import serve; ray.init(logging_level='error'); serve.shutdown()"
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode != 0:
        raise DeployError(f"serve shutdown failed: {proc.stderr[-2000:]}")
