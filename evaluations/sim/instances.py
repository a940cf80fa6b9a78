"""The simulated engine replicas: a Prefill instance (chunked forwards off a FIFO) and a decode
instance (RLD, MD or the same-DC decode pool: continuous batching), each timed by the one cost
model (pdd_serve/emulation/costmodel.py). The Simulation (simulator.py) owns them: they call back
`sim.at(t, fn, ...)` for their events, `sim.now`, and on Prefill `sim.stream_start` (a request's
first chunk is done) and `sim.prefill_done`.

- Prefill: a FIFO of jobs run as chunked forwards (a token budget per forward, short prompts
  packed together, a long prompt's tail chunk alone / packed / padded per the scheduler spec).
- Decode: between two membership changes the step times form a closed-form series
  (costmodel.StepSeries), so an instance wakes only when a sequence finishes or when a join, cancel
  or extend is waiting for a step boundary. Extends (handoff batches, the final extend, absorbs)
  run between steps, like pdd_serve's EngineWorker, and stall the batch while they run.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from evaluations.sim.line import SharedPacer
from evaluations.sim.workload import SimRequest
from pdd_serve.emulation.costmodel import (
    ChipSpec,
    StepSeries,
    decode_series,
    kv_capacity_tokens,
    prefill_time,
)
from pdd_serve.engine.radix_cache import RadixCache
from pdd_serve.transport.link import BandwidthEstimator

if TYPE_CHECKING:  # the owner, for annotations only (it imports this module)
    from evaluations.sim.simulator import Simulation

INF = math.inf


# ---------------------------------------------------------------- prefill


@dataclass(slots=True, eq=False)
class PrefillJob:
    req: SimRequest
    total: int  # uncached prompt tokens
    ctx0: int  # cached tokens before them
    done: int = 0  # tokens scheduled so far
    t_first_chunk: float = -1.0


class PrefillInstance:
    def __init__(self, sim: Simulation, idx: int, chip: ChipSpec, n_chips: int, cache: RadixCache, cache_bytes: float):
        self.sim, self.idx, self.chip, self.n = sim, idx, chip, n_chips
        self.cache, self.cache_bytes = cache, cache_bytes
        self.q: deque[PrefillJob] = deque()
        self.busy = False
        self.backlog = 0  # queued uncached tokens: the router's load signal
        self.forwards = 0
        self.busy_s = 0.0
        self.pacer: SharedPacer | None = None  # the site pair's one paced line (every replica's), when modelled
        self.bw: BandwidthEstimator | None = None  # its live estimate of the line (with the pacer)
        self.sending = 0  # KV senders running (one per request with an MD target, from the prefill call)
        self.started = 0

    def submit(self, job: PrefillJob) -> None:
        self.q.append(job)
        self.backlog += job.total
        if not self.busy:
            self._start()

    def _form(self) -> tuple[list[tuple[PrefillJob, int, int]], list[tuple[int, int]]]:
        """The next forward's pieces (job, new tokens, context) and what they cost (padding)."""
        budget = self.sim.chunk
        mode = self.sim.tail_mode
        pieces: list[tuple[PrefillJob, int, int]] = []
        q = self.q
        while q and budget > 0:
            job = q[0]
            rem = job.total - job.done
            ctx = job.ctx0 + job.done
            if rem >= budget:  # a full chunk (or the rest of the budget): the forward is full
                pieces.append((job, budget, ctx))
                job.done += budget
                if job.done == job.total:
                    q.popleft()
                break
            if job.done > 0 and mode != "packed":  # a tail chunk: never batched with others
                if pieces:
                    break
                q.popleft()
                job.done = job.total
                pieces.append((job, rem, ctx))
                cost = [(self.sim.chunk, ctx)] if mode == "padded" else [(rem, ctx)]
                return pieces, cost
            q.popleft()
            job.done = job.total
            pieces.append((job, rem, ctx))
            budget -= rem
            if not self.sim.batch_requests:
                break
        return pieces, [(n, c) for _, n, c in pieces]

    def _start(self) -> None:
        pieces, cost = self._form()
        if not pieces:
            self.busy = False
            return
        self.busy = True
        dt = prefill_time(self.chip, self.sim.model, self.n, cost)
        self.forwards += 1
        self.busy_s += dt
        self.sim.at(self.sim.now + dt, self._done, pieces)

    def _done(self, pieces: list[tuple[PrefillJob, int, int]]) -> None:
        now = self.sim.now
        finished = []
        for job, n, ctx in pieces:
            self.backlog -= n
            if job.t_first_chunk < 0:
                job.t_first_chunk = now
                self.sim.stream_start(job, self)
            if ctx + n == job.ctx0 + job.total:
                finished.append(job)
        # pdd_serve's Prefill copies a finished prompt's KV out for the relay on its engine thread,
        # paced at the NIC, before the prefill returns: the replica is busy and the request waits
        export = sum(self.sim.relay_export_s(job.req, self) for job in finished)
        if export > 0:
            self.busy_s += export
            self.sim.at(now + export, self._exported, finished)
            return
        self._exported(finished)

    def _exported(self, finished: list[PrefillJob]) -> None:
        for job in finished:
            self.sim.prefill_done(job, self)
        self._start()


