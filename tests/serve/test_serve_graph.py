"""The PDD graph end to end on the local two-site cluster: `serve run` of the graph YAMLs, then the
OpenAI API over real Router/Prefill/Relay/MainDecode replicas, Flight across sites and the object
store inside site a. One deployment for the whole module (two applications: the dev graph with
overrides on, and the production graph with them off)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from pdd_serve.checkpoints import default_model_path
from pdd_serve.engine.engine import Engine
from tests.helpers import free_port, greedy_ref, greedy_refs

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-pdd-test"
EMULATE = {"model": "llama-3-8b", "a": {"chip": "h100-sxm", "tp": 1}, "b": {"chip": "h20", "tp": 1}}


@pytest.fixture(scope="module")
def graph(ray_two_sites, tmp_path_factory):
    """Deploy graphs/pdd_dev.yaml at / and graphs/pdd.yaml at /prod with `serve run --non-blocking`."""
    from ray import serve

    serve.shutdown()  # forget any Serve client this process holds (an earlier test may have shut Serve down)
    port = free_port()
    dev = yaml.safe_load((ROOT / "graphs/pdd_dev.yaml").read_text())
    prod = yaml.safe_load((ROOT / "graphs/pdd.yaml").read_text())
    app_prod = prod["applications"][0]
    app_prod.update(name="pdd_prod", route_prefix="/prod")
    app_prod["args"]["server"] = {"api_keys": [API_KEY], "max_queue": 3}
    # the dev graph again on emulated chips (a llama-3-8b shape: P/RLD on an H100, MD on an H20), in
    # slow motion x3: the same real tokens on every path, each step paced to the emulated chip
    app_emu = yaml.safe_load((ROOT / "graphs/pdd_dev.yaml").read_text())["applications"][0]
    app_emu.update(name="pdd_emu", route_prefix="/emu")
    app_emu["args"]["emulate"] = EMULATE
    app_emu["args"]["time_scale"] = 3
    app_emu["args"]["link"] = {"preset": "wan_10g", "bandwidth_bps": 1e9, "one_way_latency_s": 0.02,
                               "jitter": "constant"}
    for d in app_emu["deployments"]:
        if d["name"] == "MainDecode":
            d["num_replicas"] = 1
        if d["name"] == "Prefill":  # two senders on the graph's one line (site a's 4 CPUs hold them)
            d["num_replicas"] = 2
            d["ray_actor_options"]["num_cpus"] = 0.25
    doc = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
           "applications": [dev["applications"][0], app_prod, app_emu]}
    path = tmp_path_factory.mktemp("graph") / "graphs.yaml"
    path.write_text(yaml.safe_dump(doc))
    serve_exe = str(Path(sys.executable).with_name("serve"))
    proc = subprocess.run([serve_exe, "run", str(path), "--non-blocking"], env=dict(os.environ),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if all(httpx.get(f"{url}{p}/health", timeout=5).status_code == 200 for p in ("", "/prod", "/emu")):
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        pytest.fail("the graph did not become healthy")
    yield url
    from ray import serve

    serve.delete("pdd")
    serve.delete("pdd_prod")
    serve.delete("pdd_emu")


@pytest.fixture(scope="module")
def ref_engine():
    return Engine.from_pretrained(default_model_path())


def _cold_prompt(seed: int, n: int = 1200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def _complete(url: str, prompt, max_tokens: int, pdd: dict | None = None, **kw) -> dict:
    body = {"model": "pdd-small", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **kw}
    if pdd:
        body["pdd"] = pdd
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _handle(name: str, app: str = "pdd"):
    from ray import serve

    return serve.get_deployment_handle(name, app)


def _replicas(name: str, app: str = "pdd") -> list:
    """A handle pinned to each live replica of a deployment (PinnedRequestRouter honours the pin)."""
    from pdd_serve.serve.pinning import pinned_handle, replica_actors

    return [pinned_handle(app, name, r) for r in sorted(replica_actors(app, name))]


def test_every_replica_runs_on_its_site(graph):
    expect = {"Router": "a", "Prefill": "a", "Relay": "a", "MainDecode": "b"}
    for app in ("pdd", "pdd_prod"):
        for name, site in expect.items():
            handles = _replicas(name, app) if name != "Router" else [_handle(name, app)]
            assert handles, (app, name)
            for h in handles:
                st = h.stats.remote().result(timeout_s=60)
                where = st if isinstance(st, dict) else st.extra
                assert where["site"] == site, (app, name, where)
    assert len(_replicas("MainDecode")) == 2  # pdd_dev.yaml: num_replicas 2 of one deployment


EVERY_PATH = ({"pipeline": "P-MD"}, {"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"},
              {"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, {"pipeline": "P-RLD"})


def _complete_each_path(url: str, seeds: tuple[int, ...], n: int) -> list[tuple[dict, dict, float]]:
    """One cold request down every path at once (path, response, its real seconds)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job: tuple[dict, int]) -> tuple[dict, dict, float]:
        t0 = time.monotonic()
        out = _complete(url, _cold_prompt(job[1]), n, job[0], ignore_eos=True)
        return job[0], out, time.monotonic() - t0

    with ThreadPoolExecutor(len(seeds)) as ex:
        return list(ex.map(one, zip(EVERY_PATH, seeds)))


