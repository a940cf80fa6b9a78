"""Control messages that cross sites pay the link: the one mechanism for every graph.

The application-level link (`LinkModel`) paces KV bytes on Flight; the control plane (the
Router's calls to Main decode, MD's token stream back) crosses the same WAN, so each message is
delayed by the link's one-way latency too (`LinkModel.latency_at`, the same jitter model).
A call pays it on the way out and on the way back; a stream's chunks are *shifted*, not slowed:
each chunk is released one latency after it arrived, whatever the consumer did meanwhile, as on a
real pipelined connection. Same-site handles are not wrapped.

Where the kernel shapes the wire (`pdd cluster up --shaped-link`) and netem is missing, this is
also where the delay comes from.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

_END = object()
# chunks a cross-site stream holds between the line and a slow reader: past it, the reader stops
# pulling from the remote stream. Far above what one latency holds in flight. What this bounds is
# the Router's own queue; Ray's streaming generator below it still buffers what the replica
# yields (Serve sets no generator backpressure), so the remote end is not slowed: a stalled
# reader's response accumulates there, in the Router's process, until its stream is closed. That
# buffer is bounded by the request itself: one chunk per decode step (~110 B pickled, a few
# hundred with Ray's per-item overhead), at most max_tokens of them, so < 2 MB for a 4096-token
# context, times the streams a Router admits (server.max_queue). Slowing MD for one slow client
# would stall its whole decode batch; vLLM buffers a slow client's outputs the same way.
STREAM_QUEUE_BOUND = 256


def remote_call(handle: Any, method: str, session_id: str | None, args: tuple, stream: bool = False) -> Any:
    """`handle.method.remote(*args)`, streaming or not, pinned to a replica when `session_id` names
    one, and a request of its own. Serve gives a child call its parent request's
    internal id, and its request router fulfils a pending call by that id (Ray 2.60): two calls
    from one request to one deployment in flight at once (an abort and a re-delivery's prepare,
    two view polls from a task started inside a request) would share it, and one would hang or
    take the other's replica. With no internal id in the context, Serve makes a fresh one."""
    from ray.serve import context as serve_context

    opts: dict[str, Any] = {"method_name": method}
    if stream:
        opts["stream"] = True
    if session_id is not None:
        opts["session_id"] = session_id

    def call() -> Any:
        cur = serve_context._get_serve_request_context()
        serve_context._serve_request_context.set(dataclasses.replace(cur, _internal_request_id=""))
        return handle.options(**opts).remote(*args)

    return contextvars.copy_context().run(call)


class CrossSiteHandle:
    """A Serve deployment handle whose every message crosses the WAN (`link.latency_at`)."""

    def __init__(self, handle: Any, link: Any) -> None:  # link: transport.link.LinkModel
        self.handle, self.link = handle, link
        self.messages = 0  # delayed messages, both ways (reported by the router's stats)
        self.max_stream_queue = 0  # the most chunks any stream held at once (<= STREAM_QUEUE_BOUND)

    def delay_s(self) -> float:
        self.messages += 1
        return self.link.real_latency_s()  # emulated: the latency in slow motion

    async def call(self, method: str, *args: Any, session_id: str | None = None) -> Any:
        await asyncio.sleep(self.delay_s())
        result = await remote_call(self.handle, method, session_id, args)
        await asyncio.sleep(self.delay_s())
        return result

    async def stream(self, method: str, *args: Any, session_id: str | None = None) -> AsyncIterator[Any]:
        """A streaming call; closing this generator cancels the remote stream at once."""
        await asyncio.sleep(self.delay_s())
        gen = remote_call(self.handle, method, session_id, args, stream=True)
        q: asyncio.Queue = asyncio.Queue(maxsize=STREAM_QUEUE_BOUND)

        async def put(item: Any) -> None:  # stamped when it arrived at the far end of the line
            await q.put((time.monotonic() + self.delay_s(), item))
            self.max_stream_queue = max(self.max_stream_queue, q.qsize())

        async def read() -> None:
            try:
                async for item in gen:
                    await put(item)  # a full queue: wait for the reader, pull no more meanwhile
                await put(_END)
            except Exception as e:  # noqa: BLE001 - the failure crosses the line like a chunk
                await put(e)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                due, item = await q.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            with contextlib.suppress(Exception):
                gen.cancel()


class LocalHandle:
    """The same interface over a same-site handle: no delay."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.messages = 0

    async def call(self, method: str, *args: Any, session_id: str | None = None) -> Any:
        return await remote_call(self.handle, method, session_id, args)

    def stream(self, method: str, *args: Any, session_id: str | None = None) -> AsyncIterator[Any]:
        return remote_call(self.handle, method, session_id, args, stream=True)


def site_handle(handle: Any, same_site: bool, link: Any) -> CrossSiteHandle | LocalHandle:
    """Wrap a handle by where its deployment sits relative to the caller."""
    if same_site or link is None or not link.config.paced:
        return LocalHandle(handle)
    return CrossSiteHandle(handle, link)
