"""A local two-site Ray cluster on one machine, standing in for two datacenters.

`cluster_up` starts two raylets with `ray start`: the head, labelled ``pdd.site=a``, and a second
node, labelled ``pdd.site=b``, that joins it. Each has its own object store, so an ObjectRef read on
the other site really crosses processes and sockets (object manager to object manager). Serve
deployments are pinned to a site with ``ray_actor_options.label_selector: {pdd.site: a|b}``; each
node also carries a custom resource ``site_a`` / ``site_b`` (1000 units) as the fallback where a
label selector can't be used.

Token auth, handled deliberately. Ray 2.60's ``ray start --head`` turns token auth on whenever it
finds a token (``RAY_AUTH_TOKEN``, else the file at ``RAY_AUTH_TOKEN_PATH``, else
``~/.ray/auth_token``, which any local ``ray.init()`` creates). A driver given an explicit address
(``RAY_ADDRESS`` or ``ray.init(address=...)``) sends the token only if ``RAY_AUTH_MODE=token`` is in
its environment; without it the driver retries ``InvalidAuthToken`` forever. So this module never
relies on the shared ``~/.ray/auth_token``: it writes a cluster-private token to
``STATE_DIR/auth_token`` (mode 0600), starts both raylets with ``RAY_AUTH_MODE=token`` and
``RAY_AUTH_TOKEN_PATH`` pointing at it (workers inherit that), and `driver_env` gives a driver the
same three variables: ``RAY_ADDRESS``, ``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN_PATH``. A set
``RAY_AUTH_TOKEN`` would take precedence over the path, so drivers must not have one.

Isolation from other clusters on the same machine: its own ``--temp-dir`` (default
``/tmp/pdd-ray-PORT``; sockets, session logs and ``ray_current_cluster`` live there, so a bare
``ray.init()`` elsewhere never attaches to it), free ports picked for the Ray client server,
dashboard and dashboard agents, and teardown that kills exactly the process groups it started
(each ``ray start`` runs in a new session) -- never ``ray stop``, which kills every Ray process of
the machine. Nothing here imports ray in-process: health probes run ``python -c`` with the driver
environment, so `pdd cluster ...` stays light and no driver connection lingers.

Shaped link (``shaped_link`` / ``--shaped-link RATE[,DELAY,JITTER,LOSS]``, root only): site b's
raylet runs in its own network namespace behind a veth pair shaped by the kernel (netns.py), so all
cross-site traffic -- Ray control, object transfers, KV over Flight -- crosses a real shaped link.
Site a then binds the host end's address (10.192.0.0/14, one /30 per GCS port) instead of
127.0.0.1; `cluster_down` removes the namespace. Off by default: nothing changes without it.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd_serve import netns
from pdd_serve.netns import NetnsError, ShapedLink, VethNamespace

SITE_LABEL = "pdd.site"
SITES = ("a", "b")
SITE_RESOURCE_UNITS = 1000  # custom resource site_a / site_b per node, the label fallback
STATE_DIR_ENV = "PDD_CLUSTER_DIR"
DEFAULT_PORT = 6390  # not Ray's 6379, so a stock `ray start --head` elsewhere doesn't collide
DEFAULT_NODE_IP = "127.0.0.1"
SERVE_DEFAULT_HTTP_PORT = 8000  # Serve's own default; the app YAML's http_options.port overrides it
MIN_OBJECT_STORE_MIB = 76  # ray: OBJECT_STORE_MINIMUM_MEMORY_BYTES = 75 MiB
# Unix socket paths are limited to 107 bytes: TEMP/session_<date>_<pid>/sockets/plasma_store.1
# adds up to ~66, so the temp dir must stay short.
MAX_TEMP_DIR_LEN = 40
STATE_FILE = "cluster.json"
TOKEN_FILE = "auth_token"
ENV_FILE = "env.sh"
LOG_DIR = "logs"
AUTH_VARS = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


class ClusterError(RuntimeError):
    """A cluster operation failed; the message is meant for humans (no traceback needed)."""


class ShapedLinkUnavailable(ClusterError):
    """--shaped-link can't work on this machine (no root, no namespaces, no `ip`); nothing started."""


