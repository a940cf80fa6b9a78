"""The router's view of every Main decode replica's DRC and load, kept current in the background.

Choosing an MD and a pipeline must not wait on a WAN round trip (the first token would pay it),
so MDs publish what they cache (`MDView`: block hashes, load, Flight location) and the router
answers "how many leading prompt blocks does MD i hold?" from its own copy. This is the pattern of
Ray Serve LLM's prefix-aware router (replica routing stats) and Dynamo's KV router (KV events).

The view can be stale (MD evicted a prefix, restarted, moved its Flight server); the orchestrator
learns the truth from MD's `prepare` reply, concurrently with prefill, and a stale view then costs
bytes or a resend, never a token. Pure: no Ray, unit-tested as is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from pdd_serve.policy import MDStatus
from pdd_serve.serve.messages import MDView


@dataclass
class _Entry:
    view: MDView
    hashes: frozenset[int]
    at: float  # when this view arrived
    assigned: list[float] = field(default_factory=list)  # requests this router sent since


class MDIndex:
    def __init__(self, max_age_s: float, settle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_s = max_age_s  # an MD whose view is older than this counts as unhealthy
        self.settle_s = settle_s  # a request sent this long before a view is in the view's load
        self.clock = clock
        self.entries: dict[Hashable, _Entry] = {}  # by replica key (a Serve replica id)
        self.failures: dict[Hashable, int] = {}

    def update(self, view: MDView) -> None:
        old = self.entries.get(view.replica)
        now = self.clock()
        if view.hashes is None:
            if old is None or old.view.epoch != view.epoch:
                return  # an unchanged-marker for a view we don't hold: the next poll sends it whole
            hashes = old.hashes
        else:
            hashes = frozenset(view.hashes)
        # assignments the MD's own count already includes (sent a poll period or more ago) drop out
        kept = [t for t in old.assigned if t > now - self.settle_s] if old is not None else []
        self.entries[view.replica] = _Entry(view, hashes, now, kept)
        self.failures[view.replica] = 0

    def retain(self, live: Iterable[Hashable]) -> None:
        """Forget replicas that are gone (scaled down, replaced): Serve's live set is the truth."""
        keep = set(live)
        for i in [i for i in self.entries if i not in keep]:
            del self.entries[i]
        for i in [i for i in self.failures if i not in keep]:
            del self.failures[i]

    def summary(self) -> dict:
        """Each replica's view as the router holds it (its stats): age, DRC blocks, failed polls."""
        now = self.clock()
        return {str(i): {"age_s": round(now - e.at, 3), "drc_blocks": len(e.hashes), "running": e.view.running,
                         "failures": self.failures.get(i, 0)} for i, e in self.entries.items()}

    def failed(self, i: Hashable) -> None:
        self.failures[i] = self.failures.get(i, 0) + 1

    def known_version(self, i: Hashable) -> tuple[str, int] | None:
        e = self.entries.get(i)
        return None if e is None else (e.view.epoch, e.view.version)

    @property
    def ready(self) -> bool:
        return bool(self.entries)

    def flight_location(self, i: Hashable) -> str | None:
        e = self.entries.get(i)
        return None if e is None else e.view.flight_location

    def assigned(self, i: Hashable) -> None:
        """This router sent MD i a request: count it as load until MD's own view includes it."""
        e = self.entries.get(i)
        if e is not None:
            e.assigned.append(self.clock())

    def status(self, i: Hashable, prompt_hashes: list[int]) -> MDStatus:
        e = self.entries.get(i)
        if e is None:
            return MDStatus(i, 0, 1 << 30, 1, healthy=False)
        hit = 0
        for h in prompt_hashes:
            if h not in e.hashes:
                break
            hit += 1
        fresh = self.clock() - e.at <= self.max_age_s and not self.failures.get(i)
        unit = max(1, e.view.hit_unit)
        return MDStatus(i, hit - hit % unit, e.view.running + len(e.assigned), e.view.capacity, healthy=fresh,
                        hit_unit=unit)
