"""LinkModel: the inter-site link (bandwidth, one-way latency, jitter), real and simulated.

One object serves two worlds (docs/design.md): the Flight client calls `pace_sync(nbytes)` /
`await pace(nbytes)` before each batch so a loopback stream behaves like the WAN, and the
simulator calls the pure `transfer_time(nbytes, at)` for the same link.

The model, in *arrival* time: the first byte of a burst arrives `latency(at)` after it is sent;
bytes then arrive at `bandwidth_bps * factor(t)`. Conditions change per `epoch_s` epoch:
- constant:  factor 1, no extra delay.
- lognormal: factor `exp(-sigma * z_k - sigma^2 / 2)`, z_k ~ N(0,1) drawn in epoch order from
             `seed` (deterministic per seed): its MEAN is 1, so `bandwidth_bps` is the long-run
             rate of a saturated link (what a line's capacity, the Router's seed estimate and
             `pdd plan` assume); its median is exp(-sigma^2 / 2) (0.96 at sigma 0.3, 0.61 at 1.0).
             Without the correction a sigma-1 link would carry 1.65x its configured rate.
- trace:     one number per epoch (cycled) from a CSV (last column) or one-number-per-line file,
             either `extra delay seconds` (trace_kind="delay") or `throughput factor`
             (trace_kind="throughput").
- stalls:    scripted (at_s, duration_s) windows in which nothing moves (factor 0).
Bandwidths are bits per second of KV payload.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdd_serve.emulation.clock import Clock

# Concurrent streams interleave on the paced line at this grain, as TCP flows share a real line:
# a small delta started behind a cold transfer waits for its fair share, not for a whole batch.
PACE_QUANTUM_BYTES = 64 * 1024
# Per stream (thread or asyncio task): link time its last paced byte arrives, per pacing epoch of a
# LinkModel (a unique key, never id(): a dead model's id is reused and its stale entry would chain).
_FLOW_TAT: contextvars.ContextVar[dict[int, float]] = contextvars.ContextVar("pdd_link_flow_tat")
_EPOCHS = itertools.count()

MAX_SHARED_FLOWS = 1024  # streams a shared line's ledger remembers (the idle ones are forgotten first)
# A sender on a shared line books this much of the line's time per call (at its mean rate): fine
# enough that concurrent senders interleave as TCP flows do, coarse enough that the booking call
# (a Serve call to the Line replica, overlapped with the previous slice's wait) is a small share
SHARED_SLICE_S = 0.02
LEDGER_BACKOFF_S = 10.0  # after the shared line's ledger failed, a sender paces alone this long (real s)

REFERENCE_KV_BYTES_PER_TOKEN = 50_000  # docs/pdd.md: a flagship 1T model has ~50 KB of KV per token
JITTERS = ("constant", "lognormal", "trace", "stalls")


@dataclass(frozen=True)
class LineConfig:
    """A line's parameters, what a `LinkModel` runs (a graph's `link:` section, pdd_serve.config's
    `LinkConfig`, names a preset of these). `bandwidth_bps=None` means unpaced (same datacenter)."""

    bandwidth_bps: float | None = None  # bits/s
    one_way_latency_s: float = 0.0
    jitter: str = "constant"  # constant | lognormal | trace | stalls  ("trace:PATH" is shorthand)
    sigma: float = 0.0  # lognormal
    seed: int = 0  # lognormal
    trace_path: str | None = None  # trace: a file ...
    trace: tuple[float, ...] = ()  # ... or the values inline
    trace_kind: str = "delay"  # delay (extra seconds) | throughput (bandwidth factor)
    stalls: tuple[tuple[float, float], ...] = ()  # (at_s, duration_s), link clock
    epoch_s: float = 1.0  # conditions are constant within an epoch
    burst_gap_s: float = 0.005  # a sender idle longer than this starts a new burst (pays latency again)
    # where in its jitter the line is at this model's time 0: the simulator replays a real run from
    # the link time its requests met (PrefillResult.link_t_s) with the same seed
    phase_s: float = 0.0

    def __post_init__(self) -> None:
        if self.jitter.startswith("trace:"):  # config.py's `jitter: trace:PATH` form
            object.__setattr__(self, "trace_path", self.jitter[len("trace:"):])
            object.__setattr__(self, "jitter", "trace")
        object.__setattr__(self, "stalls", tuple((float(a), float(d)) for a, d in self.stalls))
        object.__setattr__(self, "trace", tuple(float(v) for v in self.trace))
        if self.bandwidth_bps is not None and not (self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)):
            raise ValueError(f"link bandwidth_bps must be > 0 and finite (or None), got {self.bandwidth_bps}")
        if not (self.one_way_latency_s >= 0 and math.isfinite(self.one_way_latency_s)):
            raise ValueError(f"link one_way_latency_s must be >= 0, got {self.one_way_latency_s}")
        if self.jitter not in JITTERS:
            raise ValueError(f"link jitter must be one of {JITTERS} or trace:PATH, got {self.jitter!r}")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise ValueError(f"link sigma must be >= 0, got {self.sigma}")
        if self.jitter == "lognormal" and self.sigma == 0:
            raise ValueError("lognormal jitter needs sigma > 0")
        if not (self.epoch_s > 0 and math.isfinite(self.epoch_s)):
            raise ValueError(f"link epoch_s must be > 0, got {self.epoch_s}")
        if not (self.phase_s >= 0 and math.isfinite(self.phase_s)):
            raise ValueError(f"link phase_s must be >= 0 and finite, got {self.phase_s}")
        if self.burst_gap_s < 0:
            raise ValueError(f"link burst_gap_s must be >= 0, got {self.burst_gap_s}")
        if self.trace_kind not in ("delay", "throughput"):
            raise ValueError(f"link trace_kind must be delay|throughput, got {self.trace_kind!r}")
        if self.jitter == "trace" and not (self.trace or self.trace_path):
            raise ValueError("trace jitter needs trace_path or trace values")
        if any(not (v >= 0 and math.isfinite(v)) for v in self.trace):
            raise ValueError("link trace values must be finite and >= 0")
        if self.jitter == "stalls" and not self.stalls:
            raise ValueError("stalls jitter needs at least one (at_s, duration_s)")
        for a, d in self.stalls:
            if not (a >= 0 and d > 0 and math.isfinite(a) and math.isfinite(d)):
                raise ValueError(f"a stall needs at_s >= 0 and duration_s > 0, got ({a}, {d})")

    @property
    def paced(self) -> bool:
        return self.bandwidth_bps is not None or self.one_way_latency_s > 0 or self.jitter != "constant"


def load_trace(path: str | Path) -> tuple[float, ...]:
    """Numbers from a CSV (last column; a non-numeric header row is skipped) or one per line."""
    vals: list[float] = []
    for i, line in enumerate(Path(path).read_text().splitlines()):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        cell = line.split(",")[-1].strip()
        try:
            vals.append(float(cell))
        except ValueError:
            if i == 0 and not vals:
                continue  # header
            raise ValueError(f"{path}:{i + 1}: not a number: {cell!r}") from None
    if not vals:
        raise ValueError(f"trace {path} holds no numbers")
    return tuple(vals)


def trace_values(c: LineConfig) -> tuple[float, ...]:
    """A trace line's values, inline or read from its file (checked: a throughput trace must let
    something through); () for other jitters."""
    vals = c.trace or (load_trace(c.trace_path) if c.jitter == "trace" and c.trace_path else ())
    if c.jitter == "trace" and c.trace_kind == "throughput" and not any(v > 0 for v in vals):
        raise ValueError("a throughput trace needs at least one factor > 0 (else nothing ever moves)")
    return vals


# Calibrations of the presets (bits/s, one-way s, jitter). Not measurements: docs/pdd.md gives only the
# 10-100 Gbps Ethernet and the 1-20 s fluctuating transfers; these are our stand-ins.
_PRESETS: dict[str, LineConfig] = {
    "same_dc": LineConfig(),
    "wan_10g": LineConfig(10e9, 0.010, "lognormal", sigma=0.25),
    "wan_100g": LineConfig(100e9, 0.010, "lognormal", sigma=0.25),
    # 4 Gbps median per transfer = 4e9 * exp(1/2) mean (lognormal factors have mean 1)
    "pdd_report": LineConfig(4e9 * math.exp(0.5), 0.050, "lognormal", sigma=1.0, epoch_s=5.0),
}


def preset_config(name: str, kv_bytes_per_token: int | None = None, **overrides: object) -> LineConfig:
    """A named line's parameters (`LinkModel.preset` says what each is and how they scale), with
    `overrides` of any of them."""
    if name not in _PRESETS:
        raise ValueError(f"unknown link preset {name!r}; one of {sorted(_PRESETS)}")
    cfg = _PRESETS[name]
    if kv_bytes_per_token is not None:
        if kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token}")
        if cfg.bandwidth_bps is not None:
            cfg = replace(cfg, bandwidth_bps=cfg.bandwidth_bps * kv_bytes_per_token / REFERENCE_KV_BYTES_PER_TOKEN)
    return replace(cfg, **overrides) if overrides else cfg


class LinkModel:
    """Paces real streams and answers transfer times for the simulator (see module docstring).

    `LinkModel(cfg)` or `LinkModel(bandwidth_bps=..., one_way_latency_s=..., jitter=..., ...)`.
    Thread-safe; one token bucket per object (parallel streams sharing it share the bandwidth).
    `timer`: the real time source (tests pass a fake one).
    """

    def __init__(self, config: LineConfig | None = None, *, clock: Clock = Clock(),
                 timer: Callable[[], float] = time.monotonic, byte_scale: float = 1.0, **fields: object) -> None:
        if config is not None and fields:
            raise TypeError("pass a LineConfig or its fields, not both")
        if not byte_scale > 0:
            raise ValueError(f"byte_scale must be > 0, got {byte_scale}")
        self.config = config if config is not None else LineConfig(**fields)  # type: ignore[arg-type]
        # emulation (pdd_serve/emulation/clock.py): the link runs on the graph's emulated clock, so
        # latency, epochs, stalls and rates are the emulated line's, and each real KV byte paced
        # stands for `byte_scale` bytes of the emulated model's KV
        self.clock = clock
        self.byte_scale = float(byte_scale)
        c = self.config
        self._trace = trace_values(c)
        self._rng = np.random.default_rng(c.seed)
        self._factors: list[float] = []  # lognormal factors, drawn in epoch order: pure per seed
        self._timer = timer
        self._origin = timer()
        self._tat: float | None = None  # arrival time of the last paced byte (link clock)
        self._flows: dict[str, float] = {}  # `book`: each named stream's last booked arrival (link clock)
        self._epoch = next(_EPOCHS)  # key of this model's streams in _FLOW_TAT (new on reset)
        self._lock = threading.Lock()  # the pacer's state
        self._factors_lock = threading.Lock()  # the lazily drawn jitter (also read by transfer_time)

    # ------------------------------------------------------------ presets

    @classmethod
    def preset(cls, name: str, kv_bytes_per_token: int | None = None, *, clock: Clock = Clock(),
               byte_scale: float = 1.0, **overrides: object) -> LinkModel:
        """A named link: same_dc (unpaced), wan_10g, wan_100g, pdd_report.

        `pdd_report` stands in for docs/pdd.md's cross-DC line whose KV transfers fluctuate 1-20 s:
        4 Gbps median per transfer (one request's share of a 10 Gbps-class line; 6.6 Gbps mean,
        the configured `bandwidth_bps`), 50 ms one-way, lognormal sigma 1.0 per 5 s epoch. For the report's 50 KB/token flagship that
        gives (p50 / p90 / p99 over start times): a 6.4K-token delta (64K prompt, 90% hit)
        0.64 / 1.9 / 4.0 s; a 20K-token delta 1.8 / 4.8 / 8.0 s; a cold 64K prompt (3.3 GB)
        5.4 / 10.8 / 16.4 s: the small-median, long-tail shape of the report.

        Scaling: with `kv_bytes_per_token`, the bandwidth is multiplied by
        `kv_bytes_per_token / 50_000` (the report's 50 KB/token), so a request of N tokens takes
        as long on this model as N tokens of the flagship over the named line: the *time* for a
        token count is kept, not the byte rate. E.g. the default test model (4 layers x 2 KV heads
        x 32 dims x fp32 = 2048 B/token) gets pdd_report's 4 Gbps x 2048/50000 = 164 Mbps. Latency and jitter
        are unchanged. `None` keeps the line's raw bandwidth. same_dc ignores it.
        """
        return cls(preset_config(name, kv_bytes_per_token, **overrides), clock=clock, byte_scale=byte_scale)

    # ------------------------------------------------------------ the pure model

    @property
    def bandwidth_bps(self) -> float | None:
        return self.config.bandwidth_bps

    def _lognormal(self, k: int) -> float:
        with self._factors_lock:
            while len(self._factors) <= k:
                sig = self.config.sigma  # mean-one factors: bandwidth_bps is the mean rate
                self._factors.extend(np.exp(-sig * self._rng.standard_normal(64) - sig * sig / 2).tolist())
            return self._factors[k]

    def _factor_at(self, t: float) -> tuple[float, float]:
        """(throughput factor at link time t, time until which it holds)."""
        c = self.config
        if c.phase_s:  # the same conditions as the line at t + phase_s, on this model's clock
            f, end = self._factor_at_line(t + c.phase_s)
            return f, max(end - c.phase_s, math.nextafter(t, math.inf))  # rounding must not stall a loop
        return self._factor_at_line(t)

    def _factor_at_line(self, t: float) -> tuple[float, float]:
        c = self.config
        k = int(t // c.epoch_s)
        end = (k + 1) * c.epoch_s
        if c.jitter == "lognormal":
            f = self._lognormal(k)
        elif c.jitter == "trace" and c.trace_kind == "throughput":
            f = self._trace[k % len(self._trace)]
        else:
            f = 1.0
        for a, d in c.stalls:
            if a <= t < a + d:
                return 0.0, a + d
            if t < a < end:
                end = a
        return f, end

    def latency_at(self, t: float) -> float:
        """One-way delay of a burst starting at link time t (base + trace extra delay)."""
        c = self.config
        extra = 0.0
        if c.jitter == "trace" and c.trace_kind == "delay":
            extra = self._trace[int((t + c.phase_s) // c.epoch_s) % len(self._trace)]
        return c.one_way_latency_s + extra

    def arrival_end(self, t: float, nbytes: float) -> float:
        """Link time at which the last of `nbytes` arrives, the first arriving at t."""
        bw = self.config.bandwidth_bps
        if bw is None or nbytes <= 0:
            return t
        bits = nbytes * 8.0
        c = self.config
        if c.jitter == "constant" and not c.stalls:
            return t + bits / bw
        while True:
            f, end = self._factor_at(t)
            if f > 0:
                cap = (end - t) * bw * f
                if cap >= bits:
                    return t + bits / (bw * f)
                bits -= cap
            t = end

    def transfer_time(self, nbytes: int, at: float = 0.0) -> float:
        """Seconds from sending `nbytes` at link time `at` (idle link) until the last byte arrives.

        Pure: the same arguments give the same answer (seeded jitter included), any thread, any
        order, so the simulator and the real pacer agree.
        """
        if at < 0:
            raise ValueError(f"link time must be >= 0, got {at}")
        return self.arrival_end(at + self.latency_at(at), nbytes) - at

    def capacity_bytes(self, t0: float, t1: float) -> float:
        """Bytes the link carries between link times t0 and t1 when kept busy (the inverse of
        `arrival_end`): what the simulator shares among concurrent streams."""
        bw = self.config.bandwidth_bps
        if bw is None:
            return math.inf
        c = self.config
        if c.jitter == "constant" and not c.stalls:
            return max(0.0, t1 - t0) * bw / 8
        total, t = 0.0, t0
        while t < t1:
            f, end = self._factor_at(t)
            e = min(end, t1)
            total += (e - t) * bw * f / 8
            t = e
        return total

    # ------------------------------------------------------------ pacing real streams

    def now(self) -> float:
        """Link time: (emulated) seconds since this object was made (or `reset`)."""
        return self.clock.emulated(self._timer() - self._origin)

    def real_latency_s(self) -> float:
        """The one-way delay a message sent now waits, in real seconds (cross-site control calls)."""
        return self.clock.real(self.latency_at(self.now()))

    def reset(self) -> None:
        with self._lock:
            self._origin = self._timer()
            self._tat = None
            self._flows.clear()
            self._epoch = next(_EPOCHS)  # streams' arrival times were on the old clock

    def _book_locked(self, mine: float | None, nbytes: float, chained: bool, now: float) -> float:
        """Under the lock: the link time the last of `nbytes` arrives, for a stream whose last
        booked byte arrives at `mine` (None: its first). The line carries one stream's bytes
        after another's (bandwidth is shared)."""
        line = now if self._tat is None else self._tat
        if mine is not None and (chained or now <= mine + self.config.burst_gap_s):
            # a backlogged stream chains on the line (its sleep overshoot doesn't leak into the
            # rate; the quanta of one call were all ready at its start)
            start = max(line, mine)
        else:  # a new stream, or one idle past burst_gap_s, pays the propagation delay first
            start = max(line, now + self.latency_at(now))
        self._tat = self.arrival_end(start, nbytes)
        return self._tat

    def _reserve(self, nbytes: float, chained: bool = False) -> float:
        """Book `nbytes` of the calling stream on the line; seconds it must wait so they 'arrive'
        on time."""
        if not self.config.paced:
            return 0.0
        now = self.now()
        flows = _FLOW_TAT.get({})
        with self._lock:
            key = self._epoch
            tat = self._book_locked(flows.get(key), nbytes, chained, now)
        # copy: asyncio tasks may share the dict; a long-lived thread forgets other models' streams
        _FLOW_TAT.set({**flows, key: tat} if len(flows) < 64 else {key: tat})
        return tat - now

    def book(self, flow: str, nbytes: float, chained: bool = False) -> Booking:
        """Book `nbytes` (line bytes: this model's byte_scale is not applied) of a named stream,
        `SENDER/STREAM`: the ledger of a line that senders in other processes share (`SharedLine`,
        serve/line.py). `others` counts the streams of other senders with bytes still on the line
        (a sender's own parallel streams are its business), `mine` the caller's own, this one
        included: the line is shared per stream."""
        now = self.now()
        sender = flow.rsplit("/", 1)[0]
        with self._lock:
            if not self.config.paced or nbytes <= 0:  # nothing to carry (a clock reading): books nothing
                return Booking(0.0, now, 0)
            tat = self._book_locked(self._flows.pop(flow, None), nbytes, chained, now)
            self._flows[flow] = tat  # most recent last: the stalest streams are forgotten first
            while len(self._flows) > MAX_SHARED_FLOWS:
                del self._flows[next(iter(self._flows))]
            on = [f.rsplit("/", 1)[0] == sender for f, t in self._flows.items() if t > now]
        return Booking(tat - now, now, len(on) - sum(on), sum(on))

    def _quanta(self, nbytes: int) -> list[int]:
        q = PACE_QUANTUM_BYTES
        return [q] * (nbytes // q) + ([nbytes % q] if nbytes % q else [])

    def pace_sync(self, nbytes: int) -> float:
        """Block until `nbytes` (real bytes) may go, a quantum at a time so that concurrent streams
        share the line; returns the real seconds waited."""
        waited = 0.0
        for i, q in enumerate(self._quanta(nbytes)):
            wait = self.clock.real(self._reserve(q * self.byte_scale, chained=i > 0))
            if wait > 0:
                time.sleep(wait)
                waited += wait
        return waited

    async def pace(self, nbytes: int) -> float:
        waited = 0.0
        for i, q in enumerate(self._quanta(nbytes)):
            wait = self.clock.real(self._reserve(q * self.byte_scale, chained=i > 0))
            if wait > 0:
                await asyncio.sleep(wait)
                waited += wait
        return waited


@dataclass(frozen=True)
class Booking:
    """Bytes a sender booked on a shared line (`LinkModel.book`); crosses from the Line replica
    to each Prefill replica."""

    wait_s: float  # line seconds from `now_s` until the last booked byte arrives
    now_s: float  # the line's time when it booked them
    others: int  # other senders' streams with bytes on the line then: the sender did not have it alone
    mine: int = 0  # the sender's own streams on the line then, the booking's included


class SharedLine:
    """A sender's side of a line that several processes share: one line per site pair, whatever
    the number of Prefill replicas (a second replica must not bring a second line's bandwidth).
    The ledger (a `LinkModel` in the graph's `Line` deployment, serve/line.py) books every
    sender's bytes; this side paces its streams on the bookings, as `LinkModel.pace_sync` does.

    `book(flow, line_bytes, chained)` returns a future (`.result(timeout_s=)`, as a Serve
    `DeploymentResponse`) of a `Booking`. A call books one slice (`SHARED_SLICE_S` of the line's
    mean rate) at a time: the first slice's round trip measures the call's latency and the line's
    clock, and each next slice is booked while the current one is waited out, so the latency is
    hidden. Where the ledger fails or is slow (`timeout_s` real seconds, not slowed by the graph's
    time_scale: the Line is a same-site call), this sender paces on `local` (its own line) for
    `LEDGER_BACKOFF_S` before trying it again, and counts the failure: a transfer never waits on a
    lost ledger for more than one timeout."""

    def __init__(self, local: LinkModel, book: Callable[[str, float, bool], Any], name: str,
                 timeout_s: float = 2.0, sleep: Callable[[float], None] = time.sleep) -> None:
        self.local, self._book, self.name, self.timeout_s, self._sleep = local, book, name, timeout_s, sleep
        self.config, self.clock, self.byte_scale = local.config, local.clock, local.byte_scale
        self._offset: float | None = None  # line time - local link time, from the latest measured booking
        self.shared = 0  # bookings that found another sender's stream on the line (this one not alone)
        self.errors = 0  # bookings the ledger did not answer (paced locally instead)
        self._local_until = -math.inf  # after a failure, pace locally until this (real timer)
        self._down = False  # the ledger is failing: warned once, recovery logged
        # (own streams, other senders' streams) at the last booking, valid until its slice is waited out
        self._share: tuple[int, int, float] = (0, 0, -math.inf)
        self._ends = threading.local()  # per stream: when its last booked byte arrived (real timer)
        self._lock = threading.Lock()

    @property
    def bandwidth_bps(self) -> float | None:
        return self.config.bandwidth_bps

    def now(self) -> float:
        """The shared line's time (the local link's until the first booking)."""
        return self.local.now() + (self._offset or 0.0)

    def latency_at(self, t: float) -> float:
        return self.local.latency_at(t)

    def real_latency_s(self) -> float:
        return self.clock.real(self.latency_at(self.now()))

    def share(self) -> float:
        """This sender's share of the line at its last booking, by streams (the ledger shares the
        line per stream); 1 once that booking's slice has been waited out with no newer one."""
        mine, others, until = self._share
        return mine / (mine + others) if mine and self.local._timer() <= until else 1.0

    def _note(self, b: Booking, wake: float) -> None:
        with self._lock:
            self.shared += b.others > 0
            self._share = (b.mine, b.others, wake + self.clock.real(SHARED_SLICE_S))

    def sync(self, booking: Booking, sent: float, got: float) -> None:
        """Learn the line's clock from a booking sent at `sent` and answered at `got` (real): the
        ledger read its clock about mid-call."""
        with self._lock:
            self._offset = booking.now_s - self.local.clock.emulated((sent + got) / 2 - self.local._origin)

    def _fail(self, e: BaseException, pending: Any) -> None:
        cancel = getattr(pending, "cancel", None)
        if cancel is not None:  # a booking that comes late must not hold line time nobody uses
            try:
                cancel()
            except Exception:  # noqa: BLE001 - best effort
                pass
        with self._lock:
            self.errors += 1
            first, self._down = not self._down, True
            self._local_until = self.local._timer() + LEDGER_BACKOFF_S
        if first:
            logging.getLogger("pdd_serve").warning(
                "shared line %s: the ledger did not answer (%s: %s); pacing this sender on its own line, "
                "asking the ledger again every %gs", self.name, type(e).__name__, e, LEDGER_BACKOFF_S)

    def _use_ledger(self) -> bool:
        """Whether this call books on the ledger: yes while it answers; after a failure, no until
        the backoff ends, then one call probes it while the others stay on their own line."""
        with self._lock:
            now = self.local._timer()
            if now < self._local_until:
                return False
            if self._down:  # the probe: the others wait no timeout while it finds out
                self._local_until = now + self.timeout_s
            return True

    def _up(self) -> None:
        if self._down:
            with self._lock:
                self._down, self._local_until = False, -math.inf
            logging.getLogger("pdd_serve").warning("shared line %s: the ledger answers again", self.name)

    def sync_clock(self) -> None:
        """Read the line's clock once (a booking of nothing), so the times this sender reports
        (`PrefillResult.link_t_s`) are the line's from the start. Blocking: off the event loop."""
        sent, pending = self.local._timer(), None
        try:
            pending = self._book(f"{self.name}/clock", 0.0, False)
            b = pending.result(timeout_s=self.timeout_s)
        except Exception:  # noqa: BLE001 - the Line may still be starting: the first booking syncs it
            if pending is not None and hasattr(pending, "cancel"):
                pending.cancel()
            return
        self.sync(b, sent, self.local._timer())

    def _slices(self, nbytes: int) -> list[int]:
        bw = self.config.bandwidth_bps
        per = PACE_QUANTUM_BYTES if bw is None else max(
            PACE_QUANTUM_BYTES, int(bw / 8 * SHARED_SLICE_S / self.byte_scale))
        return [per] * (nbytes // per) + ([nbytes % per] if nbytes % per else [])

    def pace_sync(self, nbytes: int) -> float:
        """Block until `nbytes` (real bytes) may go; returns the real seconds waited."""
        if not self.config.paced or nbytes <= 0:
            return 0.0
        timer = self.local._timer
        if not self._use_ledger():  # the ledger failed lately
            return self.local.pace_sync(nbytes)
        flow = f"{self.name}/{threading.get_ident()}"
        slices = self._slices(nbytes)
        # a stream that ends one call and starts the next within the line's burst gap goes on
        # chaining: decided here, since the booking call's own delay must not read as idle time
        last = getattr(self._ends, "t", -math.inf)
        chained = timer() - last <= self.clock.real(self.config.burst_gap_s)
        sent, pending = timer(), None
        try:
            pending = self._book(flow, slices[0] * self.byte_scale, chained)
            b = pending.result(timeout_s=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the ledger is gone or slow: this sender paces alone
            self._fail(e, pending)
            return self.local.pace_sync(nbytes)
        got = timer()
        self._up()
        self.sync(b, sent, got)
        one_way = (got - sent) / 2  # the ledger books about this long after a call is sent
        waited = 0.0
        for i in range(len(slices)):
            wake = sent + one_way + self.clock.real(b.wait_s)
            self._note(b, wake)
            self._ends.t = wake
            more = i + 1 < len(slices)
            if more:  # the next slice is booked while this one is waited out
                sent = timer()
                try:
                    pending = self._book(flow, slices[i + 1] * self.byte_scale, True)
                except Exception as e:  # noqa: BLE001
                    self._fail(e, None)
                    pending = None
            dt = wake - timer()
            if dt > 0:
                self._sleep(dt)
                waited += dt
            if not more:
                break
            try:
                if pending is None:
                    raise RuntimeError("the booking could not be sent")
                b = pending.result(timeout_s=self.timeout_s)
            except Exception as e:  # noqa: BLE001
                if pending is not None:
                    self._fail(e, pending)
                return waited + self.local.pace_sync(sum(slices[i + 1:]))
        return waited


# a transfer smaller than this measures the line's delay more than its rate: it does not feed the
# estimate (Prefill's sender and the simulator both apply it)
BW_SAMPLE_MIN_BYTES = 1 << 20


class BandwidthEstimator:
    """EWMA of observed throughput (bits/s), fed by transfers and read by the router. Thread-safe."""

    def __init__(self, alpha: float = 0.2, initial_bps: float | None = None, min_seconds: float = 1e-4) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if initial_bps is not None and initial_bps <= 0:
            raise ValueError(f"initial_bps must be > 0, got {initial_bps}")
        self.alpha = alpha
        self.min_seconds = min_seconds  # shorter samples say more about timers than about the link
        self._bps = initial_bps
        self._samples = 0
        self._lock = threading.Lock()

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or not math.isfinite(seconds):
            return
        sample = nbytes * 8.0 / max(seconds, self.min_seconds)
        with self._lock:
            self._bps = sample if self._bps is None else self.alpha * sample + (1 - self.alpha) * self._bps
            self._samples += 1

    @property
    def bps(self) -> float | None:
        """Current estimate in bits/s; None before the first observation (and no initial value)."""
        with self._lock:
            return self._bps

    @property
    def samples(self) -> int:
        with self._lock:
            return self._samples

    def estimate_time(self, nbytes: int, default_bps: float | None = None) -> float | None:
        bps = self.bps or default_bps
        return None if not bps else nbytes * 8.0 / bps
