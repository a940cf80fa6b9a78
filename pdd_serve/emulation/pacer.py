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

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdd_serve.config import DEFAULT_MAX_BATCH, MEM_RESERVE_FRACTION, PDDConfig
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.costmodel import (
    ChipSpec,
    ModelShape,
    decode_batch_limit,
    decode_step_time,
    kv_capacity_tokens,
    kv_copy_time,
    load_catalog,
    model_from,
    prefill_time,
)
from pdd_serve.engine.protocol import FORWARD_KINDS, ForwardWork

STEP_KINDS = FORWARD_KINDS  # prefill: any multi-token forward (prefill chunk, extend, resume)
# what a pacer holds and counts: the forwards, and the KV moving between the pool and the NIC
# (import: received blocks into the pool; export: the pool's blocks out to a buffer)
PACED_KINDS = (*STEP_KINDS, "import", "export")
OVERRUN_WARN_SHARE = 0.05  # above this, a run measures the CPU, not the emulated chip


@dataclass(frozen=True)
class Emulation:
    """One role's emulated accelerator: `tp` chips of `chip` serving `model` (times in emulated seconds)."""

    chip: ChipSpec
    model: ModelShape
    tp: int = 1
    # one real prompt token stands for this many emulated tokens (config.PDDConfig.context_scale);
    # a generated token for one
    context_scale: int = 1
    batch_context_tokens: int | None = None  # config.EmulateEntry's: what the batch cap is sized for

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Emulated seconds of one forward over `new_tokens` after `cached_tokens` of context
        (emulated tokens)."""
        return prefill_time(self.chip, self.model, self.tp, [(new_tokens, cached_tokens)])

    def decode_s(self, batch: int, ctx_total: int) -> float:
        """Emulated seconds of one decode step of `batch` sequences holding `ctx_total` emulated
        tokens of KV."""
        return decode_step_time(self.chip, self.model, self.tp, batch, ctx_total)

    def scaled(self, tokens: int, prompt: int) -> int:
        """Emulated tokens of `tokens` real ones, `prompt` of them the prompt's."""
        return tokens + (self.context_scale - 1) * prompt

    def forward_s(self, work: ForwardWork) -> float:
        """Emulated seconds of one forward an engine reported (its prompt tokens scaled); a batch
        that mixes prefill chunks and decodes is costed by its sequences (`ForwardWork.parts`)."""
        ctx = self.scaled(work.context_tokens, work.prompt_context)
        if work.kind == "decode":
            return self.decode_s(work.seqs, ctx)
        if work.parts:
            return prefill_time(self.chip, self.model, self.tp,
                                [(self.scaled(n, pn), self.scaled(c, pc)) for n, c, pn, pc in work.parts])
        return self.prefill_s(self.scaled(work.new_tokens, work.prompt_new), ctx)

    def copy_s(self, tokens: int) -> float:
        """Emulated seconds to move `tokens` real tokens of KV between the pool and the NIC (an
        import or an export), at the catalog's NIC rate (`interconnect_gb_s`), as the simulator
        charges a copy inside a site. Every KV copy is of a prompt's blocks (a handoff sends
        generated tokens as ids, and the decoder computes their KV), so each counts context_scale."""
        return kv_copy_time(tokens * self.context_scale * self.model.kv_bytes_per_token, self.chip, self.chip)

    @property
    def kv_capacity_tokens(self) -> int:
        """Emulated tokens of KV the chips hold."""
        return kv_capacity_tokens(self.chip, self.model, self.tp, MEM_RESERVE_FRACTION)

    @property
    def real_pool_tokens(self) -> int:
        """Real tokens of the small model's pool that stand for it (each a prompt token's KV)."""
        return self.kv_capacity_tokens // self.context_scale

    @property
    def kv_bytes_per_token(self) -> int:
        """Emulated KV bytes per real prompt token (context_scale emulated tokens)."""
        return self.model.kv_bytes_per_token * self.context_scale

    def label(self) -> str:
        k = f", context_scale {self.context_scale}" if self.context_scale != 1 else ""
        return f"{self.model.name} on {self.tp} x {self.chip.name}{k}"

    def params(self, clock: Clock) -> dict[str, object]:
        return {"model": self.model.name, "chip": self.chip.name, "tp": self.tp, "time_scale": clock.time_scale,
                "context_scale": self.context_scale, "kv_bytes_per_token": self.model.kv_bytes_per_token,
                "kv_capacity_tokens": self.kv_capacity_tokens}


