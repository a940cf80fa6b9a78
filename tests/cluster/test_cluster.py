"""The local two-site cluster (pdd_serve.cluster.local).

Fast unit tests of the config / CLI paths first (no Ray started), then tests against the shared
session cluster (`ray_two_sites`, marked `cluster`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from pdd_serve.cluster import cli as cluster_cli
from pdd_serve.cluster import local as C
from pdd_serve.cluster.local import ClusterError, ClusterInfo, LocalClusterConfig

# ---- unit: no Ray -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdd")
    cluster_cli.add_cluster_parser(parser.add_subparsers(dest="command"))
    return parser


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    return args._run(args)


@pytest.mark.parametrize("kw, match", [
    ({"port": 80}, "port must be an int in 1024..65535"),
    ({"port": 70000}, "port must be"),
    ({"cpus_a": -1}, "cpus_a must be an int >= 0"),
    ({"cpus_b": 1.5}, "cpus_b must be an int"),
    ({"gpus_b": -2}, "gpus_b"),
    ({"object_store_mib": 10}, "object_store_mib must be an int >= 76"),
    ({"temp_dir": "/tmp/" + "x" * 60}, "too long"),
    ({"dashboard": True, "dashboard_port": 6390}, "dashboard_port must differ"),
    ({"start_timeout_s": 0}, "start_timeout_s"),
])
def test_config_rejects_bad_values(kw: dict, match: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        LocalClusterConfig(state_dir=tmp_path, **kw)


def test_config_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(C.STATE_DIR_ENV, raising=False)
    cfg = LocalClusterConfig()
    assert cfg.state_dir == tmp_path / ".pdd" / "cluster"
    assert cfg.temp_dir == Path("/tmp/pdd-ray-6390") and cfg.address == "127.0.0.1:6390"
    assert not cfg.dashboard
    monkeypatch.setenv(C.STATE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert LocalClusterConfig(port=7001).state_dir == tmp_path / "elsewhere"


def test_driver_env_and_env_lines(tmp_path: Path) -> None:
    cfg = LocalClusterConfig(port=7002, state_dir=tmp_path / "st dir")
    env = C.driver_env(cfg)
    assert env == {"RAY_ADDRESS": "127.0.0.1:7002", "RAY_AUTH_MODE": "token",
                   "RAY_AUTH_TOKEN_PATH": str(tmp_path / "st dir" / "auth_token")}
    lines = C.env_lines(cfg)
    assert "export RAY_AUTH_MODE=token" in lines and "unset RAY_AUTH_TOKEN" in lines
    assert f"export RAY_AUTH_TOKEN_PATH='{tmp_path}/st dir/auth_token'" in lines  # shell-quoted
    environ = {"RAY_AUTH_TOKEN": "stale", "RAY_ADDRESS": "x:1"}
    old = C.apply_driver_env(cfg, environ)
    assert old == {"RAY_AUTH_TOKEN": "stale", "RAY_ADDRESS": "x:1"}
    assert environ == env


def test_up_refuses_a_taken_port(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        cfg = LocalClusterConfig(port=port, state_dir=tmp_path / "st")
        t0 = time.monotonic()
        with pytest.raises(ClusterError, match=rf"port {port} is taken: .*pick another port"):
            C.cluster_up(cfg)
        assert time.monotonic() - t0 < 5  # refused up front, no `ray start`
    assert not (tmp_path / "st" / C.STATE_FILE).exists()


def test_cli_up_taken_port_is_one_line_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert _run(["cluster", "up", "--port", str(port), "--state-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pdd cluster up: error: port") and "Traceback" not in err


def test_cli_bad_values_and_empty_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    st = str(tmp_path / "st")
    assert _run(["cluster", "up", "--cpus-a", "-3", "--state-dir", st]) == 1
    assert "cpus_a must be" in capsys.readouterr().err
    assert _run(["cluster", "up", "--port", "12", "--state-dir", st]) == 1
    assert _run(["cluster", "status", "--state-dir", st, "--port", "7003"]) == 3  # nothing running: says so
    assert "no cluster running" in capsys.readouterr().out
    assert _run(["cluster", "down", "--state-dir", st, "--port", "7003"]) == 0  # idempotent no-op
    assert "nothing to stop" in capsys.readouterr().out
    assert _run(["cluster", "env", "--state-dir", st, "--port", "7003"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "export RAY_ADDRESS=127.0.0.1:7003" and "export RAY_AUTH_MODE=token" in out
    assert _run(["cluster"]) == 2  # no subcommand: help on stderr
    with pytest.raises(SystemExit):
        _parser().parse_args(["cluster", "up", "--port", "notanint"])


def test_cluster_help_mentions_the_essentials(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["cluster", "--help"])
    text = capsys.readouterr().out
    for needle in ("pdd.site=a", "pdd.site=b", "RAY_ADDRESS", "RAY_AUTH_MODE=token", "RAY_AUTH_TOKEN_PATH",
                   'eval "$(pdd cluster env)"', "serve run graphs/pdd.yaml", "label_selector"):
        assert needle in text


# ---- against the session cluster --------------------------------------------------------------


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def _store_used(ip: str, port: int) -> int:
    """Bytes used in one raylet's object store."""
    from ray._private.internal_api import node_stats

    return node_stats(ip, port, include_memory_info=False).store_stats.object_store_bytes_used


