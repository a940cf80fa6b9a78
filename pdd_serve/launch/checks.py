"""Checks around `ray up` that fail in bounded time with a message that says what to fix.

Ray's launcher retries an ssh that can never work (a wrong key, a host that is not there) for
minutes, and its autoscaler keeps trying to start a worker it can't reach without a word to the
user. So, for the local (on-prem) provider:

- `preflight(config)`, before `ray up`: every host in `provider.head_ip` / `worker_ips` answers
  `ssh -i auth.ssh_private_key auth.ssh_user@host true` within a timeout, or the message says which
  host and why (refused key, nothing listening, no answer).
- `wait_nodes(config)`, on the head after `ray up`: every host listed in `metadata.pdd.node_types`
  is alive in Ray with its node type's labels (`pdd.site`), or the message names the host that is
  missing or unlabelled and where to look.
"""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from pdd_serve.launch.configs import graph_demands, load_yaml, resolve_graph

SSH_OPTS = ("-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR")


class LaunchCheckError(RuntimeError):
    """A check failed; the message names the host and what to fix."""


def _load(config_path: str | Path) -> dict[str, Any]:
    try:
        cfg = yaml.safe_load(Path(config_path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise LaunchCheckError(f"{config_path}: can't read it: {e}") from None
    if not isinstance(cfg, dict) or (cfg.get("provider") or {}).get("type") != "local":
        raise LaunchCheckError(f"{config_path}: provider.type: these checks are for the local (on-prem) provider, "
                               "whose hosts are listed by address")
    return cfg


def ssh_problem(host: str, user: str, key: str, timeout_s: float) -> str | None:
    """Why `ssh user@host true` with `key` fails, in words a user can act on; None when it works."""
    cmd = ["ssh", "-i", key, *SSH_OPTS, "-o", f"ConnectTimeout={max(1, int(timeout_s))}", f"{user}@{host}", "true"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 5, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"{host}: no answer to ssh within {timeout_s:.0f}s: is the host up and its address right?"
    except OSError as e:
        return f"{host}: can't run ssh ({e}): install an ssh client"
    if r.returncode == 0:
        return None
    err = (r.stderr or r.stdout).strip().splitlines()
    last = err[-1] if err else f"exit {r.returncode}"
    low = last.lower()
    if "permission denied" in low:
        why = (f"refused the key {key} for user {user}: add {key}.pub to ~{user}/.ssh/authorized_keys on {host}, "
               "or point auth.ssh_private_key / auth.ssh_user at the right ones")
    elif "connection refused" in low:
        why = "nothing listens on port 22: start sshd there"
    elif "timed out" in low or "no route" in low or "unreachable" in low:
        why = f"did not answer ssh within {timeout_s:.0f}s: is the host up, its address right in provider, port 22 open?"
    else:
        why = "ssh failed"
    return f"{host}: {why} ({last})"


def preflight(config_path: str | Path, timeout_s: float = 10.0) -> list[str]:
    """The problems found, one per host (empty: every host answers ssh with the config's key)."""
    cfg = _load(config_path)
    prov, auth = cfg["provider"], cfg.get("auth") or {}
    hosts = [prov.get("head_ip"), *(prov.get("worker_ips") or [])]
    user, key = auth.get("ssh_user"), auth.get("ssh_private_key")
    if not user or not key:
        return [f"{config_path}: auth: needs ssh_user and ssh_private_key"]
    key = os.path.expanduser(str(key))
    if not Path(key).is_file():
        return [f"{config_path}: auth.ssh_private_key: {key} does not exist (relative paths are from where you run "
                "`ray up`: the repo root)"]
    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        found = list(pool.map(lambda h: ssh_problem(h, user, key, timeout_s), hosts))
    return [p for p in found if p]


def _expected(cfg: dict[str, Any]) -> dict[str, dict[str, str]]:
    types = ((cfg.get("metadata") or {}).get("pdd") or {}).get("node_types") or {}
    return {h: {str(k): str(v) for k, v in (t.get("labels") or {}).items()}
            for t in types.values() for h in t.get("hosts") or []}


def md_cert_names(config_path: str | Path) -> list[str]:
    """What main decode's TLS certificate must name: the graph's flight.tls_server_name when set (cloud:
    autoscaled addresses are unknown), else the local provider's site-b host addresses."""
    path = Path(config_path)
    config = load_yaml(path)
    cfg, _ = graph_demands(resolve_graph(path, None, config))
    if cfg.flight.tls_server_name:
        return [cfg.flight.tls_server_name]
    if (config.get("provider") or {}).get("type") != "local":
        raise LaunchCheckError(f"{config_path}: the graph has no flight.tls_server_name and cloud hosts' addresses "
                               "are unknown before launch: set one (the shipped cloud graphs use pdd-md)")
    site = cfg.sites.main_decode
    names = [h for h, labels in _expected(config).items() if labels.get("pdd.site") == site]
    if not names:
        raise LaunchCheckError(f"{config_path}: no host in metadata.pdd.node_types has pdd.site={site} (main decode)")
    return names


def node_table(address: str = "auto") -> list[dict[str, Any]]:
    """Ray's node table (alive and dead) without registering a driver."""
    from ray._private.internal_api import get_state_from_address

    return [{"ip": n.get("NodeManagerAddress"), "alive": bool(n.get("Alive")), "labels": dict(n.get("Labels") or {}),
             "death_reason": n.get("DeathReasonMessage") or ""}
            for n in get_state_from_address(address).node_table()]


def missing_nodes(expected: dict[str, dict[str, str]], nodes: list[dict[str, Any]]) -> list[str]:
    """What keeps the cluster from being the config's: one line per host (pure, unit-tested)."""
    alive = {n["ip"]: n for n in nodes if n["alive"]}
    out = []
    for host, labels in expected.items():
        n = alive.get(host)
        if n is None:
            dead = [d for d in nodes if d["ip"] == host]
            out.append(f"{host}: not in the cluster" + (f" (died: {dead[-1]['death_reason']})" if dead else ""))
            continue
        wrong = {k: v for k, v in labels.items() if n["labels"].get(k) != v}
        if wrong:
            out.append(f"{host}: joined without " + ", ".join(f"{k}={v}" for k, v in wrong.items())
                       + f" (has {n['labels'] or 'no labels'}): its `ray start` must pass `--labels` "
                         "(python -m pdd_serve.launch node-args)")
    return out


def wait_nodes(config_path: str | Path, timeout_s: float = 300.0, address: str = "auto") -> list[dict[str, Any]]:
    """Block until every listed host is alive with its labels; return their nodes. Raises
    LaunchCheckError naming the hosts still missing at the deadline."""
    cfg = _load(config_path)
    expected = _expected(cfg)
    deadline = time.monotonic() + timeout_s
    problems = ["no answer from Ray yet"]
    while time.monotonic() < deadline:
        try:
            nodes = node_table(address)
            problems = missing_nodes(expected, nodes)
        except Exception as e:  # the GCS may still be starting
            problems = [f"can't read Ray's node table: {type(e).__name__}: {e}"]
            nodes = []
        if not problems:
            return [n for n in nodes if n["alive"] and n["ip"] in expected]
        time.sleep(2.0)
    raise LaunchCheckError(
        f"after {timeout_s:.0f}s the cluster is not the config's:\n  " + "\n  ".join(problems)
        + "\nA worker is started by the head's autoscaler over ssh: read its log with "
          f"`ray exec {config_path} 'tail -n 80 /tmp/ray/session_latest/logs/monitor.out'`")


__all__ = ["LaunchCheckError", "missing_nodes", "node_table", "preflight", "ssh_problem", "wait_nodes"]
