"""Cross-site control messages pay the link (serve/crosssite.py): one latency each way per call,
streams shifted by one latency, not slowed; same-site handles untouched. The handle here is a
stand-in for a Serve handle (the real one is exercised in tests/serve/test_serve_graph.py)."""

from __future__ import annotations

import asyncio
import time

from pdd_serve.serve.crosssite import CrossSiteHandle, LocalHandle, site_handle
from pdd_serve.transport.link import LinkModel


class _Stream:
    def __init__(self, n: int, gap_s: float) -> None:
        self.n, self.gap_s, self.cancelled = n, gap_s, False
        self.produced: list[float] = []

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for i in range(self.n):
            await asyncio.sleep(self.gap_s)
            self.produced.append(time.monotonic())
            yield i

    def cancel(self) -> None:
        self.cancelled = True


class _Method:
    def __init__(self, owner: _Handle, name: str) -> None:
        self.owner, self.name = owner, name

    def remote(self, *args):
        self.owner.arrived.append(time.monotonic())
        if self.owner.streaming:
            self.owner.stream = _Stream(10, 0.01)
            return self.owner.stream

        async def answer():
            return (self.name, args)

        return answer()


class _Handle:
    def __init__(self, streaming: bool = False) -> None:
        self.streaming = streaming
        self.arrived: list[float] = []
        self.stream: _Stream | None = None

    def options(self, method_name: str | None = None, stream: bool = False, session_id: str | None = None):
        h = _Handle(streaming=stream) if stream != self.streaming else self
        h.session_id = session_id
        return _Method(h, method_name) if method_name else h

    def __getattr__(self, name: str):
        return _Method(self, name)


LINK = LinkModel(one_way_latency_s=0.05)


def test_a_cross_site_call_pays_the_latency_both_ways_and_a_same_site_call_does_not():
    far, near = site_handle(_Handle(), False, LINK), site_handle(_Handle(), True, LINK)
    assert isinstance(far, CrossSiteHandle) and isinstance(near, LocalHandle)

    async def rtt(h) -> float:
        t = time.monotonic()
        assert await h.call("status", 1) == ("status", (1,))
        return time.monotonic() - t

    assert asyncio.run(rtt(far)) >= 2 * 0.05
    assert asyncio.run(rtt(near)) < 0.05
    assert far.messages == 2 and near.messages == 0
    assert isinstance(site_handle(_Handle(), False, LinkModel()), LocalHandle)  # an unpaced link: same DC


def test_a_stream_is_shifted_by_the_latency_not_slowed():
    h = _Handle()
    far = CrossSiteHandle(h, LINK)

    async def main():
        t0 = time.monotonic()
        got = []
        async for item in far.stream("decode", "r1"):
            got.append((item, time.monotonic()))
            await asyncio.sleep(0.02)  # a slow consumer must not delay later chunks' arrival
        return t0, got

    t0, got = asyncio.run(main())
    assert [i for i, _ in got] == list(range(10))
    assert got[0][1] - t0 >= 2 * 0.05  # the request crossed, then the chunk came back
    # 10 chunks 10 ms apart, shifted by 50 ms each way: were each chunk delayed after the consumer
    # asked for it, the 20 ms consumer would see 10 x (20 + 50) ms; pipelined it is ~0.1 + 10 x 20 ms
    assert got[-1][1] - t0 < 0.1 + 10 * 0.02 + 0.15


def test_closing_a_cross_site_stream_cancels_the_remote_one():
    far = CrossSiteHandle(_Handle(), LINK)
    created: list[_Stream] = []
    orig = _Method.remote

    def spy(self, *args):
        s = orig(self, *args)
        if isinstance(s, _Stream):
            created.append(s)
        return s

    _Method.remote = spy
    try:
        async def main():
            gen = far.stream("decode", "r1")
            assert await gen.__anext__() == 0
            await gen.aclose()

        asyncio.run(main())
    finally:
        _Method.remote = orig
    assert created and created[0].cancelled


def test_each_call_is_a_request_of_its_own_for_serves_request_router():
    """Serve hands a child call its parent request's internal id, and Ray 2.60's request router
    fulfils pending calls by that id: two calls in flight from one request to one deployment would
    collide (one hangs or takes the other's replica). Each call clears it, so Serve makes a fresh one."""
    import dataclasses

    from ray.serve import context as serve_context

    from pdd_serve.serve.crosssite import remote_call

    seen = []

    class H:
        def options(self, **kw):
            return self

        def remote(self, *args):
            seen.append(serve_context._get_serve_request_context()._internal_request_id)

    token = serve_context._serve_request_context.set(
        dataclasses.replace(serve_context._get_serve_request_context(), _internal_request_id="parent"))
    try:
        remote_call(H(), "prepare", None, ())
        remote_call(H(), "abort", "pin", (), stream=True)
        assert seen == ["", ""]
        assert serve_context._get_serve_request_context()._internal_request_id == "parent"  # untouched
    finally:
        serve_context._serve_request_context.reset(token)


def test_a_slow_reader_holds_at_most_the_bound_and_loses_nothing(monkeypatch):
    """A client that reads slowly (or a stalled Router) must not grow the stream's buffer without
    limit: past the bound the remote stream is not pulled until the reader catches up."""
    from pdd_serve.serve import crosssite

    monkeypatch.setattr(crosssite, "STREAM_QUEUE_BOUND", 8)
    n = 200
    h = _Handle()
    orig = _Method.remote

    def many(self, *args):
        s = orig(self, *args)
        if isinstance(s, _Stream):
            s.n, s.gap_s = n, 0.0
        return s

    monkeypatch.setattr(_Method, "remote", many)
    far = CrossSiteHandle(h, LinkModel(one_way_latency_s=0.001))

    async def main():
        got = []
        async for item in far.stream("decode", "r1"):
            got.append(item)
            if len(got) == 1:
                await asyncio.sleep(0.3)  # the producer is free-running meanwhile: it must stop at 8
        return got

    assert asyncio.run(main()) == list(range(n))
    assert 0 < far.max_stream_queue <= 8
