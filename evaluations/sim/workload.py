"""Arrivals for the simulator: the report's synthetic skewed-hit benchmark, or a Mooncake trace.

Prefix reuse is expressed in block identities, never tokens: a request carries the ids of its
full prompt blocks (prefix-chain identities, like pdd_serve's block hashes and Mooncake's
hash_ids), and the radix caches match those directly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from evaluations.sim.config import ScenarioError, WorkloadSpec

FRESH_ID_BASE = 1 << 40  # ids of never-seen blocks; family blocks stay below it
FAMILY_STRIDE = 1 << 20


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: int
    arrival: float
    prompt: int
    output: int
    blocks: tuple[int, ...]  # ids of the prompt's full blocks, in order
    kind: str = "normal"  # normal | anomalous | record
    fixed_hit_p: int | None = None  # tokens: replay a measured hit instead of asking the caches
    fixed_hit_md: int | None = None
    fixed_wan_bytes: int | None = None  # bytes: replay the KV a recorded request really sent to MD
    family: int = -1
    # closed-loop sessions (a recorded run's later turns): sent `think_s` after request `after` ends
    after: int = -1
    think_s: float = 0.0
    # what a decoder caches when it is done (prompt + answer blocks); empty: the prompt's blocks
    decoded_blocks: tuple[int, ...] = ()
    # ---- outcome, filled by the simulator
    pipeline: str = ""
    reason: str = ""
    handoff_mode: str = "none"
    handoff_batches: int = 0
    fallback: str = ""
    p: int = -1
    md: int = -1
    relay: int = -1
    hit_p: int = 0
    hit_md: int = 0
    wan_bytes: int = 0  # KV bytes P sent to MD (from the view's planned block, plus any resend)
    planned_blocks: int = 0  # prompt blocks the Router's view said MD holds (P sends from there)
    real_blocks: int = 0  # what MD's prepare reply says it holds
    index_miss: bool = False  # MD held less than the view said: P resent the gap
    t_prepared: float = -1.0  # MD's prepare reply reaches the Router
    t_prefill_done: float = -1.0
    t_first_prefill: float = -1.0  # P's token reaches the client
    t_first_decoder: float = -1.0  # a decoder starts streaming
    t_kv_md: float = -1.0
    t_done: float = -1.0
    rld_tokens: int = 0
    md_tokens: int = 0
    max_gap_s: float = 0.0  # the longest stall of the stream (handoff, KV wait)
    finished: int = 0


@dataclass
class Workload:
    requests: list[SimRequest]
    warm: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)  # (family, block ids) to pre-cache
    block_size: int = 512
    label: str = ""


def _draw_hits(spec: WorkloadSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    comps = np.array(spec.hit_mixture, dtype=float)
    u = rng.random((n, 2))  # (component, position): per-request draws keep prefixes stable in n
    which = np.searchsorted(np.cumsum(comps[:, 0]) / comps[:, 0].sum(), u[:, 0], side="right")
    which = np.minimum(which, len(comps) - 1)
    return comps[which, 1] + (comps[which, 2] - comps[which, 1]) * u[:, 1]


def synthetic(spec: WorkloadSpec, rate_rps: float | None = None, requests: int | None = None,
              hit: float | None = None) -> Workload:
    """Fixed-length requests over `families` shared prefixes; request i reuses the first
    floor(h_i x blocks) blocks of its family, h_i drawn from the mixture (or `hit` for all).
    Arrivals are Poisson; the same seed gives the same requests at any rate (only time scales)."""
    n = requests or spec.requests
    rate = rate_rps or spec.rate_rps
    # one stream per attribute: the first n requests are the same whatever n (and whatever rate)
    streams = [np.random.default_rng([spec.seed, i]) for i in range(6)]
    gaps = streams[0].exponential(1.0, n)
    hits = _draw_hits(spec, streams[1], n) if hit is None else np.full(n, float(hit))
    fam = streams[2].integers(0, spec.families, n)
    anomalous = (streams[3].random(n) < spec.anomalous_fraction) if hit is None else np.zeros(n, bool)
    lo, hi = spec.anomalous_hit
    an_hits = lo + (hi - lo) * streams[4].random(n)
    bs = spec.block_size
    nb = spec.input_tokens // bs
    t = np.cumsum(gaps) / rate
    fresh = FRESH_ID_BASE
    out: list[SimRequest] = []
    for i in range(n):
        h = an_hits[i] if anomalous[i] else hits[i]
        k = min(nb, int(h * nb + 1e-9))
        f = int(fam[i])
        base = f * FAMILY_STRIDE + 1
        blocks = tuple(range(base, base + k)) + tuple(range(fresh, fresh + nb - k))
        fresh += nb - k
        out_tokens = spec.anomalous_output_tokens if anomalous[i] else spec.output_tokens
        out.append(SimRequest(i, float(t[i]), spec.input_tokens, out_tokens, blocks,
                              "anomalous" if anomalous[i] else "normal", family=f))
    warm = [(f, tuple(range(f * FAMILY_STRIDE + 1, f * FAMILY_STRIDE + 1 + nb))) for f in range(spec.families)]
    label = f"synthetic n={n} rate={rate:g}/s " + (f"hit={hit:g}" if hit is not None else f"mean hit={spec.mean_hit:.2f}")
    return Workload(out, warm, bs, label)


@lru_cache(maxsize=4)
def _read_trace(path: str) -> tuple[tuple[float, int, int, tuple[int, ...]], ...]:
    rows = []
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read trace: {e.strerror or e}") from None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            rows.append((float(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                         tuple(int(h) for h in d["hash_ids"])))
        except (ValueError, KeyError, TypeError) as e:
            raise ScenarioError(f"{path}:{i + 1}: not a Mooncake trace line "
                                 f"(timestamp, input_length, output_length, hash_ids): {e}") from None
    if not rows:
        raise ScenarioError(f"{path}: the trace holds no requests")
    return tuple(rows)


def mooncake_trace(spec: WorkloadSpec, path: str | None = None, limit: int | None = None) -> Workload:
    """A Mooncake-format trace: timestamp (ms), input_length, output_length, hash_ids (one id per
    `block_size`-token block, equal ids = reusable prefix). Ids are shifted by one because
    pdd_serve's radix cache reserves 0 for the root. A trailing partial block has no identity."""
    path = path or spec.trace_path
    if not path:
        raise ScenarioError("workload.trace_path: no trace given")
    rows = _read_trace(str(path))
    limit = limit or spec.trace_limit
    if limit:
        rows = rows[:limit]
    bs = spec.block_size
    t0 = rows[0][0]
    out = []
    for i, (ts, n_in, n_out, ids) in enumerate(rows):
        full = n_in // bs
        out.append(SimRequest(i, (ts - t0) / 1e3 * spec.trace_gap_scale, max(1, n_in), max(1, n_out),
                              tuple(h + 1 for h in ids[:full])))
    return Workload(out, [], bs, f"trace {Path(path).name} n={len(out)}")


def build_workload(spec: WorkloadSpec, **kw: object) -> Workload:
    if spec.kind == "trace":
        return mooncake_trace(spec, kw.get("path"), kw.get("limit"))  # type: ignore[arg-type]
    return synthetic(spec, kw.get("rate_rps"), kw.get("requests"), kw.get("hit"))  # type: ignore[arg-type]
