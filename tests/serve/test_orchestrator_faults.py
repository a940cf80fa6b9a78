"""The router's fault paths against real engines wired in-process (tests/serve/inprocess.py): a
replica or the line fails, the request ends early, a pool is full, a request is bad, or Prefill sheds
load. Each request still completes token-identical to one engine (or fails the way the client must
see it), and nothing is left behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from pdd_serve.engine.engine import Engine
from pdd_serve.engine.sampling import SamplingParams
from pdd_serve.serve.messages import GenRequest
from pdd_serve.serve.request_state import RequestState
from tests.helpers import make_prompt
from tests.serve.inprocess import InProcessBackends, full_md_prepare, orchestrator, run_request

# ---------------------------------------------------------------- a replica or the line fails


FAULTS = {
    "md_dies_mid_stream": dict(fail_md_after={0: 5}),
    "md_dies_twice": dict(fail_md_after={0: 5, 1: 3}),
    "wan_cut_p_md": dict(lose_kv=1),
    "prefill_dies": dict(fail_prefill=1),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_paths_complete_with_identical_output(model_dir, fault):
    """Each fault path: the request completes, token-identical to one engine, nothing repeated."""
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.05, relay_step_s=0.0)
    for k, v in FAULTS[fault].items():
        setattr(b, k, dict(v) if isinstance(v, dict) else v)
    orch = orchestrator(b, kv_wait_timeout_s=1.0, max_migrations=1)
    prompt = make_prompt(70, 33)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 40)

    async def main():
        out, st = await run_request(orch, prompt, 40, {"pipeline": "P-MD"})
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st

    out, st = asyncio.run(main())
    assert out == ref, st.info
    assert st.info.fallbacks, "the fault path was not taken"
    assert all(not d for d in b.md_seqs)
    if fault == "md_dies_mid_stream":
        assert st.info.md_replica == 1 and st.info.fallbacks == ["md_lost"]
    if fault == "md_dies_twice":  # both MDs lost: RLD finishes from the committed tokens
        assert "relay_finish" in st.info.fallbacks and st.info.eager_tokens > 0


def test_relay_lost_in_phase_one_hands_request_to_md(model_dir):
    b = InProcessBackends(model_dir, wan_delay_s=0.2)
    b.fail_relay = 1
    orch = orchestrator(b)
    prompt = make_prompt(80, 34)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 30)
    out, st = asyncio.run(run_request(orch, prompt, 30, {"pipeline": "P-RLD-MD"}))
    assert out == ref and st.info.fallbacks == ["relay_lost"] and st.info.md_tokens == 29, st.info.fallback


def test_kv_timeout_on_relay_path_lets_relay_finish(model_dir):
    b = InProcessBackends(model_dir, wan_delay_s=0.1, relay_step_s=0.01)
    b.lose_kv = 1
    orch = orchestrator(b, kv_wait_timeout_s=0.5)
    prompt = make_prompt(80, 35)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 80)

    async def main():
        out, st = await run_request(orch, prompt, 80, {"pipeline": "P-RLD-MD"})
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st

    out, st = asyncio.run(main())
    assert out == ref and st.info.fallbacks == ["kv_timeout"] and st.info.md_tokens == 0
    assert all(not d for d in b.md_seqs)


def test_md_lost_before_the_kv_lands_lets_the_relay_finish(model_dir):
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.3, relay_step_s=0.01)
    orch = orchestrator(b)
    prompt = make_prompt(80, 45)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 40)

    async def dead(i, rid, timeout_s):
        raise RuntimeError("MD replica died")

    b.md_wait_kv = dead

    async def main():
        out, st = await run_request(orch, prompt, 40, {"pipeline": "P-RLD-MD"})
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st

    out, st = asyncio.run(main())
    assert out == ref and "kv_timeout" in st.info.fallbacks and st.info.md_tokens == 0
    assert orch.relay_running == 0 and b.r.pool.num_free == b.r.pool.num_blocks


@pytest.mark.parametrize("forced, fault", [
    ({"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, "relay_dies_in_catch_up"),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"}, "relay_dies_before_kv"),
    ({"pipeline": "P-RLD"}, "relay_dies_p_rld"),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"}, "md_dies_after_one_shot"),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, "md_dies_after_catch_up"),
])
def test_relay_path_faults_lose_no_token(model_dir, forced, fault):
    """The relay or MD dies on the relay paths: the request completes from the committed token ids,
    token-identical to one engine, and nothing is left behind."""
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.3, relay_step_s=0.01)
    if fault == "relay_dies_in_catch_up":
        b.fail_relay_in_catch_up, b.batch_rtt_s = True, 0.1
    elif fault in ("relay_dies_before_kv", "relay_dies_p_rld"):
        b.fail_relay_after = 5
    else:
        b.fail_md_after = {0: 3, 1: 3}  # whichever MD holds it dies 3 chunks after the handoff
    orch = orchestrator(b, handoff_batch_tokens=1, kv_wait_timeout_s=3.0, handoff_token_threshold=4)
    prompt = make_prompt(90, 47)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 80)
    out, st = asyncio.run(run_request(orch, prompt, 80, forced))
    assert out == ref, st.info
    kind = "relay_lost" if fault.startswith("relay") else "md_lost"
    assert kind in st.info.fallbacks, st.info
    assert all(not d for d in b.md_seqs) and orch.relay_running == 0
    assert b.r.pool.num_free == b.r.pool.num_blocks


@pytest.mark.parametrize("pipeline", ["P-MD", "P-RLD-MD"])
def test_an_aborted_transfer_takes_the_fallback_at_once(model_dir, pipeline):
    """Item 3: the sender aborts mid-stream (prefill failed): MD's KV wait fails now, so the router
    re-delivers (P->MD) or lets RLD finish (P->RLD->MD) long before the KV wait's timeout."""
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.1, relay_step_s=0.01)
    b.abort_kv = 1
    orch = orchestrator(b, kv_wait_timeout_s=20.0)
    prompt = make_prompt(80, 52)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 40)
    t0 = time.monotonic()
    out, st = asyncio.run(run_request(orch, prompt, 40, {"pipeline": pipeline}))
    assert out == ref, st.info
    assert st.info.fallbacks == ["kv_timeout"] and "aborted" in st.info.fallback, st.info
    assert time.monotonic() - t0 < 10  # not the 20 s KV wait
    assert all(not d for d in b.md_seqs) and orch.relay_running == 0


