"""`pdd cluster status`: each Serve deployment's replicas per site, from a fabricated actor list
(what the GCS probe returns) -- no cluster needed."""

from __future__ import annotations

import json

from pdd_serve.cluster import cli as cluster_cli
from pdd_serve.cluster import local as C

NODE_A, NODE_B, GONE = "a1" * 28, "b2" * 28, "c3" * 28
NODES = [
    {"node_id": NODE_A, "alive": True, "labels": {"pdd.site": "a"}, "resources": {"CPU": 4.0}, "death_reason": ""},
    {"node_id": NODE_B, "alive": True, "labels": {"pdd.site": "b"}, "resources": {"CPU": 4.0}, "death_reason": ""},
]


def _replica(app: str, dep: str, rid: str, node: str, state: str = "ALIVE", pid: int | None = 100) -> dict:
    return {"class_name": f"ServeReplica:{app}:{dep}", "name": f"SERVE_REPLICA::{app}#{dep}#{rid}",
            "state": state, "node_id": node, "pid": pid, "actor_id": rid * 4}


REPLICAS = [
    _replica("pdd", "Router", "r1", NODE_A),
    _replica("pdd", "Router", "r2", NODE_A),
    _replica("pdd", "Prefill", "p1", NODE_A),
    _replica("pdd", "MainDecode", "m2", NODE_B),
    _replica("pdd", "MainDecode", "m1", NODE_B),
    _replica("pdd", "MainDecode", "m3", "", state="PENDING_CREATION", pid=None),  # autoscaling up
    _replica("pdd", "MainDecode0", "x1", NODE_B),  # the older one-deployment-per-replica names work too
    _replica("pdd", "Relay", "q1", GONE, state="RESTARTING"),  # on a node the table no longer has
]


def test_replicas_are_grouped_per_deployment_and_placed_on_their_site():
    deps = {d["deployment"]: d for d in C.serve_deployments(REPLICAS, NODES)}
    assert [d["deployment"] for d in C.serve_deployments(REPLICAS, NODES)] == \
        ["MainDecode", "MainDecode0", "Prefill", "Relay", "Router"]
    md = deps["MainDecode"]
    assert md["app"] == "pdd" and md["per_site"] == {"b": 2, C.UNPLACED: 1}
    assert md["states"] == {"ALIVE": 2, "PENDING_CREATION": 1}
    assert [r["replica"] for r in md["replicas"]] == ["m3", "m1", "m2"]  # unplaced ("-") sorts first, then ids
    assert deps["Router"]["per_site"] == {"a": 2} and deps["MainDecode0"]["per_site"] == {"b": 1}
    assert deps["Relay"]["per_site"] == {"?": 1} and deps["Relay"]["states"] == {"RESTARTING": 1}
    json.dumps(deps)  # goes into `status --json` as is


def test_names_fall_back_to_the_class_name():
    r = {"class_name": "ServeReplica:my:app:Router", "name": "", "state": "ALIVE", "node_id": NODE_A,
         "pid": 1, "actor_id": "0123456789abcdef"}
    (d,) = C.serve_deployments([r], NODES)
    assert (d["app"], d["deployment"], d["replicas"][0]["replica"]) == ("my:app", "Router", "0123456789ab")
    r2 = {**r, "name": "SERVE_REPLICA::Router#abc"}  # no app name
    (d,) = C.serve_deployments([r2], NODES)
    assert (d["app"], d["deployment"], d["replicas"][0]["replica"]) == ("", "Router", "abc")


def test_the_table_shows_counts_per_site_and_every_replica():
    lines = C.format_serve_deployments({"controller": True, "error": None}, C.serve_deployments(REPLICAS, NODES))
    text = "\n".join(lines)
    assert lines[0] == "serve: 5 deployments, 8 replicas"
    head = lines[1].split()
    assert head == ["deployment", "replicas", "site", "a", "site", "b", "unplaced", "site", "?", "states"]
    row = next(ln for ln in lines if ln.strip().startswith("pdd/MainDecode "))
    assert row.split() == ["pdd/MainDecode", "3", "0", "2", "1", "0", "ALIVE", "2,", "PENDING_CREATION", "1"]
    row = next(ln for ln in lines if ln.strip().startswith("pdd/Router "))
    assert row.split()[:6] == ["pdd/Router", "2", "2", "0", "0", "0"]
    assert f"m1          pdd.site=b  node {NODE_B[:12]}  ALIVE  pid 100" in text
    assert "m3          not placed yet  PENDING_CREATION" in text
    assert f"q1          pdd.site=?  node {GONE[:12]}  RESTARTING" in text


def test_the_table_has_only_the_sites_in_use_beyond_a_and_b():
    lines = C.format_serve_deployments({"controller": True}, C.serve_deployments(REPLICAS[:2], NODES))
    assert lines[1].split() == ["deployment", "replicas", "site", "a", "site", "b", "states"]


def test_no_serve_and_no_deployments_and_errors_say_so():
    assert C.format_serve_deployments(None, []) == []
    assert C.format_serve_deployments({"controller": False, "error": None}, []) == \
        ["serve: not running (serve run GRAPH.yaml --non-blocking starts it)"]
    assert C.format_serve_deployments({"controller": True, "error": None}, []) == ["serve: running, no deployments"]
    assert C.format_serve_deployments({"controller": True, "error": "RpcError: x"}, []) == \
        ["serve: cannot read the actor table: RpcError: x"]


def test_status_prints_the_replicas(monkeypatch, capsys):
    serve = {"controller": True, "replicas": REPLICAS, "error": None}
    st = {"message": "cluster up at 127.0.0.1:6390: sites a and b alive", "nodes": NODES, "error": None,
          "recorded": True, "shaped_link": None, "healthy": True, "running": True,
          "serve": {**serve, "deployments": C.serve_deployments(REPLICAS, NODES)}}
    monkeypatch.setattr(cluster_cli, "cluster_status", lambda cfg: st)
    assert cluster_cli.main(["status"]) == 0
    out = capsys.readouterr().out
    assert "serve: 5 deployments, 8 replicas" in out and "pdd/MainDecode " in out and "pdd.site=b" in out
    assert cluster_cli.main(["status", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [d["deployment"] for d in got["serve"]["deployments"]][0] == "MainDecode"
