"""Emulated accelerators: real tokens from the real small model, at an emulated chip's timing.

An emulating engine runs the real forward pass, then waits until the step time the cost model
(`costmodel.py`) predicts for the emulated model on the emulated chip has passed since the step
began: Dynamo's mocker and SGLang's simulator pace the same way, but emit fake tokens; ours keeps
the real ones, so the master invariant (token-identical greedy output) stays testable.

Slow motion: `time_scale` multiplies every modeled duration (and, through the config, every link
delay and cross-site timeout), so the real CPU work of a step is a small share of its modeled
time; reported times divide it back. A step whose real work took longer than its modeled time is
an *overrun*: counted per step kind (a decode step is not a prefill chunk), never hidden, since
past a few percent the run measures this machine's CPU again.

Pure: no Ray, no torch. The pacer takes its clock and sleep, so tests drive it with a fake clock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd_serve.costmodel import (
    ChipSpec,
    ModelShape,
    decode_step_time,
    kv_capacity_tokens,
    prefill_time,
)

STEP_KINDS = ("prefill", "decode")  # prefill: any multi-token forward (prefill chunk, extend, resume)
MEM_RESERVE_FRACTION = 0.1  # HBM kept for activations, graphs, fragmentation (the simulator's default)
OVERRUN_WARN_SHARE = 0.05  # above this, a run measures the CPU, not the emulated chip


@dataclass(frozen=True)
class Emulation:
    """One role's emulated accelerator: `tp` chips of `chip` serving `model`, in slow motion."""

    chip: ChipSpec
    model: ModelShape
    tp: int = 1
    time_scale: float = 1.0

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Emulated seconds of one forward over `new_tokens` after `cached_tokens` of context."""
        return prefill_time(self.chip, self.model, self.tp, [(new_tokens, cached_tokens)])

    def decode_s(self, batch: int, ctx_total: int) -> float:
        """Emulated seconds of one decode step of `batch` sequences holding `ctx_total` tokens of KV."""
        return decode_step_time(self.chip, self.model, self.tp, batch, ctx_total)

    @property
    def kv_capacity_tokens(self) -> int:
        return kv_capacity_tokens(self.chip, self.model, self.tp, MEM_RESERVE_FRACTION)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def label(self) -> str:
        return f"{self.model.name} on {self.tp} x {self.chip.name}"

    def params(self) -> dict[str, object]:
        return {"model": self.model.name, "chip": self.chip.name, "tp": self.tp, "time_scale": self.time_scale,
                "kv_bytes_per_token": self.kv_bytes_per_token, "kv_capacity_tokens": self.kv_capacity_tokens}


@dataclass
class _KindStats:
    steps: int = 0
    overruns: int = 0
    overrun_s: float = 0.0  # real seconds past the modeled time, summed
    modeled_s: float = 0.0  # emulated seconds


@dataclass
class StepPacer:
    """Holds each engine step to its modeled time: `t0 = begin()` before the forward,
    `end(kind, t0, modeled_s)` after it (on the engine thread, so imports and extends queued on
    the event loop never slip into the 'busy device' time)."""

    emulation: Emulation
    clock: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep
    _stats: dict[str, _KindStats] = field(default_factory=lambda: {k: _KindStats() for k in STEP_KINDS})
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self) -> float:
        return self.clock()

    def end(self, kind: str, t0: float, modeled_s: float) -> float:
        """Sleep out the rest of the modeled step; returns the real seconds slept."""
        target = modeled_s * self.emulation.time_scale
        spent = self.clock() - t0
        rest = target - spent
        with self._lock:
            st = self._stats[kind]
            st.steps += 1
            st.modeled_s += modeled_s
            if rest < 0:
                st.overruns += 1
                st.overrun_s += -rest
        if rest > 0:
            self.sleep(rest)
            return rest
        return 0.0

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


def overrun_warning(stats: dict[str, float], time_scale: float) -> str | None:
    """The line a table prints when a run's overrun says it measured the CPU."""
    bad = [f"{k} {stats.get(f'overrun_share_{k}', 0.0):.1%}" for k in STEP_KINDS
           if stats.get(f"overrun_share_{k}", 0.0) > OVERRUN_WARN_SHARE]
    if not bad:
        return None
    return (f"emulation overrun above {OVERRUN_WARN_SHARE:.0%} ({', '.join(bad)} of steps took longer in real "
            f"time than modeled): these figures measure this machine's CPU; raise time_scale "
            f"(now {time_scale:g}, try {time_scale * 2:g})")


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