def test_a_single_md_takes_a_request_back_after_its_kv_was_lost(model_dir):
    """One MD (as in pd_cross_dc): the KV is lost, MD drops the request, the router aborts it and
    re-delivers to the same MD. The late abort of the first registration must neither refuse nor
    drop the second (attempts), so MD finishes the request, token-identical."""
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.05)
    b.lose_kv = 1
    orch = orchestrator(b, pipelines=("P-MD",), kv_wait_timeout_s=1.0)
    prompt = make_prompt(70, 48)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 30)
    out, st = asyncio.run(run_request(orch, prompt, 30))
    assert out == ref and "kv_timeout" in st.info.fallbacks and st.info.md_tokens > 0, st.info
    assert st.gen.attempt == 1 and "relay_finish" not in st.info.fallbacks
    assert all(not d for d in b.md_seqs)


# ---------------------------------------------------------------- early ends


@pytest.mark.parametrize("pipeline", ["P-MD", "P-RLD-MD", "P-RLD"])
def test_request_ended_by_the_router_stops_every_decoder(model_dir, pipeline):
    """A stop string (or max_tokens at the router, or the client leaving) ends the stream early:
    MD and RLD stop at once and free their KV; the relay count returns to zero."""
    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.05, relay_step_s=0.01)
    orch = orchestrator(b)
    prompt = make_prompt(60, 44)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 200)

    async def main():
        await orch.refresh_views()
        st = RequestState(GenRequest("s1", tuple(prompt), SamplingParams(200)))
        out: list[int] = []
        gen = orch.run(st, {"pipeline": pipeline})
        async for toks in gen:
            out += toks
            if len(out) >= 6:
                st.finish_reason = "stop"  # what the router's detokenizer does on a stop string
                break
        await gen.aclose()
        await asyncio.gather(*orch.bg, return_exceptions=True)
        await asyncio.sleep(0.2)
        return out, st

    out, st = asyncio.run(main())
    assert out == ref[: len(out)]
    assert all(not d for d in b.md_seqs), "MD still decodes a request the client has finished"
    assert b.r.pool.num_free == b.r.pool.num_blocks and orch.relay_running == 0
    assert b.mds[0].pool.num_free + sum(1 for _ in b.mds[0].cache.nodes) == b.mds[0].pool.num_blocks


