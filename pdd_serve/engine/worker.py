"""Continuous batching for a serving replica: one engine thread, many asyncio requests.

The engine is not thread-safe, so every engine call runs on one worker thread (FIFO); the
event loop stays free for control-plane calls and Flight while the model computes. Decoding
requests join and leave the batch between steps. When the KV pool runs short, the engine preempts
the youngest request and recomputes it later (`Engine.step`); its stream just pauses.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pdd_serve.engine.engine import Sequence
from pdd_serve.engine.protocol import EngineBackend

T = TypeVar("T")


@dataclass(frozen=True)
class StepOutput:
    """Tokens produced for one request by one engine step (a decode step or an extend)."""

    token_ids: list[int]
    finish_reason: str | None = None


class EngineWorker:
    def __init__(self, engine: EngineBackend, max_batch: int = 32) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="pdd-engine")
        self._active: dict[str, tuple[Sequence, asyncio.Queue]] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self.steps = 0

    @property
    def num_running(self) -> int:
        return len(self._active)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run an engine operation on the engine thread, after whatever is queued before it."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._exec, lambda: fn(*args, **kwargs))

    async def decode(self, seq: Sequence) -> AsyncIterator[StepOutput]:
        """Decode `seq` (exactly one pending token) in the shared batch until it finishes or the
        caller stops iterating. The caller owns the sequence and releases it afterwards."""
        if seq.finished:
            return
        q: asyncio.Queue = asyncio.Queue()
        self._active[seq.request_id] = (seq, q)
        self._ensure_loop()
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            self._active.pop(seq.request_id, None)

    async def release(self, seq: Sequence, cache: bool = True) -> None:
        self._active.pop(seq.request_id, None)
        # shielded: a caller cancelled while the release waits for the engine thread (a step in
        # flight) must not drop it, as nothing else holds the sequence to free its KV later
        await asyncio.shield(self.call(self.engine.release, seq, cache))
        if self._loop_task is not None and self._loop_task.get_loop() is asyncio.get_running_loop():
            self._wake.set()  # freed blocks may let a preempted request resume

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._wake is None or self._loop_task is None or self._loop_task.get_loop() is not loop:
            self._wake = asyncio.Event()  # (re)bound to the running loop
            self._loop_task = None
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = loop.create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            batch = [(s, q) for s, q in list(self._active.values())
                     if not s.finished and (s.preempted or s.num_pending == 1)]
            batch = batch[: self.max_batch]
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                out = await self.call(self.engine.step, [s for s, _ in batch])
            except Exception as e:  # a failed step fails its requests, not the replica
                for _, q in batch:
                    q.put_nowait(e)
                for s, _ in batch:
                    self._active.pop(s.request_id, None)
                continue
            self.steps += 1
            queues = {s.request_id: q for s, q in batch}
            for s, t in out:
                queues[s.request_id].put_nowait(StepOutput([t], s.finish_reason))
            if not out:  # all preempted, the blocks held outside the batch (imports, prefill): wait
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.05)
