"""Emulated accelerators: real tokens from the real small model, at an emulated chip's timing.

An emulating engine runs the real forward pass, then waits until the step time the cost model
(`costmodel.py`) predicts for the emulated model on the emulated chip has passed since the step
began: Dynamo's mocker and SGLang's simulator pace the same way, but emit fake tokens; ours keeps
the real ones, so the master invariant (token-identical greedy output) stays testable.

Slow motion (clock.py): the pacer holds each step for its modeled time on the graph's `Clock`, so
the real CPU work of a step is a small share of it. A step whose real work took longer than its
modeled time is an *overrun*: counted per step kind (a decode step is not a prefill chunk), never
hidden, since past a few percent the run measures this machine's CPU again.

The config only names each role's chips (`PDDConfig.emulate_for`); `build_emulation` builds them.

Pure: no Ray, no torch. The pacer takes its timer and sleep, so tests drive it with a fake clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdd_serve.config import MEM_RESERVE_FRACTION, PDDConfig
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.costmodel import (
    ChipSpec,
    ModelShape,
    decode_step_time,
    kv_capacity_tokens,
    load_catalog,
    model_from,
    prefill_time,
)
from pdd_serve.engine.protocol import FORWARD_KINDS, ForwardWork

STEP_KINDS = FORWARD_KINDS  # prefill: any multi-token forward (prefill chunk, extend, resume)
OVERRUN_WARN_SHARE = 0.05  # above this, a run measures the CPU, not the emulated chip


@dataclass(frozen=True)
class Emulation:
    """One role's emulated accelerator: `tp` chips of `chip` serving `model` (times in emulated seconds)."""

    chip: ChipSpec
    model: ModelShape
    tp: int = 1

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Emulated seconds of one forward over `new_tokens` after `cached_tokens` of context."""
        return prefill_time(self.chip, self.model, self.tp, [(new_tokens, cached_tokens)])

    def decode_s(self, batch: int, ctx_total: int) -> float:
        """Emulated seconds of one decode step of `batch` sequences holding `ctx_total` tokens of KV."""
        return decode_step_time(self.chip, self.model, self.tp, batch, ctx_total)

    def forward_s(self, work: ForwardWork) -> float:
        """Emulated seconds of one forward an engine reported."""
        if work.kind == "decode":
            return self.decode_s(work.seqs, work.context_tokens)
        return self.prefill_s(work.new_tokens, work.context_tokens)

    @property
    def kv_capacity_tokens(self) -> int:
        return kv_capacity_tokens(self.chip, self.model, self.tp, MEM_RESERVE_FRACTION)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def label(self) -> str:
        return f"{self.model.name} on {self.tp} x {self.chip.name}"

    def params(self, clock: Clock) -> dict[str, object]:
        return {"model": self.model.name, "chip": self.chip.name, "tp": self.tp, "time_scale": clock.time_scale,
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_capacity_tokens": self.kv_capacity_tokens}


def build_emulation(cfg: PDDConfig, role: str) -> Emulation | None:
    """One role's emulated accelerator from the graph's `emulate:` (checked at load), None unemulated."""
    e = cfg.emulate_for(role)
    if e is None:
        return None
    cat = load_catalog()
    model = model_from(e.model, "emulate.model") if isinstance(e.model, dict) else cat.model(e.model)
    return Emulation(cat.chip(e.chip), model, e.tp)


def kv_scale(cfg: PDDConfig, real_bytes_per_token: int) -> float:
    """Emulated KV bytes per real KV byte (1 unemulated): what the link, the line's backlog, the
    bandwidth view and `wan_bytes` count, while the real small blocks cross. One emulated model
    serves the whole graph (checked at load), so any role's gives it."""
    e = build_emulation(cfg, "prefill")
    return e.kv_bytes_per_token / real_bytes_per_token if e is not None else 1.0


@dataclass
class _KindStats:
    steps: int = 0
    overruns: int = 0
    overrun_s: float = 0.0  # real seconds past the modeled time, summed
    modeled_s: float = 0.0  # emulated seconds


