"""The blind prediction (issue 40): capacity from the scenario alone, with the compare's search;
and BCR priced whole, with the line, at market and relative prices."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from evaluations.capacity import CapacitySearch, Probe
from evaluations.capacity_compare import (
    CAPACITY_GRAPHS,
    CapacityConfig,
    GraphProbes,
    agentic_spec,
    capacity_headline,
    gap_s,
    placeholder_answers,
    probe_requests,
)
from evaluations.loadgen import RequestRecord
from evaluations.open_loop import at_rate, probe_load
from evaluations.sim.blind import block_ids, predict_capacity, rel_err_to_bracket, sim_workload, with_overhead
from evaluations.sim.emulated import cost_per_hour, load_scenario, sim_scenario_for


@pytest.fixture(scope="module")
def scenario():
    return load_scenario("emulated_70b")


@pytest.fixture(scope="module")
def graphs(scenario, tmp_path_factory):
    from evaluations.harness import for_repeat, prepare_graphs

    out = tmp_path_factory.mktemp("graphs")
    return [for_repeat(g, 0) for g in prepare_graphs(CAPACITY_GRAPHS, out, 8000, scenario.link, False, emulate=scenario)]


def test_block_ids_share_exactly_the_shared_prefix() -> None:
    ids: dict[int, int] = {}
    a = block_ids(list(range(3, 67)), 16, ids)  # 4 blocks
    b = block_ids(list(range(3, 35)) + [9] * 40, 16, ids)  # the first 2 shared, then new
    assert len(a) == 4 and len(b) == 4 and a[:2] == b[:2] and not set(a[2:]) & set(b[2:])
    assert block_ids(list(range(3, 67)), 16, ids) == a  # the same prompt, the same ids


def test_the_decoder_caches_prompt_and_answer_so_a_later_turn_hits_it(scenario) -> None:
    pl = probe_load(agentic_spec(scenario, 30, 0), placeholder_answers)
    wl = sim_workload(at_rate(pl, 1.0, gap_s(scenario)), 16, pl.answers)
    by_first = {r.blocks[:8]: r for r in wl.requests if r.decoded_blocks}
    appended = 0
    for r in wl.requests:
        assert len(r.decoded_blocks) >= len(r.blocks)
        assert r.decoded_blocks[: len(r.blocks)] == r.blocks  # the prompt first, then the answer
    for s in pl.workload.sessions:  # a turn appending to the whole context starts with the answer's blocks
        for k in range(1, len(s.turns)):
            if s.turns[k].reset_to is None:
                appended += 1
    assert appended and by_first


def test_blind_capacity_brackets_within_the_gap_and_uses_no_records(scenario, graphs) -> None:
    # blind: nothing measured goes in (no records, no hits, no bytes): the signature says so
    assert not {"rows", "records", "fixed_wan_bytes"} & set(inspect.signature(predict_capacity).parameters)
    sim = with_overhead(sim_scenario_for(scenario, graphs), 0.01)
    cap = CapacityConfig()
    search = dataclasses.replace(cap.search, step=2.0, max_probes=20)

    def probe_at(rate: float):
        pl = probe_load(agentic_spec(scenario, probe_requests(scenario, cap, rate), 0), placeholder_answers)
        return sim_workload(at_rate(pl, rate, gap_s(scenario)), 16, pl.answers)

    out = predict_capacity(sim, "pd_same_dc", probe_at, search, 2.0)
    met, missed = out["capacity_bracket"]
    assert met is not None and missed is not None and met < missed <= 1.1 * met
    assert all(p["n"] >= 100 for p in out["probes"])


def test_probe_size_keeps_the_load_steady(scenario) -> None:
    cap = CapacityConfig()
    assert probe_requests(scenario, cap, 0.1) == 100
    turns = scenario.workload["turns"]
    assert probe_requests(scenario, cap, 20.0) >= 20.0 * turns * gap_s(scenario)  # starts span a session


def test_relative_error_is_the_distance_to_the_measured_bracket() -> None:
    assert rel_err_to_bracket(1.05, 1.0, 1.1) == 0.0
    assert rel_err_to_bracket(0.9, 1.0, 1.1) == pytest.approx(0.1)
    assert rel_err_to_bracket(1.21, 1.0, 1.1) == pytest.approx(0.11)
    assert rel_err_to_bracket(None, 1.0, 1.1) is None


def _records(n: int, ok: int, rate: float) -> list[RequestRecord]:
    out = []
    for i in range(n):
        r = RequestRecord(f"s{i}#0", 0, "agentic", 100, 0.9, 4, i / rate)
        if i < ok:
            r.status, r.ttft_s, r.tpot_s, r.token_ids, r.e2e_s = 200, 0.1, 0.01, [5, 6, 7, 8], 0.2
        else:
            r.status, r.error = 503, "HTTP 503: overloaded"
        out.append(r)
    return out


def test_headline_prices_every_chip_whole_and_the_line(scenario, graphs, tmp_path) -> None:
    cap = CapacityConfig(search=CapacitySearch(min_requests=10), requests=10)
    rates = {"pd_same_dc": (2.0, 2.2), "pd_cross_dc": (1.0, 1.1), "pdd": (1.5, 1.65)}
    out = {}
    for g in graphs:
        gp = GraphProbes(g)
        met, missed = rates[g.name]
        for rate, ok in ((met, 10), (missed, 5)):
            recs = _records(10, ok, rate)
            gp.records[rate] = recs
            gp.probes.append(Probe(rate, 10, ok / 10, 10 - ok))
        gp.common_rate = gp.records[met] if g.name != "pd_same_dc" else None
        out[g.name] = gp
    blind = {"pd_same_dc": {"capacity_rps": 2.1}, "pd_cross_dc": {"capacity_rps": 0.9}, "pdd": {"capacity_rps": 1.5}}
    h = capacity_headline(scenario, out, blind, cap)
    assert h["emulated"] is True and h["scenario"] == "emulated_70b" and h["context_scale"] == 1
    g = h["graphs"]
    for name, (met, missed) in rates.items():
        assert g[name]["capacity_bracket"] == [met, missed] and g[name]["capacity_rps"] == met
        cost = cost_per_hour(next(x.cfg for x in graphs if x.name == name))
        assert g[name]["cost_per_hour"] == pytest.approx(cost, abs=1e-3)
        assert g[name]["bcr"] == pytest.approx(met * 3600 / cost, rel=1e-3)
        assert g[name]["probes"][1]["shed_503"] == 5
    want = (1.5 / g["pdd"]["cost_per_hour"]) / (2.0 / g["pd_same_dc"]["cost_per_hour"]) - 1
    assert h["bcr_gain_vs_same_dc"] == pytest.approx(want, abs=1e-3)
    assert h["bcr_gain_vs_same_dc_b_1.2x_a"] != h["bcr_gain_vs_same_dc"]  # B repriced at 1.2 x A
    assert h["blind_capacity_max_rel_err"] == pytest.approx(0.1, abs=1e-3)  # cross-DC: 0.9 against [1.0, 1.1)
    assert h["p90_ttft_vs_cross_dc_at_rate"] == pytest.approx(1.0)
    assert h["outputs_identical"] is True and h["errors"] == 0
    assert set(h["deployments"]["pdd"]["replicas"]) == {"prefill", "relay", "main_decode"}
    assert h["graphs"]["pdd"]["pool_tokens_emulated"]["main_decode"] > 0
    assert set(h["blind"]) == {"pd_same_dc", "pd_cross_dc", "pdd"} and h["blind"]["pdd"]["capacity_rps"] == 1.5
    # what a run prints and keeps: the table, the attainment plot, every probe's records
    from evaluations.capacity_compare import attainment_plot, capacity_table, write_probe_records

    table = capacity_table(h)
    assert "pd_cross_dc" in table and "BCR b_1.2x_a" in table
    assert attainment_plot(h, tmp_path / "a.png").stat().st_size > 0
    import pyarrow.parquet as pq

    t = pq.read_table(write_probe_records(out, tmp_path / "r.parquet"))
    assert t.num_rows == 60 and {"graph", "rate"} <= set(t.column_names)


def test_scenario_capacity_block_is_checked(scenario) -> None:
    assert CapacityConfig.of({"requests": 120}).requests == 120
    with pytest.raises(ValueError, match="capacity.probes_per: unknown key"):
        CapacityConfig.of({"probes_per": 3})
    with pytest.raises(ValueError, match="max_gap"):
        CapacityConfig.of({"max_gap": 2})


def test_a_one_rate_run_reports_what_it_measured_not_a_capacity(scenario, graphs) -> None:
    """`measure:` (report_64k): one probe per graph gives attainment and latencies at that rate; the
    capacity and the measured BCR gains, which a single probe can't bracket, are left empty, and
    the blind prediction's stay."""
    from evaluations.capacity_compare import one_rate, one_rate_table

    cap = CapacityConfig(search=CapacitySearch(min_requests=10), requests=10)
    out = {}
    for g in graphs:
        gp = GraphProbes(g)
        ok = 12 if g.name != "pd_cross_dc" else 8
        gp.records[0.07] = _records(12, ok, 0.07)
        gp.probes.append(Probe(0.07, 12, ok / 12, 12 - ok))
        out[g.name] = gp
    blind = {"pd_same_dc": {"capacity_rps": 0.16}, "pd_cross_dc": {"capacity_rps": 0.09}, "pdd": {"capacity_rps": 0.25}}
    h = capacity_headline(scenario, out, blind, cap)
    assert h["graphs"]["pdd"]["capacity_rps"] == 0.07  # what one met probe would claim: a capacity it isn't
    one_rate(h, out, scenario)
    for v in h["graphs"].values():
        assert v["capacity_rps"] is None and v["bcr"] is None and v["blind_rel_err"] is None
        assert v["at_rate"]["rate_rps"] == 0.07 and v["at_rate"]["n"] == 12
        assert v["at_rate"]["ttft_p90_s"] is not None
    assert h["graphs"]["pd_cross_dc"]["at_rate"]["attainment"] == pytest.approx(8 / 12, abs=1e-4)
    assert h["graphs"]["pd_cross_dc"]["at_rate"]["met_sla"] is False and h["graphs"]["pdd"]["at_rate"]["met_sla"] is True
    assert h["bcr_gain_vs_same_dc"] is None and h["blind_bcr_gain_vs_same_dc"] is not None
    assert h["min_requests_per_probe"] == 12
    assert "pd_cross_dc" in one_rate_table(h) and "0.67" in one_rate_table(h)
