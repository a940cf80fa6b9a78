"""Fault paths on the real two-site graph: each request completes, token-identical to one engine,
the client sees no lost or repeated token, and Serve restores what was killed.

The dev graph (graphs/pdd_dev.yaml) has fault injection on and 8 s cross-site timeouts; here its relay
pool is cut to RELAY_POOL so the saturation test fills it however fast this machine prefills."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from pdd_serve.checkpoints import default_model_path
from pdd_serve.engine.engine import Engine
from tests.cluster_fixture import running_mds
from tests.helpers import free_port, graph_prompt, greedy_ref, wait_healthy

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
APP = "pdd_faults"
RELAY_POOL = 2  # policy.relay_max_running for this module's graph (the dev graph has 8)


@pytest.fixture(scope="module")
def graph(ray_two_sites, tmp_path_factory):
    from ray import serve

    serve.shutdown()  # forget any Serve client this process holds (an earlier test may have shut Serve down)
    port = free_port()
    doc = yaml.safe_load((ROOT / "graphs/pdd_dev.yaml").read_text())
    doc["http_options"]["port"] = port
    doc["applications"][0]["name"] = APP
    doc["applications"][0]["args"]["policy"]["relay_max_running"] = RELAY_POOL
    path = tmp_path_factory.mktemp("faults") / "graph.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([str(Path(sys.executable).with_name("serve")), "run", str(path), "--non-blocking"],
                          env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, 600)
    deadline = time.monotonic() + 300
    while len(_mds()) < 2 and time.monotonic() < deadline:  # the Router is up; both MDs too
        time.sleep(1)
    yield url
    from ray import serve

    serve.delete(APP)


@pytest.fixture(scope="module")
def ref_engine():
    return Engine.from_pretrained(default_model_path())


def _handle(name: str):
    from ray import serve

    return serve.get_deployment_handle(name, APP)


def _stream(url: str, prompt: list[int], n: int, pdd: dict, on_chunk=None) -> tuple[list[int], dict]:
    """Stream a request; return every token id the client saw (in order) and the pdd object."""
    body = {"model": "pdd-small", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "pdd": pdd}
    ids: list[int] = []
    info: dict = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            ids += obj["choices"][0].get("token_ids", [])
            info = obj.get("pdd", info)
            if on_chunk is not None:
                on_chunk(len(ids))
    return ids, info


def _mds() -> dict:
    """{replica id: a handle pinned to it} for every running MainDecode replica (one deployment)."""
    return running_mds(APP)


def _replica_actor(deployment: str):
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if f"{APP}#{deployment}#" in a["name"]:
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise LookupError(deployment)


def test_md_killed_mid_stream_migrates_to_another_md(graph, ref_engine):
    import ray

    prompt, n = graph_prompt(1, 600), 1200  # MD decodes faster than the client reads: a long stream
    killed: list[str] = []
    t_kill: list[float] = []

    from pdd_serve.serve.pinning import replica_actors

    def kill_holder(seen: int) -> None:
        if seen >= 3 and not killed:
            for r, h in _mds().items():
                if h.stats.remote().result(timeout_s=30).running:
                    t_kill.append(time.time())
                    ray.kill(ray.get_actor(replica_actors(APP, "MainDecode")[r], namespace="serve"), no_restart=True)
                    killed.append(r)
                    return

    ids, info = _stream(graph, prompt, n, {"pipeline": "P-MD"}, kill_holder)
    assert killed, "the MD holding the request was not found"
    assert ids == greedy_ref(ref_engine, prompt, n), info
    assert "md_lost" in info["fallbacks"], info
    # Serve replaces the killed replica (a new replica of the one deployment, started after the kill)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            mds = _mds()
            new = [h for r, h in mds.items() if r != killed[0]]
            if len(mds) == 2 and killed[0] not in mds and any(
                    h.stats.remote().result(timeout_s=10).extra["started_at"] > t_kill[0] for h in new):
                break
        except Exception:  # noqa: BLE001 - still starting
            pass
        time.sleep(2)
    else:
        pytest.fail(f"MainDecode replica {killed[0]} was not replaced")


def test_wan_cut_mid_transfer_redelivers_kv(graph, ref_engine):
    _handle("Prefill").inject.remote("cut").result(timeout_s=30)
    prompt, n = graph_prompt(2, 1200), 60
    ids, info = _stream(graph, prompt, n, {"pipeline": "P-MD"})
    assert ids == greedy_ref(ref_engine, prompt, n), info
    assert info["fallbacks"] == ["kv_timeout"], info


def test_wan_stall_on_relay_path_lets_relay_finish(graph, ref_engine):
    _handle("Prefill").inject.remote("stall", 30.0).result(timeout_s=30)
    prompt, n = graph_prompt(3, 1200), 1000  # RLD is usually still decoding when the 8 s KV wait gives up
    ids, info = _stream(graph, prompt, n, {"pipeline": "P-RLD-MD"})
    assert ids == greedy_ref(ref_engine, prompt, n), info
    # a fast machine may let RLD finish before the wait gives up: the same outcome, no timeout needed
    # (the timeout path itself is pinned down in test_orchestrator's test_kv_timeout_on_relay_path...)
    assert info["md_tokens"] == 0 and set(info["fallbacks"]) <= {"kv_timeout"}, info


def test_prefill_killed_mid_prefill_is_retried(graph, ref_engine):
    _handle("Prefill").inject.remote("die_in_prefill").result(timeout_s=30)
    prompt, n = graph_prompt(4, 900), 40
    ids, info = _stream(graph, prompt, n, {"pipeline": "P-MD"})
    assert ids == greedy_ref(ref_engine, prompt, n), info
    assert "prefill_retry" in info["fallbacks"], info


def test_flight_server_restart_mid_transfer(graph, ref_engine):
    prompt, n = graph_prompt(5, 1500), 60
    out: dict = {}

    def run() -> None:
        out["r"] = _stream(graph, prompt, n, {"pipeline": "P-MD"})

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.6)  # prefill is done, the 3 MB of KV are crossing the 16 Mbit/s link
    for h in _mds().values():
        h.inject.remote("restart_flight").result(timeout_s=30)
    t.join(timeout=180)
    ids, info = out["r"]
    assert ids == greedy_ref(ref_engine, prompt, n), info
    # lost with the restarted server, then re-delivered (again, if it raced the other MD's restart)
    assert info["fallbacks"] and set(info["fallbacks"]) == {"kv_timeout"}, info


def test_saturated_relay_admits_no_more_and_loses_nothing(graph, ref_engine):
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(graph_prompt(100 + i, 500), 120) for i in range(8)]
    # every transfer stalls 3 s on the line and RLD has 120 tokens to decode, so each relay stint
    # outlasts the arrival of the next RELAY_POOL prefills and the pool really fills, however fast or
    # loaded this machine is today (a pool of 8 was not always reached on a loaded CI box)
    _handle("Prefill").inject.remote("stall", 3.0, len(jobs)).result(timeout_s=30)
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda j: _stream(graph, j[0], j[1], {"pipeline": "P-RLD-MD"}), jobs))
    for (prompt, n), (ids, info) in zip(jobs, results):
        assert ids == greedy_ref(ref_engine, prompt, n), info
    st = _handle("Relay").stats.remote().result(timeout_s=30)
    assert 0 < st.extra["peak_live"] <= RELAY_POOL, st.extra
    refused = [info for _, info in results if "relay_full" in info["fallbacks"]]
    assert refused, [info["fallbacks"] for _, info in results]  # refused by the pool, served by MD
    assert all(info["eager_tokens"] == 0 for info in refused), refused


def _plasma_bytes() -> int:
    """Bytes the cluster's object stores hold now (every raylet's plasma, primary copies and all)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    return get_memory_info_reply(get_state_from_address(os.environ["RAY_ADDRESS"])).store_stats.object_store_bytes_used


