"""What several test modules share: prompts, greedy references, KV blocks, ports and waiting.

Tests never import another test module (pytest would collect its tests twice, and its private
helpers would become an API nobody declared); shared pieces live here, in tests/serve/inprocess.py
(the router against in-process engines), tests/serve/replicas.py (the real deployment classes
without Ray) and tests/cluster_fixture.py (the local two-site Ray cluster).
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine's modules import torch: loaded only by the helpers that need them
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.kv import KVBlocks, KVLayout


def make_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    """n token ids for the tiny test checkpoints (conftest's model_dir: a 512-token vocabulary)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def graph_prompt(seed: int, n: int) -> list[int]:
    """n token ids for a deployed graph's default model (ids 3..1999)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def greedy_ref(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """One engine's greedy output, n tokens whatever the EOS: what every pipeline must match."""
    from pdd_serve.engine.sampling import SamplingParams

    return engine.generate_batch([prompt], SamplingParams(n, ignore_eos=True))[0]


def greedy_refs(engine: Engine, jobs: list[tuple[list[int], int]]) -> list[list[int]]:
    """The reference for several (prompt, max_tokens) at once: one batch (continuous batching keeps
    greedy output identical to one at a time, the invariant these tests hold the graph to)."""
    from pdd_serve.engine.sampling import SamplingParams

    return engine.generate_batch([p for p, _ in jobs], [SamplingParams(n, ignore_eos=True) for _, n in jobs])


def make_blocks(layout: KVLayout, n: int, start: int = 0, partial: int = 0, seed: int = 0) -> KVBlocks:
    """n random KV blocks from block `start` on; the last one `partial` tokens short of full."""
    import numpy as np

    from pdd_serve.engine.kv import KVBlocks

    rng = np.random.default_rng(seed)
    if layout.dtype == "float32":
        data = rng.standard_normal((n, *layout.block_shape)).astype(np.float32)
    else:
        data = rng.integers(0, 1 << 16, (n, *layout.block_shape), dtype=np.uint16).view(layout.numpy_dtype)
    ntok = n * layout.block_size - partial
    return KVBlocks(layout, start, data, [int(h) for h in rng.integers(1, 2**63, n)], num_tokens=ntok)


def assert_same(a: KVBlocks, b: KVBlocks) -> None:
    """The same blocks, bit for bit, with the same hashes and checksums."""
    assert a.layout == b.layout and a.start_block == b.start_block and a.num_tokens == b.num_tokens
    assert a.hashes == b.hashes and a.checksums == b.checksums
    assert a.data.dtype == b.data.dtype and a.data.tobytes() == b.data.tobytes()  # bitwise


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float) -> None:
    """Until the graph at `url` answers /health with 200; fails the test after timeout_s."""
    import httpx
    import pytest

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    pytest.fail("graph not healthy")


async def until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Until cond() holds, polled every 5 ms on the event loop; AssertionError after timeout_s."""
    for _ in range(int(timeout_s / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")
