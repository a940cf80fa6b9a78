"""The capacity search (evaluations/capacity.py) on synthetic graphs: a bracket within 10% around
the true capacity, sheds counted as misses, and a search that can't finish says so."""

from __future__ import annotations

import math
import random

import pytest

from evaluations.capacity import (
    Bracket,
    CapacitySearch,
    Probe,
    SearchIncomplete,
    bracket,
    next_rate,
    probe_of,
    search_capacity,
)
from evaluations.loadgen import SLA, RequestRecord


def _graph(capacity: float, n: int = 100, seed: int = 0, noise: float = 0.0):
    """A synthetic graph: attainment falls from 1 to 0 around `capacity` (0.9 exactly there),
    each probe's attainment drawn from n Bernoulli requests when noise is on."""
    rng = random.Random(seed)
    calls: list[float] = []

    def probe(rate: float) -> Probe:
        calls.append(rate)
        p = 1 / (1 + math.exp(12 * (rate / capacity - 1) - math.log(9)))  # 0.9 at rate == capacity
        att = sum(rng.random() < p for _ in range(n)) / n if noise else p
        return Probe(rate=rate, n=n, attainment=att, shed_503=int(n * (1 - att) / 2))

    return probe, calls


@pytest.mark.parametrize("start", [0.05, 0.7, 1.0, 3.0, 40.0])
def test_the_bracket_holds_the_true_capacity_within_ten_percent(start):
    probe, calls = _graph(capacity=1.0)
    cfg = CapacitySearch()
    b, probes = search_capacity(probe, cfg, start_rate=start)
    assert b.met is not None and b.missed is not None
    assert b.met <= 1.0 + 1e-9 and b.missed >= 1.0 - 1e-9  # exactly 1.0 sits on the 0.9 edge
    assert b.missed <= b.met * 1.10
    assert b.capacity == b.met and [p.rate for p in probes] == calls
    assert len(probes) <= cfg.max_probes


def test_next_rate_steps_up_then_down_then_halves_the_ratio():
    cfg = CapacitySearch(step=2.0)
    assert next_rate([], cfg, 1.5) == 1.5
    assert next_rate([Probe(1.0, 100, 0.95)], cfg, 1.0) == 2.0  # nothing missed: up
    assert next_rate([Probe(1.0, 100, 0.5)], cfg, 1.0) == 0.5  # nothing met: down
    assert next_rate([Probe(1.0, 100, 0.95), Probe(2.0, 100, 0.5)], cfg, 1.0) == pytest.approx(math.sqrt(2))
    assert next_rate([Probe(1.0, 100, 0.95), Probe(1.09, 100, 0.5)], cfg, 1.0) is None  # tight


def test_a_met_probe_above_a_miss_does_not_raise_capacity():
    probes = [Probe(1.0, 100, 0.92), Probe(1.2, 100, 0.85), Probe(1.5, 100, 0.91)]
    assert bracket(probes, 0.9) == Bracket(met=1.0, missed=1.2)


def test_a_noisy_graph_still_ends_in_a_tight_bracket():
    for seed in range(5):
        probe, _ = _graph(capacity=2.0, n=200, seed=seed, noise=1.0)
        b, probes = search_capacity(probe, CapacitySearch(), start_rate=1.0)
        assert b.tight(0.10) and 1.6 < b.met < 2.4, (seed, probes)


def test_a_search_that_runs_out_of_probes_says_so_rather_than_reporting_a_wide_bracket():
    probe, calls = _graph(capacity=1000.0)
    with pytest.raises(SearchIncomplete, match="no bracket within 10% after 3 probes"):
        search_capacity(probe, CapacitySearch(max_probes=3), start_rate=1.0)
    assert calls == [1.0, 2.0, 4.0]


def test_a_probe_shorter_than_the_minimum_is_refused():
    with pytest.raises(ValueError, match="ran 19 requests; at least 100"):
        search_capacity(lambda r: Probe(r, 19, 1.0), CapacitySearch(), start_rate=1.0)


def test_a_shed_request_is_an_slo_miss():
    sla = SLA(ttft_s=1.0, tpot_s=0.1)
    ok = RequestRecord("s", 0, "x", status=200, ttft_s=0.5, tpot_s=0.05)
    slow = RequestRecord("s", 1, "x", status=200, ttft_s=1.5, tpot_s=0.05)
    shed = RequestRecord("s", 2, "x", status=503, error="overloaded")
    p = probe_of(2.0, [ok, ok, slow, shed], sla)
    assert p == Probe(rate=2.0, n=4, attainment=0.5, shed_503=1)
    with pytest.raises(ValueError, match="no requests"):
        probe_of(1.0, [], sla)


@pytest.mark.parametrize("kw, msg", [({"attainment": 0}, "attainment"), ({"max_gap": 0}, "max_gap"),
                                     ({"min_requests": 0}, "min_requests"), ({"step": 1.05}, "step"),
                                     ({"max_probes": 1}, "max_probes")])
def test_bad_search_settings_are_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        CapacitySearch(**kw)