def decode_batch_cap(e: Emulation | None, set_cap: int | None, tpot_s: float | None, ctx_per_seq: int,
                     pool_tokens: int) -> int:
    """A decoder's batch cap: the graph's `max_batch` where it sets one; on emulated chips with a
    TPOT SLO, the largest batch they step within it with every sequence at `ctx_per_seq` tokens (the
    engine's context limit: any batch under the cap meets it; the emulation's batch_context_tokens
    where it sets one) and whose KV fits the pool of `pool_tokens`, at least one; otherwise
    DEFAULT_MAX_BATCH (no larger than the pool holds). Both are real tokens, scaled here as prompt
    tokens (the limit's worst case). The serving graph and the simulator both take it from here."""
    if set_cap is not None:
        return set_cap
    if e is None:
        return DEFAULT_MAX_BATCH
    ctx_per_seq, pool_tokens = ctx_per_seq * e.context_scale, pool_tokens * e.context_scale
    if e.batch_context_tokens is not None:
        ctx_per_seq = e.batch_context_tokens
    if tpot_s is None:  # no SLO to size it by: the default, as an unemulated engine has
        return max(1, min(DEFAULT_MAX_BATCH, decode_batch_limit(e.chip, e.model, e.tp, math.inf, ctx_per_seq,
                                                                pool_tokens)))
    return max(1, decode_batch_limit(e.chip, e.model, e.tp, tpot_s, ctx_per_seq, pool_tokens))


def build_emulation(cfg: PDDConfig, role: str) -> Emulation | None:
    """One role's emulated accelerator from the graph's `emulate:` (checked at load), None unemulated."""
    e = cfg.emulate_for(role)
    if e is None:
        return None
    cat = load_catalog()
    model = model_from(e.model, "emulate.model") if isinstance(e.model, dict) else cat.model(e.model)
    return Emulation(cat.chip(e.chip), model, e.tp, cfg.context_scale, e.batch_context_tokens)


def kv_scale(cfg: PDDConfig, real_bytes_per_token: int) -> float:
    """Emulated KV bytes per real KV byte (1 unemulated): what the link, the line's backlog, the
    bandwidth view and `wan_bytes` count, while the real small blocks cross. Every block that
    crosses is a prompt's, so it counts context_scale emulated tokens. One emulated model serves
    the whole graph (checked at load), so any role's gives it."""
    e = build_emulation(cfg, "prefill")
    return e.kv_bytes_per_token / real_bytes_per_token if e is not None else 1.0


@dataclass
class _KindStats:
    steps: int = 0  # paced calls of this kind (a prefill chunk, a decode step, an extend, an import, an export)
    overruns: int = 0  # of them, calls whose whole real time exceeded their modeled time
    overrun_s: float = 0.0  # real seconds past the modeled time, summed
    modeled_s: float = 0.0  # emulated seconds
    real_s: float = 0.0  # real seconds of the whole calls


@dataclass
class StepPacer:
    """Holds each engine call to its modeled time on the graph's `clock`: `t0 = begin()` before
    the call, `hold(t0, kind, modeled)` after it (on the engine thread, so imports and extends
    queued on the event loop never slip into the 'busy device' time). An overrun is counted over
    the whole call, not only its forwards: the host work around them (sampling, bookkeeping,
    hashing) is this machine's too, and a call that took longer than the chip would have means
    the run measured the CPU."""

    emulation: Emulation
    clock: Clock = Clock()
    timer: Callable[[], float] = time.perf_counter
    sleep: Callable[[float], None] = time.sleep
    _stats: dict[str, _KindStats] = field(default_factory=lambda: {k: _KindStats() for k in PACED_KINDS})
    _lock: threading.Lock = field(default_factory=threading.Lock)
    unpaced_s: float = 0.0  # real seconds of engine calls no cost models (matching, hashing, adding)

    def begin(self) -> float:
        return self.timer()

    def end(self, kind: str, t0: float, modeled_s: float) -> float:
        """Sleep out the rest of the modeled call; returns the real seconds slept."""
        return self.hold(t0, kind, [(modeled_s, self.timer() - t0)])

    def hold(self, t0: float, kind: str, parts: list[tuple[float, float]], host_s: float = 0.0) -> float:
        """One engine call of `kind` that began at `t0` and ran `parts` (modeled seconds, real
        seconds of each forward or copy in it): count the call, then sleep out the rest of its
        modeled time since t0; returns the real seconds slept. Each part takes the longer of its
        real and its modeled time, as if held on its own (one that overran does not eat the
        modeled time of the next); the call overran when its whole real time exceeded its modeled
        time, and an overrun is never slept away. `host_s`: real seconds of the call spent on host
        work a chip overlaps with its compute (the blocks a chunk hands the Flight sender): not
        counted against the call, reported as unpaced."""
        modeled = sum(m for m, _ in parts)
        target = sum(max(real, self.clock.real(m)) for m, real in parts)
        wall = self.timer() - t0
        elapsed = wall - host_s
        with self._lock:
            st = self._stats[kind]
            st.steps += 1
            st.modeled_s += modeled
            st.real_s += elapsed
            over = elapsed - self.clock.real(modeled)
            if over > 0:
                st.overruns += 1
                st.overrun_s += over
        rest = target - wall
        if rest > 0:
            self.sleep(rest)
            return rest
        return 0.0

    def add_unpaced(self, real_s: float) -> None:
        with self._lock:
            self.unpaced_s += real_s

    def params(self) -> dict[str, object]:
        """What this pacer emulates, and on which clock."""
        return self.emulation.params(self.clock)

    def stats(self) -> dict[str, float]:
        """Per kind: calls, overruns, overrun share, overrun seconds (real), modeled seconds, real
        seconds; and the engine's unpaced real seconds (host work no cost models)."""
        out: dict[str, float] = {}
        with self._lock:
            for k, st in self._stats.items():
                out[f"{k}_steps"] = st.steps
                out[f"{k}_overruns"] = st.overruns
                out[f"overrun_share_{k}"] = st.overruns / st.steps if st.steps else 0.0
                out[f"{k}_overrun_s"] = st.overrun_s
                out[f"{k}_modeled_s"] = st.modeled_s
                out[f"{k}_real_s"] = st.real_s
            out["unpaced_s"] = self.unpaced_s
        return out


