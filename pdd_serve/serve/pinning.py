"""Serve request routing for PDD's stateful deployments: every call about a request reaches the
replica that holds it.

Main decode holds a request's KV from `prepare` to the end of its decode, so the KV wait, the
handoff batches, the decode stream and the abort must all land on one replica of the one
`MainDecode` deployment, whatever its `num_replicas` or autoscaling does. The Router picks the
replica (from its background view of every replica's DRC and load, before prefill, with no
round trip) and *pins* each call to it through Serve's own stickiness key, the handle's
`session_id`. `PinnedRequestRouter` (a `ray.serve.request_router.RequestRouter`, set as the
deployment's `request_router_config`) honours the pin; an unpinned call goes to the least loaded
replica by the replicas' `record_routing_stats`, then by Serve's queue lengths.

A pinned replica that is gone (scaled down, died) is not waited for: the call goes to any live
replica, which refuses it (`check_pin`), so the Router's fault path migrates the request by its
token ids at once. The Router also learns the live replica set from here (`live_replicas`), to
keep a view of each one.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.request_router import RequestRouter

PIN_PREFIX = "pdd-replica:"
# by import path, not the class object (which Serve would pickle by value)
ROUTER_CLASS = "pdd_serve.serve.pinning.PinnedRequestRouter"

# (app, deployment) -> the ids of its running replicas, as this process's request router last
# heard from the controller. Written by the router's event loop, read by the Router's: a tuple
# assignment is atomic.
_live: dict[tuple[str, str], tuple[str, ...]] = {}
_stats: dict[tuple[str, str], dict[str, dict]] = {}  # the replicas' routing stats, same source


class ReplicaGone(RuntimeError):
    """A call pinned to a replica reached another: the pinned one is gone (scaled down or died)."""


def pin(replica: str) -> str:
    """The handle `session_id` that routes a call to `replica`."""
    return PIN_PREFIX + replica


def pinned_replica(session_id: str | None) -> str | None:
    if session_id and session_id.startswith(PIN_PREFIX):
        return session_id[len(PIN_PREFIX):]
    return None


def rank_replicas(pinned: str | None, stats: Mapping[str, Mapping[str, Any] | None]) -> list[list[str]]:
    """Replica ids in ranks, most preferred first (Serve takes the shortest queue within a rank).

    Pinned: only that replica, or every replica when it is gone (one of them refuses the call at
    once). Unpinned: the least loaded by the replicas' routing stats (`running / capacity`); a
    replica with no stats yet ranks with the least loaded (it is new, and likely empty)."""
    ids = sorted(stats)
    if pinned is not None:
        return [[pinned]] if pinned in stats else [ids]

    def load(r: str) -> float:
        s = stats[r] or {}
        return s.get("running", 0) / max(1, s.get("capacity", 1))

    if not ids:
        return []
    best = min(load(r) for r in ids)
    first = [r for r in ids if load(r) <= best]
    rest = [r for r in ids if r not in first]
    return [first, rest] if rest else [first]


def live_replicas(app: str, deployment: str) -> tuple[str, ...] | None:
    """The running replicas of a deployment, as this process's request router knows them (None
    before the first call through a handle to it has started the router)."""
    return _live.get((app, deployment))


def replica_stats(app: str, deployment: str) -> dict[str, dict]:
    """Each live replica's routing stats (`record_routing_stats`), as last broadcast by the
    controller (every `request_routing_stats_period_s`); empty before the router started."""
    return _stats.get((app, deployment), {})


def replica_actors(app: str, deployment: str) -> dict[str, str]:
    """{replica id: actor name} of a deployment's live replicas (a driver, a test or the soak
    addresses each replica this way: `pinned_handle`, `ray.get_actor(name, namespace="serve")`)."""
    import ray

    # Serve names replica actors SERVE_REPLICA::<app>#<deployment>#<replica id>, in namespace "serve"
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == "serve" and a["name"].startswith(prefix)]
    return {n[len(prefix):]: n for n in names}


def pinned_handle(app: str, deployment: str, replica: str) -> Any:
    """A Serve handle whose every call goes to `replica` (outside the graph: tests, the soak)."""
    from ray import serve

    return serve.get_deployment_handle(deployment, app).options(session_id=pin(replica))


def this_replica() -> str:
    """This replica's id, the one pins name; outside Serve (a unit test), a fresh one."""
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - no replica context: Serve raises RayServeException
        return f"local-{uuid.uuid4().hex[:8]}"


def current_pin() -> str | None:
    """The replica the call being served was pinned to (None: unpinned)."""
    from ray.serve.context import _get_serve_request_context

    return pinned_replica(_get_serve_request_context().session_id)


def check_pin(replica: str) -> None:
    """Refuse a call pinned to another replica: that replica is gone and this one does not hold
    the request (the Router migrates it by token ids)."""
    want = current_pin()
    if want is not None and want != replica:
        raise ReplicaGone(f"the call was pinned to replica {want}, which is gone (scaled down or died); "
                          f"replica {replica} does not hold the request")


class PinnedRequestRouter(RequestRouter):
    """Serve's request router for MainDecode, Prefill (the Router's per-replica `line_state`
    polls are pinned) and Relay (whose routing stats give the pool's load): pins by `session_id`,
    else least loaded. Set in each deployment's `@serve.deployment(request_router_config=...)`."""

    def update_replicas(self, replicas: Sequence[Any]) -> None:
        super().update_replicas(replicas)
        # through the imported module, not this class's globals: Serve may hand this process a
        # by-value copy of the class, whose globals would be a registry nobody reads
        reg = importlib.import_module("pdd_serve.serve.pinning")
        key = (self._deployment_id.app_name, self._deployment_id.name)
        stats = {r.replica_id.unique_id: dict(r.routing_stats or {}) for r in replicas}
        reg._stats[key] = stats
        reg._live[key] = tuple(sorted(stats))

    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        session = None
        if pending_request is not None:
            session = pending_request.metadata.session_id
            # these ranks are the whole choice: if none can take the call now, Serve must back off
            # before asking again (without this its routing loop spins and starves the process)
            pending_request.routing_context.should_backoff = True
        ranks = rank_replicas(pinned_replica(session), {i: r.routing_stats for i, r in by_id.items()})
        return [[by_id[i] for i in rank] for rank in ranks]