@pytest.mark.parametrize("forced, relay_dies", [
    ({"pipeline": "P-RLD-MD", "handoff_mode": "one-shot"}, False),
    ({"pipeline": "P-RLD-MD", "handoff_mode": "catch-up"}, False),
    ({"pipeline": "P-RLD"}, True),  # the relay dies: MD takes the request over
])
def test_the_relays_kv_copy_is_freed_when_the_relay_is_cut(model_dir, forced, relay_dies):
    """Item 2: the prompt KV Prefill put in the object store for RLD (here the KVBlocks object the
    in-process Prefill hands over) is dropped once RLD is cut or ends, while MD still decodes."""
    import gc
    import weakref

    b = InProcessBackends(model_dir, num_md=1, wan_delay_s=0.2, relay_step_s=0.01)
    if relay_dies:
        b.fail_relay_after = 4
    refs: list[weakref.ref] = []
    prefill = b.prefill

    async def tracked(preq):
        res = await prefill(preq)
        if res.kv_ref is not None:
            refs.append(weakref.ref(res.kv_ref))
        return res

    b.prefill = tracked
    orch = orchestrator(b, handoff_batch_tokens=1, handoff_token_threshold=4)
    prompt = make_prompt(120, 48)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 80)

    async def main():
        await orch.refresh_views()
        st = RequestState(GenRequest("kv1", tuple(prompt), SamplingParams(80)))
        out, alive_while_md_decodes = [], []
        async for toks in orch.run(st, forced):
            out += toks
            if st.info.md_tokens >= 20 and not alive_while_md_decodes:  # well after the cut (RLD's
                gc.collect()  # own cleanup may still run at MD's first token), long before the end
                alive_while_md_decodes.append(refs[0]() is not None)
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st, alive_while_md_decodes

    out, st, alive = asyncio.run(main())
    assert out == ref, st.info
    assert refs and alive == [False], f"the relay's KV copy was still held while MD decoded ({st.info})"
    if relay_dies:
        assert "relay_lost" in st.info.fallbacks


# ---------------------------------------------------------------- full pools and bad requests (item 13 leftovers)


def test_a_full_md_is_not_marked_failed_and_the_request_goes_elsewhere(model_dir):
    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.05, relay_step_s=0.0)
    full_md_prepare(b, {0})
    orch = orchestrator(b, pipelines=("P-MD",), kv_wait_timeout_s=2.0)
    prompt = make_prompt(60, 49)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 20)

    async def main():
        await orch.refresh_views()
        orch.index.entries[1].view = dataclasses.replace(orch.index.entries[1].view, running=50)  # pick MD 0
        out, st = await run_request(orch, prompt, 20, fresh_view=False)
        return out, st

    out, st = asyncio.run(main())
    assert out == ref, st.info
    assert "md_full" in st.info.fallbacks and st.info.md_replica == 1, st.info
    assert orch.index.failures.get(0, 0) == 0  # busy is not dead: MD 0's view stands
    assert all(not d for d in b.md_seqs)


