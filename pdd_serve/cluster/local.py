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

This module is the public face: the config, `cluster_up` / `cluster_down` / `cluster_status` and the
names other code imports. The parts live beside it: config.py (settings, state file, driver
environment), procs.py (processes via /proc, ports, `terminate`), inspection.py (GCS probe, Serve
replicas per site, log tails), netns.py (the shaped link), cli.py (`pdd cluster ...`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from pdd_serve.cluster import netns
from pdd_serve.cluster.config import (
    DEFAULT_NODE_IP,
    ENV_FILE,
    LOG_DIR,
    SITE_LABEL,
    SITE_RESOURCE_UNITS,
    SITES,
    STATE_DIR_ENV,
    STATE_FILE,
    TOKEN_FILE,
    ClusterError,
    ClusterInfo,
    LocalClusterConfig,
    ShapedLinkUnavailable,
    apply_driver_env,
    driver_env,
    env_lines,
    load_state,
    ray_subprocess_env,
    recorded_config,
    refresh_ray_auth_config,
    save_state,
)
from pdd_serve.cluster.inspection import (
    UNPLACED,
    alive_sites,
    format_serve_deployments,
    latest_session_dir,
    local_alive_sites,
    log_tail,
    probe_cluster,
    serve_deployments,
)
from pdd_serve.cluster.netns import NetnsError, ShapedLink, VethNamespace
from pdd_serve.cluster.procs import (
    cluster_pids,
    free_ports,
    group_runs,
    groups_running_under,
    kill_groups,
    port_problem,
)

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
                                stdin=subprocess.DEVNULL, env=ray_subprocess_env(cfg), start_new_session=True)
    state["pgids"][site] = proc.pid  # its own session: every process it spawns shares this group
    save_state(cfg, state)
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
    session = latest_session_dir(Path(cfg.temp_dir))
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
    state = load_state(cfg)
    if state is not None:
        rcfg = recorded_config(cfg, state)
        head = state.get("pgids", {}).get("a")
        probe = (probe_cluster(rcfg, wait_s=2.0) if head and group_runs(head, "gcs/gcs_server")
                 else {"nodes": [], "error": "the head's GCS is not running"})
        sites = local_alive_sites(state, probe["nodes"])
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
    leftovers = groups_running_under(Path(cfg.temp_dir))
    if leftovers:
        say(f"stopping leftover Ray processes under {cfg.temp_dir} (groups {sorted(leftovers)})")
        kill_groups(leftovers)

    client, agent_a, agent_b, dash = free_ports(4, avoid={cfg.port, cfg.dashboard_port})
    ports = {"gcs": cfg.port, "ray_client": client, "dashboard_agent_a": agent_a, "dashboard_agent_b": agent_b,
             "dashboard": cfg.dashboard_port if cfg.dashboard else dash}
    _write_token(cfg)
    state = {"identity": cfg.identity(), "address": cfg.address, "pgids": {}, "ports": ports,
             "token_path": str(cfg.token_path), "started_at": time.time()}
    save_state(cfg, state)
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
            save_state(cfg, state)
            worker[worker.index("--node-ip-address") + 1] = cfg.veth.ns_ip
            prefix_b = cfg.veth.exec_prefix
        say(f"starting site a (head, GCS {cfg.address}) ...")
        _start_site(cfg, state, "a", head, max(1.0, deadline - time.monotonic()))
        say(f"starting site b ... ({time.monotonic() - t0:.1f}s)")
        _start_site(cfg, state, "b", worker, max(1.0, deadline - time.monotonic()), prefix=prefix_b)
        probe = probe_cluster(cfg, wait_s=max(1.0, deadline - time.monotonic()))
        sites = alive_sites(probe["nodes"])
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
    session = latest_session_dir(Path(cfg.temp_dir))
    state["session_dir"] = str(session) if session else None
    save_state(cfg, state)
    (Path(cfg.state_dir) / ENV_FILE).write_text("\n".join(env_lines(cfg)) + "\n")
    say(f"cluster up in {time.monotonic() - t0:.1f}s")
    return _info(cfg, state, sites, already_running=False)


def _teardown(cfg: LocalClusterConfig, state: dict[str, Any] | None) -> list[int]:
    groups = set((state or {}).get("pgids", {}).values()) | groups_running_under(Path(cfg.temp_dir))
    pids = kill_groups(groups)
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
    state = load_state(cfg)
    rcfg = recorded_config(cfg, state)
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
    state = load_state(cfg)
    rcfg = recorded_config(cfg, state)
    out: dict[str, Any] = {"state_dir": str(cfg.state_dir), "recorded": state is not None,
                           "address": rcfg.address, "temp_dir": str(rcfg.temp_dir), "running": False,
                           "healthy": False, "sites": {}, "nodes": [], "error": None,
                           "env": driver_env(cfg), "ports": (state or {}).get("ports", {}),
                           "shaped_link": (state or {}).get("netns")}
    pgids = (state or {}).get("pgids", {})
    procs = {s: len(cluster_pids([pgids[s]])) if s in pgids else 0 for s in SITES}
    if state is None and not groups_running_under(Path(rcfg.temp_dir)):
        out["message"] = f"no cluster running (nothing recorded in {cfg.state_dir}); start one with `pdd cluster up`"
        out["sites"] = {s: {"alive": False, "node_id": None, "processes": 0} for s in SITES}
        return out
    if state is None or ("a" in pgids and group_runs(pgids["a"], "gcs/gcs_server")):
        probe = probe_cluster(rcfg, wait_s=0.0, replicas=True)
    else:
        probe = {"nodes": [], "error": "the head's GCS (site a) is not running"}
    alive = local_alive_sites(state or {}, probe["nodes"])
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
            "from pdd_serve.cluster.local import LocalClusterConfig, cluster_down\n"
            "from pdd_serve.cluster.procs import proc_stat\n"
            "pid = int(sys.argv[1])\n"
            "while (st := proc_stat(pid)) and st[0] != 'Z':\n"
            "    time.sleep(1.0)\n"
            "cfg = LocalClusterConfig(port=int(sys.argv[2]), node_ip=sys.argv[3], temp_dir=sys.argv[4],\n"
            "                         state_dir=sys.argv[5])\n"
            "cluster_down(cfg, remove_logs=sys.argv[6] == '1')\n")
    return subprocess.Popen([sys.executable, "-c", code, str(watch_pid), str(cfg.port), cfg.node_ip,
                             str(cfg.temp_dir), str(cfg.state_dir), "1"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


__all__ = ["STATE_DIR_ENV", "UNPLACED", "ClusterError", "ClusterInfo", "LocalClusterConfig", "ShapedLinkUnavailable",
           "apply_driver_env", "cluster_down", "cluster_status", "cluster_up", "driver_env", "env_lines",
           "format_serve_deployments", "log_tail", "port_problem", "refresh_ray_auth_config", "serve_deployments",
           "spawn_reaper"]
