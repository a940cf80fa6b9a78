"""Workloads as token-id requests: agentic sessions, hit-rate sweeps and Mooncake trace replay.

Everything is token ids (the completions API takes them), so prefix sharing is exact and a request's
prefix-cache hit is known by construction:

- **Agentic sessions** (PDD's target traffic): a context that grows turn by turn (the model's answer,
  then a tool output, appended). Each request draws a *target hit* from a `HitDistribution` (default
  skewed like docs/pdd.md: mean ~0.9, ~76% of requests above 0.95) and the generator sizes the appended
  tool output so the request hits exactly that much of what a decode-side cache holds (the session's
  earlier prompt + answer). A target the context can't reach is realized by a reset (the agent drops
  old tool outputs and opens a new file on top of its task prompt); hit 0 is a cold document. A small
  share of ultra-long-input, very-short-output requests stands in for docs/pdd.md's anomalous traffic.
- **Hit-rate sweep**: every request hits the same fraction (a warm-up request caches its prefix).
- **Mooncake trace replay**: each `hash_ids` entry (a 512-token block in the trace) maps to a
  reproducible run of `block_tokens` token ids, so equal ids share real prefix KV; token counts are
  scaled by `block_tokens / 512` (recorded); trace timestamps or Poisson arrivals; a time window
  and a request cap.

`planned_hit` is the *decode-side* view (prefix of an earlier prompt + output, block-aligned, at
least one prompt token left to compute, as the engine's radix cache matches); Prefill's own cache
holds prompts only, so its hit on a follow-up turn is lower by the answer's length.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOKEN_LO, TOKEN_HI = 3, 2048  # ids 0-2 are the default tokenizer's specials; 2048 = its vocab
TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' hash_ids granularity
DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
KINDS = ("agentic", "cold", "anomalous", "sweep", "trace", "warmup", "chat")


class TraceError(ValueError):
    """A trace line that can't be replayed; the message names the file and line."""


@dataclass(frozen=True)
class Turn:
    """One request: the context kept from earlier turns (`reset_to`), plus `tokens`."""

    tokens: tuple[int, ...]  # appended to the (possibly reset) context to form the prompt
    max_tokens: int
    kind: str = "agentic"
    reset_to: int | None = None  # keep only the first N context tokens first (None: all; 0: cold)
    think_s: float = 0.0  # pause after the previous answer before sending this turn
    planned_hit: float | None = None  # decode-side prefix hit by design (see module docstring)

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"Turn.max_tokens must be > 0, got {self.max_tokens}")
        if self.kind not in KINDS:
            raise ValueError(f"Turn.kind must be one of {KINDS}, got {self.kind!r}")
        if self.reset_to is not None and self.reset_to < 0:
            raise ValueError(f"Turn.reset_to must be >= 0, got {self.reset_to}")
        if self.think_s < 0:
            raise ValueError(f"Turn.think_s must be >= 0, got {self.think_s}")
        if self.planned_hit is not None and not 0.0 <= self.planned_hit <= 1.0:
            raise ValueError(f"Turn.planned_hit must be in [0, 1], got {self.planned_hit}")


@dataclass(frozen=True)
class Session:
    session_id: str
    turns: tuple[Turn, ...]
    start_s: float = 0.0  # open-loop arrival of the first turn (later turns follow its answers)

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"session {self.session_id} has no turns")
        if self.start_s < 0:
            raise ValueError(f"session {self.session_id}: start_s must be >= 0")
        if self.turns[0].reset_to not in (None, 0) or (not self.turns[0].tokens):
            raise ValueError(f"session {self.session_id}: the first turn must carry the whole prompt")


@dataclass(frozen=True)
class Workload:
    """What a load generator replays: measured sessions, plus warm-up sessions run (and awaited)
    first, which put shared prefixes into the caches and are not measured."""

    name: str
    sessions: tuple[Session, ...]
    warmup: tuple[Session, ...] = ()
    params: tuple[tuple[str, Any], ...] = ()  # how it was generated: recorded with every run

    def __post_init__(self) -> None:
        ids = [s.session_id for s in (*self.warmup, *self.sessions)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"workload {self.name}: session ids must be unique")

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def turns(self) -> Iterator[Turn]:
        for s in self.sessions:
            yield from s.turns

    def param_dict(self) -> dict[str, Any]:
        return {"workload": self.name, **dict(self.params), "requests": self.num_requests,
                "sessions": len(self.sessions), "warmup_sessions": len(self.warmup)}


