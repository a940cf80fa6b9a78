"""LinkModel: the pure transfer-time model, its jitters and presets, and pacing of a real stream."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from pdd_serve.engine.kv import KVLayout
from pdd_serve.transport import link as link_mod
from pdd_serve.transport.flight import KVFlightClient, KVFlightServer
from pdd_serve.transport.link import (
    REFERENCE_KV_BYTES_PER_TOKEN,
    BandwidthEstimator,
    LineConfig,
    LinkModel,
    SharedLine,
)
from tests.helpers import make_blocks

MB = 1_000_000


def test_config_checks() -> None:
    for bad in (dict(bandwidth_bps=0), dict(bandwidth_bps=float("inf")), dict(one_way_latency_s=-1),
                dict(jitter="gaussian"), dict(jitter="lognormal"), dict(jitter="trace"), dict(jitter="stalls"),
                dict(stalls=((1.0, 0.0),)), dict(trace_kind="x"), dict(epoch_s=0), dict(trace=(-1.0,))):
        with pytest.raises(ValueError):
            LineConfig(**bad)  # type: ignore[arg-type]
    cfg = LineConfig(jitter="trace:/some/file.csv")  # config.py's shorthand
    assert cfg.jitter == "trace" and cfg.trace_path == "/some/file.csv"
    with pytest.raises(ValueError):
        LinkModel(bandwidth_bps=1e9, jitter="trace", trace=(0.0, 0.0), trace_kind="throughput")


def test_constant_transfer_time_is_latency_plus_serialization() -> None:
    m = LinkModel(bandwidth_bps=8e9, one_way_latency_s=0.02)
    assert m.transfer_time(MB) == pytest.approx(0.02 + 8e6 / 8e9)
    assert m.transfer_time(MB, at=123.4) == pytest.approx(m.transfer_time(MB))
    assert m.transfer_time(0) == pytest.approx(0.02)
    assert LinkModel.preset("same_dc").transfer_time(10**12) == 0.0


def test_lognormal_is_pure_and_seeded() -> None:
    a = LinkModel(bandwidth_bps=1e9, jitter="lognormal", sigma=0.5, seed=7)
    b = LinkModel(bandwidth_bps=1e9, jitter="lognormal", sigma=0.5, seed=7)
    pts = [(50 * MB, t * 0.37) for t in range(200)]
    fwd = [a.transfer_time(n, t) for n, t in pts]
    rev = [b.transfer_time(n, t) for n, t in reversed(pts)][::-1]  # another call order, another object
    assert fwd == rev == [a.transfer_time(n, t) for n, t in pts]
    other = LinkModel(bandwidth_bps=1e9, jitter="lognormal", sigma=0.5, seed=8)
    assert fwd != [other.transfer_time(n, t) for n, t in pts]
    one_epoch = [a.transfer_time(MB, float(k)) for k in range(400)]  # 8 ms nominal, inside one epoch
    med = sorted(one_epoch)[200] / 0.008
    assert 1.0 < med < 1.3  # median time factor exp(sigma^2 / 2) = 1.13: bandwidth_bps is the mean rate
    assert max(one_epoch) / min(one_epoch) > 3  # and it does fluctuate


def test_phase_replays_the_line_from_a_later_point_of_its_jitter() -> None:
    """phase_s: the model at time t is the line at t + phase_s (the simulator replays a real run
    from the link time its requests met), for transfer times and carried bytes alike."""
    kw = dict(bandwidth_bps=1e9, jitter="lognormal", sigma=0.5, seed=3, epoch_s=1.0)
    line, shifted = LinkModel(**kw), LinkModel(**kw, phase_s=7.3)
    for at in (0.0, 0.2, 0.69, 1.5, 4.0):
        assert shifted.transfer_time(300 * MB, at) == pytest.approx(line.transfer_time(300 * MB, at + 7.3))
        assert shifted.capacity_bytes(at, at + 2.5) == pytest.approx(line.capacity_bytes(at + 7.3, at + 9.8))
    assert shifted.transfer_time(300 * MB, 0.0) != pytest.approx(line.transfer_time(300 * MB, 0.0))
    stalled = LinkModel(bandwidth_bps=8e6, jitter="stalls", stalls=[(10.0, 2.0)], phase_s=9.5)
    assert stalled.transfer_time(MB, 0.0) == pytest.approx(3.0)  # 0.5 s, the stall's 2 s, 0.5 s
    with pytest.raises(ValueError, match="phase_s"):
        LineConfig(bandwidth_bps=1e9, phase_s=-1.0)


def test_lognormal_bandwidth_is_the_mean_rate() -> None:
    """A saturated sender moves bandwidth_bps on average (factors have mean 1, not median 1), and
    capacity_bytes is arrival_end's inverse (what the simulator shares among streams)."""
    for sigma in (0.3, 1.0):
        m = LinkModel(bandwidth_bps=8e6, jitter="lognormal", sigma=sigma, epoch_s=1.0, seed=3)
        assert m.capacity_bytes(0.0, 20_000.0) / 20_000.0 == pytest.approx(1e6, rel=0.03)
        end = m.arrival_end(2.5, 7 * MB)
        assert m.capacity_bytes(2.5, end) == pytest.approx(7 * MB, rel=1e-9)
    assert LinkModel(bandwidth_bps=8e6).capacity_bytes(1.0, 3.0) == pytest.approx(2 * MB)
    report = LinkModel.preset("pdd_report")  # calibrated on its median: 4 Gbps
    assert report.transfer_time(50 * MB, 0.0) > 0 and report.bandwidth_bps == pytest.approx(4e9 * 1.6487, rel=1e-4)


