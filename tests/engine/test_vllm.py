"""vLLM behind PDD's engine seam (issue 22): the connector's KV layout, the token-id handoff, a
failed load, cleanup, config checks, and the graph on the two-site cluster with a killed MD.

Runs where vLLM is installed (CI: its own venv, `PDD_REQUIRE_VLLM=1`, where a missing vLLM fails
instead of skipping). vLLM runs in-process and its KV connector is one per process, so this module
holds one connector engine (`veng`) for its engine-level tests and as the graph tests' reference:
vLLM's own single-engine greedy generate, every prompt in flight at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

if os.environ.get("PDD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm")
import httpx  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402, F401 - PDD_REQUIRE_VLLM=1: fail here, loudly, if vLLM is not installed
import yaml  # noqa: E402

from pdd_serve.checkpoints import default_model_path  # noqa: E402
from pdd_serve.config import ConfigError, load_config  # noqa: E402
from pdd_serve.engine.engine import Engine  # noqa: E402
from pdd_serve.engine.kv import KVError  # noqa: E402
from pdd_serve.engine.protocol import EngineBackend, ForwardWork  # noqa: E402
from pdd_serve.engine.sampling import SamplingParams  # noqa: E402
from pdd_serve.engine.vllm.engine import VllmEngine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
N = 16  # requests in flight at once: chunked prefill and decode mix in vLLM's batches


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def veng():
    # prefix caching off: every handoff below must load its KV through the connector, not hit
    # vLLM's local cache (the graph test runs with it on)
    e = VllmEngine(default_model_path(), kv_cache_bytes=128 << 20, enable_prefix_cache=False,
                   engine_args={"max_num_batched_tokens": 512})
    e.warmup()
    return e


@pytest.fixture(scope="module")
def teng():
    return Engine.from_pretrained(default_model_path())


def _idle(e: VllmEngine) -> bool:
    return e.num_live() == 0 and not e.llm.has_unfinished_requests()


def test_it_is_an_engine_backend(veng):
    assert isinstance(veng, EngineBackend)
    assert veng.layout.block_size == 16 and veng.layout.dtype == "float32"


def test_connector_reads_vllm_kv_value_for_value(veng, teng):
    """vLLM's CPU cache (K transposed per block and head, then V) read into PDD's blocks equals
    our engine's KV for the same prompt: same hashes, same values to fp32 kernel noise."""
    prompt = _prompt(1, 100)  # 100 tokens: 6 full blocks and a partial one; 4 vLLM blocks
    s = veng.add("kv", prompt, SamplingParams(4))
    r = teng.add("kv", prompt, SamplingParams(4))
    try:
        assert veng.prefill(s) == teng.prefill(r)
        a, b = veng.export_kv(s), teng.export_kv(r)
        assert a.hashes == b.hashes and a.num_tokens == b.num_tokens == 100
        assert torch.allclose(torch.from_numpy(a.data), torch.from_numpy(b.data), atol=1e-4)
        part = veng.export_kv(s, 2, 5)
        assert part.start_block == 2 and part.num_tokens == 48 and part.hashes == b.hashes[2:5]
        assert (part.data == a.data[2:5]).all()
    finally:
        veng.release(s)
        teng.release(r)
    assert _idle(veng)


