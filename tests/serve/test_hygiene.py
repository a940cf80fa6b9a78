"""Issue 13, items 3 and 7, at unit level: the real deployment classes (no Ray cluster), a tiny
real engine, and MD's real Flight server on loopback.

Item 3: a request MD drops while a router call for it is still in flight leaves nothing behind
(before `_uncall`, the call's exit left `_calls[rid] == 0` for every such request, forever).
Item 7: the heavy work of a request stays off the replica's event loop (Prefill's object-store
put, MD's KV join, the Router's parse), and each KV block's CRC is computed once per hop.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import types

import pytest

from pdd_serve.engine.engine import SamplingParams
from tests.helpers import until
from tests.serve.replicas import (
    BLOCKS,
    PROMPT,
    NoHandle,
    ThreadRecorder,
    long_request,
    prompt_kv,
    prompt_request,
    push_kv,
    record_engine_calls,
    serve_once,
)

pytestmark = pytest.mark.usefixtures("no_cluster")  # the replicas are built here, without Ray


# ---------------------------------------------------------------- item 3: MD's call counts never leak


# everything MD keeps per request
MD_STATE = ("_calls", "_touched", "seqs", "_kv", "_registered", "_attempt", "_t_prepare", "_aborted",
            "_extend_on_import")


def _assert_forgotten(md, rid: str, free_blocks: int) -> None:  # noqa: ANN001
    held = {name: getattr(md, name)[rid] for name in MD_STATE if rid in getattr(md, name)}
    assert not held, f"MD still holds {rid} after it dropped it: {held}"
    assert md.flight.bytes_reserved == 0
    assert md.engine.pool.num_free == free_blocks


@pytest.mark.parametrize("call", ["wait_kv", "handoff_batch", "decode"])
def test_an_abort_while_a_call_waits_for_the_kv_leaves_nothing(md, call: str) -> None:
    """The router aborts a request (its client went away) while one of its calls waits for KV
    that will never come. The call ends at once, and MD keeps no trace of the request; before the
    fix `wait_kv` and `handoff_batch` left `_calls[rid] == 0` behind. (`decode` dropped the request
    after its own call ended even then: kept so every kind of call stays covered.)"""
    rid = f"abort-during-{call}"
    free = md.engine.pool.num_free

    async def main() -> None:
        await md.prepare(prompt_request(rid))
        if call == "decode":
            async def run() -> object:
                return [c async for c in md.decode(rid, [], 30)]
        else:
            def run():  # noqa: ANN202
                return getattr(md, call)(rid, *([[]] if call == "handoff_batch" else []), 30)
        task = asyncio.create_task(run())
        await until(lambda: rid in md._kv)  # the call is in flight: MD's wait on Flight has begun
        assert md._calls.get(rid)
        assert await md.abort(rid)
        if call == "wait_kv":
            assert not (await asyncio.wait_for(task, 5)).ok
        else:  # no KV: the call fails, at once, not at its 30 s timeout
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(task, 5)

    asyncio.run(main())
    _assert_forgotten(md, rid, free)


def test_wait_kv_keeps_one_budget_when_the_prepare_arrives_late(md) -> None:
    """wait_kv overtook its prepare, which lands 2 s into a 2.5 s budget; the KV never comes. The
    wait ends at the budget (with MD's reason), not 2 s + another full 2.5 s (before the fix),
    by which time the Router's silence timer had fired and MD's reason was lost."""
    rid = "late-prepare"
    free = md.engine.pool.num_free

    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        wait = asyncio.create_task(md.wait_kv(rid, 2.5))
        await asyncio.sleep(2.0)
        await md.prepare(prompt_request(rid))
        ready = await asyncio.wait_for(wait, 10)
        assert not ready.ok and "not complete after" in ready.error, ready
        assert await md.abort(rid)
        return loop.time() - t0

    elapsed = asyncio.run(main())
    assert elapsed < 3.8, f"wait_kv took {elapsed:.1f}s for a 2.5 s budget"
    _assert_forgotten(md, rid, free)


def test_an_abort_during_a_handoff_extend_leaves_nothing(md, sender, monkeypatch: pytest.MonkeyPatch) -> None:
    """The abort lands while a catch-up batch waits on the engine thread (the KV is in): the
    extend finds the request aborted and fails, and MD forgets the request entirely."""
    rid = "abort-during-extend"
    first, kv = prompt_kv(sender, rid)
    free = md.engine.pool.num_free
    entered, gate = threading.Event(), threading.Event()
    real_extend = md.engine.extend

    def held_extend(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - holds the engine thread mid-call
        entered.set()
        gate.wait(10)
        return real_extend(*args, **kwargs)

    monkeypatch.setattr(md.engine, "extend", held_extend)

    async def main() -> None:
        await md.prepare(prompt_request(rid))
        await asyncio.to_thread(push_kv, md, kv, rid)
        assert (await md.wait_kv(rid, 10)).ok
        handoff = asyncio.create_task(md.handoff_batch(rid, [first, 7, 8], 10))
        await until(entered.is_set)  # the handoff's extend runs on the engine thread now
        abort = asyncio.create_task(md.abort(rid))
        await until(lambda: rid not in md.seqs)  # dropped while the call is still in progress
        assert md._calls.get(rid) == 1
        gate.set()
        with pytest.raises(RuntimeError, match="finished"):  # the engine refuses an aborted request
            await asyncio.wait_for(handoff, 10)
        assert await asyncio.wait_for(abort, 10)

    asyncio.run(main())
    _assert_forgotten(md, rid, free)


@pytest.mark.parametrize("kv_first", [False, True])
def test_a_decode_waiting_for_its_kv_extends_in_the_imports_engine_call(md, sender, kv_first: bool) -> None:
    """P->MD: decode is called before the KV lands (the usual case). Its extend over P's token runs
    in the same engine-thread call as the import, so the batch loop cannot slip a step between them
    (in an emulated run that step cost every P-MD request one decode step of TTFT). With the KV
    already in (`kv_first`), the extend is its own call. Either way: the same tokens as one engine's
    greedy generate, and nothing left behind."""
    rid = f"extend-on-import-{kv_first}"
    first, kv = prompt_kv(sender, rid)
    ref = sender.add(f"{rid}-ref", list(PROMPT), SamplingParams(4, ignore_eos=True))
    want = [sender.prefill(ref)]
    while not ref.finished:
        want += [t for _, t in sender.step([ref])]
    sender.release(ref, cache=False)
    free, cached_before = md.engine.pool.num_free, md.engine.cache.num_blocks
    submitted = record_engine_calls(md)

    async def main() -> list[int]:
        await md.prepare(prompt_request(rid))
        if kv_first:
            await asyncio.to_thread(push_kv, md, kv, rid)
            assert (await md.wait_kv(rid, 10)).ok
        task = asyncio.create_task(_collect(md.decode(rid, [first], 10)))
        if not kv_first:
            await until(lambda: rid in md._extend_on_import)  # decode waits for the KV
            await asyncio.to_thread(push_kv, md, kv, rid)
        return await asyncio.wait_for(task, 20)

    got = asyncio.run(main())
    assert [first, *got] == want
    assert ("_extend_committed" in submitted) == kv_first, submitted  # merged into `load` otherwise
    cached = md.engine.cache.num_blocks - cached_before  # a finished request's blocks stay in MD's DRC
    assert 0 < cached <= BLOCKS, cached  # its full blocks
    _assert_forgotten(md, rid, free - cached)


def test_mds_prepare_admits_and_matches_in_one_engine_call_and_a_cancel_gives_the_hit_back(md) -> None:
    """Admission and the DRC match run in ONE engine-thread call: every call waits for the decode
    step in flight and the batch loop queues the next step as soon as one ends, so a second call
    waited a whole step more before MD expected the KV (an emulated same-DC run measured it: the
    KV landed 4-15 ms after the decode call, then the import waited one 17 ms step). A prepare
    cancelled while that call runs still gives back the prefix the call adopts."""
    seed = md.engine.add("seed", list(PROMPT), SamplingParams(4, ignore_eos=True))
    md.engine.prefill(seed)
    md.engine.release(seed)  # the prompt's full blocks are in MD's DRC
    free, cached = md.engine.pool.num_free, md.engine.cache.num_blocks
    assert cached > 0
    real_call, real_match = md.worker.call, md.engine.match_prefix
    submitted = record_engine_calls(md)
    entered, gate = threading.Event(), threading.Event()

    def gated_match(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - holds the engine thread mid-call
        entered.set()
        gate.wait(10)
        return real_match(*args, **kwargs)

    async def main() -> None:
        reply = await md.prepare(prompt_request("one-call"))
        assert submitted == ["_admit"] and reply.hit_tokens > 0, (submitted, reply)
        assert await md.abort("one-call")
        md.engine.match_prefix = gated_match
        task = asyncio.create_task(md.prepare(prompt_request("cancelled")))
        await until(entered.is_set)  # `_admit` runs on the engine thread: the prepare is cancelled now
        releases = submitted.count("release")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()  # the match completes and adopts the prefix, for a prepare that is gone
        await until(lambda: submitted.count("release") > releases)  # the give-back
        await real_call(lambda: None)  # one thread, FIFO: the release is done

    asyncio.run(main())
    for rid in ("one-call", "cancelled"):
        _assert_forgotten(md, rid, free)
    assert md.engine.cache.num_blocks == cached
    assert all(node.lock == 0 for node in md.engine.cache.nodes.values())  # evictable again


async def _collect(chunks) -> list[int]:  # noqa: ANN001
    return [t async for c in chunks for t in c.token_ids]


# ---------------------------------------------------------------- item 7: off the event loop, one CRC per hop


def test_md_joins_the_received_runs_on_the_engine_thread(md, sender, monkeypatch: pytest.MonkeyPatch) -> None:
    """The KV arrives in several Flight batches; joining them copies the whole delta. That join
    (`ReceivedKV.blocks` -> `concat_blocks`) must run on MD's engine thread, not its event loop
    (before the fix, `got.blocks` was evaluated on the loop as an argument of the worker call)."""
    from pdd_serve.transport import flight_server

    join = ThreadRecorder(flight_server.concat_blocks)
    monkeypatch.setattr(flight_server, "concat_blocks", join)
    rid = "join"
    _, kv = prompt_kv(sender, rid)

    async def main() -> None:
        await md.prepare(prompt_request(rid))
        await asyncio.to_thread(push_kv, md, kv, rid)
        assert (await md.wait_kv(rid, 10)).ok

    asyncio.run(main())
    assert join.calls, "the received runs were never joined: the test no longer exercises the join"
    assert all(not on_loop and name.startswith("pdd-engine") for name, on_loop in join.calls), join.calls
    assert md.seqs[rid].num_computed == len(PROMPT)


def test_md_verifies_each_block_crc_once_per_flight_hop(md, sender, crcs: list[int]) -> None:
    """Prefill -> MD over real Flight: the server checks every block's CRC as it arrives; MD's
    import must not compute them all again (before the fix: two CRCs per block)."""
    rid = "crc-flight"
    _, kv = prompt_kv(sender, rid)  # the sender computes its CRCs here, before the count
    crcs.clear()

    async def main() -> None:
        await md.prepare(prompt_request(rid))
        await asyncio.to_thread(push_kv, md, kv, rid)
        assert (await md.wait_kv(rid, 10)).ok

    asyncio.run(main())
    assert len(crcs) == BLOCKS, f"{len(crcs)} CRC32s for {BLOCKS} blocks over one hop"
    assert set(crcs) == {md.engine.layout.block_bytes}


def test_relay_verifies_each_block_crc_once_per_object_store_hop(cfg, sender, crcs: list[int],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill -> Relay through the object store: `get_kv` checks the CRCs, the relay's import
    must not check them again. Only Ray's `get` is stood in for (no cluster): it hands back the
    object `put_kv` would have stored."""
    import ray

    from pdd_serve.serve.messages import RelayRequest
    from pdd_serve.serve.relay import Relay
    from pdd_serve.transport import object_store

    monkeypatch.setattr(object_store, "ray", types.SimpleNamespace(get=lambda obj, timeout: obj,
                                                                   exceptions=ray.exceptions))
    rid = "crc-relay"
    first, kv = prompt_kv(sender, rid)
    stored = object_store.KVObject(kv.layout, kv.start_block, kv.data, tuple(kv.hashes), tuple(kv.checksums),
                                   kv.num_tokens)
    relay = Relay.func_or_class(cfg)
    crcs.clear()

    async def main() -> list:
        return [c async for c in relay.generate(RelayRequest(prompt_request(rid), (first,), stored))]

    try:
        chunks = asyncio.run(main())
    finally:
        relay.worker._exec.shutdown(wait=True)
    assert sum(len(c.token_ids) for c in chunks) == 3  # it decoded: the KV was loaded
    assert len(crcs) == BLOCKS, f"{len(crcs)} CRC32s for {BLOCKS} blocks over one hop"


def test_prefill_puts_the_relays_kv_in_the_object_store_off_the_event_loop(cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    """`put_kv` copies the whole prompt KV into shared memory: it must not run on Prefill's event
    loop, where every other request's calls wait meanwhile. Only the put itself is stood in for
    (no object store here); the prefill and the export are real."""
    from pdd_serve.serve.messages import PrefillRequest
    from pdd_serve.serve.prefill import Prefill
    from pdd_serve.transport import object_store

    ref = object()
    put = ThreadRecorder(lambda kv: ref)
    monkeypatch.setattr(object_store, "put_kv", put)
    prefill = Prefill.func_or_class(cfg)
    try:
        res = asyncio.run(prefill.prefill(PrefillRequest(prompt_request("put"), to_relay=True, md_target=None)))
    finally:
        prefill.worker._exec.shutdown(wait=True)
    assert res.kv_ref is ref
    assert len(put.calls) == 1
    name, on_loop = put.calls[0]
    assert not on_loop and name != threading.main_thread().name, put.calls


def test_a_relay_export_is_paced_counted_and_reported_and_a_plain_p_md_makes_none(cfg, monkeypatch) -> None:
    """Late relay exports the whole prompt's KV for the relay on a P->MD request that may still
    switch: on an emulated chip that copy is held at the NIC's rate and counted as an export, and
    the request reports its object-store bytes. A prefill for P->MD alone exports nothing."""
    import dataclasses

    from pdd_serve.config import load_config
    from pdd_serve.serve.messages import PrefillRequest
    from pdd_serve.serve.prefill import Prefill
    from pdd_serve.transport import object_store

    monkeypatch.setattr(object_store, "put_kv", lambda kv: object())  # no object store here
    emu = load_config({"emulate": {"model": "llama-3-70b", "chip": "h100-sxm", "tp": 4}, "time_scale": 0.01}).emulate
    ecfg = dataclasses.replace(cfg, emulate=emu, time_scale=0.01)
    prefill = Prefill.func_or_class(ecfg)
    try:
        plain = asyncio.run(prefill.prefill(PrefillRequest(prompt_request("plain"), to_relay=False, md_target=None)))
        assert plain.relay_kv_bytes == 0 and prefill.engine.pacer.stats()["export_steps"] == 0
        req = prompt_request("late")
        res = asyncio.run(prefill.prefill(PrefillRequest(req, to_relay=True, md_target=None)))
    finally:
        prefill.worker._exec.shutdown(wait=True)
    st = prefill.engine.pacer.stats()
    assert st["export_steps"] == 1 and st["export_modeled_s"] > 0
    # the prompt's KV at the emulated model's 320 KiB per token
    assert res.relay_kv_bytes == len(req.prompt_token_ids) * 327_680


def test_router_parses_and_tokenizes_off_the_event_loop_on_one_thread(cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing and tokenizing a large body takes a while: not on the Router's event loop, where
    every stream waits meanwhile, and always on the same one thread (a fast tokenizer used from two
    threads at once can fail "already borrowed"). The real parser runs and tokenizes each prompt,
    which is longer than the model's context: each request ends as a 400 right after the parse
    (no Prefill or MD is needed) and the recorded thread is where the tokenizer ran."""
    import json

    from starlette.requests import Request

    from pdd_serve.serve import openai_api as oai
    from pdd_serve.serve.router import Router

    parse = ThreadRecorder(oai.parse_request)
    monkeypatch.setattr(oai, "parse_request", parse)
    # Serve's ingress subclasses the user's class; its first base is the plain Router. Its MD
    # argument is one handle since pinning.py (a list of per-MD handles before it).
    router_cls = Router.func_or_class.__bases__[0]
    md_arg = list(inspect.signature(router_cls.__init__).parameters)[4]
    router = router_cls(cfg, NoHandle(), None, [] if md_arg == "mds" else NoHandle())
    # the Router's background view of the MDs needs live replicas and plays no part in a parse
    monkeypatch.setattr(router, "_watch_views", lambda: None)
    body = json.dumps({"model": cfg.server.model_name, "prompt": "hello " * 2000, "max_tokens": 4}).encode()

    def request() -> Request:
        async def receive() -> dict:
            return {"type": "http.request", "body": body, "more_body": False}

        return Request({"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
                        "headers": [(b"content-type", b"application/json")]}, receive)

    async def main() -> list:
        return await asyncio.gather(*(router.completions(request()) for _ in range(3)))

    try:
        responses = asyncio.run(main())
    finally:
        if hasattr(router, "_parser"):  # the parse thread; absent where parsing ran on the loop
            router._parser.shutdown(wait=True)
    assert all(r.status_code == 400 and b"context_length_exceeded" in r.body for r in responses), \
        [r.body for r in responses]
    assert len(parse.calls) == 3
    assert not any(on_loop for _, on_loop in parse.calls), parse.calls
    threads = {name for name, _ in parse.calls}
    assert len(threads) == 1 and threads != {threading.main_thread().name}, parse.calls


# ---------------------------------------------------------------- the relay pool's share (issue 14)


def test_relay_share_follows_the_pools_live_replicas(cfg, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each relay replica admits its share of `relay_max_running`; the share follows how many
    replicas the pool really has (a `num_replicas` in the graph's `deployments:` may differ from
    `sites.relay_replicas`), so the pool in total never admits more. Only Serve's replica context
    and Ray's actor listing and `get` are stood in for (no cluster: a real `ray.get` here would
    start a local Ray instance inside the test process)."""
    import dataclasses

    import ray

    from pdd_serve.serve import pinning
    from pdd_serve.serve import relay as relay_mod
    from pdd_serve.serve.messages import RelayRequest, RelaySaturated
    from pdd_serve.transport import object_store

    assert relay_mod.relay_share(8, 3) == 2 and relay_mod.relay_share(2, 4) == 1 and relay_mod.relay_share(8, 0) == 8
    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, relay_max_running=4))
    live = {"r1": "a"}
    ctx = types.SimpleNamespace(app_name="pdd", deployment="Relay")
    monkeypatch.setattr(relay_mod.serve, "get_replica_context", lambda: ctx)
    monkeypatch.setattr(object_store, "ray", types.SimpleNamespace(get=lambda ref, timeout: "not KV",
                                                                   exceptions=ray.exceptions))
    no_kv = types.SimpleNamespace(hex=lambda: "ab" * 8)
    monkeypatch.setattr(pinning, "replica_actors", lambda app, dep: dict(live) if (app, dep) == ("pdd", "Relay") else {})
    relay = relay_mod.Relay.func_or_class(cfg)
    try:
        assert relay.max_running == 4  # sites.relay_replicas is 1
        live.update(r2="b", r3="c", r4="d")  # the YAML ran 4 replicas

        async def one() -> None:
            async for _ in relay.generate(RelayRequest(prompt_request("share"), (1,), no_kv)):
                pass

        async def recount_then_one() -> None:
            # due (a new replica's first request): a request starts the recount...
            with pytest.raises(object_store.KVError):  # admitted (the share was still 4): no KV here
                await one()
            if relay._recounting is not None:  # ...in the background
                await relay._recounting
            relay.live = {"x"}  # holds one: its share is now 1, so the next request is refused
            with pytest.raises(RelaySaturated, match=r"\(1\)"):
                await one()

        asyncio.run(recount_then_one())
        assert relay.max_running == 1
        live.clear()  # a failed listing (or none yet) keeps the last share
        asyncio.run(relay._recount())
        assert relay.max_running == 1
    finally:
        relay.worker._exec.shutdown(wait=True)


# ---------------------------------------------------------------- no orphaned prefill work


def test_a_prefill_past_its_budget_stops_at_a_chunk_and_frees_its_blocks(cfg) -> None:
    """The Router gave up on this call (its budget passed): the engine stops at the next chunk
    boundary instead of computing the whole prompt for nobody, and every block is freed."""
    from pdd_serve.serve.messages import PrefillRequest
    from pdd_serve.serve.prefill import Prefill, PrefillAbandoned

    prefill = Prefill.func_or_class(cfg)
    free = prefill.engine.pool.num_free
    forwards = []
    try:
        serve_once(prefill)
        prefill.engine.on_forward = forwards.append  # the seam's report: one per chunk computed
        with pytest.raises(PrefillAbandoned, match="past the router's budget"):
            asyncio.run(prefill.prefill(PrefillRequest(long_request("late"), False, None, budget_s=1e-6)))

        async def queued() -> None:  # the engine thread is busy past the budget: the call never runs
            busy = asyncio.ensure_future(prefill.worker.call(time.sleep, 1.0))
            with pytest.raises(PrefillAbandoned, match="past the router's budget"):
                await prefill.prefill(PrefillRequest(long_request("queued"), False, None, budget_s=0.3))
            await busy

        asyncio.run(queued())
        ok = asyncio.run(prefill.prefill(PrefillRequest(prompt_request("in-time"), False, None, budget_s=60)))
    finally:
        prefill.worker._exec.shutdown(wait=True)
    assert ok.first_token >= 0
    assert len(forwards) == 1  # the 100-token request's; the late ones stopped before their first chunk
    assert prefill.abandoned == 2 and prefill.stats().extra["prefills_abandoned"] == 2
    e = prefill.engine
    assert e.pool.num_free + e.cache.num_blocks >= free  # no block leaked: free, or cached (the finished prompt)
    assert prefill.prefilling == 0


def test_a_cancelled_prefill_call_stops_its_engine_job(cfg) -> None:
    """The caller went away (Serve cancels the replica's coroutine): the job already on the engine
    thread stops at its next chunk and frees its blocks; before, it ran the whole prompt."""
    from pdd_serve.serve.messages import PrefillRequest
    from pdd_serve.serve.prefill import Prefill

    prefill = Prefill.func_or_class(cfg)
    serve_once(prefill)
    free = prefill.engine.pool.num_free
    chunks = []
    started, gate = threading.Event(), threading.Event()

    def on_forward(w) -> None:  # noqa: ANN001 - holds the engine thread after the first chunk
        chunks.append(w)
        started.set()
        gate.wait(10)

    prefill.engine.on_forward = on_forward

    async def main() -> None:
        task = asyncio.create_task(prefill.prefill(PrefillRequest(long_request("gone"), False, None, budget_s=60)))
        await until(started.is_set)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()

    try:
        asyncio.run(main())
    finally:
        prefill.worker._exec.shutdown(wait=True)  # the job has ended either way
    assert len(chunks) == 1, f"{len(chunks)} chunks computed after the cancel"
    assert prefill.abandoned == 1 and prefill.prefilling == 0
    # the chunk computed before the stop is offered to the prefix cache (a retry reuses it); the rest is free
    assert prefill.engine.pool.num_free + prefill.engine.cache.num_blocks >= free


def test_admission_runs_on_the_engine_thread(cfg, md) -> None:
    """`engine.add` reads the pool and the prefix cache the engine thread changes, and hashes the
    whole prompt: Prefill and Main decode run it on the engine thread, never on the event loop."""
    from pdd_serve.serve.messages import PrefillRequest
    from pdd_serve.serve.prefill import Prefill

    prefill = Prefill.func_or_class(cfg)
    serve_once(prefill)
    adds = {"prefill": ThreadRecorder(prefill.engine.add), "md": ThreadRecorder(md.engine.add)}
    prefill.engine.add, md.engine.add = adds["prefill"], adds["md"]
    try:
        asyncio.run(prefill.prefill(PrefillRequest(prompt_request("adm-p"), False, None)))
        asyncio.run(md.prepare(prompt_request("adm-md")))
        assert asyncio.run(md.abort("adm-md"))
    finally:
        prefill.worker._exec.shutdown(wait=True)
    calls = [c for r in adds.values() for c in r.calls]
    assert len(calls) == 2 and all(name.startswith("pdd-engine") and not on_loop for name, on_loop in calls), calls


def test_a_full_send_buffer_refuses_prefills_that_would_add_to_the_line(cfg, md) -> None:
    """Prefill's KV for transfers still on the line is capped (flight.send_buffer_bytes): while a
    stalled transfer holds the buffer, a prefill that would add to the line is refused at
    admission as overloaded (the router retries or goes elsewhere), one that needs no WAN
    transfer still runs, and the buffer returns to 0 when the transfer ends."""
    import dataclasses

    from pdd_serve.engine.kv import PoolFullError
    from pdd_serve.serve.messages import KVTarget, PrefillRequest
    from pdd_serve.serve.prefill import Prefill
    from pdd_serve.serve.request_state import is_overloaded

    block_bytes = md.engine.layout.block_bytes
    cfg = dataclasses.replace(cfg, flight=dataclasses.replace(cfg.flight, send_buffer_bytes=BLOCKS * block_bytes),
                              policy=dataclasses.replace(cfg.policy, allow_fault_injection=True))
    prefill = Prefill.func_or_class(cfg)
    prefill.inject("stall", 1.5)  # the first transfer's line stalls mid-stream

    async def main() -> None:
        a = await md.prepare(prompt_request("held"))
        await prefill.prefill(PrefillRequest(prompt_request("held"), False, KVTarget(a.flight_location, a.start_block)))
        assert prefill.send_buffered == BLOCKS * block_bytes  # its transfer is still on the line
        b = await md.prepare(prompt_request("refused"))
        with pytest.raises(PoolFullError, match="send_buffer_bytes") as e:
            await prefill.prefill(PrefillRequest(prompt_request("refused"), False, KVTarget(b.flight_location, b.start_block)))
        assert is_overloaded(e.value)
        local = await prefill.prefill(PrefillRequest(prompt_request("no-wan"), False, None))  # P->RLD: nothing on the line
        assert local.first_token >= 0
        assert (await md.wait_kv("held", 10)).ok
        await until(lambda: prefill.send_buffered == 0)
        ok = await prefill.prefill(PrefillRequest(prompt_request("refused"), False, KVTarget(b.flight_location, b.start_block)))
        assert ok.first_token >= 0 and (await md.wait_kv("refused", 10)).ok
        await until(lambda: prefill.send_buffered == 0)  # the sender thread ends just after MD has it all

    try:
        asyncio.run(main())
        assert prefill.send_refused == 1 and prefill.stats().extra["send_refused"] == 1
        assert prefill.send_buffered == 0
    finally:
        prefill.worker._exec.shutdown(wait=True)
        prefill._senders.shutdown(wait=True)


def test_the_flight_expect_wait_derives_from_the_link(cfg) -> None:
    """A push may land before MD's `expect` (the prepare crosses the control plane while Prefill
    computes): the server's wait for it is the dispatch floor plus the line's one-way delay twice,
    not a fixed 2 s whatever the link."""
    import dataclasses

    from pdd_serve.config import LinkConfig
    from pdd_serve.serve.main_decode import EXPECT_WAIT_FLOOR_S, MainDecode

    for one_way in (0.0, 0.25):
        c = dataclasses.replace(cfg, link=LinkConfig(overrides=(("one_way_latency_s", one_way),)))
        replica = MainDecode.func_or_class(c)
        try:
            assert replica.flight.expect_wait_s == pytest.approx(EXPECT_WAIT_FLOOR_S + 2 * one_way)
        finally:
            replica.flight.close()
            replica.worker._exec.shutdown(wait=True)


def test_the_send_buffer_holds_no_more_than_the_line_drains_within_mds_wait(cfg) -> None:
    """KV queued behind more than the line carries before MD stops waiting would reach MD too
    late: the cap is the smaller of flight.send_buffer_bytes and rate x kv_wait_timeout_s (in
    real bytes: emulated KV is kv_scale times larger on the line)."""
    import dataclasses

    from pdd_serve.serve.prefill import Prefill

    cfg = dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, kv_wait_timeout_s=8.0))
    prefill = Prefill.func_or_class(cfg)
    try:
        prefill.bw._bps = 16e6  # a 16 Mbit/s line: 2 MB/s, 16 MB within an 8 s wait
        assert prefill.send_cap() == min(cfg.flight.send_buffer_bytes, int(16e6 / 8 * 8.0 / prefill.kv_scale))
        assert prefill.send_cap() == 16_000_000
        prefill.bw._bps = 1e12  # a fast line: the configured buffer is the bound
        assert prefill.send_cap() == cfg.flight.send_buffer_bytes
        prefill.kv_scale = 100.0  # emulated: each real byte is 100 on the line
        prefill.bw._bps = 16e9
        assert prefill.send_cap() == 160_000_000
    finally:
        prefill.worker._exec.shutdown(wait=True)