# ---------------------------------------------------------------- the hit distribution


@dataclass(frozen=True)
class HitDistribution:
    """A mixture of uniform bands `(weight, lo, hi)` over the prefix-hit rate of a request.

    The default follows docs/pdd.md's agentic traffic: mean ~0.9 and 70-80% of requests above 0.95
    (76% in [0.95, 0.995]), 20% mid-hit in [0.70, 0.95) and 4% cold (hit 0: a new document).
    """

    bands: tuple[tuple[float, float, float], ...] = ((0.76, 0.95, 0.995), (0.20, 0.70, 0.95), (0.04, 0.0, 0.0))

    def __post_init__(self) -> None:
        bands = tuple((float(w), float(lo), float(hi)) for w, lo, hi in self.bands)
        object.__setattr__(self, "bands", bands)
        if not bands:
            raise ValueError("HitDistribution needs at least one band")
        for w, lo, hi in bands:
            if not (w > 0 and 0.0 <= lo <= hi < 1.0):
                raise ValueError(f"a hit band needs weight > 0 and 0 <= lo <= hi < 1, got ({w}, {lo}, {hi})")

    @classmethod
    def point(cls, hit: float) -> HitDistribution:
        return cls(((1.0, hit, hit),))

    @classmethod
    def parse(cls, spec: str) -> HitDistribution:
        """`W:LO-HI,W:X,...`, e.g. `0.76:0.95-0.995,0.2:0.7-0.95,0.04:0`; a single `X` is a point."""
        spec = spec.strip()
        try:
            if ":" not in spec:
                return cls.point(float(spec))
            bands = []
            for part in spec.split(","):
                w, rng = part.split(":")
                lo, _, hi = rng.partition("-")
                bands.append((float(w), float(lo), float(hi or lo)))
            return cls(tuple(bands))
        except ValueError as e:
            raise ValueError(f"bad hit distribution {spec!r} (expected W:LO-HI,W:X,... or X): {e}") from None

    @property
    def total_weight(self) -> float:
        return sum(w for w, _, _ in self.bands)

    @property
    def mean(self) -> float:
        return sum(w * (lo + hi) / 2 for w, lo, hi in self.bands) / self.total_weight

    def share_above(self, x: float) -> float:
        """P(hit > x) of the distribution itself (before block rounding)."""
        s = 0.0
        for w, lo, hi in self.bands:
            if hi == lo:
                s += w if lo > x else 0.0
            else:
                s += w * min(1.0, max(0.0, (hi - max(lo, x)) / (hi - lo)))
        return s / self.total_weight

    def sample(self, rng: random.Random) -> float:
        r = rng.random() * self.total_weight
        for w, lo, hi in self.bands:
            if r < w:
                return rng.uniform(lo, hi)
            r -= w
        _, lo, hi = self.bands[-1]
        return rng.uniform(lo, hi)

    def __str__(self) -> str:
        return ",".join(f"{w:g}:{lo:g}" + (f"-{hi:g}" if hi != lo else "") for w, lo, hi in self.bands)


# ---------------------------------------------------------------- token helpers


def fresh_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    """n token ids nobody else has: random over 2045 ids, so a 16-token block never collides."""
    return tuple(rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n))


def _aligned(n: int, block_size: int) -> int:
    return n // block_size * block_size


def _hit_tokens(cached: int, prompt_len: int, block_size: int) -> int:
    """Tokens a radix cache serves: full cached blocks, and at least one prompt token left to compute."""
    return _aligned(min(cached, prompt_len - 1), block_size)


def _arrivals(rng: random.Random, n: int, rate: float, arrival: str) -> list[float]:
    if arrival == "uniform":
        return [i / rate for i in range(n)]
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---------------------------------------------------------------- agentic sessions