def test_handoffs_between_vllm_engines_equal_its_own_generate(veng, teng):
    """P -> MD and P -> RLD -> MD (one-shot and catch-up) for N requests at once: KV out of a
    prefill, into another request by PDD's blocks, decoding batched together; the relay's tokens
    handed to MD by token ids over the loaded prompt KV. Every output equals vLLM's own greedy
    generate of the prompt (all N in flight in one engine) and is reported against our engine."""
    work = [(_prompt(100 + i, 150 + 70 * i), 40 + 4 * (i % 3), ("P-MD", "one-shot", "catch-up")[i % 3])
            for i in range(N)]
    params = [SamplingParams(n, ignore_eos=True) for _, n, _ in work]
    ref = veng.generate_batch([p for p, _, _ in work], params)
    assert ref == teng.generate_batch([p for p, _, _ in work], params)  # today they agree; report if not

    done: dict[int, list[int]] = {}
    mds, relays = {}, {}
    for i, ((prompt, _, path), sp) in enumerate(zip(work, params)):
        p = veng.add(f"p{i}", prompt, sp)
        first = veng.prefill(p)
        kv = veng.export_kv(p)
        veng.release(p)
        md = veng.add(f"md{i}", prompt, sp)
        md.token_ids.append(first)  # what P sampled, as the Router hands it on
        if path == "P-MD":
            veng.import_kv(md, kv)
            mds[i] = md
        else:
            rl = veng.add(f"rld{i}", prompt, sp)
            veng.import_kv(rl, kv.slice(0, 3))  # KV arrives in pieces
            veng.import_kv(rl, kv.slice(3, kv.num_blocks))
            veng.append_tokens(rl, [first])
            veng.import_kv(md, kv)
            relays[i] = rl
            mds[i] = md
    # relays decode with MD's one-shot requests in one batch until each has 8 eager tokens
    while any(len(r.output_ids) < 9 for r in relays.values()):
        live = [r for r in relays.values() if len(r.output_ids) < 9] + [mds[i] for i in mds if i not in relays]
        veng.step([s for s in live if not s.finished])
    for i, rl in relays.items():
        committed = rl.output_ids[1:]  # the relay's tokens past P's first one
        md = mds[i]
        if work[i][2] == "catch-up":
            assert veng.extend(md, committed[:4], sample=False) is None
            tok = veng.extend(md, committed[4:])
        else:
            tok = veng.extend(md, committed)
        assert md.output_ids[:-1] == rl.output_ids and tok == md.output_ids[-1]
        veng.release(rl)
    while any(not s.finished for s in mds.values()):
        veng.step([s for s in mds.values() if not s.finished])
    for i, md in mds.items():
        done[i] = md.output_ids
        veng.release(md)
    assert [done[i] for i in range(N)] == ref
    assert _idle(veng)


def test_a_failed_kv_load_is_recomputed_not_wrong(veng):
    prompt, n = _prompt(7, 300), 12
    want = veng.generate(prompt, n)
    p = veng.add("p", prompt, SamplingParams(n))
    first = veng.prefill(p)
    kv = veng.export_kv(p)
    veng.release(p)
    md = veng.add("md", prompt, SamplingParams(n))
    veng.import_kv(md, kv)
    veng.append_tokens(md, [first])
    before = veng.store.load_failures
    veng.step([md])  # submits the request with its offer ...
    assert veng.store.load_failures == before
    # ... a second request whose offer is damaged between submit and load (one layer of four
    # left): the load fails, the connector reports its blocks, vLLM recomputes them
    md2 = veng.add("md2", prompt, SamplingParams(n))
    veng.import_kv(md2, kv)
    veng.append_tokens(md2, [first])
    live = veng._submit(md2, n - 1)
    first0, kv0 = veng.store.offers[live.req_id]
    veng.store.offers[live.req_id] = (first0, kv0[:, :1])
    while not (md.finished and md2.finished):
        veng.step([s for s in (md, md2) if not s.finished])
    assert veng.store.load_failures == before + 1
    assert md.output_ids == md2.output_ids == want
    veng.release(md)
    veng.release(md2)
    assert _idle(veng)


def test_release_mid_decode_frees_everything_and_reports_forwards(veng):
    seen: list[ForwardWork] = []
    veng.on_forward = seen.append
    free0 = veng.pool.num_free
    try:
        seqs = [veng.add(f"r{i}", _prompt(30 + i, 200), SamplingParams(50)) for i in range(4)]
        for s in seqs:
            veng.prefill(s)
        for _ in range(3):
            veng.step(seqs)
        assert all(len(s.output_ids) == 4 for s in seqs)
        for s in seqs:  # the client went away: nothing finished on its own
            veng.release(s)
        assert all(s.finish_reason == "abort" for s in seqs)
    finally:
        veng.on_forward = None
    assert _idle(veng) and veng.pool.num_free == free0
    assert {w.kind for w in seen} == {"prefill", "decode"}
    assert any(w.kind == "decode" and w.seqs == 4 for w in seen)
    # which tokens were the prompt's (context_scale costs those k-fold): a prompt's prefill all of
    # its new tokens, a decode step none of them and the prompts of its context; per sequence
    assert all(w.prompt_new == w.new_tokens for w in seen if w.kind == "prefill")
    assert all(w.prompt_new == 0 and 0 < w.prompt_context <= w.context_tokens for w in seen if w.kind == "decode")
    assert all(len(w.parts) == w.seqs for w in seen)


