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
