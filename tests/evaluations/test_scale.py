"""Scaling out the Serve way, on the real two-site cluster: one MainDecode deployment whose
replicas come and go, and two Router replicas.

Every call about a request reaches the replica that holds it (PinnedRequestRouter); the relay
pool admits at most `relay_max_running` in total whichever Router sends; a new MD replica gets
new requests; a replica removed mid-stream loses no token (its requests migrate by token ids).
Greedy output is token-identical to one engine throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from pdd_serve.serve.pinning import replica_actors
from tests.cluster_fixture import running_mds
from tests.helpers import free_port, graph_prompt, greedy_ref, greedy_refs, wait_healthy

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
APP = "pdd_scale"
RELAY_MAX = 3


def _doc(port: int, md_replicas: int) -> dict:
    """graphs/pdd.yaml (2 Routers) with a fixed MD replica count we change between tests."""
    doc = yaml.safe_load((ROOT / "graphs/pdd.yaml").read_text())
    doc["http_options"]["port"] = port
    app = doc["applications"][0]
    app["name"] = APP
    app["args"]["policy"].update(relay_max_running=RELAY_MAX, allow_overrides=True, kv_wait_timeout_s=8)
    app["args"]["server"] = {"expose_cache_hits": True}
    for d in app["deployments"]:
        if d["name"] == "MainDecode":
            d.pop("autoscaling_config", None)
            d.update(num_replicas=md_replicas, graceful_shutdown_timeout_s=1)
    return doc


def _deploy(doc: dict, path: Path) -> None:
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([str(Path(sys.executable).with_name("serve")), "run", str(path), "--non-blocking"],
                          env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def graph(ray_two_sites, tmp_path_factory):
    from ray import serve

    serve.shutdown()
    port = free_port()
    path = tmp_path_factory.mktemp("scale") / "graph.yaml"
    _deploy(_doc(port, 2), path)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 600)
    _wait_replicas(2)
    yield url, port, path
    serve.delete(APP)


@pytest.fixture(scope="module")
def ref_engine():
    from pdd_serve.checkpoints import default_model_path
    from pdd_serve.engine.engine import Engine

    return Engine.from_pretrained(default_model_path())


def _mds() -> dict:
    return running_mds(APP)


def _wait_replicas(n: int, timeout_s: float = 300) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        mds = _mds()
        if len(mds) == n and len(replica_actors(APP, "MainDecode")) == n:  # none starting or stopping
            return mds
        time.sleep(1)
    pytest.fail(f"MainDecode did not reach {n} replicas: {sorted(_mds())}")


def _stream(url: str, prompt: list[int], n: int, pdd: dict, first: threading.Event | None = None) -> tuple[list[int], dict]:
    body = {"model": "pdd-small", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "pdd": pdd}
    ids: list[int] = []
    info: dict = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                ids += obj["choices"][0].get("token_ids", [])
                info = obj.get("pdd", info)
                if first is not None and ids:
                    first.set()
    return ids, info


def _pin_refusals() -> int:
    return sum(h.stats.remote().result(timeout_s=30).extra["pin_refusals"] for h in _mds().values())


def test_every_router_watches_the_mds_before_its_first_request(graph):
    """First in this module: no request has reached either Router. Each watches every MD from its
    start, so no Router's first request waits a round trip to every MD for a view (before, the
    watch started with a replica's first request: 2 x the line's one-way latency on it)."""
    from ray import serve

    handle = serve.get_deployment_handle("Router", APP)
    routers, want = set(replica_actors(APP, "Router")), {r: "running" for r in _mds()}
    assert len(routers) == 2
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (set(seen) == routers and all(w == want for w in seen.values())):
        st = handle.stats.remote().result(timeout_s=30)  # Serve spreads these over both replicas
        seen[st["replica"]] = st["md_watchers"]
        time.sleep(0.2)
    assert set(seen) == routers and all(w == want for w in seen.values()), (seen, want)


def test_handoff_calls_reach_the_replica_that_holds_the_request(graph, ref_engine):
    url, _, _ = graph
    jobs = [({"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"}, 11), ({"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, 12),
            ({"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, 13), ({"pipeline": "P-MD"}, 14), ({"pipeline": "P-MD"}, 15)]
    # relay requests: long enough that RLD still decodes when the KV lands (the line is shared; 500
    # tokens were not always enough on a loaded CI box: RLD finished a catch-up before its last batch)
    size = {"P-RLD-MD": (1000, 800), "P-MD": (300, 100)}
    with ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: _stream(url, graph_prompt(j[1], size[j[0]["pipeline"]][0]),
                                               size[j[0]["pipeline"]][1], j[0]), jobs))
    want = greedy_refs(ref_engine, [(graph_prompt(seed, size[pdd["pipeline"]][0]), size[pdd["pipeline"]][1]) for pdd, seed in jobs])
    for (pdd, _), (ids, info), ref in zip(jobs, outs, want):
        assert ids == ref, info
        assert info["fallbacks"] == [], info  # no call went astray (a refused pin would show as md_lost)
        if pdd["pipeline"] == "P-RLD-MD":
            assert info["handoff_mode"] == pdd["handoff_mode"] and info["md_tokens"] > 0, info
    assert {info["md_replica"] for _, info in outs} <= set(_mds())
    assert _pin_refusals() == 0
    from ray import serve

    # the Routers know the live replica set from Serve's request router: one view watcher per MD
    st = serve.get_deployment_handle("Router", APP).stats.remote().result(timeout_s=30)
    assert st["md_watchers"] == {r: "running" for r in _mds()}, st


def test_two_routers_never_admit_more_than_the_relay_pool_holds(graph, ref_engine):
    url, _, _ = graph
    from pdd_serve.serve.pinning import pinned_handle, replica_actors

    relays = [pinned_handle(APP, "Relay", r) for r in replica_actors(APP, "Relay")]
    seen: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen.append(sum(len(h.stats.remote().result(timeout_s=30).extra["live"]) for h in relays))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample)
    sampler.start()
    n, seeds = 120, range(40, 48)  # 8 forced relay requests at once over 2 Routers, a pool of 3
    try:
        with ThreadPoolExecutor(len(seeds)) as pool:
            outs = list(pool.map(lambda s: _stream(url, graph_prompt(s, 600), n, {"pipeline": "P-RLD-MD"}), seeds))
    finally:
        done.set()
        sampler.join()
    for (ids, info), ref in zip(outs, greedy_refs(ref_engine, [(graph_prompt(s, 600), n) for s in seeds])):
        assert ids == ref, info
    peak = max(h.stats.remote().result(timeout_s=30).extra["peak_live"] for h in relays)
    assert max(seen) <= RELAY_MAX and peak <= RELAY_MAX, (seen, peak)
    refused = sum(info["fallbacks"].count("relay_full") for _, info in outs)
    assert peak == RELAY_MAX or refused == 0, (peak, refused)  # the pool filled before it refused


def test_a_replica_removed_mid_stream_loses_no_token(graph, ref_engine):
    """Scale MainDecode 2 -> 1 while long streams decode on both: the removed replica drains for
    graceful_shutdown_timeout_s (1 s), then its requests migrate by token ids to the survivor."""
    url, port, path = graph
    n, seeds = 1200, (61, 62, 63, 64)
    starts = [threading.Event() for _ in seeds]
    with ThreadPoolExecutor(len(seeds)) as pool:
        futs = [pool.submit(_stream, url, graph_prompt(s, 500), n, {"pipeline": "P-MD"}, ev) for s, ev in zip(seeds, starts)]
        for ev in starts:
            assert ev.wait(120)
        before = {r: h.stats.remote().result(timeout_s=30).running for r, h in _mds().items()}
        _deploy(_doc(port, 1), path)
        outs = [f.result() for f in futs]
    after = _wait_replicas(1)
    (kept,) = after
    removed = [r for r in before if r != kept]
    assert removed and kept in before, (before, kept)
    for (ids, info), ref in zip(outs, greedy_refs(ref_engine, [(graph_prompt(s, 500), n) for s in seeds])):
        assert ids == ref, info
        assert info["md_replica"] == kept, info
    moved = [info for _, info in outs if info["fallbacks"]]
    assert before[removed[0]] == 0 or moved, (before, [i["fallbacks"] for _, i in outs])
    assert all(set(i["fallbacks"]) <= {"md_lost", "kv_timeout"} for i in moved), moved


def test_a_new_md_replica_gets_new_requests_under_load(graph, ref_engine):
    """Scale MainDecode 1 -> 2 while the one replica decodes: the Routers see the new replica
    (Serve's broadcast, then its view) and send it new requests."""
    url, port, path = graph
    (old,) = _wait_replicas(1)
    stop = threading.Event()
    busy: list[tuple[list[int], dict]] = []

    def load() -> None:  # keeps the old replica decoding
        i = 0
        while not stop.is_set():
            busy.append(_stream(url, graph_prompt(80 + i, 300), 400, {"pipeline": "P-MD"}))
            i += 1

    loaders = [threading.Thread(target=load) for _ in range(2)]
    for t in loaders:
        t.start()
    try:
        time.sleep(2)
        _deploy(_doc(port, 2), path)
        new = set(_wait_replicas(2)) - {old}
        assert len(new) == 1
        got = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(i["md_replica"] in new for _, i in got):
            s = 90 + len(got)
            ids, info = _stream(url, graph_prompt(s, 300), 20, {"pipeline": "P-MD"})
            assert ids == greedy_ref(ref_engine, graph_prompt(s, 300), 20), info
            got.append((ids, info))
        assert any(i["md_replica"] in new for _, i in got), [i["md_replica"] for _, i in got]
    finally:
        stop.set()
        for t in loaders:
            t.join(timeout=300)
    assert busy and all(not i["fallbacks"] for _, i in busy), [i["fallbacks"] for _, i in busy]