@dataclass(frozen=True)
class AgenticWorkload:
    """Agentic multi-turn sessions with a target prefix-hit distribution (module docstring)."""

    sessions: int = 8
    turns: int = 4
    system_tokens: int = 1024  # shared by every session; a warm-up request caches it
    max_tokens: int = 96  # output per turn (sent with ignore_eos, so the plan's lengths hold)
    hit: HitDistribution = field(default_factory=HitDistribution)
    max_context_tokens: int = 3072  # prompt + output stays below this (the default model: 4096)
    cold_tokens: tuple[int, int] = (1024, 2048)  # a hit-0 request opens a fresh document this long
    anomalous_share: float = 0.03  # docs/pdd.md: ~3-4% of requests
    anomalous_tokens: tuple[int, int] = (2048, 2560)
    anomalous_max_tokens: int = 4
    session_rate: float = 0.5  # session arrivals per second
    arrival: str = "poisson"  # poisson | uniform
    think_s: float = 1.0  # mean pause between an answer and the next turn (tool execution)
    block_size: int = 16  # the serving graph's KV block: hits are whole blocks
    seed: int = 0

    def __post_init__(self) -> None:
        for k in ("sessions", "turns", "system_tokens", "max_tokens", "max_context_tokens", "anomalous_max_tokens",
                  "block_size"):
            if getattr(self, k) <= 0:
                raise ValueError(f"AgenticWorkload.{k} must be > 0, got {getattr(self, k)}")
        if isinstance(self.hit, str):
            object.__setattr__(self, "hit", HitDistribution.parse(self.hit))
        for k in ("cold_tokens", "anomalous_tokens"):
            lo, hi = getattr(self, k)
            if not 0 < lo <= hi:
                raise ValueError(f"AgenticWorkload.{k} must be (lo, hi) with 0 < lo <= hi, got {(lo, hi)}")
        if not 0.0 <= self.anomalous_share < 1.0:
            raise ValueError(f"AgenticWorkload.anomalous_share must be in [0, 1), got {self.anomalous_share}")
        if not self.session_rate > 0 or self.arrival not in ("poisson", "uniform"):
            raise ValueError("AgenticWorkload needs session_rate > 0 and arrival poisson|uniform")
        if self.think_s < 0:
            raise ValueError(f"AgenticWorkload.think_s must be >= 0, got {self.think_s}")
        longest = max(self.system_tokens + self.block_size, self.cold_tokens[1], self.anomalous_tokens[1])
        if longest + self.max_tokens > self.max_context_tokens:
            raise ValueError(f"AgenticWorkload: prompts of {longest} tokens + {self.max_tokens} output tokens "
                             f"exceed max_context_tokens={self.max_context_tokens}")

    @property
    def anomalous(self) -> int:
        return round(self.anomalous_share * self.sessions * self.turns)


def agentic_workload(w: AgenticWorkload) -> Workload:
    rng = random.Random(w.seed)
    system = fresh_tokens(random.Random(f"system:{w.seed}"), w.system_tokens)
    budget = w.max_context_tokens - w.max_tokens  # the longest prompt a turn may send
    starts = _arrivals(rng, w.sessions, w.session_rate, w.arrival)
    sessions: list[Session] = []
    for i in range(w.sessions):
        turns: list[Turn] = []
        ctx = 0  # context tokens (prompt + answer) after the previous turn
        first_prompt = 0  # the session's task prompt: a reset keeps it
        for k in range(w.turns):
            h = w.hit.sample(rng)
            think = 0.0 if k == 0 else w.think_s * rng.uniform(0.5, 1.5)
            turn = _agentic_turn(w, rng, system, h, k, ctx, first_prompt, budget, think)
            kept = ctx if turn.reset_to is None else turn.reset_to
            prompt = kept + len(turn.tokens)
            if k == 0 or turn.reset_to == 0:
                first_prompt = prompt
            ctx = prompt + w.max_tokens
            turns.append(turn)
        sessions.append(Session(f"agent-{i}", tuple(turns), start_s=starts[i]))
    span = max(starts[-1], 1.0 / w.session_rate)
    for j in range(w.anomalous):
        n = rng.randint(*w.anomalous_tokens)
        turn = Turn(fresh_tokens(rng, n), w.anomalous_max_tokens, "anomalous", planned_hit=0.0)
        sessions.append(Session(f"anomalous-{j}", (turn,), start_s=rng.uniform(0.0, span)))
    warm = Session("warmup-system", (Turn(system, 8, "warmup"),))
    params = (("sessions", w.sessions), ("turns", w.turns), ("system_tokens", w.system_tokens),
              ("max_tokens", w.max_tokens), ("hit", str(w.hit)), ("hit_mean", round(w.hit.mean, 4)),
              ("max_context_tokens", w.max_context_tokens), ("cold_tokens", f"{w.cold_tokens[0]}-{w.cold_tokens[1]}"),
              ("anomalous", w.anomalous), ("anomalous_tokens", f"{w.anomalous_tokens[0]}-{w.anomalous_tokens[1]}"),
              ("anomalous_max_tokens", w.anomalous_max_tokens), ("session_rate", w.session_rate),
              ("arrival", w.arrival), ("think_s", w.think_s), ("block_size", w.block_size), ("seed", w.seed))
    return Workload("agentic", tuple(sorted(sessions, key=lambda s: s.start_s)), (warm,), params)


