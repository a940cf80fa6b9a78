"""Continuous batching on the engine thread: concurrent requests equal each alone."""

from __future__ import annotations

import asyncio

import pytest

from pdd_serve.engine.engine import Engine
from pdd_serve.engine.kv import OutOfBlocksError, PoolFullError
from pdd_serve.engine.sampling import RequestError, SamplingParams
from pdd_serve.engine.worker import EngineWorker
from tests.helpers import make_prompt


def test_concurrent_decodes_join_and_leave_the_batch(model_dir):
    eng = Engine.from_pretrained(model_dir, enable_prefix_cache=False)
    prompts = [make_prompt(n, n) for n in (5, 40, 17, 90)]
    lens = [20, 8, 30, 12]
    refs = [eng.generate(p, m) for p, m in zip(prompts, lens)]
    worker = EngineWorker(eng, max_batch=3)

    async def one(i: int, delay: float) -> list[int]:
        await asyncio.sleep(delay)
        seq = eng.add(f"r{i}", prompts[i], SamplingParams(lens[i]))
        await worker.call(eng.prefill, seq)
        out = list(seq.output_ids)
        async for step in worker.decode(seq):
            out += step.token_ids
        await worker.release(seq)
        return out

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(one(i, 0.01 * i) for i in range(4)))

    assert asyncio.run(main()) == refs
    assert eng.pool.num_free == eng.pool.num_blocks
    assert worker.steps < sum(lens)  # steps were shared


def test_a_consumer_that_stops_early_leaves_the_batch(model_dir):
    eng = Engine.from_pretrained(model_dir, enable_prefix_cache=False)
    worker = EngineWorker(eng)

    async def main() -> int:
        seq = eng.add("x", make_prompt(10, 1), SamplingParams(50, ignore_eos=True))
        await worker.call(eng.prefill, seq)
        n = 0
        async for _ in worker.decode(seq):
            n += 1
            if n == 5:
                break
        await worker.release(seq)
        await asyncio.sleep(0.05)
        return worker.num_running

    assert asyncio.run(main()) == 0
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_full_pool_preempts_and_resumes_without_losing_a_token(model_dir, prefix_cache):
    """More decoding KV than the pool holds: the youngest request is preempted and recomputed
    later, every stream equals one engine's greedy generate, and nothing stays allocated."""
    ref_eng = Engine.from_pretrained(model_dir, enable_prefix_cache=False)
    shared = make_prompt(16, 99)  # a shared prefix, so with the cache on the recompute can hit
    prompts = [shared + make_prompt(n, 100 + i) for i, n in enumerate((5, 12, 20, 9, 30))]
    refs = [ref_eng.generate(p, 48) for p in prompts]
    assert min(map(len, refs)) > 24  # long enough to outgrow the pool
    eng = Engine.from_pretrained(model_dir, kv_cache_bytes=12 * ref_eng.layout.block_bytes,
                                 enable_prefix_cache=prefix_cache)
    worker = EngineWorker(eng, max_batch=8)
    refused = 0

    async def one(i: int) -> list[int]:
        nonlocal refused
        await asyncio.sleep(0.005 * i)
        def admit():  # noqa: ANN202 - admission and its prefill as one engine-thread call, as the
            seq = eng.add(f"r{i}", prompts[i], SamplingParams(48))  # replicas run them: a decode step
            eng.prefill(seq)  # between them could take the blocks admission counted as free
            return seq

        while True:
            try:
                seq = await worker.call(admit)
                break
            except PoolFullError:  # typed "not now": the caller retries (the router: elsewhere)
                refused += 1
                await asyncio.sleep(0.01)
        out = list(seq.output_ids)
        async for step in worker.decode(seq):
            assert len(step.token_ids) == 1
            out += step.token_ids
        assert out == seq.output_ids
        await worker.release(seq)
        return out

    async def main() -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    assert asyncio.run(main()) == refs
    assert eng.preemptions > 0 and eng.num_preempted == 0
    cached = eng.cache.num_blocks if eng.cache is not None else 0
    assert eng.pool.num_free + cached == eng.pool.num_blocks


