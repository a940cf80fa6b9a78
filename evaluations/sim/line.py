"""The simulated line: the LinkModel a scenario's link builds (pdd_serve's own, the one its
Prefill paces with), optionally under a kernel-shaped wire (`WireCap`), and a Prefill replica's
pacer shared by its concurrent streams (`SharedPacer`)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from evaluations.sim.config import SimLink
from pdd_serve.transport.link import LinkModel

if TYPE_CHECKING:  # the owner, for annotations only (it imports this module)
    from evaluations.sim.simulator import Simulation


def line_model(sl: SimLink, kv_bytes_per_token: int) -> LinkModel | WireCap:
    """The LinkModel of a scenario's link for a model of `kv_bytes_per_token`, under the kernel-
    shaped wire when the scenario gives one (`wire_bps`)."""
    link = LinkModel(sl.link.line(kv_bytes_per_token))
    if sl.wire_bps is None:
        return link
    return WireCap(link, sl.wire_bps * sl.wire_goodput / 8)


# ---------------------------------------------------------------- a kernel-shaped wire


class WireCap:
    """The LinkModel's pacing over a kernel-shaped wire (tbf): a stream gets the model's jittered
    rate, never more than the wire's goodput. Same interface as the LinkModel calls the simulator
    makes (the model itself is used unchanged underneath)."""

    def __init__(self, link: Any, wire_bytes_s: float) -> None:
        self.link, self.cap = link, wire_bytes_s
        self.config = link.config
        self.bandwidth_bps = link.bandwidth_bps

    def latency_at(self, t: float) -> float:
        return self.link.latency_at(t)

    def _segments(self, t: float):  # (start, end, bytes/s) per jitter epoch from t on
        e = self.config.epoch_s
        while True:
            end = (math.floor(t / e) + 1) * e
            yield t, end, min(self.link.capacity_bytes(t, end) / (end - t), self.cap)
            t = end

    def capacity_bytes(self, t0: float, t1: float) -> float:
        total = 0.0
        for a, b, rate in self._segments(t0):
            if a >= t1:
                return total
            total += rate * (min(b, t1) - a)
        return total

    def arrival_end(self, t: float, nbytes: float) -> float:
        if nbytes <= 0:
            return t
        for a, b, rate in self._segments(t):
            if rate * (b - a) >= nbytes:
                return a + nbytes / rate
            nbytes -= rate * (b - a)
        raise AssertionError("unreachable")

    def transfer_time(self, nbytes: int, at: float = 0.0) -> float:
        return self.arrival_end(at + self.latency_at(at), nbytes) - at


# ---------------------------------------------------------------- the paced line


class SharedPacer:
    """pdd_serve's paced line (serve/line.py), shared by every Prefill replica's concurrent Flight
    streams. Each
    stream books one quantum (`PACE_QUANTUM_BYTES`) at a time, chained on the last booked arrival,
    so concurrent streams take turns quantum by quantum: processor sharing of the link's (jittered)
    rate among STREAMS, not FIFO. A push runs on up to `streams` parallel streams, each sending
    one batch (`unit_bytes`) at a time, so a transfer of one batch has one stream's share and a
    large one up to `streams` shares (a small delta behind a cold push gets 1/3, not 1/2, at 2
    streams). Fluid model: every active flow gets capacity x its streams / all streams."""

    def __init__(self, sim: Simulation, link: Any, streams: int = 1, unit_bytes: float | None = None) -> None:
        self.sim, self.link = sim, link
        self.streams, self.unit = max(1, streams), unit_bytes
        self.done_cb: dict[int, Callable[[float], None]] = {}
        self.weight: dict[int, int] = {}
        self.heap: list[tuple[float, int]] = []  # (service per stream at which the flow is done, rid)
        self.served = 0.0  # bytes every stream active since the start has received
        self.t = 0.0
        self.ver = 0

    def streams_for(self, nbytes: float) -> int:
        if self.unit is None or self.unit <= 0:
            return self.streams
        return max(1, min(self.streams, math.ceil(nbytes / self.unit)))

    def backlog(self) -> list[int]:
        """Bytes left of each flow on the line (what the real Router's ledger estimates)."""
        self._advance(self.sim.now)
        return [max(0, int((done - self.served) * self.weight[rid])) for done, rid in self.heap]

    def _advance(self, now: float) -> None:
        if self.weight and now > self.t:
            self.served += self.link.capacity_bytes(self.t, now) / sum(self.weight.values())
        self.t = max(self.t, now)

    def add(self, rid: int, nbytes: int, on_done: Callable[[float], None]) -> None:
        now = self.sim.now
        if nbytes <= 0:
            on_done(now)
            return
        self._advance(now)
        w = self.streams_for(nbytes)
        self.done_cb[rid], self.weight[rid] = on_done, w
        heapq.heappush(self.heap, (self.served + nbytes / w, rid))
        self._schedule()

    def _schedule(self) -> None:
        self.ver += 1
        if self.heap:
            left = (self.heap[0][0] - self.served) * sum(self.weight.values())
            self.sim.at(self.link.arrival_end(self.t, max(0.0, left)), self._tick, self.ver)

    def _tick(self, ver: int) -> None:
        if ver != self.ver:
            return
        self._advance(self.sim.now)
        done = []
        while self.heap and self.heap[0][0] <= self.served * (1 + 1e-12) + 1e-6:
            rid = heapq.heappop(self.heap)[1]
            del self.weight[rid]
            done.append(self.done_cb.pop(rid))
        self._schedule()
        for cb in done:
            cb(self.sim.now)