@pytest.mark.cluster
def test_two_labelled_nodes_with_separate_stores(ray_two_sites: ClusterInfo) -> None:
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    by_site = {n["Labels"].get("pdd.site"): n for n in nodes}
    assert set(by_site) >= {"a", "b"}
    a, b = by_site["a"], by_site["b"]
    assert a["NodeID"] == ray_two_sites.node_ids["a"] and b["NodeID"] == ray_two_sites.node_ids["b"]
    assert a["NodeID"] != b["NodeID"]
    assert a["ObjectStoreSocketName"] != b["ObjectStoreSocketName"]  # two plasma stores
    assert (a["NodeManagerPort"], a["ObjectManagerPort"]) != (b["NodeManagerPort"], b["ObjectManagerPort"])
    assert a["Resources"]["site_a"] == C.SITE_RESOURCE_UNITS and b["Resources"]["site_b"] == C.SITE_RESOURCE_UNITS
    assert a["Resources"]["object_store_memory"] > 0 and b["Resources"]["object_store_memory"] > 0
    assert _node_id() == a["NodeID"]  # the driver attaches to the head, site a


@pytest.mark.cluster
def test_label_selector_places_task_and_actor(ray_two_sites: ClusterInfo) -> None:
    import ray

    @ray.remote(num_cpus=0.1)
    def where() -> str:
        return _node_id()

    @ray.remote(num_cpus=0.1)
    class Where:
        def node(self) -> str:
            return _node_id()

    ids = ray_two_sites.node_ids
    assert ray.get(where.options(label_selector={"pdd.site": "b"}).remote()) == ids["b"]
    assert ray.get(where.options(label_selector={"pdd.site": "a"}).remote()) == ids["a"]
    assert ray.get(where.options(resources={"site_b": 0.01}).remote()) == ids["b"]  # the fallback
    actor = Where.options(label_selector={"pdd.site": "b"}).remote()
    try:
        assert ray.get(actor.node.remote()) == ids["b"]
    finally:
        ray.kill(actor)