def test_admission_tells_not_now_from_never(model_dir):
    probe = Engine.from_pretrained(model_dir, enable_prefix_cache=False)
    eng = Engine.from_pretrained(model_dir, kv_cache_bytes=4 * probe.layout.block_bytes, enable_prefix_cache=False)
    with pytest.raises(RequestError, match="raise kv_cache_bytes"):  # can never fit: the client's fault
        eng.add("big", make_prompt(40, 1), SamplingParams(40))
    a = eng.add("a", make_prompt(40, 1), SamplingParams(8))
    eng.prefill(a)  # holds 3 of the 4 blocks
    with pytest.raises(PoolFullError, match="retry later"):
        eng.add("b", make_prompt(40, 2), SamplingParams(8))
    with pytest.raises(OutOfBlocksError):  # and it is not a RequestError: the orchestrator may retry it
        eng.add("b", make_prompt(40, 2), SamplingParams(8))
    assert not issubclass(PoolFullError, ValueError)
    eng.release(a)
    eng.release(eng.add("b", make_prompt(40, 2), SamplingParams(8)))


def test_generate_batch_admits_as_room_frees_and_matches_generate(model_dir):
    ref_eng = Engine.from_pretrained(model_dir, enable_prefix_cache=False)
    prompts = [make_prompt(n, 200 + n) for n in (30, 7, 45, 18, 26, 33)]
    refs = [ref_eng.generate(p, 40) for p in prompts]
    eng = Engine.from_pretrained(model_dir, kv_cache_bytes=10 * ref_eng.layout.block_bytes, enable_prefix_cache=False)
    assert eng.generate_batch(prompts, SamplingParams(40)) == refs
    assert eng.preemptions > 0 and eng.pool.num_free == eng.pool.num_blocks
    # seeded sampling too: a recomputed sequence draws with the same (seed, step) as it would have
    kw = dict(temperature=0.9, top_p=0.95, seed=7)
    refs = [ref_eng.generate(p, 40, **kw) for p in prompts]
    before = eng.preemptions
    assert eng.generate_batch(prompts, SamplingParams(40, **kw)) == refs
    assert eng.preemptions > before


def test_an_extend_short_of_blocks_preempts_younger_decoders_not_itself(model_dir):
    """MD's handoff extend for an older request, on a full pool: the younger decoding request is
    preempted and resumes later; both equal one engine's greedy output."""
    ref_eng = Engine.from_pretrained(model_dir, enable_prefix_cache=False)
    old_p, young_p = make_prompt(40, 301), make_prompt(40, 302)
    old_ref, young_ref = ref_eng.generate(old_p, 60), ref_eng.generate(young_p, 30)
    assert len(old_ref) == 60 and len(young_ref) == 30
    eng = Engine.from_pretrained(model_dir, kv_cache_bytes=7 * ref_eng.layout.block_bytes, enable_prefix_cache=False)
    old, young = eng.add("old", old_p, SamplingParams(60)), eng.add("young", young_p, SamplingParams(30))
    eng.prefill(old)
    eng.prefill(young)
    for _ in range(4):
        eng.step([old, young])  # both decode: 3 + 3 blocks of 7
    # the relay's committed tokens arrive for `old` (80 tokens: 2 more blocks, 1 is free)
    nxt = eng.extend(old, old_ref[len(old.output_ids):40])
    assert nxt == old_ref[40] and young.preempted and eng.preemptions == 1
    with pytest.raises(PoolFullError):  # preempted work goes first
        eng.add("new", make_prompt(5, 303), SamplingParams(4))
    while not old.finished:
        eng.step([old, young])
    eng.release(old)
    while not young.finished:
        eng.step([young])
    assert old.output_ids == old_ref and young.output_ids == young_ref
    eng.release(young)
    assert eng.pool.num_free == eng.pool.num_blocks and eng.num_preempted == 0


def test_a_release_whose_caller_is_cancelled_still_frees_the_kv(model_dir):
    """A release waits for the engine thread (a step in flight); the caller is cancelled meanwhile
    (a Serve call that timed out). The release still runs: nothing else holds the sequence."""
    import threading

    eng = Engine.from_pretrained(model_dir, enable_prefix_cache=False)
    w = EngineWorker(eng, max_batch=4)
    free = eng.pool.num_free
    gate = threading.Event()

    async def main() -> None:
        seq = eng.add("r", make_prompt(40, 1), SamplingParams(4, ignore_eos=True))
        await w.call(eng.prefill, seq)
        assert eng.pool.num_free < free
        busy = asyncio.ensure_future(w.call(gate.wait, 10))  # the engine thread is busy
        task = asyncio.create_task(w.release(seq, cache=False))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await busy
        await w.call(lambda: None)  # FIFO: after the release

    asyncio.run(main())
    w._exec.shutdown(wait=True)
    assert eng.pool.num_free == free
