"""Looking at a running local cluster: the GCS probe, Serve replicas per site, log tails."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pdd_serve.cluster.config import (
    LOG_DIR,
    SITE_LABEL,
    SITES,
    LocalClusterConfig,
    load_state,
    ray_subprocess_env,
    recorded_config,
)
from pdd_serve.cluster.procs import group_runs

# ---- probing ----------------------------------------------------------------------------------

# Runs in a subprocess with the driver env: reads the GCS node table (what ray.nodes() returns)
# without registering a driver. Retries until both sites are alive or the deadline passes.
_PROBE = r"""
import json, sys, time
addr, wait_s, sites = sys.argv[1], float(sys.argv[2]), sys.argv[3].split(",")
want_replicas = len(sys.argv) > 4 and sys.argv[4] == "1"
from ray._private.internal_api import get_state_from_address
deadline = time.monotonic() + wait_s
while True:
    nodes, err = [], None
    try:
        for n in get_state_from_address(addr).node_table():
            nodes.append({"node_id": n["NodeID"], "alive": bool(n["Alive"]), "labels": dict(n.get("Labels") or {}),
                          "resources": dict(n.get("Resources") or {}), "ip": n.get("NodeManagerAddress"),
                          "node_manager_port": n.get("NodeManagerPort"),
                          "object_manager_port": n.get("ObjectManagerPort"),
                          "object_store_socket": n.get("ObjectStoreSocketName"),
                          "death_reason": n.get("DeathReasonMessage") or ""})
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    alive = {n["labels"].get("pdd.site") for n in nodes if n["alive"]}
    if (err is None and all(s in alive for s in sites)) or time.monotonic() >= deadline:
        break
    time.sleep(0.5)
out = {"nodes": nodes, "error": err}
if want_replicas and err is None:
    # Serve's replica actors (class ServeReplica:APP:DEPLOYMENT) and its controller, from the GCS actor table
    serve = {"controller": False, "replicas": [], "error": None}
    try:
        for a in get_state_from_address(addr).actor_table(None).values():
            cls, state = a.get("ActorClassName") or "", a.get("State") or "?"
            if state == "DEAD":
                continue
            if cls == "ServeController":
                serve["controller"] = True
            elif cls.startswith("ServeReplica:"):
                serve["replicas"].append({"class_name": cls, "name": a.get("Name") or "", "state": state,
                                          "node_id": (a.get("Address") or {}).get("NodeID") or "",
                                          "pid": a.get("Pid") or None, "actor_id": a.get("ActorID")})
    except Exception as e:
        serve["error"] = f"{type(e).__name__}: {e}"
    out["serve"] = serve
