"""The request router's choice, as a pure function: a pinned call goes to its replica (or, when
that replica is gone, anywhere, where it is refused at once); an unpinned one to the least loaded."""

from __future__ import annotations

import pytest

from pdd_serve.serve.pinning import ReplicaGone, check_pin, pin, pinned_replica, rank_replicas


def test_a_pin_round_trips_through_the_session_id():
    assert pinned_replica(pin("abc123")) == "abc123"
    assert pinned_replica("") is None and pinned_replica(None) is None
    assert pinned_replica("a-client-session") is None  # a user's own session id is not a pin


def test_a_pinned_call_goes_only_to_its_replica():
    stats = {"r1": {"running": 0, "capacity": 8}, "r2": {"running": 8, "capacity": 8}}
    assert rank_replicas("r2", stats) == [["r2"]]  # busy or not: it holds the request


def test_a_call_pinned_to_a_gone_replica_goes_anywhere_and_is_refused_there(monkeypatch):
    assert rank_replicas("gone", {"r1": {}, "r2": {}}) == [["r1", "r2"]]
    monkeypatch.setattr("pdd_serve.serve.pinning.current_pin", lambda: "gone")
    with pytest.raises(ReplicaGone, match="gone"):
        check_pin("r1")
    monkeypatch.setattr("pdd_serve.serve.pinning.current_pin", lambda: None)
    check_pin("r1")  # unpinned calls are served anywhere


def test_an_unpinned_call_goes_to_the_least_loaded_replica():
    stats = {"r1": {"running": 6, "capacity": 8}, "r2": {"running": 1, "capacity": 8},
             "r3": {"running": 1, "capacity": 8}}
    assert rank_replicas(None, stats) == [["r2", "r3"], ["r1"]]
    assert rank_replicas(None, {"new": None, "r1": {"running": 2, "capacity": 8}}) == [["new"], ["r1"]]
    assert rank_replicas(None, {}) == []


class _FakeMD:
    """Records what would cross the line to MainDecode."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str | None]] = []

    async def call(self, method: str, *args, session_id: str | None = None):  # noqa: ANN002, ANN201
        self.sent.append((method, session_id))
        return method

    def stream(self, method: str, *args, session_id: str | None = None):  # noqa: ANN002, ANN201
        self.sent.append((method, session_id))

        async def gen():  # noqa: ANN202
            yield method

        return gen()


def test_the_router_does_not_send_calls_pinned_to_a_replica_serve_no_longer_has(monkeypatch):
    """A replica that left Serve's replica set would refuse every pinned call, one WAN round trip
    each: the Router refuses them itself (the same ReplicaGone the orchestrator migrates on)."""
    import asyncio

    from pdd_serve.serve import router
    from pdd_serve.serve.router import ServeBackends, known_gone

    assert known_gone("r2", ["r1"]) and not known_gone("r1", ["r1", "r2"])
    assert not known_gone(None, ["r1"]) and not known_gone("r2", None)  # unpinned / no set yet: send

    b = ServeBackends.__new__(ServeBackends)  # the adapter alone: no Serve handles
    b.md, b._md_id, b.gone_pins = _FakeMD(), ("app", "MainDecode"), 0
    live = {("app", "MainDecode"): ("r1",)}
    monkeypatch.setattr(router, "live_replicas", lambda app, dep: live.get((app, dep)))

    async def main() -> None:
        assert await b.md_wait_kv("r1", "req", 5) == "wait_kv"
        for call in (lambda: b.md_wait_kv("r2", "req", 5), lambda: b.md_handoff_batch("r2", "req", [1], 5),
                     lambda: b.md_absorb("r2", "req", [1], 5), lambda: b.md_abort("r2", "req", 0),
                     lambda: b.md_prepare("r2", None, None)):
            with pytest.raises(ReplicaGone, match="r2 is gone"):
                await call()
        stream = b.md_decode("r2", "req", [1], 5)  # fails on iteration, where a remote refusal would
        with pytest.raises(ReplicaGone):
            async for _ in stream:
                pass
        assert [c async for c in b.md_decode("r1", "req", [1], 5)] == ["decode"]
        live.clear()  # Serve's router not started: nothing is known gone, the call goes out
        assert await b.md_abort("r2", "req", 0) == "abort"

    asyncio.run(main())
    assert b.md.sent == [("wait_kv", pin("r1")), ("decode", pin("r1")), ("abort", pin("r2"))]
    assert b.gone_pins == 6