def test_trace_file_delay_and_throughput(tmp_path: Path) -> None:
    f = tmp_path / "trace.csv"
    f.write_text("t,value\n0,0.5\n1,0.0\n# comment\n2,2.0\n")
    d = LinkModel(bandwidth_bps=8e6, one_way_latency_s=0.1, jitter="trace", trace_path=str(f))
    assert d.transfer_time(MB, at=0.2) == pytest.approx(0.1 + 0.5 + 1.0)  # extra delay of epoch 0
    assert d.transfer_time(MB, at=1.5) == pytest.approx(0.1 + 1.0)
    assert d.transfer_time(MB, at=3.0) == pytest.approx(0.1 + 0.5 + 1.0)  # the trace cycles
    lines = tmp_path / "tp.txt"
    lines.write_text("1.0\n0.5\n")
    tp = LinkModel(bandwidth_bps=8e6, jitter="trace", trace_path=str(lines), trace_kind="throughput")
    # 1 MB at 1 MB/s: epoch 0 moves 1 MB in 1 s; from 0.5 s: 0.5 MB in epoch 0, 0.5 MB at half speed = 1 s
    assert tp.transfer_time(MB, at=0.0) == pytest.approx(1.0)
    assert tp.transfer_time(MB, at=0.5) == pytest.approx(1.5)


def test_stalls() -> None:
    m = LinkModel(bandwidth_bps=8e6, jitter="stalls", stalls=[(1.0, 2.0), (10.0, 1.0)])
    assert m.transfer_time(MB, at=0.0) == pytest.approx(1.0)  # done right as the stall starts
    assert m.transfer_time(2 * MB, at=0.0) == pytest.approx(4.0)  # 1 s, stalled 2 s, 1 s
    assert m.transfer_time(MB, at=1.5) == pytest.approx(2.5)  # starts inside the stall
    assert m.transfer_time(MB, at=5.0) == pytest.approx(1.0)


