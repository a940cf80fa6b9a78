"""Continuous batching on the engine thread: concurrent requests equal each alone."""

from __future__ import annotations

import asyncio

from pdd_serve.engine.engine import Engine
from pdd_serve.engine.sampling import SamplingParams
from pdd_serve.engine.scheduler import EngineWorker
from tests.test_engine import _prompt


def test_concurrent_decodes_join_and_leave_the_batch(model_dir):
    eng = Engine.from_pretrained(model_dir, enable_prefix_cache=False)
    prompts = [_prompt(n, n) for n in (5, 40, 17, 90)]
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
        seq = eng.add("x", _prompt(10, 1), SamplingParams(50, ignore_eos=True))
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