def test_every_pool_full_is_overloaded_not_a_fault(model_dir):
    """No MD can admit the request and neither can the relay: the orchestrator raises Overloaded
    (the router's 503 + Retry-After) before any token, and leaves nothing behind."""
    from pdd_serve.engine.kv import PoolFullError
    from pdd_serve.serve.request_state import Overloaded, is_overloaded

    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.05)
    full_md_prepare(b, {0, 1})
    real_relay = b.relay

    async def full_relay(rreq):
        raise PoolFullError("relay: the KV pool is full")
        yield  # an async generator, like the real stream

    b.relay = full_relay
    orch = orchestrator(b, pipelines=("P-MD", "P-RLD-MD"), kv_wait_timeout_s=2.0)
    prompt = make_prompt(60, 50)

    async def main():
        await orch.refresh_views()
        st = RequestState(GenRequest("full", tuple(prompt), SamplingParams(20)))
        out = []
        with pytest.raises(Overloaded) as ei:
            async for toks in orch.run(st, {"pipeline": "P-MD"}):
                out += toks
        await asyncio.gather(*orch.bg, return_exceptions=True)
        return out, st, ei.value

    out, st, err = asyncio.run(main())
    assert out == [] and is_overloaded(err)  # P->MD holds P's first token: the client saw nothing
    assert "md_full" in st.info.fallbacks and orch.index.failures.get(0, 0) == orch.index.failures.get(1, 0) == 0
    assert all(not d for d in b.md_seqs) and orch.relay_running == 0
    b.relay = real_relay


def test_a_relay_that_refuses_is_full_not_lost_and_md_serves_the_request(model_dir):
    """The relay pool admits (relay_max_running in total, whichever routers send): a refusal
    keeps the request on MD, counted as relay_full, token-identical."""
    from pdd_serve.serve.relay import RelaySaturated

    class Refusing(InProcessBackends):
        async def relay(self, rreq):
            raise RelaySaturated("relay replica holds 8 requests, its share of policy.relay_max_running (8)")
            yield  # an async generator, like the real stream

    b = Refusing(model_dir, wan_delay_s=0.1)
    orch = orchestrator(b)
    prompt = make_prompt(81, 34)
    ref = Engine.from_pretrained(model_dir).generate(prompt, 20)
    out, st = asyncio.run(run_request(orch, prompt, 20, {"pipeline": "P-RLD-MD"}))
    assert out == ref and st.info.fallbacks == ["relay_full"] and st.info.md_tokens == 19, st.info
    assert orch.relay_running == 0


@pytest.mark.parametrize("where", ["md", "relay"])
def test_a_request_error_while_decoding_fails_the_request_and_is_not_migrated(model_dir, where):
    """Non-finite logits (a RequestError) mid-decode: the request's own fault, so it fails (a 400)
    at once; it is not migrated to another MD or handed to the relay as an infrastructure fault."""
    from pdd_serve.engine.sampling import RequestError
    from pdd_serve.serve.request_state import is_request_error

    b = InProcessBackends(model_dir, num_md=2, wan_delay_s=0.2, relay_step_s=0.01)
    real_decode, real_relay = b.md_decode, b.relay

    async def bad_md(i, rid, committed, timeout_s):
        n = 0
        async for chunk in real_decode(i, rid, committed, timeout_s):
            yield chunk
            n += 1
            if n == 3:
                raise RequestError("non-finite logits (inf/NaN) while sampling")

    async def bad_relay(rreq):
        n = 0
        async for chunk in real_relay(rreq):
            yield chunk
            n += 1
            if n == 3:
                raise RequestError("non-finite logits (inf/NaN) while sampling")

    if where == "md":
        b.md_decode = bad_md
    else:
        b.relay = bad_relay
    orch = orchestrator(b)
    prompt = make_prompt(60, 51)
    forced = {"pipeline": "P-MD"} if where == "md" else {"pipeline": "P-RLD-MD"}

    async def main():
        await orch.refresh_views()
        st = RequestState(GenRequest("bad", tuple(prompt), SamplingParams(40)))
        with pytest.raises(Exception) as ei:
            async for _ in orch.run(st, forced):
                pass
        await asyncio.gather(*orch.bg, return_exceptions=True)
        await asyncio.sleep(0.1)
        return st, ei.value

    st, err = asyncio.run(main())
    assert is_request_error(err), repr(err)
    assert not st.info.fallbacks, st.info.fallbacks  # no migration, no relay takeover
    assert all(not d for d in b.md_seqs) and orch.relay_running == 0
    assert b.r.pool.num_free == b.r.pool.num_blocks


