"""Capacity: the highest offered rate a graph serves within its SLA (issue 40's BCR numerator).

A graph's capacity is the highest offered rate at which at least `attainment` (0.9) of the requests
meet both the TTFT and the TPOT SLO: DistServe's goodput, the report's "max RPS within SLA". A
request shed at the door (503) is an SLO miss, not an error to drop: a graph must not look better by
refusing work.

It is found with a bracket, not a point: the highest rate that met and the lowest that missed, no
more than `max_gap` (10%) apart, each probe at least `min_requests` (100) long. A short probe can't
tell 85% from 90% attainment: at 19 requests, a graph whose true attainment is 85% passes a 90% test
about one time in five.

The search is pure decisions over the probes so far (`next_rate`), so the emulated compare and the
simulator can run the same search over their own probes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from evaluations.loadgen import SLA, RequestRecord


@dataclass(frozen=True)
class CapacitySearch:
    attainment: float = 0.9  # share of a probe's requests that must meet both SLOs
    max_gap: float = 0.10  # done when the lowest miss <= (1 + max_gap) x the highest met
    min_requests: int = 100  # per probe
    step: float = 2.0  # factor per probe while only one side of the bracket is known
    max_probes: int = 12  # a search that needs more says so rather than running on

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if not 0 < self.max_gap < 1:
            raise ValueError(f"max_gap must be in (0, 1), got {self.max_gap}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests must be >= 1, got {self.min_requests}")
        if self.step <= 1 + self.max_gap:
            raise ValueError(f"step must be > 1 + max_gap ({1 + self.max_gap}), got {self.step}")
        if self.max_probes < 2:
            raise ValueError(f"max_probes must be >= 2 (a bracket needs a met and a missed probe), got {self.max_probes}")


@dataclass(frozen=True)
class Probe:
    """One offered rate, run open loop (every send time fixed before it starts)."""

    rate: float  # offered requests/s
    n: int  # requests offered
    attainment: float  # share of the n that met both SLOs; shed requests count as misses
    shed_503: int = 0  # of the n, refused at the door

    def met(self, target: float) -> bool:
        return self.attainment >= target


@dataclass(frozen=True)
class Bracket:
    met: float | None  # the highest rate that met, below every rate that missed
    missed: float | None  # the lowest rate that missed

    def tight(self, max_gap: float) -> bool:
        return self.met is not None and self.missed is not None and self.missed <= self.met * (1 + max_gap)

    @property
    def capacity(self) -> float | None:
        """The capacity the bracket vouches for: its met rate (None: no probed rate met)."""
        return self.met


def bracket(probes: Iterable[Probe], target: float) -> Bracket:
    """The tightest bracket the probes support. A rate that met above one that missed (noise, or
    a graph that isn't monotonic) doesn't raise capacity: the lowest miss bounds it."""
    probes = list(probes)
    missed = min((p.rate for p in probes if not p.met(target)), default=None)
    met = max((p.rate for p in probes if p.met(target) and (missed is None or p.rate < missed)), default=None)
    return Bracket(met, missed)


def next_rate(probes: list[Probe], cfg: CapacitySearch, start_rate: float) -> float | None:
    """The rate to probe next, or None when the bracket is tight."""
    if not probes:
        return start_rate
    b = bracket(probes, cfg.attainment)
    if b.tight(cfg.max_gap):
        return None
    if b.met is None:  # nothing met yet: step down from the lowest miss
        return b.missed / cfg.step
    if b.missed is None:  # nothing missed yet: step up from the highest met
        return b.met * cfg.step
    return math.sqrt(b.met * b.missed)  # the gap is a ratio, so halve it in log space


class SearchIncomplete(RuntimeError):
    pass


def search_capacity(probe: Callable[[float], Probe], cfg: CapacitySearch, start_rate: float,
                    log: Callable[[str], None] = lambda m: None,
                    initial: Iterable[Probe] = ()) -> tuple[Bracket, list[Probe]]:
    """Probe rates until the bracket is tight. Raises SearchIncomplete (with the probes so far)
    when `max_probes` runs out first: a bracket wider than asked is not a capacity. `initial`:
    probes already run (e.g. at a common rate fixed before the search); they count as its own."""
    if not start_rate > 0:
        raise ValueError(f"start_rate must be > 0, got {start_rate}")
    probes: list[Probe] = list(initial)  # where there are some, the bracket decides the next rate
    while (rate := next_rate(probes, cfg, start_rate)) is not None:
        if len(probes) == cfg.max_probes:
            b = bracket(probes, cfg.attainment)
            raise SearchIncomplete(f"no bracket within {cfg.max_gap:.0%} after {cfg.max_probes} probes "
                                   f"(met {b.met}, missed {b.missed}): start nearer the capacity or allow more probes")
        p = probe(rate)
        if p.n < cfg.min_requests:
            raise ValueError(f"a probe at {rate:.3g} req/s ran {p.n} requests; at least {cfg.min_requests} are needed "
                             "to tell 85% from 90% attainment")
        probes.append(p)
        log(f"probe {len(probes)}: {p.rate:.3g} req/s, n={p.n}, attainment {p.attainment:.3f}, shed {p.shed_503}")
    return bracket(probes, cfg.attainment), probes


def probe_of(rate: float, records: list[RequestRecord], sla: SLA) -> Probe:
    """A probe's figures from its request records: a 503 (or any error) is an SLO miss."""
    if not records:
        raise ValueError("a probe with no requests has no attainment")
    met = sum(sla.meets(r) for r in records)
    return Probe(rate=rate, n=len(records), attainment=met / len(records),
                 shed_503=sum(r.status == 503 for r in records))


__all__ = ["Bracket", "CapacitySearch", "Probe", "SearchIncomplete", "bracket", "next_rate", "probe_of",
           "search_capacity"]