def test_presets_and_scaling() -> None:
    assert LinkModel.preset("wan_10g").bandwidth_bps == 10e9
    assert LinkModel.preset("wan_100g").bandwidth_bps == 100e9
    assert not LinkModel.preset("same_dc").config.paced
    with pytest.raises(ValueError):
        LinkModel.preset("moon")
    small = LinkModel.preset("pdd_report", kv_bytes_per_token=2048)
    flagship = LinkModel.preset("pdd_report")
    for tokens, at in ((100, 0.0), (6400, 3.3), (65536, 17.0)):  # same token count -> same time
        assert small.transfer_time(tokens * 2048, at) == pytest.approx(
            flagship.transfer_time(tokens * REFERENCE_KV_BYTES_PER_TOKEN, at))
    times = [flagship.transfer_time(65536 * REFERENCE_KV_BYTES_PER_TOKEN, a * 0.7) for a in range(500)]
    assert 1.0 < sorted(times)[250] < 20.0 and max(times) > 3 * min(times)  # docs/pdd.md: 1-20 s, fluctuating
    assert LinkModel.preset("wan_10g", one_way_latency_s=0.0).config.one_way_latency_s == 0.0


def test_pacing_matches_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a fake clock: a backlogged sender takes exactly transfer_time; an idle gap pays latency again."""
    now = [0.0]
    monkeypatch.setattr(link_mod.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    m = LinkModel(bandwidth_bps=8e6, one_way_latency_s=0.05, jitter="stalls", stalls=[(0.5, 0.25)],
                  timer=lambda: now[0])
    for _ in range(10):
        m.pace_sync(100_000)
    assert now[0] == pytest.approx(m.transfer_time(MB, 0.0)) == pytest.approx(0.05 + 1.0 + 0.25)
    now[0] += 1.0  # idle
    t0 = now[0]
    m.pace_sync(100_000)
    assert now[0] - t0 == pytest.approx(m.transfer_time(100_000, t0))
    assert asyncio.run(LinkModel(bandwidth_bps=8e9).pace(1000)) >= 0  # the async form runs too
    assert LinkModel.preset("same_dc").pace_sync(10**9) == 0.0


def test_concurrent_streams_share_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small transfer that starts while a big one is crossing waits for a fair share of the line
    (as TCP flows share it), not for the big one's whole batch; both pay the latency once."""
    import contextvars

    now = [0.0]
    m = LinkModel(bandwidth_bps=8e6, one_way_latency_s=0.05, timer=lambda: now[0])  # 1 MB/s
    big, small = contextvars.copy_context(), contextvars.copy_context()  # two streams
    q = link_mod.PACE_QUANTUM_BYTES
    # a stream's record of another (or a dead) model never chains this one's
    older = LinkModel(bandwidth_bps=8e3, one_way_latency_s=1.0, timer=lambda: now[0])
    assert big.run(older._reserve, q) > 60
    # the big stream books its first quantum of a 1 MB batch; the small one arrives meanwhile
    assert big.run(m._reserve, q) == pytest.approx(0.05 + q / 1e6)
    now[0] = 0.01
    done_small = now[0] + small.run(m._reserve, q)
    # it lands right after the big stream's quantum in flight, not after its whole 1 MB batch
    assert done_small == pytest.approx(0.05 + 2 * q / 1e6)
    assert done_small < 0.05 + 1.0
    # the big stream's next quantum queues behind it: the line alternates between the two
    now[0] = 0.05 + q / 1e6
    assert now[0] + big.run(m._reserve, q, True) == pytest.approx(0.05 + 3 * q / 1e6)


class _Answered:
    """A booking call that has its answer (a Serve DeploymentResponse's `result`)."""

    def __init__(self, value) -> None:  # noqa: ANN001
        self.value = value

    def result(self, timeout_s: float | None = None):  # noqa: ANN201
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


def _sender(ledger: LinkModel, name: str, **kw) -> SharedLine:  # noqa: ANN003
    """A Prefill replica's side of the one line: its own link object (as another process has),
    booking every byte on the shared ledger."""
    local = LinkModel(ledger.config, **kw)
    return SharedLine(local, lambda flow, n, chained: _Answered(ledger.book(flow, n, chained)), name)