def _agentic_turn(w: AgenticWorkload, rng: random.Random, system: tuple[int, ...], h: float, k: int, ctx: int,
                  first_prompt: int, budget: int, think: float) -> Turn:
    """Size this turn so that it hits `h` of a prefix the decode side caches: the whole context
    (append), the session's task prompt (reset) or the shared system prompt; hit 0 is cold."""
    bs = w.block_size
    if h > 0:
        # candidates: (kept tokens, tokens of it the cache holds: the last answer token has no KV)
        cands: list[tuple[int | None, int, int]] = []
        if k > 0:
            cands += [(None, ctx, ctx - 1), (first_prompt, first_prompt, first_prompt)]
        cands.append((0, 0, len(system)))  # reset_to 0, then the system prompt is re-sent
        for reset_to, kept, cached in cands:
            base = kept if reset_to != 0 else len(system)  # tokens the prompt starts with
            # floor: block rounding never leaves a request below its target hit
            total = max(base + 1, math.floor(_aligned(cached, bs) / h))
            if total > budget:
                continue
            head = system if reset_to == 0 else ()  # a new task under the shared system prompt
            tokens = head + fresh_tokens(rng, total - base)
            planned = _hit_tokens(cached, total, bs) / total
            return Turn(tokens, w.max_tokens, "agentic", reset_to, think, planned)
    n = rng.randint(*w.cold_tokens)
    return Turn(fresh_tokens(rng, n), w.max_tokens, "cold", 0, think, 0.0)


def agentic_sessions(w: AgenticWorkload) -> list[Session]:
    """The measured sessions of `agentic_workload(w)` (kept for callers that want a plain list)."""
    return list(agentic_workload(w).sessions)


# ---------------------------------------------------------------- multi-turn chat


@dataclass(frozen=True)
class ChatWorkload:
    """Multi-turn chat as a chat benchmark client sends it: every conversation opens with one
    shared system prompt and its own user context, then asks `turns` questions; each answer and
    the next question are appended. No warm-up: the first conversations arrive at cold caches."""

    conversations: int = 10
    turns: int = 4
    system_tokens: int = 800  # shared by every conversation
    context_tokens: int = 300  # each conversation's own, after the system prompt
    turn_tokens: int = 120  # each question
    max_tokens: int = 48  # each answer (sent with ignore_eos)
    seed: int = 0

    def __post_init__(self) -> None:
        for k in ("conversations", "turns", "system_tokens", "turn_tokens", "max_tokens"):
            if getattr(self, k) <= 0:
                raise ValueError(f"ChatWorkload.{k} must be > 0, got {getattr(self, k)}")
        if self.context_tokens < 0:
            raise ValueError(f"ChatWorkload.context_tokens must be >= 0, got {self.context_tokens}")


def chat_workload(w: ChatWorkload) -> Workload:
    rng = random.Random(w.seed)
    system = fresh_tokens(random.Random(f"system:{w.seed}"), w.system_tokens)
    sessions = []
    for i in range(w.conversations):
        opening = system + fresh_tokens(rng, w.context_tokens + w.turn_tokens)
        later = [fresh_tokens(rng, w.turn_tokens) for _ in range(w.turns - 1)]
        turns = [Turn(t, w.max_tokens, "chat") for t in (opening, *later)]
        sessions.append(Session(f"chat-{i}", tuple(turns)))
    params = tuple((k, getattr(w, k)) for k in ("conversations", "turns", "system_tokens", "context_tokens",
                                                 "turn_tokens", "max_tokens", "seed"))
    return Workload("chat", tuple(sessions), (), params)


# ---------------------------------------------------------------- hit-rate sweep