@dataclass(frozen=True)
class LocalClusterConfig:
    """Settings of the local two-site cluster; validated on construction.

    The state dir is the cluster's identity: it records the address, process groups, ports and
    token, so `cluster_down` / `cluster_status` / `driver_env` find the cluster from it alone.
    """

    port: int = DEFAULT_PORT  # GCS port of the head (site a)
    dashboard: bool = False  # off saves CPU; Serve's HTTP proxy works without it
    dashboard_port: int = 8265  # used only when dashboard is on
    cpus_a: int = 4  # logical CPUs per raylet; may exceed the physical cores
    cpus_b: int = 4
    gpus_a: int | None = None  # None: Ray autodetects (on site a only, so GPUs aren't counted twice)
    gpus_b: int = 0
    object_store_mib: int = 512  # per raylet
    state_dir: str | Path | None = None  # default $PDD_CLUSTER_DIR, else ./.pdd/cluster
    temp_dir: str | Path | None = None  # ray --temp-dir; default /tmp/pdd-ray-PORT
    node_ip: str = DEFAULT_NODE_IP  # both raylets and drivers use it, so drivers attach to site a
    start_timeout_s: float = 120.0
    # "RATE[,DELAY,JITTER,LOSS]" or a ShapedLink: site b behind a kernel-shaped veth (netns.py)
    shaped_link: ShapedLink | str | None = None

    def __post_init__(self) -> None:
        _check_port("port", self.port)
        if self.dashboard:
            _check_port("dashboard_port", self.dashboard_port)
            if self.dashboard_port == self.port:
                raise ValueError("dashboard_port must differ from port")
        for name in ("cpus_a", "cpus_b"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        for name in ("gpus_a", "gpus_b"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{name} must be an int >= 0 (or None for gpus_a), got {v!r}")
        if not isinstance(self.object_store_mib, int) or self.object_store_mib < MIN_OBJECT_STORE_MIB:
            raise ValueError(f"object_store_mib must be an int >= {MIN_OBJECT_STORE_MIB} (Ray's minimum), "
                             f"got {self.object_store_mib!r}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {self.start_timeout_s!r}")
        if not self.node_ip or any(c.isspace() for c in self.node_ip):
            raise ValueError(f"node_ip must be an IP address, got {self.node_ip!r}")
        sd = self.state_dir
        if sd is None:
            sd = os.environ.get(STATE_DIR_ENV) or Path.cwd() / ".pdd" / "cluster"
        object.__setattr__(self, "state_dir", Path(sd).expanduser().absolute())
        td = Path(self.temp_dir).expanduser().absolute() if self.temp_dir else Path(f"/tmp/pdd-ray-{self.port}")
        if len(str(td)) > MAX_TEMP_DIR_LEN:
            raise ValueError(f"temp_dir {str(td)!r} is too long ({len(str(td))} > {MAX_TEMP_DIR_LEN} chars): "
                             "Ray puts its unix sockets under it and socket paths are limited to 107 bytes")
        object.__setattr__(self, "temp_dir", td)
        if self.shaped_link is not None:
            link = self.shaped_link if isinstance(self.shaped_link, ShapedLink) else ShapedLink.parse(self.shaped_link)
            object.__setattr__(self, "shaped_link", link)
            host_ip = VethNamespace.for_port(self.port).host_ip
            if self.node_ip == DEFAULT_NODE_IP:  # site a must be reachable from inside the namespace
                object.__setattr__(self, "node_ip", host_ip)
            elif self.node_ip != host_ip:
                raise ValueError(f"with shaped_link, node_ip is the host end of the veth ({host_ip}), "
                                 f"got {self.node_ip!r}")

    @property
    def veth(self) -> VethNamespace | None:
        """The namespace + veth pair site b runs behind (None without a shaped link)."""
        return VethNamespace.for_port(self.port) if self.shaped_link is not None else None

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.port}"

    @property
    def token_path(self) -> Path:
        return Path(self.state_dir) / TOKEN_FILE

    def identity(self) -> dict[str, Any]:
        """The settings a running cluster must match for `cluster_up` to reuse it."""
        return {"port": self.port, "node_ip": self.node_ip, "temp_dir": str(self.temp_dir),
                "dashboard": self.dashboard, "cpus_a": self.cpus_a, "cpus_b": self.cpus_b,
                "gpus_a": self.gpus_a, "gpus_b": self.gpus_b, "object_store_mib": self.object_store_mib,
                **({"shaped_link": self.shaped_link.spec} if isinstance(self.shaped_link, ShapedLink) else {})}


def _check_port(name: str, port: object) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= 65535:
        raise ValueError(f"{name} must be an int in 1024..65535, got {port!r}")


@dataclass(frozen=True)
class ClusterInfo:
    """What a driver needs to know about a running local cluster."""

    address: str  # RAY_ADDRESS, "IP:PORT" of the head's GCS
    node_ids: dict[str, str]  # site -> node id (hex)
    env: dict[str, str]  # driver environment: RAY_ADDRESS, RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH
    token_path: str
    state_dir: str
    temp_dir: str
    session_dir: str | None
    dashboard_url: str | None  # None when the dashboard is off
    serve_port: int = SERVE_DEFAULT_HTTP_PORT  # where Serve's proxy (on the head, site a) listens by default
    ports: dict[str, int] = field(default_factory=dict)  # the extra ports picked at start
    already_running: bool = False  # cluster_up found it healthy and did nothing
    config: LocalClusterConfig | None = None  # the config it runs with (for cluster_status / cluster_down)
    shaped_link: dict[str, Any] | None = None  # the netns record (veth, link, kernel, describe); None: off


# ---- state ----------------------------------------------------------------------------------


def _state_path(cfg: LocalClusterConfig) -> Path:
    return Path(cfg.state_dir) / STATE_FILE


def _load_state(cfg: LocalClusterConfig) -> dict[str, Any] | None:
    try:
        return json.loads(_state_path(cfg).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ClusterError(f"cannot read cluster state {_state_path(cfg)}: {e}; remove it to start over") from e


def _save_state(cfg: LocalClusterConfig, state: dict[str, Any]) -> None:
    p = _state_path(cfg)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, p)


def _recorded_cfg(cfg: LocalClusterConfig, state: dict[str, Any] | None) -> LocalClusterConfig:
    """cfg with the address-defining fields taken from the recorded state, when there is one."""
    if not state:
        return cfg
    ident = state.get("identity", {})
    try:
        return LocalClusterConfig(port=ident["port"], node_ip=ident["node_ip"], temp_dir=ident["temp_dir"],
                                  state_dir=cfg.state_dir, start_timeout_s=cfg.start_timeout_s)
    except (KeyError, ValueError):
        return cfg


def driver_env(cfg: LocalClusterConfig) -> dict[str, str]:
    """Environment a driver (`ray.init`, `serve run`, `ray status`) needs for this cluster.

    RAY_ADDRESS: the head's GCS; RAY_AUTH_MODE=token: without it a driver given an address does not
    send the token (and retries InvalidAuthToken forever); RAY_AUTH_TOKEN_PATH: the cluster's token
    file. Also make sure RAY_AUTH_TOKEN is unset in that environment (it would win over the path).
    Read from the recorded state when there is one, else derived from cfg (same values).
    """
    rcfg = _recorded_cfg(cfg, _load_state(cfg))
    return {"RAY_ADDRESS": rcfg.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(rcfg.token_path)}


def apply_driver_env(cfg: LocalClusterConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Put `driver_env` into `environ` (default os.environ) and drop RAY_AUTH_TOKEN.

    Returns the previous values (None-able via absence) so a caller can restore them. If ray is
    already imported in this process, its cached auth config is refreshed too.
    """
    environ = os.environ if environ is None else environ
    old = {k: environ[k] for k in (*AUTH_VARS, "RAY_AUTH_TOKEN") if k in environ}
    environ.pop("RAY_AUTH_TOKEN", None)
    environ.update(driver_env(cfg))
    if environ is os.environ:
        refresh_ray_auth_config()
    return old


def refresh_ray_auth_config() -> None:
    """Make an already-imported ray re-read RAY_AUTH_* (it caches them at import / first use)."""
    if "ray._raylet" not in sys.modules:
        return
    with contextlib.suppress(Exception):
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def _subprocess_env(cfg: LocalClusterConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN_PATH"] = str(cfg.token_path)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def env_lines(cfg: LocalClusterConfig) -> list[str]:
    """Shell lines for `eval "$(pdd cluster env)"`."""
    lines = [f"export {k}={shlex.quote(v)}" for k, v in driver_env(cfg).items()]
    lines.append("unset RAY_AUTH_TOKEN")
    return lines


# ---- processes (via /proc; psutil isn't a dependency) ----------------------------------------


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, parent pid, process group) of pid, or None if it's gone."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2:].split()
    return fields[0], int(fields[1]), int(fields[2])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _snapshot() -> dict[int, tuple[str, int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _proc_stat(int(name))) is not None:
            out[int(name)] = st
    return out


def _cluster_procs(pgids: Iterable[int], known: Iterable[int] = ()) -> set[int]:
    """Live Ray processes in the given process groups, plus their descendants and `known` pids.

    Descendants matter: `ray start` puts GCS, raylet and agents in its own session, but each worker
    (ray::IDLE, Serve replicas, ...) calls setsid, so it is found only as a child of its raylet.
    """
    groups, snap = set(pgids), _snapshot()
    children: dict[int, list[int]] = {}
    for pid, (_st, ppid, _pg) in snap.items():
        children.setdefault(ppid, []).append(pid)
    todo = [pid for pid, (_st, _ppid, pg) in snap.items() if pg in groups] + [p for p in known if p in snap]
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(children.get(pid, ()))
    protected = {os.getpid()}
    p = os.getpid()
    while p > 1 and (st := snap.get(p)):  # never this process or its ancestors
        p = st[1]
        protected.add(p)
    return {pid for pid in seen - protected if snap[pid][0] != "Z" and "ray" in _cmdline(pid)}


def _running(pgid: int, binary: str) -> bool:
    """Whether the group runs Ray's `binary` ("raylet/raylet" or "gcs/gcs_server")."""
    return any(f"/{binary} " in _cmdline(pid) for pid in _cluster_procs([pgid]))


def _local_alive_sites(state: dict[str, Any], nodes: list[dict[str, Any]]) -> dict[str, str]:
    """`_alive_sites`, less sites whose raylet process is gone (the GCS takes ~30 s to notice)."""
    pgids = state.get("pgids", {})
    return {s: nid for s, nid in _alive_sites(nodes).items() if s not in pgids or _running(pgids[s], "raylet/raylet")}


def _groups_running_under(temp_dir: Path) -> set[int]:
    """Process groups of processes whose command line names this cluster's session dir."""
    needle = f"{temp_dir}/session_"
    out = set()
    for pid, (st, _ppid, pg) in _snapshot().items():
        if st != "Z" and needle in _cmdline(pid):
            out.add(pg)
    return out


def _kill_groups(pgids: Iterable[int], grace_s: float = 2.0) -> list[int]:
    """SIGTERM the Ray processes of these groups and their descendants, SIGKILL what's left after
    grace_s. Returns the pids signalled."""
    groups = set(pgids) - {os.getpgrp(), 0, 1}
    victims = _cluster_procs(groups)
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        left = _cluster_procs(groups, victims)
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait_s
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = _cluster_procs(groups, victims | left)
            victims |= left
        if not left:
            break
    return sorted(victims)


# ---- ports ------------------------------------------------------------------------------------


def port_problem(host: str, port: int) -> str | None:
    """Why `port` can't be used for the head's GCS, or None if it's free."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        with contextlib.suppress(OSError):
            if s.connect_ex((host, port)) == 0:
                return f"something is already listening on {host}:{port}"
    for h in ("0.0.0.0", host):  # the GCS binds all interfaces
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((h, port))
            except OSError as e:
                return f"cannot bind {h}:{port} ({e.strerror or e})"
    return None


def _free_ports(n: int, avoid: Iterable[int] = ()) -> list[int]:
    avoid, socks, ports = set(avoid), [], []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            socks.append(s)
            p = s.getsockname()[1]
            if p not in avoid and p >= 1024:
                ports.append(p)
    finally:
        for s in socks:
            s.close()
    return ports


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


def _probe(cfg: LocalClusterConfig, wait_s: float = 0.0, sites: Iterable[str] = SITES,
           replicas: bool = False) -> dict[str, Any]:
    """Node table of the cluster at cfg.address: {"nodes": [...], "error": str | None}; with
    `replicas`, also "serve": {"controller": bool, "replicas": [live ServeReplica actors], "error"}."""
    cmd = [sys.executable, "-c", _PROBE, cfg.address, str(wait_s), ",".join(sites), "1" if replicas else "0"]
    try:
        r = subprocess.run(cmd, env=_subprocess_env(cfg), capture_output=True, text=True, timeout=wait_s + 30,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"nodes": [], "error": f"GCS probe of {cfg.address} timed out"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("PDD_PROBE "):
            return json.loads(line[len("PDD_PROBE "):])
    return {"nodes": [], "error": f"GCS probe failed (exit {r.returncode}): {_tail_text(r.stderr, 10)}"}


def _alive_sites(nodes: list[dict[str, Any]]) -> dict[str, str]:
    """site -> node id of the alive node carrying that label (the newest one if several)."""
    out: dict[str, str] = {}
    for n in nodes:
        site = n["labels"].get(SITE_LABEL)
        if n["alive"] and site in SITES:
            out[site] = n["node_id"]
    return out


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


def _session_dir(temp_dir: Path) -> Path | None:
    latest = Path(temp_dir) / "session_latest"
    with contextlib.suppress(OSError):
        if latest.exists():
            return latest.resolve()
    return None


def log_tail(cfg: LocalClusterConfig, lines: int = 25) -> str:
    """The tails of this cluster's `ray start` output and of Ray's GCS / raylet logs, for error reports."""
    rcfg = _recorded_cfg(cfg, _load_state(cfg))
    parts = []
    paths = [Path(cfg.state_dir) / LOG_DIR / f"ray_start_{s}.log" for s in SITES]
    session = _session_dir(Path(rcfg.temp_dir))
    if session:
        logs = session / "logs"
        paths += [logs / "gcs_server.err", logs / "gcs_server.out", logs / "raylet.err", logs / "raylet.out",
                  logs / "raylet.1.err", logs / "raylet.1.out"]
    for p in paths:
        t = _tail_file(p, lines)
        if t:
            parts.append(f"--- {p} (tail) ---\n{t}")
    return "\n".join(parts) if parts else f"(no logs found under {cfg.state_dir} or {rcfg.temp_dir})"


# ---- up / down / status -----------------------------------------------------------------------


def _ray_exe() -> str:
    exe = Path(sys.executable).parent / "ray"
    if exe.exists():
        return str(exe)
    found = shutil.which("ray")
    if not found:
        raise ClusterError("the `ray` command was not found next to this Python or on PATH; install ray[serve]")
    return found


def _start_site(cfg: LocalClusterConfig, state: dict[str, Any], site: str, args: list[str],
                timeout_s: float, prefix: Iterable[str] = ()) -> None:
    log_path = Path(cfg.state_dir) / LOG_DIR / f"ray_start_{site}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:  # prefix: `ip netns exec NS` for site b behind a shaped link
        proc = subprocess.Popen([*prefix, _ray_exe(), "start", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=_subprocess_env(cfg), start_new_session=True)
    state["pgids"][site] = proc.pid  # its own session: every process it spawns shares this group
    _save_state(cfg, state)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`ray start` for site {site} did not return within {timeout_s:.0f}s") from None
    if rc != 0:
        raise ClusterError(f"`ray start` for site {site} failed (exit {rc})")


def _write_token(cfg: LocalClusterConfig) -> None:
    p = cfg.token_path
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # what `ray get-auth-token --generate` makes
    os.chmod(p, 0o600)


def _info(cfg: LocalClusterConfig, state: dict[str, Any], node_ids: dict[str, str],
          already_running: bool) -> ClusterInfo:
    ports = state.get("ports", {})
    dash = f"http://127.0.0.1:{ports['dashboard']}" if state["identity"].get("dashboard") else None
    session = _session_dir(Path(cfg.temp_dir))
    return ClusterInfo(address=cfg.address, node_ids=dict(node_ids), env=driver_env(cfg),
                       token_path=str(cfg.token_path), state_dir=str(cfg.state_dir), temp_dir=str(cfg.temp_dir),
                       session_dir=str(session) if session else None, dashboard_url=dash, ports=dict(ports),
                       already_running=already_running, config=cfg, shaped_link=state.get("netns"))


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    """Serialize up/down on one state dir (flock on the directory itself, so it can be removed)."""
    if not state_dir.is_dir():
        yield
        return
    fd = os.open(state_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def cluster_up(cfg: LocalClusterConfig, log: Callable[[str], None] | None = None) -> ClusterInfo:
    """Start the two-site cluster, or report the recorded one if it's already up and healthy.

    Raises ClusterError (message with log tails) if the port is taken, `ray start` fails or the two
    labelled nodes don't show up alive within cfg.start_timeout_s; what was started is torn down.
    """
    Path(cfg.state_dir).mkdir(parents=True, exist_ok=True)
    with _locked(Path(cfg.state_dir)):
        return _up(cfg, log or (lambda _msg: None))


def _up(cfg: LocalClusterConfig, say: Callable[[str], None]) -> ClusterInfo:
    state = _load_state(cfg)
    if state is not None:
        rcfg = _recorded_cfg(cfg, state)
        head = state.get("pgids", {}).get("a")
        probe = (_probe(rcfg, wait_s=2.0) if head and _running(head, "gcs/gcs_server")
                 else {"nodes": [], "error": "the head's GCS is not running"})
        sites = _local_alive_sites(state, probe["nodes"])
        if probe["error"] is None and set(sites) == set(SITES):
            if state.get("identity") != cfg.identity():
                diff = {k: (state.get("identity", {}).get(k), v) for k, v in cfg.identity().items()
                        if state.get("identity", {}).get(k) != v}
                raise ClusterError(
                    f"a cluster is already running from {cfg.state_dir} with other settings "
                    f"({', '.join(f'{k}: running {a!r}, asked {b!r}' for k, (a, b) in diff.items())}); "
                    "run `pdd cluster down` first, or use another --state-dir")
            say(f"cluster already up at {rcfg.address} (state in {cfg.state_dir})")
            return _info(cfg, state, sites, already_running=True)  # identity matched: same address
        why = probe["error"] or f"alive sites: {sorted(sites) or 'none'}"
        say(f"recorded cluster in {cfg.state_dir} is not healthy ({why}); tearing down what is left")
        _down(cfg)

    if cfg.shaped_link is not None and (why := netns.support()):
        raise ShapedLinkUnavailable(f"--shaped-link needs a network namespace and a veth pair, but {why}; "
                                    "nothing was started")
    # a shaped link's host veth address doesn't exist yet: check the port on loopback (the GCS binds all)
    problem = port_problem(cfg.node_ip if cfg.shaped_link is None else DEFAULT_NODE_IP, cfg.port)
    if problem:
        raise ClusterError(f"port {cfg.port} is taken: {problem}. It is not a cluster recorded in "
                           f"{cfg.state_dir}; pick another port (--port) or stop whatever holds it")
    if cfg.dashboard:
        problem = port_problem("127.0.0.1", cfg.dashboard_port)
        if problem:
            raise ClusterError(f"dashboard port {cfg.dashboard_port} is taken: {problem}; "
                               "pick another (--dashboard-port) or run without the dashboard")
    leftovers = _groups_running_under(Path(cfg.temp_dir))
    if leftovers:
        say(f"stopping leftover Ray processes under {cfg.temp_dir} (groups {sorted(leftovers)})")
        _kill_groups(leftovers)

    client, agent_a, agent_b, dash = _free_ports(4, avoid={cfg.port, cfg.dashboard_port})
    ports = {"gcs": cfg.port, "ray_client": client, "dashboard_agent_a": agent_a, "dashboard_agent_b": agent_b,
             "dashboard": cfg.dashboard_port if cfg.dashboard else dash}
    _write_token(cfg)
    state = {"identity": cfg.identity(), "address": cfg.address, "pgids": {}, "ports": ports,
             "token_path": str(cfg.token_path), "started_at": time.time()}
    _save_state(cfg, state)
    deadline = time.monotonic() + cfg.start_timeout_s
    common = ["--node-ip-address", cfg.node_ip, "--temp-dir", str(cfg.temp_dir), "--disable-usage-stats",
              "--object-store-memory", str(cfg.object_store_mib * 2**20)]
    head = [*common, "--head", "--port", str(cfg.port), "--labels", f"{SITE_LABEL}=a",
            "--num-cpus", str(cfg.cpus_a), "--resources", json.dumps({"site_a": SITE_RESOURCE_UNITS}),
            "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent_a),
            "--include-dashboard", "true" if cfg.dashboard else "false",
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(ports["dashboard"])]
    if cfg.gpus_a is not None:
        head += ["--num-gpus", str(cfg.gpus_a)]
    worker = [*common, "--address", cfg.address, "--labels", f"{SITE_LABEL}=b",
              "--num-cpus", str(cfg.cpus_b), "--num-gpus", str(cfg.gpus_b),
              "--resources", json.dumps({"site_b": SITE_RESOURCE_UNITS}),
              "--dashboard-agent-listen-port", str(agent_b)]
    t0 = time.monotonic()
    try:
        prefix_b: list[str] = []
        if cfg.veth is not None:
            state["netns"] = _setup_shaped_link(cfg, say)
            _save_state(cfg, state)
            worker[worker.index("--node-ip-address") + 1] = cfg.veth.ns_ip
            prefix_b = cfg.veth.exec_prefix
        say(f"starting site a (head, GCS {cfg.address}) ...")
        _start_site(cfg, state, "a", head, max(1.0, deadline - time.monotonic()))
        say(f"starting site b ... ({time.monotonic() - t0:.1f}s)")
        _start_site(cfg, state, "b", worker, max(1.0, deadline - time.monotonic()), prefix=prefix_b)
        probe = _probe(cfg, wait_s=max(1.0, deadline - time.monotonic()))
        sites = _alive_sites(probe["nodes"])
        if set(sites) != set(SITES):
            raise ClusterError(f"the labelled nodes did not come up within {cfg.start_timeout_s:.0f}s "
                               f"(alive sites: {sorted(sites) or 'none'}; {probe['error'] or 'no probe error'})")
    except BaseException as e:  # also Ctrl-C: never leave a half-started cluster behind
        tail = log_tail(cfg)
        _teardown(cfg, state)
        unavailable = isinstance(e, ShapedLinkUnavailable)  # nothing ran: no logs worth keeping
        _remove_state(cfg, keep_logs=not unavailable)
        if unavailable:
            raise
        if isinstance(e, (ClusterError, OSError)):
            raise ClusterError(f"{e}\n{tail}") from None
        raise
    state["node_ids"] = sites
    session = _session_dir(Path(cfg.temp_dir))
    state["session_dir"] = str(session) if session else None
    _save_state(cfg, state)
    (Path(cfg.state_dir) / ENV_FILE).write_text("\n".join(env_lines(cfg)) + "\n")
    say(f"cluster up in {time.monotonic() - t0:.1f}s")
    return _info(cfg, state, sites, already_running=False)


def _teardown(cfg: LocalClusterConfig, state: dict[str, Any] | None) -> list[int]:
    groups = set((state or {}).get("pgids", {}).values()) | _groups_running_under(Path(cfg.temp_dir))
    pids = _kill_groups(groups)
    _destroy_shaped_link(cfg, state)
    return pids


def _setup_shaped_link(cfg: LocalClusterConfig, say: Callable[[str], None]) -> dict[str, Any]:
    """Make site b's namespace + shaped veth; returns the record kept in the state."""
    veth, link = cfg.veth, cfg.shaped_link
    assert veth is not None and isinstance(link, ShapedLink)
    try:
        kernel = netns.create(veth, link)
    except NetnsError as e:
        raise ShapedLinkUnavailable(f"could not set up the shaped link: {e}; nothing was started") from None
    lines = netns.describe(link, kernel)
    say(f"shaped link: site b in netns {veth.name} ({veth.ns_ip}) behind veth {veth.host_if} ({veth.host_ip})")
    for line in lines:
        say(f"  {line}")
    return {"veth": veth.to_dict(), "link": link.spec, "kernel": kernel.to_dict(), "describe": lines}


def _destroy_shaped_link(cfg: LocalClusterConfig, state: dict[str, Any] | None) -> str | None:
    """Remove the recorded namespace (or the port's, if one lingers without a record); never raises:
    teardown goes on regardless. Returns the error, if any."""
    rec = (state or {}).get("netns")
    veth = VethNamespace.from_dict(rec["veth"]) if rec else VethNamespace.for_port(cfg.port)
    if not rec and not netns.exists(veth):
        return None
    try:
        netns.destroy(veth)
    except (NetnsError, ValueError) as e:
        return str(e)
    return None


def _remove_state(cfg: LocalClusterConfig, keep_logs: bool = False) -> None:
    sd = Path(cfg.state_dir)
    for name in (STATE_FILE, ENV_FILE, *(() if keep_logs else (TOKEN_FILE,))):
        with contextlib.suppress(FileNotFoundError):
            (sd / name).unlink()
    if not keep_logs:
        shutil.rmtree(sd / LOG_DIR, ignore_errors=True)
        with contextlib.suppress(OSError):
            sd.rmdir()  # only if empty: the state dir may hold other things


def _remove_ray_logs(temp_dir: Path) -> None:
    """Delete Ray's session dirs under temp_dir (and temp_dir if that empties it); nothing else."""
    if not temp_dir.is_dir():
        return
    for p in temp_dir.iterdir():
        if p.name.startswith("session_"):
            if p.is_symlink():
                p.unlink()
            else:
                shutil.rmtree(p, ignore_errors=True)
        elif p.name == "ray_current_cluster":
            p.unlink()
    with contextlib.suppress(OSError):
        temp_dir.rmdir()


def cluster_down(cfg: LocalClusterConfig, remove_logs: bool = False) -> dict[str, Any]:
    """Stop exactly this cluster (both raylets and everything they spawned) and forget it.

    Idempotent; works on a half-dead cluster. Kills the process groups recorded at start plus any
    whose processes run under this cluster's temp dir -- never other Ray clusters of the machine.
    remove_logs also deletes Ray's session dirs under the temp dir.
    """
    with _locked(Path(cfg.state_dir)):
        return _down(cfg, remove_logs)


def _down(cfg: LocalClusterConfig, remove_logs: bool = False) -> dict[str, Any]:
    state = _load_state(cfg)
    rcfg = _recorded_cfg(cfg, state)
    pids = _teardown(rcfg, state)
    ns_left = [n for n in [(state or {}).get("netns", {}).get("veth", {}).get("name")] if n and netns.exists(n)]
    _remove_state(cfg)
    if remove_logs:
        _remove_ray_logs(Path(rcfg.temp_dir))
    if pids:
        msg = f"stopped the cluster at {rcfg.address} ({len(pids)} processes)"
    elif state:
        msg = f"no processes were left of the cluster at {rcfg.address}; state in {cfg.state_dir} removed"
    else:
        msg = f"no cluster recorded in {cfg.state_dir} and none running under {rcfg.temp_dir}: nothing to stop"
    if ns_left:
        msg += f"; WARNING: network namespace {ns_left[0]} could not be removed (`ip netns del {ns_left[0]}`)"
    elif (state or {}).get("netns"):
        msg += f"; removed network namespace {state['netns']['veth']['name']} and its veth pair"
    return {"stopped_pids": pids, "had_state": state is not None, "message": msg}


def cluster_status(cfg: LocalClusterConfig) -> dict[str, Any]:
    """Nodes with their pdd.site labels, alive/dead and resources; says so when nothing runs.

    Keys: running (some site alive), healthy (both), address, sites {a, b: alive, node_id,
    processes}, nodes (GCS node table, dead nodes included), error, message; and, when the GCS
    answered, serve {controller, replicas, error, deployments (serve_deployments: each Serve
    deployment's live replicas with their site)}.
    """
    state = _load_state(cfg)
    rcfg = _recorded_cfg(cfg, state)
    out: dict[str, Any] = {"state_dir": str(cfg.state_dir), "recorded": state is not None,
                           "address": rcfg.address, "temp_dir": str(rcfg.temp_dir), "running": False,
                           "healthy": False, "sites": {}, "nodes": [], "error": None,
                           "env": driver_env(cfg), "ports": (state or {}).get("ports", {}),
                           "shaped_link": (state or {}).get("netns")}
    pgids = (state or {}).get("pgids", {})
    procs = {s: len(_cluster_procs([pgids[s]])) if s in pgids else 0 for s in SITES}
    if state is None and not _groups_running_under(Path(rcfg.temp_dir)):
        out["message"] = f"no cluster running (nothing recorded in {cfg.state_dir}); start one with `pdd cluster up`"
        out["sites"] = {s: {"alive": False, "node_id": None, "processes": 0} for s in SITES}
        return out
    if state is None or ("a" in pgids and _running(pgids["a"], "gcs/gcs_server")):
        probe = _probe(rcfg, wait_s=0.0, replicas=True)
    else:
        probe = {"nodes": [], "error": "the head's GCS (site a) is not running"}
    alive = _local_alive_sites(state or {}, probe["nodes"])
    out["nodes"] = probe["nodes"]
    out["error"] = probe["error"]
    if probe.get("serve") is not None:
        out["serve"] = {**probe["serve"], "deployments": serve_deployments(probe["serve"]["replicas"], probe["nodes"])}
    out["sites"] = {s: {"alive": s in alive, "node_id": alive.get(s), "processes": procs[s]} for s in SITES}
    out["running"] = bool(alive) or any(procs.values())
    out["healthy"] = set(alive) == set(SITES)
    if out["healthy"]:
        out["message"] = f"cluster up at {rcfg.address}: sites a and b alive"
    elif out["running"]:
        out["message"] = (f"cluster at {rcfg.address} is only partly up (alive sites: {sorted(alive) or 'none'}, "
                          f"processes per site: {procs}); `pdd cluster down` then `pdd cluster up` to restart")
    else:
        out["message"] = f"no cluster running (stale state in {cfg.state_dir}; `pdd cluster down` clears it)"
    return out


def spawn_reaper(cfg: LocalClusterConfig, watch_pid: int | None = None) -> subprocess.Popen:
    """Start a tiny detached process that runs `cluster_down(cfg)` once `watch_pid` (default: this
    process) has exited -- so a test session killed hard doesn't leave the cluster behind."""
    watch_pid = os.getpid() if watch_pid is None else watch_pid
    code = ("import os, sys, time\n"
            "from pdd_serve.cluster import LocalClusterConfig, cluster_down, _proc_stat\n"
            "pid = int(sys.argv[1])\n"
            "while (st := _proc_stat(pid)) and st[0] != 'Z':\n"
            "    time.sleep(1.0)\n"
            "cfg = LocalClusterConfig(port=int(sys.argv[2]), node_ip=sys.argv[3], temp_dir=sys.argv[4],\n"
            "                         state_dir=sys.argv[5])\n"
            "cluster_down(cfg, remove_logs=sys.argv[6] == '1')\n")
    return subprocess.Popen([sys.executable, "-c", code, str(watch_pid), str(cfg.port), cfg.node_ip,
                             str(cfg.temp_dir), str(cfg.state_dir), "1"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


# ---- CLI --------------------------------------------------------------------------------------

CLUSTER_DESCRIPTION = """\
A local two-site Ray cluster on this machine, standing in for two datacenters.

  pdd cluster up       start it (idempotent: a healthy recorded cluster is just reported)
  pdd cluster env      print the driver environment as `export` lines
  pdd cluster status   nodes, their pdd.site labels, alive/dead, resources; each Serve
                       deployment's replicas per site (node, state)
  pdd cluster down     stop exactly this cluster (also a half-dead one) and forget it

Two sites: two raylets, each with its own object store. Site a is the head (GCS on --port,
default 6390), labelled pdd.site=a; site b joins it, labelled pdd.site=b. Each also carries a
custom resource site_a / site_b (1000 units). Pin Serve deployments with
  ray_actor_options: {label_selector: {pdd.site: b}, num_cpus: 0.5}
CPUs are logical (--cpus-a / --cpus-b, default 4 each; may exceed the real cores).

Shaped link (root): `pdd cluster up --shaped-link RATE[,DELAY,JITTER,LOSS]`, e.g. 40mbit or
100mbit,50ms,5ms,0.1%, runs site b's raylet in its own network namespace behind a veth pair shaped
by the kernel (tbf/htb for the rate; netem for delay/jitter/loss where the kernel has it), so all
cross-site traffic (Ray control and the KV Flight stream) crosses it with real TCP. DELAY is
one-way. `up` prints which parts are kernel-shaped; what isn't must come from the graph's
args.link (LinkModel). Site a's address becomes the host veth end (10.192.x.y), so MD's Flight
server must bind a reachable address: see cluster_configs/graphs/local-shaped-*.yaml. Without
namespaces (not root, no `ip`) it says so and exits 4 having started nothing.

Drivers and token auth: the cluster uses token auth with its own token in STATE_DIR/auth_token
(never the shared ~/.ray/auth_token). A driver (ray.init, `serve run`, `ray status`) needs
  RAY_ADDRESS=IP:PORT  RAY_AUTH_MODE=token  RAY_AUTH_TOKEN_PATH=STATE_DIR/auth_token
and no RAY_AUTH_TOKEN. Without RAY_AUTH_MODE=token a driver given an address doesn't send the
token and retries InvalidAuthToken forever. So:
  pdd cluster up
  eval "$(pdd cluster env)"
  serve run graphs/pdd.yaml --non-blocking     # deployments pinned by label_selector
  pdd cluster down
Serve's HTTP proxy runs on the head (site a), on the YAML's http_options.port (default 8000);
the dashboard is off by default (saves CPU; Serve doesn't need it, but `serve deploy` /
`serve status` / `ray job submit` do: use --dashboard).

State: STATE_DIR (--state-dir, else $PDD_CLUSTER_DIR, else ./.pdd/cluster) records the address,
process groups, ports and token; Ray's own sockets and logs live in --temp-dir (default
/tmp/pdd-ray-PORT), which keeps this cluster apart from any other Ray on the machine.
"""


def _cfg_from_args(args: argparse.Namespace) -> LocalClusterConfig:
    kw: dict[str, Any] = {}
    for name in ("port", "dashboard", "dashboard_port", "cpus_a", "cpus_b", "gpus_a", "gpus_b",
                 "object_store_mib", "state_dir", "temp_dir", "node_ip", "start_timeout_s", "shaped_link"):
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    return LocalClusterConfig(**kw)


def _add_common(p: argparse.ArgumentParser, up: bool = False) -> None:
    p.add_argument("--state-dir", default=None,
                   help="where the cluster is recorded (default: $PDD_CLUSTER_DIR, else ./.pdd/cluster)")
    p.add_argument("--port", type=int, default=None,
                   help=f"head GCS port (default: {DEFAULT_PORT}; down/status/env read it from the state dir)")
    p.add_argument("--temp-dir", default=None,
                   help=f"Ray --temp-dir, at most {MAX_TEMP_DIR_LEN} chars (default: /tmp/pdd-ray-PORT)")
    p.add_argument("--node-ip", default=None, help=f"IP of both raylets and drivers (default: {DEFAULT_NODE_IP})")
    if up:
        d = LocalClusterConfig.__dataclass_fields__
        p.add_argument("--cpus-a", type=int, default=None, help=f"logical CPUs of site a (default: {d['cpus_a'].default})")
        p.add_argument("--cpus-b", type=int, default=None, help=f"logical CPUs of site b (default: {d['cpus_b'].default})")
        p.add_argument("--gpus-a", type=int, default=None, help="GPUs of site a (default: autodetect)")
        p.add_argument("--gpus-b", type=int, default=None, help="GPUs of site b (default: 0)")
        p.add_argument("--object-store-mib", type=int, default=None,
                       help=f"object store per raylet, MiB (default: {d['object_store_mib'].default})")
        p.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=None,
                       help="start Ray's dashboard (default: off)")
        p.add_argument("--dashboard-port", type=int, default=None, help="dashboard port (default: 8265)")
        p.add_argument("--timeout", dest="start_timeout_s", type=float, default=None,
                       help="seconds to wait for both sites (default: 120)")
        p.add_argument("--shaped-link", default=None, metavar="RATE[,DELAY,JITTER,LOSS]",
                       help="root: put site b in a network namespace behind a kernel-shaped veth, e.g. "
                            "40mbit or 100mbit,50ms,5ms,0.1%% (DELAY one-way; see above)")


def _err(cmd: str, e: Exception) -> int:
    print(f"pdd cluster {cmd}: error: {e}", file=sys.stderr)
    return 1


def _run_up(args: argparse.Namespace) -> int:
    try:
        cfg = _cfg_from_args(args)
        info = cluster_up(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    except ShapedLinkUnavailable as e:
        print(f"pdd cluster up: {e}", file=sys.stderr)
        return 4
    except (ValueError, ClusterError) as e:
        return _err("up", e)
    print(f"address:     {info.address}  ({'already running' if info.already_running else 'started'})")
    for s in SITES:
        print(f"site {s}:      node {info.node_ids[s]}  ({SITE_LABEL}={s})")
    print(f"token:       {info.token_path}")
    print(f"state dir:   {info.state_dir}")
    print(f"ray logs:    {info.session_dir or info.temp_dir}/logs")
    print(f"dashboard:   {info.dashboard_url or 'off'}")
    print(f"serve http:  proxy on site a, port from the app's http_options (default {info.serve_port})")
    if info.shaped_link:
        v = info.shaped_link["veth"]
        print(f"shaped link: {info.shaped_link['link']}: site b in netns {v['name']} ({v['ns_ip']}), "
              f"site a on {v['host_if']} ({v['host_ip']})")
        for line in info.shaped_link["describe"]:
            print(f"  {line}")
    print("driver env (or: eval \"$(pdd cluster env)\"):")
    for line in env_lines(cfg):
        print(f"  {line}")
    return 0


def _run_down(args: argparse.Namespace) -> int:
    try:
        res = cluster_down(_cfg_from_args(args), remove_logs=args.remove_logs)
    except (ValueError, ClusterError) as e:
        return _err("down", e)
    print(res["message"])
    return 0


def _run_status(args: argparse.Namespace) -> int:
    try:
        st = cluster_status(_cfg_from_args(args))
    except (ValueError, ClusterError) as e:
        return _err("status", e)
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
    else:
        print(st["message"])
        for n in sorted(st["nodes"], key=lambda n: (n["labels"].get(SITE_LABEL, "~"), not n["alive"])):
            res = n["resources"]
            print(f"  {SITE_LABEL}={n['labels'].get(SITE_LABEL, '?')}  {'ALIVE' if n['alive'] else 'DEAD '}  "
                  f"{n['node_id'][:12]}  CPU {res.get('CPU', 0):g}  GPU {res.get('GPU', 0):g}  "
                  f"object store {res.get('object_store_memory', 0) / 2**20:.0f} MiB"
                  + (f"  ({n['death_reason']})" if n["death_reason"] else ""))
        if st["error"] and st["recorded"]:
            print(f"  probe error: {st['error']}")
        for line in format_serve_deployments(st.get("serve"), (st.get("serve") or {}).get("deployments", [])):
            print(f"  {line}")
        if st["shaped_link"]:
            v = st["shaped_link"]["veth"]
            print(f"  shaped link {st['shaped_link']['link']}: site b in netns {v['name']} "
                  f"({'present' if netns.exists(v['name']) else 'MISSING'})")
    return 0 if st["healthy"] else (1 if st["running"] else 3)


def _run_env(args: argparse.Namespace) -> int:
    try:
        cfg = _cfg_from_args(args)
        if _load_state(cfg) is None:
            print(f"# note: no cluster recorded in {cfg.state_dir}; run `pdd cluster up`", file=sys.stderr)
        print("\n".join(env_lines(cfg)))
    except (ValueError, ClusterError) as e:
        return _err("env", e)
    return 0


def run_cluster(args: argparse.Namespace) -> int:
    """Dispatch `pdd cluster SUBCOMMAND`; prints the help when no subcommand was given."""
    fn = getattr(args, "cluster_func", None)
    if fn is None:
        args.cluster_parser.print_help(sys.stderr)
        return 2
    return fn(args)


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """Fill an existing `cluster` parser with the up/down/status/env subcommands (for cli.COMMANDS:
    Command("cluster", ..., add_cluster_arguments, run_cluster, CLUSTER_DESCRIPTION))."""
    sub = p.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND")
    specs = [
        ("up", "start the two-site cluster (idempotent)", _run_up, True),
        ("down", "stop exactly this cluster and forget it (idempotent)", _run_down, False),
        ("status", "nodes, labels, alive/dead, resources, Serve replicas per site "
                   "(exit 0 healthy, 1 partly up, 3 not running)",
         _run_status, False),
        ("env", "print `export` lines for a driver: eval \"$(pdd cluster env)\"", _run_env, False),
    ]
    for name, help_, fn, up in specs:
        sp = sub.add_parser(name, help=help_, description=f"{help_}\n\n{CLUSTER_DESCRIPTION}",
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        _add_common(sp, up=up)
        if name == "down":
            sp.add_argument("--remove-logs", action="store_true", help="also delete Ray's session logs")
        if name == "status":
            sp.add_argument("--json", action="store_true", help="print the full status as JSON")
        sp.set_defaults(func=fn, cluster_func=fn)
    p.set_defaults(cluster_parser=p)


def add_cluster_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `cluster up|down|status|env` on the `pdd` CLI's subparsers.

    Leaf parsers set `func` (and `cluster_func`) to a function(args) -> int exit code; the `cluster`
    parser itself sets `_run=run_cluster`, which dispatches (or prints help when no subcommand).
    """
    p = subparsers.add_parser("cluster", help="local two-site Ray cluster (up/down/status/env)",
                              description=CLUSTER_DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(p)
    p.set_defaults(_run=run_cluster)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m pdd_serve.cluster ...`, the same as `pdd cluster ...`."""
    parser = argparse.ArgumentParser(prog="pdd")
    add_cluster_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cluster", *(sys.argv[1:] if argv is None else argv)])
    return run_cluster(args)


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["ClusterError", "ClusterInfo", "LocalClusterConfig", "ShapedLinkUnavailable", "add_cluster_arguments", "add_cluster_parser",
           "apply_driver_env", "cluster_down", "cluster_status", "cluster_up", "driver_env", "env_lines",
           "format_serve_deployments", "log_tail", "port_problem", "run_cluster", "serve_deployments",
           "spawn_reaper"]