def test_import_refuses_kv_of_other_tokens(veng):
    p = veng.add("p", _prompt(8, 64), SamplingParams(2))
    veng.prefill(p)
    kv = veng.export_kv(p)
    veng.release(p)
    other = veng.add("o", _prompt(9, 64), SamplingParams(2))
    with pytest.raises(KVError, match="do not belong"):
        veng.import_kv(other, kv)
    veng.release(other)
    assert _idle(veng)


def test_a_step_that_raises_fails_the_engine_not_a_token(veng, monkeypatch):
    """vLLM's scheduler state is undefined after a step raised: every later call refuses (the
    replica's check_health then has Serve replace it) instead of decoding on."""
    from pdd_serve.serve.common import check_engine

    def boom():
        raise RuntimeError("kernel failed")

    s = veng.add("f", _prompt(10, 40), SamplingParams(4))
    monkeypatch.setattr(veng.llm, "step", boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        veng.prefill(s)
    with pytest.raises(RuntimeError, match="engine failed"):
        check_engine(veng)
    with pytest.raises(RuntimeError, match="serves nothing until Serve replaces it"):
        veng.step([veng.add("g", _prompt(11, 40), SamplingParams(4))])
    veng.release(s)
    # (test-only) the real engine never stepped: give the module's engine back
    monkeypatch.undo()
    veng.failed = None
    veng.llm.abort_request([k for k in list(veng._by_ext)])
    veng._by_ext.clear()
    veng._live.clear()
    veng.store.offers.clear()
    veng.store.save.clear()
    assert veng.generate(_prompt(12, 40), 4) and _idle(veng)


# ---------------------------------------------------------------- main decode's DRC over vLLM's prefix cache


def _stored(hashes, parent, tokens, extra=None):
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=32,
                       lora_id=None, medium="GPU", lora_name=None, extra_keys=extra)


def test_drc_view_maps_vllm_kv_events_to_pdd_hashes():
    """vLLM's events, through its own wire encoding, into PDD's chain hashes: a chain stored in two
    batches, a re-emitted store, a salted block and an orphan skipped, a removal, then a lost
    batch, which clears the view (it may under-report, never claim what vLLM never stored)."""
    import msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, KVEventBatch

    from pdd_serve.engine.kv import block_hashes
    from pdd_serve.engine.vllm.cache import VllmCacheView

    toks = _prompt(40, 96)
    ours = block_hashes(toks, 16)
    view = VllmCacheView(16)
    wire = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)

    def send(seq, *events):
        view.apply(seq, dec.decode(wire.encode(KVEventBatch(ts=0.0, events=list(events)))).events)

    send(0, _stored([b"v0", b"v1"], None, toks[:64]))
    send(1, _stored([b"v2"], b"v1", toks[64:96]), _stored([b"v1"], b"v0", toks[32:64]),  # v1 again
         _stored([b"s0"], None, _prompt(41, 32), extra=[("salt",)]), _stored([b"o1"], b"nope", toks[:32]))
    assert list(view.nodes) == ours and view.match(ours) == 6 and view.skipped_blocks == 2
    assert view.stats.inserted_blocks == 6
    send(2, BlockRemoved(block_hashes=[b"v1"], medium="GPU"))
    assert view.match(ours) == 2 and view.num_blocks == 4 and view.stats.evicted_blocks == 2
    send(3, AllBlocksCleared())
    assert view.num_blocks == 0
    send(4, _stored([b"v0"], None, toks[:32]))
    send(6, _stored([b"v1"], b"v0", toks[32:64]))  # batch 5 was lost: what 4 stored may be gone
    assert view.num_blocks == 0 and view.match(ours) == 0