@dataclass(frozen=True)
class SweepWorkload:
    """Independent requests that all hit `hit` of their prompt: each reuses a prefix that a
    warm-up request (same prefix, run first) put into both caches; the rest is fresh."""

    hit: float
    requests: int = 6
    prompt_tokens: int = 1536
    max_tokens: int = 64
    rate: float = 0.5  # arrivals per second
    arrival: str = "poisson"
    block_size: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.hit < 1.0:
            raise ValueError(f"SweepWorkload.hit must be in [0, 1), got {self.hit}")
        if self.requests <= 0 or self.prompt_tokens <= self.block_size or self.max_tokens <= 0:
            raise ValueError("SweepWorkload needs requests > 0, prompt_tokens > block_size, max_tokens > 0")
        if not self.rate > 0 or self.arrival not in ("poisson", "uniform"):
            raise ValueError("SweepWorkload needs rate > 0 and arrival poisson|uniform")


def sweep_workload(w: SweepWorkload) -> Workload:
    # tokens seeded per point, so two points never share a prefix (each starts from cold caches);
    # arrivals seeded without it, so every point sees the same arrival times
    rng = random.Random(f"sweep:{w.seed}:{w.hit}")
    prefix_len = _aligned(round(w.hit * w.prompt_tokens), w.block_size)
    starts = _arrivals(random.Random(f"sweep-arrivals:{w.seed}"), w.requests, w.rate, w.arrival)
    sessions, warm = [], []
    for i in range(w.requests):
        prefix = fresh_tokens(rng, prefix_len)
        prompt = prefix + fresh_tokens(rng, w.prompt_tokens - prefix_len)
        planned = _hit_tokens(prefix_len, len(prompt), w.block_size) / len(prompt)
        if prefix_len:
            # 16 output tokens: long enough that the anomalous-traffic filter lets MD cache it
            warm.append(Session(f"warm-{i}", (Turn(prefix, 16, "warmup"),)))
        sessions.append(Session(f"sweep-{i}", (Turn(prompt, w.max_tokens, "sweep", planned_hit=planned),),
                                start_s=starts[i]))
    params = (("hit", w.hit), ("requests", w.requests), ("prompt_tokens", w.prompt_tokens),
              ("max_tokens", w.max_tokens), ("rate", w.rate), ("arrival", w.arrival),
              ("block_size", w.block_size), ("seed", w.seed))
    return Workload(f"sweep-hit-{w.hit:g}", tuple(sessions), tuple(warm), params)


# ---------------------------------------------------------------- Mooncake trace replay


@dataclass(frozen=True)
class TraceRecord:
    line: int  # 1-based line number in the file
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None) -> Iterator[TraceRecord]:
    """Mooncake-format JSONL records, validated; a bad line raises TraceError naming file and line."""
    path = Path(path)
    try:
        f = path.open()
    except OSError as e:
        raise TraceError(f"{path}: cannot read trace: {e}") from None
    n = 0
    with f:
        for i, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            yield _parse_trace_line(path, i, raw)
            n += 1
            if limit is not None and n >= limit:
                return