@pytest.mark.parametrize("pdd, seed", zip(EVERY_PATH, (11, 12, 13, 14)))
def test_emulated_chips_keep_greedy_output_identical_on_every_path(graph, ref_engine, pdd, seed):
    """Emulation paces every step and counts KV at the emulated size; the tokens stay the real model's.
    One path at a time: the emulated line (1 Gb/s) carries one 157 MB KV while the relay decodes."""
    prompt = _cold_prompt(seed)
    n = 300
    t0 = time.monotonic()
    out = _complete(f"{graph}/emu", prompt, n, pdd, ignore_eos=True)
    real_s = time.monotonic() - t0
    info = out["pdd"]
    assert out["choices"][0]["token_ids"] == greedy_ref(ref_engine, prompt, n)
    assert info["pipeline"] == pdd["pipeline"]
    assert info["ttft_s"] < real_s / 2  # reported in emulated seconds (slow motion x3)
    if pdd["pipeline"] != "P-RLD":
        # 1200 tokens of an 8B shape's KV (128 KiB/token, 157 MB) cross, not the small model's 2.4 MB
        assert info["wan_bytes"] > 100_000_000, info
    if pdd["pipeline"] == "P-RLD-MD":
        assert info["eager_tokens"] > 0 and info["md_tokens"] > 0, info
        assert info["handoff_mode"] == pdd["handoff_mode"]
    stats = {name: [h.stats.remote().result(timeout_s=60) for h in _replicas(name, "pdd_emu")]
             for name in ("Prefill", "MainDecode")}
    emus = [st.extra["emulation"] for st in stats["Prefill"]]  # two replicas: one of them prefilled it
    assert all(e["chip"] == "h100-sxm" and e["time_scale"] == 3 for e in emus)
    assert sum(e["prefill_steps"] for e in emus) > 0
    md = stats["MainDecode"][0].extra["emulation"]
    assert md["chip"] == "h20" and (md["decode_steps"] > 0 or pdd["pipeline"] == "P-RLD")