def test_drc_on_vllm_imports_only_past_the_hit_and_recomputes_a_stale_hit():
    """Main decode over vLLM with prefix caching on (its own process: one connector engine per
    process): turn 2 of a conversation imports only the blocks past the DRC hit and vLLM's cache
    supplies the rest; a hit evicted after the match is recomputed; tokens identical throughout."""
    r = subprocess.run([sys.executable, str(ROOT / "tests/_vllm_drc.py")], capture_output=True, text=True,
                       timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["cleared"] and got["view_holds_a"], got
    assert got["t1"]["hit"] == 0 and got["t1"]["imported_blocks"] == got["t1"]["prompt_blocks"], got
    t2 = got["t2"]
    assert t2["hit"] >= got["a_blocks"] * 16 and t2["hit"] % 32 == 0 and t2["drc_lost"] == 0, got
    assert t2["imported_blocks"] == t2["prompt_blocks"] - t2["hit"] // 16, got
    assert got["t3"]["hit"] > 0 and got["t3"]["drc_lost"] == 1, got
    assert got["t1_identical"] and got["t2_identical"] and got["t3_identical"], got
    assert got["load_failures"] == 0 and got["live"] == 0, got


@pytest.mark.parametrize("engines, match", [
    ({"model": {"backend": "vllm", "vllm": {"max_num_seqz": 4}}}, "vllm.max_num_seqz is not a vLLM engine argument"),
    ({"model": {"backend": "vllm", "vllm": {"kv_transfer_config": {}}}}, "vllm.kv_transfer_config is set by pdd_serve"),
    ({"model": {"vllm": {"max_num_seqs": 4}}}, "backend is torch: set backend: vllm"),
    ({"model": {"backend": "vlm"}}, "backend must be one of torch, vllm"),
    ({"engines": {"main_decode": {"backend": "vllm", "vllm": {"enforce_eagr": True}}}},
     "engines.main_decode: vllm.enforce_eagr is not a vLLM engine argument"),
])
def test_bad_vllm_config_is_refused_at_load_naming_the_field(engines, match):
    with pytest.raises(ConfigError, match=match):
        load_config(engines)


def test_a_model_vllm_cannot_load_fails_with_vllm_s_reason(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    # a valid config and no weights: our checks pass, vLLM's loader refuses it
    (bad / "config.json").write_text((default_model_path() / "config.json").read_text())
    code = f"from pdd_serve.engine.vllm.engine import VllmEngine\nVllmEngine({str(bad)!r})"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "vLLM could not load" in r.stderr and "weights" in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------- the graph on the two-site cluster

APP = "pdd_vllm"


@pytest.fixture(scope="module")
def graph(ray_two_sites, tmp_path_factory):
    from ray import serve

    from tests.helpers import free_port

    serve.shutdown()
    port = free_port()
    doc = yaml.safe_load((ROOT / "graphs/pdd_vllm.yaml").read_text())
    doc["http_options"]["port"] = port
    app = doc["applications"][0]
    app["name"] = APP
    app["args"]["server"] = {"expose_cache_hits": True}
    app["args"]["policy"]["allow_fault_injection"] = True
    app["args"]["sites"]["main_decode_replicas"] = 2
    for d in app["deployments"]:
        if d["name"] == "MainDecode":
            d["num_replicas"] = 2
    path = tmp_path_factory.mktemp("vllm_graph") / "graph.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = subprocess.run([str(Path(sys.executable).with_name("serve")), "run", str(path), "--non-blocking"],
                          env=dict(os.environ), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    url = f"http://127.0.0.1:{port}"
    from tests.cluster_fixture import running_mds

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200 and len(running_mds(APP)) == 2:
                break
        except Exception:  # noqa: BLE001 - still starting
            pass
        time.sleep(1)
    else:
        pytest.fail("the vLLM graph did not become healthy")
    yield url
    serve.delete(APP)


async def _stream_all(url: str, jobs: list[tuple[list[int], int, dict]]) -> list[tuple[list[int], dict]]:
    async def one(client, prompt, n, pdd):
        body = {"model": "pdd-small", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
                "return_token_ids": True, "ignore_eos": True, "pdd": pdd}
        ids, info = [], {}
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    obj = json.loads(line[6:])
                    assert "error" not in obj, obj
                    if obj.get("choices"):
                        ids += obj["choices"][0].get("token_ids", [])
                    info = obj.get("pdd", info)
        return ids, info

    async with httpx.AsyncClient() as client:
        return await asyncio.gather(*(one(client, p, n, d) for p, n, d in jobs))


@pytest.mark.cluster
def test_graph_on_vllm_is_token_identical_on_every_path(graph, veng):
    paths = [{"pipeline": "P-MD"}, {"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"},
             {"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}]
    jobs = [(_prompt(200 + i, 200 + 60 * i), 160, paths[i % 3]) for i in range(N)]
    ref = veng.generate_batch([p for p, _, _ in jobs], [SamplingParams(n, ignore_eos=True) for _, n, _ in jobs])
    results = asyncio.run(_stream_all(graph, jobs))
    modes = set()
    for (_, _, want), (ids, info), r in zip(jobs, results, ref):
        assert ids == r, info
        assert info["pipeline"] == want["pipeline"], info
        modes.add(info["handoff_mode"])
        if want["pipeline"] == "P-MD":
            assert info["wan_bytes"] > 0 and info["eager_tokens"] == 0
    assert {"one-shot", "catch-up"} <= modes, modes


@pytest.mark.cluster
def test_vllm_md_drc_serves_the_next_turn_from_its_prefix_cache(graph, veng):
    """Turn 2 of a conversation goes to the MD whose vLLM cache holds turn 1 (the router's view,
    from vLLM's events), which receives only the blocks past the hit: fewer WAN bytes, same tokens."""
    from pdd_serve.engine.kv import block_hashes
    from pdd_serve.serve.pinning import pinned_handle

    turn1 = _prompt(400, 600)
    [(out1, a)] = asyncio.run(_stream_all(graph, [(turn1, 40, {"pipeline": "P-MD"})]))
    turn2 = turn1 + out1 + _prompt(401, 40)
    md = pinned_handle(APP, "MainDecode", a["md_replica"])
    chain = set(block_hashes(turn1[: len(turn1) // 32 * 32], 16))
    deadline = time.monotonic() + 30
    while not chain <= set(md.routing_view.remote(None).result(timeout_s=30).hashes) and time.monotonic() < deadline:
        time.sleep(0.25)
    time.sleep(0.5)  # the routers' background view picks it up
    [(out2, b)] = asyncio.run(_stream_all(graph, [(turn2, 40, {"pipeline": "P-MD"})]))
    assert b["md_replica"] == a["md_replica"], (a, b)
    assert b["prefix_hit_md"] >= 0.9 * len(turn1) / len(turn2) and b["wan_bytes"] < a["wan_bytes"] / 4, (a, b)
    assert [out1, out2] == veng.generate_batch([turn1, turn2], SamplingParams(40, ignore_eos=True))


@pytest.mark.cluster
def test_vllm_md_killed_mid_stream_migrates_by_token_ids(graph, veng):
    import ray

    from pdd_serve.serve.pinning import replica_actors
    from tests.cluster_fixture import running_mds

    prompt, n = _prompt(300, 500), 1500
    want = veng.generate_batch([prompt], SamplingParams(n, ignore_eos=True))[0]
    killed: list[str] = []
    ids: list[int] = []
    info: dict = {}
    body = {"model": "pdd-small", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "pdd": {"pipeline": "P-MD"}}
    with httpx.stream("POST", f"{graph}/v1/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            if obj.get("choices"):
                ids += obj["choices"][0].get("token_ids", [])
            info = obj.get("pdd", info)
            if len(ids) >= 3 and not killed:
                for rid, h in running_mds(APP).items():
                    if h.stats.remote().result(timeout_s=30).running:
                        ray.kill(ray.get_actor(replica_actors(APP, "MainDecode")[rid], namespace="serve"),
                                 no_restart=True)
                        killed.append(rid)
                        break
    assert killed, "the MD holding the request was not found"
    assert ids == want, info
    assert "md_lost" in info["fallbacks"], info