def _parse_trace_line(path: Path, i: int, raw: str) -> TraceRecord:
    where = f"{path}:{i}"
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise TraceError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")

    def count(k: str, lo: int) -> int:
        v = obj[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise TraceError(f"{where}: {k} must be an integer >= {lo}, got {v!r}")
        return v

    ts, inp, out = count("timestamp", 0), count("input_length", 1), count("output_length", 1)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
        raise TraceError(f"{where}: hash_ids must be a non-empty list of integers >= 0")
    need = math.ceil(inp / TRACE_BLOCK_TOKENS)
    if len(ids) != need:
        raise TraceError(f"{where}: {len(ids)} hash_ids for input_length {inp} "
                         f"(expected {need} blocks of {TRACE_BLOCK_TOKENS} tokens)")
    return TraceRecord(i, ts, inp, out, tuple(ids))


@dataclass(frozen=True)
class TraceReplay:
    """How to replay a Mooncake trace on the small model."""

    path: str = str(DEFAULT_TRACE)
    block_tokens: int = 32  # tokens per trace block (512 in the trace): the input scale is block_tokens/512
    output_scale: float | None = None  # None: the input scale
    min_output_tokens: int = 8
    max_output_tokens: int = 128
    start_s: float = 0.0  # time window of the trace to replay, seconds from its start
    window_s: float | None = None
    max_requests: int | None = 40
    arrival: str = "trace"  # trace (its timestamps x gap_scale) | poisson
    gap_scale: float = 1.0  # trace: >1 stretches the trace's gaps (slows it down)
    rate: float = 1.0  # poisson: arrivals per second
    max_context_tokens: int = 4096  # prompt + output above this: the line is skipped (counted)
    block_size: int = 16  # the serving graph's KV block (planned hits are whole blocks)
    seed: int = 0
    # a window's prefix reuse reaches back minutes: warm both caches first with the prefixes it
    # reuses from the trace's earlier requests (prefill only, not measured), so it sees those hits
    warm_history: bool = True

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.block_size <= 0 or self.min_output_tokens <= 0 or self.max_output_tokens < self.min_output_tokens:
            raise ValueError("TraceReplay needs block_tokens > 0 and 0 < min_output_tokens <= max_output_tokens")
        if self.output_scale is not None and not self.output_scale > 0:
            raise ValueError(f"TraceReplay.output_scale must be > 0, got {self.output_scale}")
        if self.start_s < 0 or (self.window_s is not None and self.window_s <= 0):
            raise ValueError("TraceReplay needs start_s >= 0 and window_s > 0 (or None)")
        if self.max_requests is not None and self.max_requests <= 0:
            raise ValueError("TraceReplay.max_requests must be > 0 (or None)")
        if self.arrival not in ("trace", "poisson") or not self.gap_scale > 0 or not self.rate > 0:
            raise ValueError("TraceReplay needs arrival trace|poisson, gap_scale > 0 and rate > 0")

    @property
    def input_scale(self) -> float:
        return self.block_tokens / TRACE_BLOCK_TOKENS

    @property
    def effective_output_scale(self) -> float:
        return self.input_scale if self.output_scale is None else self.output_scale


class BlockTokens:
    """hash id -> its block's token ids, reproducibly (seeded by (seed, hash id)), so a block is
    the same tokens in every run and every request that names it."""

    def __init__(self, block_tokens: int, seed: int = 0) -> None:
        self.block_tokens, self.seed = block_tokens, seed
        self._cache: dict[int, tuple[int, ...]] = {}

    def __call__(self, h: int) -> tuple[int, ...]:
        toks = self._cache.get(h)
        if toks is None:
            toks = self._cache[h] = fresh_tokens(random.Random(f"mooncake:{self.seed}:{h}"), self.block_tokens)
        return toks

    def prompt(self, hash_ids: Iterable[int], length: int) -> tuple[int, ...]:
        out: list[int] = []
        for h in hash_ids:
            out.extend(self(h))
        return tuple(out[:length])


def trace_workload(r: TraceReplay) -> Workload:
    """Sessions of one request each, from the trace's window; planned hits from its hash ids."""
    blocks = BlockTokens(r.block_tokens, r.seed)
    rng = random.Random(f"arrivals:{r.seed}")
    sessions: list[Session] = []
    seen: set[int] = set()  # hash chains of the block prefixes of earlier replayed requests
    skipped = 0
    t0_ms: int | None = None
    t_poisson = 0.0
    start_ms, end_ms = r.start_s * 1000, (r.start_s + r.window_s) * 1000 if r.window_s else math.inf
    history: set[int] = set()  # hash chains of the requests before the window
    warmups: list[Session] = []

    def chains_of(ids: Sequence[int]) -> list[int]:
        out, parent = [], 0
        for h in ids:
            parent = hash((parent, h))
            out.append(parent)
        return out

    for rec in read_trace(r.path):
        if rec.timestamp_ms < start_ms:
            if r.warm_history:
                n_hist = max(2, round(rec.input_length * r.input_scale))
                history.update(chains_of(rec.hash_ids[: math.ceil(n_hist / r.block_tokens)]))
            continue
        if rec.timestamp_ms >= end_ms or (r.max_requests is not None and len(sessions) >= r.max_requests):
            break
        n_in = max(2, round(rec.input_length * r.input_scale))
        n_out = min(r.max_output_tokens, max(r.min_output_tokens, round(rec.output_length * r.effective_output_scale)))
        if n_in + n_out > r.max_context_tokens:
            skipped += 1
            continue
        if t0_ms is None:
            t0_ms = rec.timestamp_ms
        if r.arrival == "trace":
            at = (rec.timestamp_ms - t0_ms) / 1000 * r.gap_scale
        else:
            at, t_poisson = t_poisson, t_poisson + rng.expovariate(r.rate)
        ids = rec.hash_ids[: math.ceil(n_in / r.block_tokens)]
        chains = chains_of(ids)
        # the full blocks of this prompt that the history holds and the window has not warmed yet
        k = 0
        while k < len(chains) and (k + 1) * r.block_tokens <= n_in and (chains[k] in seen or chains[k] in history):
            k += 1
        if k and chains[k - 1] not in seen:
            # 16 output tokens, like the other warm-ups: a 1-token answer to a long prompt is
            # anomalous traffic, which PDD keeps off the WAN (it would warm P's cache, not MD's)
            warmups.append(Session(f"history-{rec.line}", (Turn(blocks.prompt(ids[:k], k * r.block_tokens), 16,
                                                                 "warmup"),)))
            seen.update(chains[:k])
        hit_blocks = 0
        while hit_blocks < len(chains) and chains[hit_blocks] in seen:
            hit_blocks += 1
        planned = _hit_tokens(hit_blocks * r.block_tokens, n_in, r.block_size) / n_in
        seen.update(chains)
        turn = Turn(blocks.prompt(ids, n_in), n_out, "trace", planned_hit=planned)
        sessions.append(Session(f"trace-{rec.line}", (turn,), start_s=at))
    if not sessions:
        raise TraceError(f"{r.path}: no replayable request in the window start_s={r.start_s} window_s={r.window_s}")
    params = (("trace", Path(r.path).name), ("block_tokens", r.block_tokens), ("input_scale", r.input_scale),
              ("output_scale", r.effective_output_scale), ("min_output_tokens", r.min_output_tokens),
              ("max_output_tokens", r.max_output_tokens), ("start_s", r.start_s), ("window_s", r.window_s),
              ("max_requests", r.max_requests), ("arrival", r.arrival), ("gap_scale", r.gap_scale),
              ("rate", r.rate), ("skipped_too_long", skipped), ("seed", r.seed),
              ("history_warmups", len(warmups)))
    return Workload("mooncake-conversation", tuple(sessions), tuple(warmups), params)


# ---------------------------------------------------------------- statistics


def simulate_hits(workload: Workload, block_size: int = 16, output_tokens: int | None = None) -> list[float]:
    """Each measured request's decode-side hit, recomputed independently of the generators: replay
    the prompts in arrival order (warm-up first) against a set of block-hash chains of every
    earlier prompt + answer (answers are placeholder tokens of `max_tokens`, as ignore_eos gives),
    the way a radix cache of unbounded size would serve them."""
    cached: set[tuple[int, int]] = set()
    answer_rng = random.Random("answers")

    def chain(tokens: Sequence[int]) -> list[tuple[int, int]]:
        out, parent = [], 0
        for b in range(len(tokens) // block_size):
            parent = hash((parent, tuple(tokens[b * block_size:(b + 1) * block_size])))
            out.append((b, parent))
        return out

    def run(s: Session, measure: bool) -> Iterator[tuple[float, float]]:
        ctx: list[int] = []
        for t in s.turns:
            ctx = (ctx if t.reset_to is None else ctx[: t.reset_to]) + list(t.tokens)
            hits = 0
            for key in chain(ctx[:-1]):
                if key not in cached:
                    break
                hits += 1
            if measure:
                yield s.start_s, hits * block_size / len(ctx)
            answer = fresh_tokens(answer_rng, output_tokens or t.max_tokens)
            ctx = ctx + list(answer)
            cached.update(chain(ctx[:-1]))

    for s in workload.warmup:
        list(run(s, False))
    out: list[tuple[float, float]] = []
    for s in sorted(workload.sessions, key=lambda s: s.start_s):
        out.extend(run(s, True))
    return [h for _, h in out]


def hit_stats(hits: Sequence[float]) -> dict[str, float]:
    n = len(hits)
    if not n:
        return {"requests": 0, "mean": math.nan, "above_0.95": math.nan, "zero": math.nan}
    return {"requests": n, "mean": sum(hits) / n, "above_0.95": sum(h > 0.95 for h in hits) / n,
            "zero": sum(h == 0 for h in hits) / n}