def test_two_prefill_replicas_book_on_the_graphs_one_line(graph, ref_engine):
    """The emulated graph runs two Prefill replicas and one Line: both replicas book on it (each
    reads its clock at start), a second replica brings no line of its own, and transfers through
    it keep the tokens identical. (The sharing itself: tests/transport/test_link.py.)"""
    from concurrent.futures import ThreadPoolExecutor

    prefills = _replicas("Prefill", "pdd_emu")
    assert len(prefills) == 2
    from pdd_serve.serve.pinning import replica_actors

    assert len(replica_actors("pdd_emu", "Line")) == len(replica_actors("pdd", "Line")) == 1
    line = _handle("Line", "pdd_emu")
    prompts = [_cold_prompt(seed, 600) for seed in (21, 22, 23)]
    with ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda p: _complete(f"{graph}/emu", p, 8, {"pipeline": "P-MD"}, ignore_eos=True), prompts))
    for out, ref in zip(outs, greedy_refs(ref_engine, [(p, 8) for p in prompts])):
        assert out["choices"][0]["token_ids"] == ref and out["pdd"]["wan_bytes"] > 0
    st = line.stats.remote().result(timeout_s=60)
    ids = {h.stats.remote().result(timeout_s=60).extra["replica"] for h in prefills}
    assert ids <= set(st["senders"]) and len(ids) == 2, (ids, st)
    assert st["bookings"] > 0 and st["line_bytes"] >= sum(o["pdd"]["wan_bytes"] for o in outs) * 0.99
    for h in prefills:
        extra = h.stats.remote().result(timeout_s=60).extra
        assert extra["line_errors"] == 0


def test_greedy_output_is_token_identical_on_every_path(graph, ref_engine):
    seeds, n = (1, 2, 3, 4), 400  # long enough that RLD is still decoding when the KV lands at MD
    outs = _complete_each_path(graph, seeds, n)
    want = greedy_refs(ref_engine, [(_cold_prompt(seed), n) for seed in seeds])
    for (pdd, out, _), ref in zip(outs, want):
        info = out["pdd"]
        assert out["choices"][0]["token_ids"] == ref, info
        assert info["pipeline"] == pdd["pipeline"]
        if pdd["pipeline"] == "P-RLD-MD":
            # the 2.4 MB prompt KV needs >1 s over the 16 Mbit/s link: RLD streams eager tokens meanwhile
            assert info["eager_tokens"] > 0 and info["md_tokens"] > 0, info
            assert info["handoff_mode"] == pdd["handoff_mode"]
            # catch-up takes rounds while more than handoff_batch_tokens (8) are pending
            # (policy.catchup_done); a prefill slowed by a loaded CPU streams most of the KV while it
            # computes, so RLD may have made no more than that by the time it lands: one final extend
            rounds = 2 if pdd["handoff_mode"] == "catch-up" and info["eager_tokens"] > 8 else 1
            assert info["handoff_batches"] >= rounds, info
            assert info["kv_ready_s"] is not None and info["wan_bytes"] > 2_000_000
        if pdd["pipeline"] == "P-RLD":
            assert info["wan_bytes"] == 0 and info["md_tokens"] == 0


def test_policy_routes_cold_to_relay_and_next_turn_to_md_with_affinity(graph, ref_engine):
    turn1 = _cold_prompt(50, 1000)
    a = _complete(graph, turn1, 40)
    assert a["pdd"]["pipeline"] == "P-RLD-MD", a["pdd"]
    turn2 = turn1 + a["choices"][0]["token_ids"] + _cold_prompt(51, 30)
    # if RLD finished turn 1 before its KV crossed, MD absorbs it once the KV lands: wait for that
    from pdd_serve.engine.kv import block_hashes

    hashes = block_hashes(turn1, 16)
    from pdd_serve.serve.pinning import pinned_handle

    md = pinned_handle("pdd", "MainDecode", a["pdd"]["md_replica"])
    deadline = time.monotonic() + 30
    while (not set(hashes) <= set(md.routing_view.remote(None).result(timeout_s=30).hashes)
           and time.monotonic() < deadline):
        time.sleep(0.25)
    time.sleep(0.5)  # the router's background view (every 0.1 s, 50 ms each way) picks it up
    b = _complete(graph, turn2, 40)
    assert b["pdd"]["pipeline"] == "P-MD", json.dumps(b["pdd"])
    assert b["pdd"]["md_replica"] == a["pdd"]["md_replica"]
    assert b["pdd"]["prefix_hit_md"] > 0.9 and b["pdd"]["wan_bytes"] < 200_000
    assert b["choices"][0]["token_ids"] == ref_engine.generate(turn2, 40)


