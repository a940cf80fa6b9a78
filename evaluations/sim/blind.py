"""Blind prediction (issue 40): each graph's capacity from the scenario file alone, before a run.

The simulator gets what a site planner has before anything runs: the scenario (model shape, chips,
replicas, link, SLA), the probe's requests as token blocks (their prefix sharing, so the
simulator's own caches decide every hit), their lengths and fixed send times, and one software
overhead per request from a calibration step run before the measured probes. It does not get a
single measured hit, byte count, jitter phase or send time of the run it predicts (the replay in
validate.py does, and is labelled a replay). Capacity is found with the same bracket search the
compare runs (evaluations/capacity.py), on the deployment's own link seed; `draws` other seeds say
how much capacity moves with the line's luck.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from evaluations.capacity import Bracket, CapacitySearch, Probe, SearchIncomplete, search_capacity
from evaluations.sim.config import Scenario
from evaluations.sim.metrics import meets_sla
from evaluations.sim.simulator import Simulation
from evaluations.sim.validate import with_link_seed
from evaluations.sim.workload import SimRequest
from evaluations.sim.workload import Workload as SimWorkload
from evaluations.workloads import Workload
from pdd_serve.engine.blocks import block_hashes


def block_ids(tokens: list[int] | tuple[int, ...], block_size: int, ids: dict[int, int]) -> tuple[int, ...]:
    """The full blocks of `tokens` as small prefix-chain ids (equal prefixes, equal ids), as the
    engines' radix caches see them; `ids` numbers chain hashes in first-seen order (0 is the root)."""
    return tuple(ids.setdefault(h, len(ids) + 1) for h in block_hashes(list(tokens), block_size))


def sim_workload(wl: Workload, block_size: int, answers: Mapping[tuple[str, int], list[int]] | None = None,
                 context_scale: int = 1) -> SimWorkload:
    """An open-loop probe (evaluations/open_loop.py: one request per session, fixed send times) as
    the simulator's requests. With `answers`, a decoder caches the prompt and its answer when it is
    done, as the engines do, so a later turn's decode-side hit comes out of the simulation. At
    `context_scale` k a real prompt token is k of the simulator's tokens and a block k x
    `block_size` (the serving graph's costs, config.PDDConfig.context_scale); output stays 1:1."""
    if context_scale != 1 and answers:
        raise ValueError("context_scale > 1 takes single-turn requests: an answer fed back would be scaled")
    ids: dict[int, int] = {}
    reqs = []
    for rid, s in enumerate(sorted(wl.sessions, key=lambda s: s.start_s)):
        (t,) = s.turns
        prompt = list(t.tokens)
        r = SimRequest(rid, s.start_s, len(prompt) * context_scale, t.max_tokens, block_ids(prompt, block_size, ids),
                       "anomalous" if t.kind == "anomalous" else "normal")
        sid, _, k = s.session_id.rpartition("#")
        ans = (answers or {}).get((sid, int(k))) if sid else None
        if ans is not None:  # the last generated token has no KV yet: the engines cache one less
            r.decoded_blocks = block_ids(prompt + list(ans)[:-1], block_size, ids)
        reqs.append(r)
    warm = [(0, block_ids(list(w.turns[0].tokens), block_size, ids)) for w in wl.warmup]
    return SimWorkload(reqs, warm, block_size * context_scale, f"{wl.name}: {len(reqs)} open-loop requests")


def probe_in_sim(sc: Scenario, graph: str, wl: SimWorkload) -> Probe:
    sim = Simulation(sc, sc.deployments[graph], wl)
    reqs = sim.run()
    met = sum(meets_sla(r, sc.sla) for r in reqs)
    return Probe(rate=0.0, n=len(reqs), attainment=met / len(reqs))


def with_overhead(sc: Scenario, request_overhead_s: float) -> Scenario:
    return dataclasses.replace(sc, scheduler=dataclasses.replace(sc.scheduler, request_overhead_s=request_overhead_s))


def predict_capacity(sc: Scenario, graph: str, probe_at: Callable[[float], SimWorkload], search: CapacitySearch,
                     start_rate: float, seed: int | None = None, draws: int = 0) -> dict[str, Any]:
    """The graph's blind capacity bracket on link seed `seed` (None: same site), and over `draws`
    other seeds (the line's luck). `probe_at(rate)`: the probe's requests at that rate."""

    def one(scx: Scenario) -> tuple[Bracket, list[Probe]]:
        def probe(rate: float) -> Probe:
            return dataclasses.replace(probe_in_sim(scx, graph, probe_at(rate)), rate=rate)

        try:
            return search_capacity(probe, search, start_rate)
        except SearchIncomplete as e:
            raise SearchIncomplete(f"{graph}: {e}") from None

    base = sc if seed is None else with_link_seed(sc, graph, seed)
    b, probes = one(base)
    out: dict[str, Any] = {"capacity_rps": b.capacity, "capacity_bracket": [b.met, b.missed],
                           "probes": [dataclasses.asdict(p) for p in probes], "link_seed": seed}
    if seed is not None and draws:
        caps = [one(with_link_seed(sc, graph, seed + 1000 + i))[0].capacity or 0.0 for i in range(draws)]
        out["capacity_over_draws"] = {"draws": draws, "min": min(caps), "median": statistics.median(caps),
                                      "max": max(caps)}
    return out


def rel_err_to_bracket(pred: float | None, met: float | None, missed: float | None) -> float | None:
    """How far a predicted capacity lies outside the measured bracket [met, missed), relative to
    the bracket's met rate (0 inside it)."""
    if pred is None or met is None:
        return None
    if pred < met:
        return (met - pred) / met
    if missed is not None and pred >= missed:
        return (pred - missed) / met
    return 0.0


__all__ = ["block_ids", "predict_capacity", "probe_in_sim", "rel_err_to_bracket", "sim_workload", "with_overhead"]