@pytest.mark.cluster
def test_object_store_path_between_sites(ray_two_sites: ClusterInfo) -> None:
    """Site a puts an 8 MiB KV-like buffer; readers on a and b get it zero-copy; it's freed after."""
    import ray
    from ray.experimental import get_object_locations

    nbytes = 8 * 2**20

    @ray.remote(num_cpus=0.1)
    class KVWriter:
        def put(self, seed: int) -> tuple[list, str, str]:
            kv = np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32)
            ref = ray.put(kv)  # this actor owns the object; it lives in site a's store
            return [ref], hashlib.sha256(kv.data).hexdigest(), _node_id()  # nested: the ref, not the value

    @ray.remote(num_cpus=0.1)
    class KVReader:
        def read(self, refs: list) -> dict:
            kv = ray.get(refs[0])
            out = {"node": _node_id(), "writeable": kv.flags.writeable, "owndata": kv.flags.owndata,
                   "dtype": str(kv.dtype), "nbytes": kv.nbytes, "sha": hashlib.sha256(kv.data).hexdigest()}
            del kv
            return out

    nodes = {n["Labels"].get("pdd.site"): n for n in ray.nodes() if n["Alive"]}
    stores = {s: (nodes[s]["NodeManagerAddress"], nodes[s]["NodeManagerPort"]) for s in ("a", "b")}
    base = {s: _store_used(*stores[s]) for s in stores}
    writer = KVWriter.options(label_selector={"pdd.site": "a"}).remote()
    reader_a = KVReader.options(label_selector={"pdd.site": "a"}).remote()
    reader_b = KVReader.options(label_selector={"pdd.site": "b"}).remote()
    try:
        refs, sha, wnode = ray.get(writer.put.remote(0))
        assert wnode == ray_two_sites.node_ids["a"]
        got_a, got_b = ray.get([reader_a.read.remote(refs), reader_b.read.remote(refs)])
        assert got_a["node"] == ray_two_sites.node_ids["a"] and got_b["node"] == ray_two_sites.node_ids["b"]
        for got in (got_a, got_b):
            assert not got["writeable"] and not got["owndata"]  # zero-copy view of the store's buffer
            assert got["dtype"] == "float32" and got["nbytes"] == nbytes
            assert got["sha"] == sha  # bitwise equal on both sites
        locs = get_object_locations(refs)[refs[0]]
        assert set(locs["node_ids"]) == set(ray_two_sites.node_ids.values())  # a copy in each store
        assert locs["object_size"] >= nbytes
        for s in ("a", "b"):
            assert _store_used(*stores[s]) >= base[s] + nbytes
        del refs
    finally:
        for h in (writer, reader_a, reader_b):
            ray.kill(h)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        used = {s: _store_used(*stores[s]) for s in stores}
        if all(used[s] < base[s] + nbytes for s in stores):
            break
        time.sleep(0.2)
    assert all(used[s] < base[s] + nbytes for s in stores), f"not freed: baseline {base}, now {used}"


@pytest.mark.cluster
def test_up_is_idempotent_and_status_reports_both_sites(ray_two_sites: ClusterInfo) -> None:
    cfg = ray_two_sites.config
    assert cfg is not None
    again = C.cluster_up(cfg)
    assert again.already_running and again.node_ids == ray_two_sites.node_ids
    assert again.address == ray_two_sites.address and again.env == ray_two_sites.env
    st = C.cluster_status(cfg)
    assert st["healthy"] and st["running"]
    for s in ("a", "b"):
        assert st["sites"][s]["alive"] and st["sites"][s]["node_id"] == ray_two_sites.node_ids[s]
        assert st["sites"][s]["processes"] > 0
    labels = {n["labels"].get("pdd.site") for n in st["nodes"] if n["alive"]}
    assert labels == {"a", "b"}
    assert {n["resources"]["CPU"] for n in st["nodes"] if n["alive"]} == {cfg.cpus_a, cfg.cpus_b}
    assert st["env"] == ray_two_sites.env
    other = dataclasses.replace(cfg, cpus_a=cfg.cpus_a + 1)
    with pytest.raises(ClusterError, match="other settings"):
        C.cluster_up(other)


@pytest.mark.cluster
def test_serve_deployments_pinned_to_sites(ray_two_sites: ClusterInfo) -> None:
    import ray
    from ray import serve

    @serve.deployment(ray_actor_options={"label_selector": {"pdd.site": "b"}, "num_cpus": 0.1})
    class SiteB:
        def __call__(self) -> str:
            return ray.get_runtime_context().get_node_id()

    @serve.deployment(ray_actor_options={"label_selector": {"pdd.site": "a"}, "num_cpus": 0.1})
    class SiteA:
        def __init__(self, b) -> None:
            self.b = b

        async def __call__(self) -> dict[str, str]:
            return {"a": ray.get_runtime_context().get_node_id(), "b": await self.b.remote()}

    serve.start(proxy_location="Disabled")  # handles only: no HTTP port to collide on
    try:
        handle = serve.run(SiteA.bind(SiteB.bind()), name="pdd-cluster-test", route_prefix=None)
        assert handle.remote().result(timeout_s=60) == ray_two_sites.node_ids
    finally:
        serve.delete("pdd-cluster-test")