def overrun_warning(stats: dict[str, float], clock: Clock) -> str | None:
    """The line a table prints when a run's overrun says it measured the CPU (on `clock`)."""
    bad = [f"{k} {stats.get(f'overrun_share_{k}', 0.0):.1%}" for k in PACED_KINDS
           if stats.get(f"overrun_share_{k}", 0.0) > OVERRUN_WARN_SHARE]
    if not bad:
        return None
    slower = clock.slower()
    advice = (f"raise time_scale (now {clock.time_scale:g}, try {slower.time_scale:g})" if slower != clock
              else f"time_scale {clock.time_scale:g} can go no slower (it stays under 1e6)")
    return (f"emulation overrun above {OVERRUN_WARN_SHARE:.0%} ({', '.join(bad)} of steps took longer in real "
            f"time than modeled): these figures measure this machine's CPU; {advice}")


def merge_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Sum per-replica pacer stats (shares recomputed from the sums). `unpaced_engine_share`: the
    engines' real time in calls no cost models, over all their real time in engine calls."""
    out: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            if not k.startswith("overrun_share_") and k != "unpaced_engine_share":
                out[k] = out.get(k, 0) + v
    for k in PACED_KINDS:
        n = out.get(f"{k}_steps", 0)
        out[f"overrun_share_{k}"] = out.get(f"{k}_overruns", 0) / n if n else 0.0
    paced = sum(out.get(f"{k}_real_s", 0.0) for k in PACED_KINDS)
    un = out.get("unpaced_s", 0.0)
    out["unpaced_engine_share"] = un / (un + paced) if un + paced > 0 else 0.0
    return out