print("PDD_PROBE " + json.dumps(out))
"""


def probe_cluster(cfg: LocalClusterConfig, wait_s: float = 0.0, sites: Iterable[str] = SITES,
           replicas: bool = False) -> dict[str, Any]:
    """Node table of the cluster at cfg.address: {"nodes": [...], "error": str | None}; with
    `replicas`, also "serve": {"controller": bool, "replicas": [live ServeReplica actors], "error"}."""
    cmd = [sys.executable, "-c", _PROBE, cfg.address, str(wait_s), ",".join(sites), "1" if replicas else "0"]
    try:
        r = subprocess.run(cmd, env=ray_subprocess_env(cfg), capture_output=True, text=True, timeout=wait_s + 30,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"nodes": [], "error": f"GCS probe of {cfg.address} timed out"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("PDD_PROBE "):
            return json.loads(line[len("PDD_PROBE "):])
    return {"nodes": [], "error": f"GCS probe failed (exit {r.returncode}): {_tail_text(r.stderr, 10)}"}


def alive_sites(nodes: list[dict[str, Any]]) -> dict[str, str]:
    """site -> node id of the alive node carrying that label (the newest one if several)."""
    out: dict[str, str] = {}
    for n in nodes:
        site = n["labels"].get(SITE_LABEL)
        if n["alive"] and site in SITES:
            out[site] = n["node_id"]
    return out


def local_alive_sites(state: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[str, str]:
    """`alive_sites`, less sites whose raylet process is gone (the GCS takes ~30 s to notice)."""
    pgids = state.get("pgids", {})
    return {s: nid for s, nid in alive_sites(nodes).items() if s not in pgids or group_runs(pgids[s], "raylet/raylet")}


# ---- Serve replicas per site ------------------------------------------------------------------

UNPLACED = "-"  # a replica not on a node yet (pending creation)


def _replica_ids(r: dict[str, Any]) -> tuple[str, str, str]:
    """(app, deployment, replica id) of a ServeReplica actor: from its name
    `SERVE_REPLICA::APP#DEPLOYMENT#ID` (what Serve's ReplicaID writes), else its class name
    `ServeReplica:APP:DEPLOYMENT`."""
    name = r.get("name") or ""
    if name.startswith("SERVE_REPLICA::"):
        parts = name[len("SERVE_REPLICA::"):].split("#")
        if len(parts) == 3:
            return parts[0], parts[1], parts[2]
        if len(parts) == 2:
            return "", parts[0], parts[1]
    _, _, rest = (r.get("class_name") or "").partition(":")
    app, _, dep = rest.rpartition(":")
    return app, dep or "?", (r.get("actor_id") or "?")[:12]


def serve_deployments(replicas: Iterable[dict[str, Any]], nodes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group live Serve replica actors by deployment, each placed on its node's pdd.site label.

    replicas: {"class_name", "name", "state", "node_id", "pid"} (the probe's "serve.replicas");
    nodes: the probe's node table. Returns, per deployment (sorted by app, then name):
    {"app", "deployment", "replicas": [{"replica", "site", "node_id", "state", "pid"}],
    "per_site": {site: count}, "states": {state: count}}. Any deployment names work (one
    MainDecode deployment with N replicas, or MainDecode0..N-1)."""
    site_of = {n["node_id"]: (n.get("labels") or {}).get(SITE_LABEL, "?") for n in nodes}
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in replicas:
        app, dep, rid = _replica_ids(r)
        node = r.get("node_id") or ""
        placed = bool(node) and set(node) not in ({"f"}, {"0"})  # empty or nil node id: not placed yet
        site = site_of.get(node, "?") if placed else UNPLACED
        g = groups.setdefault((app, dep), {"app": app, "deployment": dep, "replicas": [], "per_site": {},
                                           "states": {}})
        g["replicas"].append({"replica": rid, "site": site, "node_id": node, "state": r.get("state") or "?",
                              "pid": r.get("pid")})
        g["per_site"][site] = g["per_site"].get(site, 0) + 1
        g["states"][r.get("state") or "?"] = g["states"].get(r.get("state") or "?", 0) + 1
    out = [groups[k] for k in sorted(groups)]
    for g in out:
        g["replicas"].sort(key=lambda x: (x["site"], x["replica"]))
    return out


def format_serve_deployments(serve: dict[str, Any] | None, deployments: list[dict[str, Any]]) -> list[str]:
    """`pdd cluster status` lines for Serve: a table of replicas per site per deployment, then each
    replica (site, node, state, pid). `serve` is the probe's {"controller", "error"}."""
    if serve is None:
        return []
    if serve.get("error"):
        return [f"serve: cannot read the actor table: {serve['error']}"]
    if not deployments:
        return ["serve: " + ("running, no deployments" if serve.get("controller") else
                             "not running (serve run GRAPH.yaml --non-blocking starts it)")]
    sites = sorted({*SITES, *(s for d in deployments for s in d["per_site"])},
                   key=lambda s: (s in ("?", UNPLACED), s))
    heads = ["deployment", "replicas", *(f"site {s}" if s not in ("?", UNPLACED) else
                                         ("unplaced" if s == UNPLACED else "site ?") for s in sites), "states"]
    rows = []
    for d in deployments:
        rows.append([f"{d['app']}/{d['deployment']}" if d["app"] else d["deployment"], str(len(d["replicas"])),
                     *(str(d["per_site"].get(s, 0)) for s in sites),
                     ", ".join(f"{k} {v}" for k, v in sorted(d["states"].items()))])
    widths = [max(len(r[i]) for r in [heads, *rows]) for i in range(len(heads))]

    def line(cells: list[str]) -> str:
        return "  " + "  ".join(c.ljust(w) if i in (0, len(cells) - 1) else c.rjust(w)
                                for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    n = sum(len(d["replicas"]) for d in deployments)
    out = [f"serve: {len(deployments)} deployment{'s' * (len(deployments) != 1)}, {n} replica{'s' * (n != 1)}",
           line(heads)]
    for d, row in zip(deployments, rows):
        out.append(line(row))
        for r in d["replicas"]:
            where = "not placed yet" if r["site"] == UNPLACED else f"{SITE_LABEL}={r['site']}  node {r['node_id'][:12]}"
            out.append(f"      {r['replica']:<10}  {where}  {r['state']}" + (f"  pid {r['pid']}" if r["pid"] else ""))
    return out


# ---- logs -------------------------------------------------------------------------------------


def _tail_text(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _tail_file(path: Path, lines: int = 30, max_bytes: int = 65536) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_bytes))
            return _tail_text(f.read().decode(errors="replace"), lines)
    except OSError:
        return ""


def latest_session_dir(temp_dir: Path) -> Path | None:
    latest = Path(temp_dir) / "session_latest"
    with contextlib.suppress(OSError):
        if latest.exists():
            return latest.resolve()
    return None


def log_tail(cfg: LocalClusterConfig, lines: int = 25) -> str:
    """The tails of this cluster's `ray start` output and of Ray's GCS / raylet logs, for error reports."""
    rcfg = recorded_config(cfg, load_state(cfg))
    parts = []
    paths = [Path(cfg.state_dir) / LOG_DIR / f"ray_start_{s}.log" for s in SITES]
    session = latest_session_dir(Path(rcfg.temp_dir))
    if session:
        logs = session / "logs"
        paths += [logs / "gcs_server.err", logs / "gcs_server.out", logs / "raylet.err", logs / "raylet.out",
                  logs / "raylet.1.err", logs / "raylet.1.out"]
    for p in paths:
        t = _tail_file(p, lines)
        if t:
            parts.append(f"--- {p} (tail) ---\n{t}")
    return "\n".join(parts) if parts else f"(no logs found under {cfg.state_dir} or {rcfg.temp_dir})"
