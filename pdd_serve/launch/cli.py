"""`python -m pdd_serve.launch validate|node-args|render|preflight|wait-nodes|secrets`: the command
line over configs.py (validation, node args), checks.py (around `ray up`), template.py (the
generated commands) and keys.py (secrets)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdd_serve.launch import configs
from pdd_serve.launch.checks import LaunchCheckError, md_cert_names, preflight, wait_nodes
from pdd_serve.launch.configs import LaunchConfigError, load_yaml, node_args, validate_cluster_config
from pdd_serve.launch.keys import make_secrets
from pdd_serve.launch.template import rendered


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdd_serve.launch", description=configs.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("validate", help="check cluster YAMLs against Ray's schema and their PDD graph")
    v.add_argument("configs", nargs="+")
    v.add_argument("--graph", default=None, help="graph YAML to check against (default: metadata.pdd.graph)")
    n = sub.add_parser("node-args", help="print this host's `ray start --labels/--resources` from an on-prem config")
    n.add_argument("config")
    n.add_argument("--ip", default=None, help="this host's address as listed (default: detect)")
    r = sub.add_parser("render", help="rewrite the generated setup/start commands from metadata.pdd.launch")
    r.add_argument("configs", nargs="+")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each file that differs")
    f = sub.add_parser("preflight", help="before `ray up` (local provider): every host answers ssh with the config's key")
    f.add_argument("config")
    f.add_argument("--timeout", type=float, default=10.0, help="seconds per host (default 10)")
    w = sub.add_parser("wait-nodes", help="on the head after `ray up`: wait until every listed host joined with its "
                                          "labels; prints them as JSON")
    w.add_argument("config")
    w.add_argument("--timeout", type=float, default=300.0, help="seconds (default 300)")
    k = sub.add_parser("secrets", help="make what .pdd/launch lacks: Ray and Flight tokens, API keys, Flight TLS "
                                       "for site b's hosts (or the graph's flight.tls_server_name)")
    k.add_argument("config")
    k.add_argument("--out", default=".pdd/launch", help="directory (default .pdd/launch, what the configs mount)")
    args = p.parse_args(argv)
    if args.cmd in ("render", "preflight", "wait-nodes", "secrets"):
        return run_checks(args)
    if args.cmd == "node-args":
        try:
            print(" ".join(node_args(args.config, args.ip)))
        except LaunchConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    rc = 0
    for c in args.configs:
        try:
            print("\n".join(validate_cluster_config(c, args.graph).summary()))
        except LaunchConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            rc = 1
    return rc


def run_checks(args: argparse.Namespace) -> int:
    """`python -m pdd_serve.launch render|preflight|wait-nodes` (argparse is there)."""
    try:
        if args.cmd == "render":
            drift = []
            for c in args.configs:
                want = rendered(c, load_yaml(Path(c)))
                if Path(c).read_text() != want:
                    drift.append(c)
                    if not args.check:
                        Path(c).write_text(want)
            verb = "differs from metadata.pdd.launch (run render without --check)" if args.check else "rewritten"
            for c in drift:
                print(f"{c}: {verb}", file=sys.stderr if args.check else sys.stdout)
            return 1 if (args.check and drift) else 0
        if args.cmd == "secrets":
            made = make_secrets(args.out, md_cert_names(args.config))
            print(f"{args.out}: " + (f"made {', '.join(made)}" if made else "complete, nothing made"))
            return 0
        if args.cmd == "preflight":
            problems = preflight(args.config, args.timeout)
            for p in problems:
                print(f"error: {p}", file=sys.stderr)
            if not problems:
                print(f"{args.config}: every host answers ssh")
            return 1 if problems else 0
        nodes = wait_nodes(args.config, args.timeout)
        print(json.dumps({"nodes": nodes, "sites": sorted({n["labels"].get("pdd.site", "") for n in nodes})}))
        return 0
    except (LaunchCheckError, LaunchConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
