"""The `pdd cluster up|down|status|env` command line (also `python -m pdd_serve.cluster`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdd_serve.cluster import netns
from pdd_serve.cluster.config import (
    DEFAULT_NODE_IP,
    DEFAULT_PORT,
    MAX_TEMP_DIR_LEN,
    SITE_LABEL,
    SITES,
    ClusterError,
    LocalClusterConfig,
    ShapedLinkUnavailable,
    env_lines,
    load_state,
)
from pdd_serve.cluster.inspection import format_serve_deployments
from pdd_serve.cluster.local import cluster_down, cluster_status, cluster_up

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
        if load_state(cfg) is None:
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


__all__ = ["CLUSTER_DESCRIPTION", "add_cluster_arguments", "add_cluster_parser", "main", "run_cluster"]