def test_official_openai_client_streams(graph):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{graph}/v1", api_key="unused")
    prompt = "The relay decodes while the KV crawls across the WAN"
    full = client.completions.create(model="pdd-small", prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model="pdd-small", prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].model_extra["pdd"]["pipeline"] in ("P-MD", "P-RLD-MD")
    chat = client.chat.completions.create(model="pdd-small", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=16, temperature=0, stream=True)
    parts = [c.choices[0].delta.content or "" for c in chat if c.choices]
    assert "".join(parts)
    assert [m.id for m in client.models.list().data] == ["pdd-small"]


def test_concurrent_streams_over_mixed_pipelines_lose_no_token(graph, ref_engine):
    paths = [{"pipeline": "P-MD"}, {"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"},
             {"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, {"pipeline": "P-RLD"}, None]
    jobs = [(_cold_prompt(100 + i, 300 + 150 * (i % 4)), 40 + 10 * (i % 3), paths[i % len(paths)]) for i in range(8)]

    async def one(client: httpx.AsyncClient, prompt, n, pdd) -> tuple[list[int], dict]:
        body = {"model": "pdd-small", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                "return_token_ids": True, "ignore_eos": True}
        if pdd:
            body["pdd"] = pdd
        ids: list[int] = []
        info: dict = {}
        async with client.stream("POST", f"{graph}/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    ids += obj["choices"][0].get("token_ids", []) if obj.get("choices") else []
                    info = obj.get("pdd", info)
        return ids, info

    async def main():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, p, n, d) for p, n, d in jobs))

    results = asyncio.run(main())
    pipelines = set()
    for (ids, info), ref in zip(results, greedy_refs(ref_engine, [(p, n) for p, n, _ in jobs])):
        assert ids == ref, info
        pipelines.add(info["pipeline"])
    assert {"P-MD", "P-RLD-MD", "P-RLD"} <= pipelines


