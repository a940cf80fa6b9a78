"""Main decode's DRC on a vLLM engine with prefix caching on, run by `tests/engine/test_vllm.py` in its own
process (vLLM's worker-side KV connector is one per process, and that module's engine runs with
prefix caching off). Prints one JSON line of what it saw; the test asserts on it.

Three turns on one engine, as main decode sees them (the prompt's KV produced by a salted prefill,
so it never comes from vLLM's cache, and imported from the DRC hit on):
  1. a cold prompt A: no hit, every block imported; decoded
  2. A + turn 1's output + new text: the DRC view (vLLM's events in PDD's hashes) holds A, so only
     the blocks after the hit are imported, and vLLM's own cache supplies the rest
  3. A + other text, with vLLM's cache reset after the match: the view was stale, the connector
     sees the hole, and vLLM recomputes the prompt
"""

from __future__ import annotations

import json
import random
import time

from pdd_serve.checkpoints import default_model_path
from pdd_serve.engine.kv import block_hashes
from pdd_serve.engine.sampling import SamplingParams
from pdd_serve.engine.vllm.engine import VllmEngine


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def main() -> None:
    e = VllmEngine(default_model_path(), kv_cache_bytes=64 << 20, engine_args={"max_num_batched_tokens": 512})
    bs, n = e.block_size, 24
    a = _tokens(1, 300)
    out1 = e.generate(a, n)
    b, c = a + out1 + _tokens(2, 40), a + _tokens(3, 50)
    want_b, want_c = e.generate_batch([b, c], SamplingParams(n))
    chain = block_hashes(a[: len(a) // 32 * 32], bs)  # A's blocks as vLLM caches them (32 tokens each)

    def view_holds_a(want: bool) -> bool:
        deadline = time.monotonic() + 30  # the publisher thread sends a step's events just after it
        while (set(chain) <= set(e.cache.nodes)) != want and time.monotonic() < deadline:
            e.cache.refresh()
            time.sleep(0.05)
        return (set(chain) <= set(e.cache.nodes)) == want

    # the references' blocks out, so every turn below starts from what it imports (the reset's
    # event is published by the next step)
    e.llm.reset_prefix_cache()
    e.generate(_tokens(4, 8), 1)
    cleared = view_holds_a(False)

    def handoff(name: str, prompt: list[int], *, reset_after_match: bool = False) -> dict:
        p = e.add(f"p-{name}", prompt, SamplingParams(n))
        first = e.prefill(p, use_cache=False)  # salted: prefill's blocks never reach the DRC
        md = e.add(f"md-{name}", prompt, SamplingParams(n))
        hit = e.match_prefix(md)
        blocks = e.export_kv(p, start_block=hit // bs)
        e.release(p)
        if reset_after_match:
            e.llm.reset_prefix_cache()
        lost = e.store.drc_lost
        e.import_kv(md, blocks)
        e.append_tokens(md, [first])
        while not md.finished:
            e.step([md])
        out = md.output_ids
        e.release(md)
        return {"hit": hit, "imported_blocks": blocks.num_blocks, "prompt_blocks": -(-len(prompt) // bs),
                "drc_lost": e.store.drc_lost - lost, "out": out}

    t1 = handoff("a", a)
    holds = view_holds_a(True)
    t2 = handoff("b", b)
    t3 = handoff("c", c, reset_after_match=True)
    brief = lambda t: {k: v for k, v in t.items() if k != "out"}  # noqa: E731
    print(json.dumps({
        "cleared": cleared, "t1": brief(t1), "t1_identical": t1["out"] == out1,
        "view_holds_a": holds, "a_blocks": len(chain),
        "t2": brief(t2), "t2_identical": t2["out"] == want_b, "t3": brief(t3), "t3_identical": t3["out"] == want_c,
        "stats": {"queries": e.cache.stats.queries, "hit_tokens": e.cache.stats.hit_tokens,
                  "inserted": e.cache.stats.inserted_blocks, "evicted": e.cache.stats.evicted_blocks},
        "skipped_blocks": e.cache.skipped_blocks, "load_failures": e.store.load_failures, "live": e.num_live(),
    }))


if __name__ == "__main__":
    main()