@dataclass
class StepPacer:
    """Holds each engine step to its modeled time on the graph's `clock`: `t0 = begin()` before the
    forward, `end(kind, t0, modeled_s)` after it (on the engine thread, so imports and extends
    queued on the event loop never slip into the 'busy device' time)."""

    emulation: Emulation
    clock: Clock = Clock()
    timer: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep
    _stats: dict[str, _KindStats] = field(default_factory=lambda: {k: _KindStats() for k in STEP_KINDS})
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self) -> float:
        return self.timer()

    def end(self, kind: str, t0: float, modeled_s: float) -> float:
        """Sleep out the rest of the modeled step; returns the real seconds slept."""
        return self.hold(t0, [(kind, modeled_s, self.timer() - t0)])

    def hold(self, t0: float, forwards: list[tuple[str, float, float]]) -> float:
        """One engine call that began at `t0` and ran `forwards` (kind, modeled seconds, real
        seconds each): count each, then sleep out the rest of their modeled time since t0;
        returns the real seconds slept. A forward whose real time exceeded its modeled time is an
        overrun of its kind, never slept away."""
        target = 0.0
        with self._lock:
            for kind, modeled_s, real_s in forwards:
                st = self._stats[kind]
                st.steps += 1
                st.modeled_s += modeled_s
                over = real_s - self.clock.real(modeled_s)
                if over > 0:
                    st.overruns += 1
                    st.overrun_s += over
                # each forward takes the longer of its real and its modeled time, as if held on its
                # own: one that overran does not eat the modeled time of the next in the same call
                target += max(real_s, self.clock.real(modeled_s))
        rest = target - (self.timer() - t0)
        if rest > 0:
            self.sleep(rest)
            return rest
        return 0.0

    def params(self) -> dict[str, object]:
        """What this pacer emulates, and on which clock."""
        return self.emulation.params(self.clock)

    def stats(self) -> dict[str, float]:
        """Per step kind: steps, overruns, overrun share, overrun seconds (real), modeled seconds."""
        out: dict[str, float] = {}
        with self._lock:
            for k, st in self._stats.items():
                out[f"{k}_steps"] = st.steps
                out[f"{k}_overruns"] = st.overruns
                out[f"overrun_share_{k}"] = st.overruns / st.steps if st.steps else 0.0
                out[f"{k}_overrun_s"] = st.overrun_s
                out[f"{k}_modeled_s"] = st.modeled_s
        return out


def overrun_warning(stats: dict[str, float], clock: Clock) -> str | None:
    """The line a table prints when a run's overrun says it measured the CPU (on `clock`)."""
    bad = [f"{k} {stats.get(f'overrun_share_{k}', 0.0):.1%}" for k in STEP_KINDS
           if stats.get(f"overrun_share_{k}", 0.0) > OVERRUN_WARN_SHARE]
    if not bad:
        return None
    slower = clock.slower()
    advice = (f"raise time_scale (now {clock.time_scale:g}, try {slower.time_scale:g})" if slower != clock
              else f"time_scale {clock.time_scale:g} can go no slower (it stays under 1e6)")
    return (f"emulation overrun above {OVERRUN_WARN_SHARE:.0%} ({', '.join(bad)} of steps took longer in real "
            f"time than modeled): these figures measure this machine's CPU; {advice}")


def merge_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Sum per-replica pacer stats (shares recomputed from the sums)."""
    out: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            if not k.startswith("overrun_share_"):
                out[k] = out.get(k, 0) + v
    for k in STEP_KINDS:
        n = out.get(f"{k}_steps", 0)
        out[f"overrun_share_{k}"] = out.get(f"{k}_overruns", 0) / n if n else 0.0
    return out


class PacedEngine:
    """An engine behind the seam (`engine.protocol.EngineBackend`) held to an emulated chip's
    timing. Each call that computes (`prefill`, `extend`, `step`) returns no sooner than the
    modeled time of the forwards the engine reported during it; a chunked prefill is held at every
    chunk, before `on_chunk` lets that chunk's blocks leave, as on the chip. Everything else is
    the engine's own (attribute access passes through). Only calls through this wrapper are paced."""

    _OWN = ("inner", "pacer", "_work")

    def __init__(self, engine: Any, pacer: StepPacer) -> None:
        object.__setattr__(self, "inner", engine)
        object.__setattr__(self, "pacer", pacer)
        object.__setattr__(self, "_work", [])
        engine.on_forward = self._work.append  # runs on the engine thread, as every call here

    def __getattr__(self, name: str) -> Any:  # only for names not set on the wrapper
        if name in PacedEngine._OWN:  # not set yet (a copy, an unpickle): no recursion through inner
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        """Attributes are the engine's (a test replacing `add` replaces the engine's); its
        `on_forward` is this wrapper's, which pacing depends on."""
        if name == "on_forward":
            raise AttributeError("a PacedEngine's engine reports its forwards to the pacer: wrap the engine "
                                 "before pacing it, or read pacer.stats()")
        setattr(self.inner, name, value)

    def _begin(self) -> float:
        self._work.clear()  # forwards of an unpaced call (generate) are not this call's
        return self.pacer.begin()

    def _hold(self, t0: float) -> None:
        work, emu = list(self._work), self.pacer.emulation
        self._work.clear()
        self.pacer.hold(t0, [(w.kind, emu.forward_s(w), w.real_s) for w in work])

    def prefill(self, seq: Any, use_cache: bool = True, chunk_tokens: int | None = None,
                on_chunk: Callable[[Any], None] | None = None) -> int:
        t0 = [self._begin()]

        def chunk(s: Any) -> None:  # the chunk's time is up before its blocks may leave
            self._hold(t0[0])
            t0[0] = self.pacer.begin()
            if on_chunk is not None:
                on_chunk(s)

        try:
            return self.inner.prefill(seq, use_cache, chunk_tokens, chunk)
        finally:  # a call that failed after computing still held the chip (and is counted)
            self._hold(t0[0])

    def extend(self, seq: Any, token_ids: list[int], sample: bool = True) -> int | None:
        t0 = self._begin()
        try:
            return self.inner.extend(seq, token_ids, sample)
        finally:
            self._hold(t0)

    def step(self, seqs: list[Any]) -> list[tuple[Any, int]]:
        t0 = self._begin()
        try:
            return self.inner.step(seqs)
        finally:
            self._hold(t0)
