"""The real deployment classes without Ray, for unit tests: the requests, KV and recorders the
tests of Prefill, the relay and Main decode share. Their fixtures (`cfg`, `md`, `sender`, `crcs`,
`no_cluster`) are in tests/serve/conftest.py.
"""

from __future__ import annotations

import asyncio
import threading
import types
from collections.abc import Callable

from pdd_serve.engine.engine import SamplingParams
from pdd_serve.serve.messages import GenRequest

PROMPT = [3 + (i * 37) % 500 for i in range(100)]  # 100 tokens: 7 blocks of 16, the last partial
BLOCKS = 7
TOKEN, MAC_KEY = "hygiene-token", "hygiene-mac"


def prompt_kv(engine, rid: str):  # noqa: ANN001, ANN202 - (first token, the prompt's KV blocks)
    seq = engine.add(rid, list(PROMPT), SamplingParams(4, ignore_eos=True))
    first = engine.prefill(seq)
    kv = engine.export_kv(seq)
    engine.release(seq, cache=False)
    assert kv.num_blocks == BLOCKS
    return first, kv


def push_kv(md, kv, rid: str) -> None:  # noqa: ANN001
    """One real Flight hop, in 2-block batches: MD receives several runs it must join."""
    from pdd_serve.transport.flight import KVFlightClient

    KVFlightClient(md.flight.location, TOKEN, layout=md.engine.layout, mac_key=MAC_KEY, batch_blocks=2,
                   deadline_s=10).push(rid, [kv])


def prompt_request(rid: str) -> GenRequest:
    return GenRequest(rid, tuple(PROMPT), SamplingParams(4, ignore_eos=True))


def long_request(rid: str) -> GenRequest:  # two prefill chunks (256 + 144 tokens)
    return GenRequest(rid, tuple(3 + (i * 37) % 500 for i in range(400)), SamplingParams(4, ignore_eos=True))


def serve_once(prefill) -> None:  # noqa: ANN001
    """A first prefill, of tokens no other prompt here has: the replica calibrates its cost on the
    engine thread before its first prefill, so what a test counts there afterwards is its own."""
    from pdd_serve.serve.messages import PrefillRequest

    first = GenRequest("first", tuple(range(505, 512)) * 3, SamplingParams(1))
    asyncio.run(prefill.prefill(PrefillRequest(first, False, None, budget_s=60)))


def record_engine_calls(md) -> list[str]:  # noqa: ANN001
    """The name of every function MD submits to its engine thread from now on, in order."""
    submitted: list[str] = []
    real_call = md.worker.call

    async def recording_call(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        submitted.append(getattr(fn, "__name__", repr(fn)))
        return await real_call(fn, *args, **kwargs)

    md.worker.call = recording_call
    return submitted


def on_event_loop() -> bool:
    """Whether the calling thread is running an asyncio event loop (a replica's loop thread)."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


class NoHandle:
    """Stands in for a Serve deployment handle (no cluster here): names a deployment, serves no call."""

    deployment_id = types.SimpleNamespace(app_name="hygiene", name="none")


class ThreadRecorder:
    """Wraps a blocking function; records, per call, its thread and whether a loop runs there."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        self.calls.append((threading.current_thread().name, on_event_loop()))
        return self.fn(*args, **kwargs)