class PacedEngine:
    """An engine behind the seam (`engine.protocol.EngineBackend`) held to an emulated chip's
    timing. Each call that computes (`prefill`, `extend`, `step`) returns no sooner than the
    modeled time of the forwards the engine reported during it; a chunked prefill is held at every
    chunk, before `on_chunk` lets that chunk's blocks leave, as on the chip. A KV import or export
    called on its own is held to the copy's time at the chip's NIC rate; one made inside a paced
    call (a chunk's blocks handed to the Flight sender) overlaps the compute, as a chip's DMA
    does, and its host time is reported as unpaced. Every other engine call on the engine thread
    (matching, hashing, adding) is timed as unpaced host work. Only calls through this wrapper are
    paced."""

    _OWN = ("inner", "pacer", "_work", "_depth", "_host_s")
    _PACED = ("prefill", "extend", "step", "import_kv", "export_kv")

    def __init__(self, engine: Any, pacer: StepPacer) -> None:
        object.__setattr__(self, "inner", engine)
        object.__setattr__(self, "pacer", pacer)
        object.__setattr__(self, "_work", [])
        object.__setattr__(self, "_depth", 0)  # paced calls in progress (a chunk's export nests in prefill)
        object.__setattr__(self, "_host_s", 0.0)  # host seconds inside the current paced call
        engine.on_forward = self._work.append  # runs on the engine thread, as every call here

    def __getattr__(self, name: str) -> Any:  # only for names not set on the wrapper
        if name in PacedEngine._OWN:  # not set yet (a copy, an unpickle): no recursion through inner
            raise AttributeError(name)
        value = getattr(self.inner, name)
        if not callable(value) or name.startswith("_") or isinstance(value, type):
            return value
        return self._timed(value)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` timed as unpaced host work when it runs on the engine thread (stats read from the
        event loop are not the engine's work)."""
        pacer = self.pacer

        def call(*args: Any, **kwargs: Any) -> Any:
            if not threading.current_thread().name.startswith("pdd-engine"):
                return fn(*args, **kwargs)
            t = pacer.timer()
            try:
                return fn(*args, **kwargs)
            finally:
                pacer.add_unpaced(pacer.timer() - t)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        """Attributes are the engine's (a test replacing `add` replaces the engine's); its
        `on_forward` is this wrapper's, which pacing depends on."""
        if name == "on_forward":
            raise AttributeError("a PacedEngine's engine reports its forwards to the pacer: wrap the engine "
                                 "before pacing it, or read pacer.stats()")
        if name in PacedEngine._OWN:
            object.__setattr__(self, name, value)
            return
        setattr(self.inner, name, value)

    def _begin(self) -> float:
        self._work.clear()  # forwards of an unpaced call (generate) are not this call's
        self._depth += 1
        self._host_s = 0.0
        return self.pacer.begin()

    def _hold(self, t0: float, kind: str) -> None:
        work, emu = list(self._work), self.pacer.emulation
        self._work.clear()
        host, self._host_s = self._host_s, 0.0
        if work:  # a call that computed nothing (an empty step) held no chip
            self.pacer.hold(t0, kind, [(emu.forward_s(w), w.real_s) for w in work], host)
        else:  # its host time is unpaced (less the copies inside it, counted there already)
            self.pacer.add_unpaced(self.pacer.timer() - t0 - host)

    def _end(self) -> None:
        self._depth -= 1

    def prefill(self, seq: Any, use_cache: bool = True, chunk_tokens: int | None = None,
                on_chunk: Callable[[Any], None] | None = None) -> int:
        t0 = [self._begin()]

        def chunk(s: Any) -> None:  # the chunk's time is up before its blocks may leave
            self._hold(t0[0], "prefill")
            t0[0] = self.pacer.begin()
            if on_chunk is not None:
                on_chunk(s)

        try:
            return self.inner.prefill(seq, use_cache, chunk_tokens, chunk)
        finally:  # a call that failed after computing still held the chip (and is counted)
            self._hold(t0[0], "prefill")
            self._end()

    def extend(self, seq: Any, token_ids: list[int], sample: bool = True) -> int | None:
        t0 = self._begin()
        try:
            return self.inner.extend(seq, token_ids, sample)
        finally:
            self._hold(t0, "prefill")
            self._end()

    def step(self, seqs: list[Any]) -> list[tuple[Any, int]]:
        t0 = self._begin()
        try:
            return self.inner.step(seqs)
        finally:
            self._hold(t0, "decode")
            self._end()

    def _copy(self, kind: str, fn: Callable[[], Any], tokens: Callable[[Any], int]) -> Any:
        """An import or export: held to its NIC time on its own; inside a paced call, host work."""
        t0 = self.pacer.begin()
        if self._depth:
            try:
                return fn()
            finally:
                dt = self.pacer.timer() - t0
                self._host_s += dt
                self.pacer.add_unpaced(dt)
        out = None
        try:
            out = fn()
            return out
        finally:
            n = tokens(out)
            if n > 0:
                self.pacer.hold(t0, kind, [(self.pacer.emulation.copy_s(n), self.pacer.timer() - t0)])

    def import_kv(self, seq: Any, blocks: Any, verify: bool = True) -> None:
        return self._copy("import", lambda: self.inner.import_kv(seq, blocks, verify), lambda _: _tokens(blocks))

    def export_kv(self, seq: Any, start_block: int = 0, end_block: int | None = None) -> Any:
        return self._copy("export", lambda: self.inner.export_kv(seq, start_block, end_block),
                          lambda out: 0 if out is None else _tokens(out))


def _tokens(blocks: Any) -> int:
    """Valid token slots of a KVBlocks run (its last block may be partial)."""
    n = getattr(blocks, "num_tokens", -1)
    if n is None or n < 0:
        n = len(blocks.data) * blocks.layout.block_size
    return int(n)