def test_router_maps_full_pools_to_503_and_request_errors_to_400():
    from pdd_serve.engine.kv import PoolFullError
    from pdd_serve.engine.sampling import RequestError
    from pdd_serve.serve.request_state import Overloaded
    from pdd_serve.serve.router import client_error

    class Wrapped(RuntimeError):  # how Ray hands back a replica's exception
        def __init__(self, cause):
            super().__init__("Traceback ... /home/secret/path.py")
            self.cause = cause

    for e in (Overloaded("all full"), Wrapped(PoolFullError("full"))):
        err = client_error(e, "cmpl-1")
        assert err.status == 503 and err.type == "overloaded_error" and int(err.headers()["Retry-After"]) >= 1
    err = client_error(Wrapped(RequestError("non-finite logits")), "cmpl-1")
    assert err.status == 400 and "non-finite" in err.message
    err = client_error(Wrapped(RuntimeError("boom")), "cmpl-1")
    assert err.status == 500 and "secret" not in err.message and "cmpl-1" in err.message


# ---------------------------------------------------------------- shedding at the door


@pytest.mark.parametrize("failure", ["busy", "timeout"])
def test_a_prefill_busy_on_every_attempt_is_shed_as_overloaded_not_a_500(model_dir, failure):
    """Under overload Prefill refuses what its queue would not reach within the budget (or a
    prefill ran out of it): after its retries the request is Overloaded, which the Router answers
    with a 503 + Retry-After at the door, not a 500; nothing is held afterwards."""
    from pdd_serve.serve.messages import PrefillBusy
    from pdd_serve.serve.request_state import Overloaded
    from pdd_serve.serve.router import client_error

    class Busy(InProcessBackends):
        calls = 0

        async def prefill(self, preq):
            Busy.calls += 1
            if failure == "busy":
                raise PrefillBusy("this Prefill replica has 9000 prompt tokens queued")
            await asyncio.sleep(10)

    b = Busy(model_dir)
    orch = orchestrator(b, prefill_retries=1)
    if failure == "timeout":
        orch.timeout = 0.2
    async def main() -> BaseException:
        try:
            await run_request(orch, make_prompt(90, 40), 8, {"pipeline": "P-MD"})
        except Overloaded as e:
            await asyncio.gather(*orch.bg, return_exceptions=True)  # MD's cleanup of the prepared request
            return e
        raise AssertionError("not shed")

    e = asyncio.run(main())
    assert Busy.calls == 2
    err = client_error(e, "r")
    assert err.status == 503 and err.headers().get("Retry-After"), err.body()
    assert orch.fallbacks.get("prefill_full" if failure == "busy" else "prefill_retry") == 2
    assert all(not d for d in b.md_seqs) and orch.relay_running == 0


def test_a_prefill_that_fails_otherwise_is_still_an_error(model_dir):
    """A Prefill that dies on every attempt is a fault (500 with the request id), not capacity."""
    b = InProcessBackends(model_dir)
    b.fail_prefill = 5
    orch = orchestrator(b, prefill_retries=1)
    with pytest.raises(RuntimeError, match="prefill failed after 2 attempts"):
        asyncio.run(run_request(orch, make_prompt(91, 40), 8, {"pipeline": "P-MD"}))