def test_relay_kv_copy_leaves_the_object_store_at_the_handoff(graph, ref_engine):
    """Item 2: Prefill's object-store copy of the prompt KV (for RLD) is freed when RLD is cut at
    the handoff, not when the request ends: MD goes on decoding while the store no longer holds it."""
    prompt, n = graph_prompt(6, 1500), 900  # MD decodes for seconds after the cut: the samples see it
    kv_bytes = -(-len(prompt) // 16) * ref_engine.layout.block_bytes  # ~3 MB
    base = _plasma_bytes()
    samples: list[tuple[int, int, int]] = []  # (relay live, MD running, object store bytes)
    out: dict = {}

    def run() -> None:
        out["r"] = _stream(graph, prompt, n, {"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"})

    t = threading.Thread(target=run)
    t.start()
    while t.is_alive():
        relay = _handle("Relay").stats.remote().result(timeout_s=30)
        md = sum(h.stats.remote().result(timeout_s=30).running for h in _mds().values())
        samples.append((len(relay.extra["live"]), md, _plasma_bytes() - base))
        time.sleep(0.2)
    t.join()
    ids, info = out["r"]
    assert ids == greedy_ref(ref_engine, prompt, n), info
    assert info["handoff_mode"] == "one-shot" and info["md_tokens"] > 0, info
    relay_phase = [b for live, _, b in samples if live]
    assert relay_phase and max(relay_phase) >= 0.9 * kv_bytes, (kv_bytes, samples)  # the copy was there
    cut = max(i for i, (live, _, _) in enumerate(samples) if live) + 1
    md_phase = [b for _, md, b in samples[cut:] if md]  # RLD cut, MD decoding
    assert len(md_phase) >= 3, samples
    # freed within a moment of the cut (Ray's release is asynchronous), while MD still decodes
    assert md_phase[-1] < kv_bytes / 2, (kv_bytes, samples)


@pytest.mark.parametrize("pipeline", ["P-RLD-MD", "P-RLD"])
def test_relay_killed_mid_stream_md_takes_over(graph, ref_engine, pipeline):
    """The relay's process dies a few tokens into the stream (every stream it held dies with it):
    MD takes the request from the committed token ids; the Router's relay count stays true."""
    _handle("Relay").inject.remote("die_mid_stream", 4).result(timeout_s=30)
    prompt, n = graph_prompt(7 if pipeline == "P-RLD" else 8, 1200), 300
    ids, info = _stream(graph, prompt, n, {"pipeline": pipeline, **({"handoff_mode": "one-shot"}
                                                                      if pipeline == "P-RLD-MD" else {})})
    assert ids == greedy_ref(ref_engine, prompt, n), info
    assert "relay_lost" in info["fallbacks"] and info["md_tokens"] > 0, info
    assert _handle("Router").stats.remote().result(timeout_s=30)["relay_running"] == 0
    wait_healthy(graph, 60)
    deadline = time.monotonic() + 180  # Serve restores the relay before the next test
    while time.monotonic() < deadline:
        try:
            _handle("Relay").stats.remote().result(timeout_s=10)
            break
        except Exception:  # noqa: BLE001 - still restarting
            time.sleep(2)