# ---------------------------------------------------------------- decode


@dataclass(slots=True, eq=False)
class Member:
    req: SimRequest
    remaining: int  # tokens this instance is to generate
    ctx: int  # KV tokens when it joins
    on_join: Callable[[Member, float], None] | None = None
    on_finish: Callable[[Member, float], None] | None = None
    join_step: int = -1
    finish_step: int = -1
    joined: bool = False
    cancelled: bool = False
    done: bool = False


class DecodeInstance:
    def __init__(self, sim: Simulation, idx: int, role: str, chip: ChipSpec, n_chips: int, max_batch: int,
                 cache: RadixCache | None = None, cache_bytes: float = 0.0):
        self.sim, self.idx, self.role, self.chip, self.n = sim, idx, role, chip, n_chips
        self.cap_tokens = kv_capacity_tokens(chip, sim.model, n_chips, sim.sc.scheduler.mem_reserve_fraction)
        self.max_batch = max_batch
        self.cache, self.cache_bytes = cache, cache_bytes
        self.members: dict[int, Member] = {}
        self.fin: list[tuple[int, int]] = []  # (finish step, rid); stale entries skipped
        self.step = 0  # steps completed when the current segment started
        self.seg_t0 = 0.0
        self.series: StepSeries | None = None
        self.ctx = 0  # KV tokens of the members at seg_t0
        self.reserved = 0  # prompt + output tokens reserved by members (admission control)
        self.waiting: deque[Member] = deque()
        self.ops: deque[tuple[float, Callable[..., None], tuple]] = deque()
        self.busy_until = 0.0  # end of the running block of extends
        self.wake_t = INF
        self.ver = 0
        self.assigned = 0  # requests routed here, not yet released (MDStatus.running)
        self.tokens = 0
        self.peak_batch = 0

    # ---- requests from the simulation

    def join(self, m: Member) -> None:
        if m.cancelled:
            return
        self.waiting.append(m)
        self._poke()

    def op(self, cost: float, cb: Callable[..., None], *args: Any) -> None:
        self.ops.append((cost, cb, args))
        self._poke()

    def cancel(self, m: Member) -> None:
        """Stop generating for m (the handoff's cut); it leaves the batch at the next boundary."""
        m.cancelled = True
        if m.joined and not m.done:
            self._poke()

    def tokens_by(self, m: Member, t: float) -> int:
        if not m.joined:
            return 0
        if m.done:
            return m.remaining
        steps = self.step - m.join_step
        if self.series is not None and t > self.seg_t0:
            steps += self.series.steps_within(t - self.seg_t0, self._seg_cap())
        return min(m.remaining, max(0, steps))

    # ---- the engine loop

    def _seg_cap(self) -> int:
        while self.fin:
            fs, rid = self.fin[0]
            m = self.members.get(rid)
            if m is not None and not m.cancelled and m.finish_step == fs:
                return fs - self.step
            heapq.heappop(self.fin)
        return 1 << 30  # only cancelled members left: they leave at the next boundary

    def _poke(self) -> None:
        now = self.sim.now
        if self.series is None or now < self.seg_t0:
            tb = max(now, self.busy_until, self.seg_t0 if self.series is not None else now)
        else:
            dt = now - self.seg_t0
            j = self.series.steps_within(dt, self._seg_cap())
            done = self.series.time(j)
            tb = self.seg_t0 + (done if done >= dt - 1e-12 else self.series.time(j + 1))
        if tb < self.wake_t - 1e-12:
            self._schedule(tb)

    def _schedule(self, t: float) -> None:
        self.ver += 1
        self.wake_t = t
        self.sim.at(t, self._wake, self.ver)

    def _wake(self, ver: int) -> None:
        if ver != self.ver:
            return
        self.wake_t = INF
        now = self.sim.now
        if now < self.busy_until:  # woken inside a block of extends: resume at its end
            self._schedule(self.busy_until)
            return
        # 1. advance the running segment to this boundary
        if self.series is not None and now >= self.seg_t0:
            j = self.series.steps_within(now - self.seg_t0, self._seg_cap())
            self.step += j
            self.ctx += len(self.members) * j
            self.tokens += len(self.members) * j
        self.series = None
        # 2. finished and cancelled members leave
        while self.fin and self.fin[0][0] <= self.step:
            fs, rid = heapq.heappop(self.fin)
            m = self.members.get(rid)
            if m is None or m.cancelled or m.finish_step != fs:
                continue
            self._remove(m)
            if m.on_finish is not None:
                m.on_finish(m, now)
        for m in [m for m in self.members.values() if m.cancelled]:
            self._remove(m)
        # 3. queued extends run now, back to back; decoding resumes after them
        t = now
        while self.ops:
            cost, cb, args = self.ops.popleft()
            t += cost
            self.sim.at(t, cb, *args)
        self.busy_until = t
        # 4. admission (FIFO): batch cap and KV memory
        joined: list[Member] = []
        while self.waiting:
            m = self.waiting[0]
            if m.cancelled:
                self.waiting.popleft()
                continue
            need = m.ctx + m.remaining
            if self.members and (len(self.members) >= self.max_batch or self.reserved + need > self.cap_tokens):
                break
            self.waiting.popleft()
            m.joined, m.join_step, m.finish_step = True, self.step, self.step + m.remaining
            self.members[m.req.rid] = m
            heapq.heappush(self.fin, (m.finish_step, m.req.rid))
            self.ctx += m.ctx
            self.reserved += need
            joined.append(m)
        self.peak_batch = max(self.peak_batch, len(self.members))
        # 5. the next segment
        self.seg_t0 = t
        if self.members:
            self.series = decode_series(self.chip, self.sim.model, self.n, len(self.members), self.ctx)
            self._schedule(t + self.series.time(self._seg_cap()))
            first = t + self.series.time(1)  # a joiner's first token comes out of the segment's first step
            for m in joined:
                if m.on_join is not None:
                    m.on_join(m, first)
        elif t > now and (self.waiting or self.ops):
            self._schedule(t)

    def _remove(self, m: Member) -> None:
        del self.members[m.req.rid]
        m.done = True
        made = self.step - m.join_step
        if m.cancelled:
            m.remaining = min(m.remaining, made)  # what was generated before the cut is what counts
        self.ctx -= m.ctx + made
        self.reserved -= m.ctx + m.finish_step - m.join_step