def test_cancelled_stream_frees_relay_and_md(graph):
    body = {"model": "pdd-small", "prompt": _cold_prompt(7, 1500), "max_tokens": 1500, "temperature": 0,
            "stream": True, "ignore_eos": True, "pdd": {"pipeline": "P-RLD-MD"}}
    with httpx.stream("POST", f"{graph}/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                n += 1
                if n == 5:
                    break
    relay, mds = _handle("Relay"), _replicas("MainDecode")
    def freed(r_st, m_st) -> bool:
        return (r_st.running == 0 and r_st.free_blocks == r_st.total_blocks
                and all(s.running == 0 and s.free_blocks + s.cached_blocks == s.total_blocks for s in m_st))

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r_st = relay.stats.remote().result(timeout_s=30)
        m_st = [m.stats.remote().result(timeout_s=30) for m in mds]
        if freed(r_st, m_st):
            break
        time.sleep(0.5)
    assert r_st.running == 0 and r_st.free_blocks == r_st.total_blocks
    for s in m_st:
        assert s.running == 0 and s.free_blocks + s.cached_blocks == s.total_blocks
        assert s.extra["flight_bytes_reserved"] == 0


@pytest.mark.parametrize("path, body, status, param", [
    ("", b"{not json", 400, None),
    ("", {"model": "pdd-small"}, 400, "prompt"),
    ("", {"model": "pdd-small", "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("", {"model": "pdd-small", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("", {"model": "pdd-small", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("", {"model": "pdd-small", "prompt": [5] * 3990, "max_tokens": 200}, 400, "max_tokens"),
    ("", {"model": "pdd-small", "prompt": [5, 99999]}, 400, "prompt"),
    ("", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("/prod", {"model": "pdd-small", "prompt": "hi", "pdd": {"pipeline": "P-RLD"}}, 403, None),
])
def test_bad_http_input_gets_openai_errors(graph, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{graph}{path}/v1/completions", headers=headers, timeout=60, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param


def test_api_keys_are_required_when_configured(graph):
    body = {"model": "pdd-small", "prompt": "hi", "max_tokens": 2, "temperature": 0}
    for headers in ({}, {"authorization": "Bearer wrong"}):
        r = httpx.post(f"{graph}/prod/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(f"{graph}/prod/v1/models", timeout=60)
    assert r.status_code == 401
    r = httpx.post(f"{graph}/prod/v1/completions", json=body, headers={"authorization": f"Bearer {API_KEY}"},
                   timeout=60)
    assert r.status_code == 200


def test_overload_gets_clean_503_and_accepted_requests_complete(graph, ref_engine):
    """2x the routers' queue bound (server.max_queue: 3 in each of the 2 Router replicas) at once:
    the excess is refused at once with 503 + Retry-After (no unbounded queueing), everything
    admitted completes correctly."""
    jobs = [_cold_prompt(300 + i, 400) for i in range(12)]

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> httpx.Response:
        body = {"model": "pdd-small", "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        return await client.post(f"{graph}/prod/v1/completions", json=body, timeout=300,
                                 headers={"authorization": f"Bearer {API_KEY}"})

    async def main():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, p) for p in jobs))

    t0 = time.monotonic()
    results = asyncio.run(main())
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 503} and codes.count(503) >= 1 and codes.count(200) >= 3, codes
    for prompt, r in zip(jobs, results):
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "overloaded_error"
        else:
            assert r.json()["choices"][0]["token_ids"] == greedy_ref(ref_engine, prompt, 48)
    assert time.monotonic() - t0 < 120


def test_cross_site_calls_pay_the_link_on_real_handles(graph):
    """A Serve call to site b through the cross-site wrapper takes at least two one-way latencies;
    the same call as a same-site call does not. The Router delays its own calls to MD the same way."""
    from pdd_serve.serve.crosssite import site_handle
    from pdd_serve.transport.link import LinkModel

    link = LinkModel(one_way_latency_s=0.05)
    md = _handle("MainDecode")

    async def rtt(h) -> float:
        best = float("inf")
        for _ in range(3):  # the best of three: the machine is shared
            t = time.monotonic()
            await h.call("routing_view", None)
            best = min(best, time.monotonic() - t)
        return best

    assert asyncio.run(rtt(site_handle(md, False, link))) >= 2 * 0.05
    assert asyncio.run(rtt(site_handle(md, True, link))) < 2 * 0.05
    st = _handle("Router").stats.remote().result(timeout_s=60)
    assert st["control_messages_delayed"] > 0  # the graph's own Router -> MD traffic paid the link


def test_metrics_endpoint_serves_the_cluster_view(graph):
    """GET /metrics on the API's own port: the Prometheus text of every Ray node's metrics export,
    PDD's families under Ray's names and vLLM's, after a request (Ray's agents export every few
    seconds: poll). The prod app has API keys and hides cache facts, so only an admin key reads it."""
    from prometheus_client.parser import text_string_to_metric_families

    body = {"model": "pdd-small", "prompt": "metrics at the API port", "max_tokens": 4, "temperature": 0}
    assert httpx.post(f"{graph}/v1/completions", json=body, timeout=300).status_code == 200
    deadline = time.monotonic() + 90
    while True:
        r = httpx.get(f"{graph}/metrics", timeout=30)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:500]
        if "ray_pdd_requests_total{" in r.text and "vllm:time_to_first_token_seconds_bucket{" in r.text:
            break
        assert time.monotonic() < deadline, r.text[-3000:]
        time.sleep(2)
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    nodes = {s.labels["outcome"]: s.value for s in fams["pdd_metrics_nodes"].samples}
    assert nodes == {"ok": 2.0, "failed": 0.0}  # both sites' nodes read
    assert sum(s.value for s in fams["vllm:request_success"].samples if s.labels.get("application") == "pdd") >= 1
    assert any(s.labels["model_name"] == "pdd-small" for s in fams["vllm:generation_tokens"].samples)
    assert not any(n.startswith(("ray_node_", "ray_gcs_")) for n in fams)  # Ray's system metrics stay on Ray's port
    assert httpx.get(f"{graph}/prod/metrics", timeout=30).status_code == 401
    auth = {"authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{graph}/prod/metrics", headers=auth, timeout=30).status_code == 403