def test_two_senders_share_one_line() -> None:
    """Two Prefill replicas' transfers at once take the line's rate between them, not each the
    whole line (a second replica must not bring a second line's bandwidth). Lower bounds only:
    pacing never finishes early, whatever the machine's load."""
    ledger = LinkModel(bandwidth_bps=8e6, one_way_latency_s=0.01)  # 1 MB/s
    a, b = _sender(ledger, "p0"), _sender(ledger, "p1")
    t0 = time.monotonic()
    a.pace_sync(300_000)  # alone: the line's rate
    assert time.monotonic() - t0 >= 0.3 and a.shared == 0
    time.sleep(0.05)  # past burst_gap_s: the next transfers start afresh
    done: dict[str, float] = {}

    def push(s: SharedLine) -> None:
        s.pace_sync(300_000)
        done[s.name] = time.monotonic()

    t0 = time.monotonic()
    threads = [threading.Thread(target=push, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 600 KB on a 1 MB/s line: the last lands after 0.6 s; on two lines each would land at 0.3 s
    assert max(done.values()) - t0 >= 0.6
    assert a.shared > 0 and b.shared > 0  # each met the other's stream: neither feeds the estimate
    assert a.errors == b.errors == 0


def test_a_shared_line_counts_emulated_bytes_keeps_the_line_clock_and_survives_its_ledger() -> None:
    ledger = LinkModel(bandwidth_bps=8e6)
    time.sleep(0.2)  # the Line replica started before this sender
    s = _sender(ledger, "p0", byte_scale=10.0)  # each real byte stands for 10 of the emulated model's
    assert s.now() < ledger.now() - 0.1  # before a booking: this sender's own clock
    s.sync_clock()
    assert s.now() == pytest.approx(ledger.now(), abs=0.05)
    t0 = time.monotonic()
    s.pace_sync(20_000)  # 200 KB on the line
    assert time.monotonic() - t0 >= 0.2
    # the ledger unreachable: the transfer paces on this sender's own line, counted, never blocked
    gone = SharedLine(LinkModel(bandwidth_bps=8e6), lambda *a: _Answered(RuntimeError("Line replica died")), "p1")
    t0 = time.monotonic()
    gone.pace_sync(100_000)
    assert gone.errors == 1 and time.monotonic() - t0 >= 0.1


def test_a_lone_sender_on_a_shared_line_paces_exactly_as_on_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a fake clock and a 2 ms booking call: back-to-back calls take the line's own time
    (each next slice is booked while the current one is waited out, and its wake-up counts from
    when it was booked), and the sender reads the line's clock, not its own."""
    now = [5.0]
    ledger = LinkModel(bandwidth_bps=8e6, one_way_latency_s=0.05, timer=lambda: now[0])  # 1 MB/s
    now[0] = 7.0  # the sender starts 2 s after the Line
    calls = []

    def book(flow: str, n: float, chained: bool) -> _Answered:
        calls.append(n)
        now[0] += 0.001  # half the call's round trip each way
        b = ledger.book(flow, n, chained)
        now[0] += 0.001
        return _Answered(b)

    s = SharedLine(LinkModel(ledger.config, timer=lambda: now[0]), book, "p0",
                   sleep=lambda dt: now.__setitem__(0, now[0] + dt))
    t0 = now[0]
    for _ in range(10):
        s.pace_sync(100_000)
    assert now[0] - t0 == pytest.approx(ledger.transfer_time(10 * 100_000), abs=0.003)  # 1.05 s
    assert len(calls) > 10  # 20 ms slices: several bookings a call
    assert s.now() == pytest.approx(ledger.now(), abs=1e-6)
    assert s.shared == 0 and s.share() == 1.0


def test_a_senders_share_of_the_line_is_by_streams_while_it_sends() -> None:
    """What Prefill's line_state drains its transfers at: its streams over every stream on the
    line at its last booking, the whole line once that slice is waited out."""
    now = [0.0]
    ledger = LinkModel(bandwidth_bps=8e6, timer=lambda: now[0])
    ledger.book("p9/1", 1_000_000)  # another replica's 1 MB on the line
    seen = []

    def sleep(dt: float) -> None:
        seen.append(s.share())
        now[0] += dt

    s = SharedLine(LinkModel(ledger.config, timer=lambda: now[0]),
                   lambda f, n, c: _Answered(ledger.book(f, n, c)), "p0", sleep=sleep)
    s.pace_sync(100_000)
    assert seen and all(x == 0.5 for x in seen) and s.shared > 0
    now[0] += 1.0
    assert s.share() == 1.0


def test_a_senders_own_streams_are_not_others_and_a_lost_ledger_is_left_alone_a_while() -> None:
    ledger = LinkModel(bandwidth_bps=8e6)
    assert (ledger.book("p0/1", 500_000).others, ledger.book("p0/2", 500_000).others) == (0, 0)  # its own streams
    b = ledger.book("p1/1", 500_000)  # another replica's stream meets both of p0's
    assert (b.others, b.mine) == (2, 1)
    calls = []

    def gone(*a) -> _Answered:  # noqa: ANN002
        calls.append(a)
        return _Answered(RuntimeError("Line replica died"))

    s = SharedLine(LinkModel(bandwidth_bps=8e9), gone, "p2")
    s.pace_sync(1000)
    s.pace_sync(1000)  # within the backoff: its own line at once, the ledger not asked again
    assert len(calls) == 1 and s.errors == 1
    s.sync_clock()  # a clock read that fails (the Line still starting) is no outage
    assert s.errors == 1


def test_real_flight_stream_holds_the_paced_rate() -> None:
    # Behavioural rate check, 10% tolerance, not a performance benchmark: the pacer must make a real
    # loopback Flight stream run at the link's configured rate over a >= 2 s transfer.
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16)  # 32 KiB blocks
    kv = make_blocks(layout, 320)  # 10.5 MB
    rate = 40e6  # bits/s -> ~2.1 s
    link = LinkModel(bandwidth_bps=rate)
    with KVFlightServer("127.0.0.1", layout=layout, token="t", max_bytes_per_request=64 << 20) as srv:
        srv.expect("paced", kv.num_blocks)
        c = KVFlightClient(srv.location, "t", layout=layout, batch_blocks=8, deadline_s=30, link=link)
        # a first unpaced push warms what a process does once (the channel, Arrow's first encode): a
        # test run alone would otherwise count ~0.3 s of it against the line's rate
        srv.expect("warm", 8)
        KVFlightClient(srv.location, "t", layout=layout, batch_blocks=8, deadline_s=30).push("warm", [make_blocks(layout, 8)])
        srv.wait_complete_sync("warm", 10)
        t0 = time.monotonic()
        c.push("paced", [kv])
        srv.wait_complete_sync("paced", 10)
        elapsed = time.monotonic() - t0
    assert elapsed >= 2.0
    assert kv.nbytes * 8 / elapsed == pytest.approx(rate, rel=0.10)


def test_bandwidth_estimator() -> None:
    est = BandwidthEstimator(alpha=0.5)
    assert est.bps is None and est.estimate_time(100) is None
    est.observe(1_000_000, 1.0)
    assert est.bps == 8e6
    est.observe(1_000_000, 0.5)
    assert est.bps == pytest.approx(0.5 * 16e6 + 0.5 * 8e6)
    assert est.estimate_time(1_500_000) == pytest.approx(1.0)
    est.observe(0, 1.0)  # ignored
    assert est.samples == 2

    shared = BandwidthEstimator(alpha=0.1, initial_bps=1e9)
    ts = [threading.Thread(target=lambda: [shared.observe(1000, 1e-3) for _ in range(500)]) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert shared.samples == 2000 and shared.bps == pytest.approx(8e6, rel=1e-3)
