"""PDD's decisions as pure functions: pipeline, MD replica, handoff mode, anomalous filter,
Prefill's admission.

The real Router and the simulator call exactly these, so one policy runs in both worlds.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pdd_serve.config import PolicyConfig


@dataclass(frozen=True)
class LinkEstimate:
    bandwidth_bps: float  # live estimate, bytes/s
    latency_s: float  # one-way
    backlog: tuple[int, ...] = ()  # bytes still to cross of the transfers already on the line

    def transfer_s(self, nbytes: int) -> float:
        """Arrival time of `nbytes` sent now. Flows share the line fairly (as TCP flows do), so a
        transfer already on it delays this one by at most as many bytes as this one sends."""
        if nbytes <= 0:
            return 0.0
        shared = sum(min(b, nbytes) for b in self.backlog)
        return self.latency_s + (nbytes + shared) / self.bandwidth_bps


def wan_backlog(flows: list[tuple[int, float]], now: float, bandwidth_bps: float) -> tuple[int, ...]:
    """Bytes left of each (nbytes, started_at) transfer on the line (0 once it should have crossed),
    assuming it got a fair share since it started: the router's view of the line, with no message
    from the sender needed."""
    if bandwidth_bps == float("inf"):
        return (0,) * len(flows)
    share = bandwidth_bps / max(1, len(flows))
    return tuple(max(0, int(n - share * max(0.0, now - t0))) for n, t0 in flows)


@dataclass(frozen=True)
class MDStatus:
    """A Main decode replica as the router sees it for one request (from its background view)."""

    index: Hashable  # the replica's key (its Serve replica id; the simulator numbers them)
    hit_blocks: int  # leading prompt blocks already in its DRC
    running: int  # sequences decoding now
    capacity: int  # decode batch cap
    healthy: bool = True
    hit_unit: int = 1  # its cache hits in whole units of this many blocks (hit_blocks is a multiple)


@dataclass(frozen=True)
class PipelineDecision:
    pipeline: str  # P-MD | P-RLD-MD | P-RLD
    reason: str
    transfer_s: float  # estimated WAN time of the blocks MD lacks


def is_anomalous(prompt_tokens: int, max_tokens: int, transfer_s: float, policy: PolicyConfig) -> bool:
    """Ultra-long input, ultra-short output, large transfer: the WAN would carry it for nothing."""
    return (prompt_tokens >= policy.anomalous_min_input_tokens
            and max_tokens <= policy.anomalous_max_output_tokens
            and transfer_s >= policy.anomalous_min_transfer_s)


def choose_pipeline(prompt_tokens: int, max_tokens: int, missing_bytes: int, link: LinkEstimate,
                    relay_running: int, policy: PolicyConfig, forced: str | None = None) -> PipelineDecision:
    """P->MD when the missing KV reaches MD within the budget; P->RLD->MD when it doesn't (RLD masks
    the transfer); P->RLD only for anomalous traffic. A saturated relay pool takes nothing new."""
    t = link.transfer_s(missing_bytes)
    allowed = policy.pipelines
    relay_ok = relay_running < policy.relay_max_running
    if forced is not None:
        return PipelineDecision(forced, "forced by request", t)
    if "P-RLD" in allowed and relay_ok and is_anomalous(prompt_tokens, max_tokens, t, policy):
        return PipelineDecision("P-RLD", "anomalous: long input, short output, large transfer", t)
    if "P-MD" in allowed and (t <= policy.wan_budget_s or "P-RLD-MD" not in allowed):
        return PipelineDecision("P-MD", f"transfer {t:.3f}s within budget {policy.wan_budget_s}s", t)
    if "P-RLD-MD" in allowed and relay_ok:
        return PipelineDecision("P-RLD-MD", f"transfer {t:.3f}s over budget {policy.wan_budget_s}s", t)
    if "P-MD" in allowed:
        return PipelineDecision("P-MD", "relay saturated: decode waits for the KV at MD", t)
    return PipelineDecision("P-RLD-MD", "only relay pipelines allowed", t)


def pick_md(candidates: list[MDStatus], prompt_blocks: int, block_bytes: int, link: LinkEstimate,
            load_penalty_s: float = 0.05) -> Hashable:
    """The MD replica with the smallest estimated cost: transfer of the blocks it lacks (DRC prefix
    affinity) plus a load term. Full or unhealthy replicas are skipped while another is free."""
    usable = [c for c in candidates if c.healthy] or candidates
    open_ = [c for c in usable if c.running < c.capacity] or usable

    def cost(c: MDStatus) -> tuple[float, Hashable]:
        missing = max(0, prompt_blocks - c.hit_blocks) * block_bytes
        return link.transfer_s(missing) + load_penalty_s * c.running / max(1, c.capacity), c.index

    return min(open_, key=cost).index


def plan_handoff(eager_tokens: int, relay_running: int, policy: PolicyConfig, forced: str | None = None) -> str:
    """One-shot frees RLD soonest but MD stalls on a big extend; catch-up hides the stall but keeps
    RLD busy. Catch-up when many tokens must move, unless the relay pool is under pressure."""
    if forced in ("one-shot", "catch-up"):
        return forced
    if policy.handoff_mode != "auto":
        return policy.handoff_mode
    busy = relay_running >= policy.relay_busy_fraction * policy.relay_max_running
    return "catch-up" if eager_tokens > policy.handoff_token_threshold and not busy else "one-shot"


# a prefill admitted only if it should end within this share of the router's budget: the estimate
# is a fit over recent prompts, and the rest of the budget is for the answer's trip back
PREFILL_ADMIT_SHARE = 0.75


@dataclass(frozen=True)
class PrefillCost:
    """A prefill's engine time: a fixed part per prefill (the forwards' per-call costs, sampling)
    plus a part per prompt token it computes. A rate alone (tokens/s) has no fixed part: measured
    on short prompts, where the fixed part is most of the time, it made 1.2K-token prompts look
    20x slower than they ran (issue 38)."""

    fixed_s: float
    per_token_s: float

    def __post_init__(self) -> None:
        for f in ("fixed_s", "per_token_s"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"PrefillCost.{f} must be finite and >= 0, got {v!r}")

    def seconds(self, prefills: int, tokens: int) -> float:
        """Engine seconds of `prefills` prefills that compute `tokens` prompt tokens between them."""
        return self.fixed_s * prefills + self.per_token_s * tokens


def fit_prefill_cost(samples: Sequence[tuple[int, float]],
                     calibration: Sequence[tuple[int, float]] = ()) -> PrefillCost | None:
    """A replica's prefill cost from its recent prefills, `samples` of (tokens computed, engine
    seconds), and its `calibration` (the same engine's prefills at two or more sizes, measured
    once): least squares with one per-token part for both sets and a fixed part of each set's
    own, the samples' kept. What a prefill costs beside its tokens moves with the load on the
    machine (a few ms on a quiet core here, hundreds in the graph under load), the per-token
    part far less: so samples of one size set the fixed part and keep the calibration's
    per-token part, and samples over a wider range of sizes than its own outweigh it. None with
    neither set spanning two sizes: a cost measured on one size says nothing of another.
    Neither part is negative: a falling line is all fixed part, a line below the origin all
    per-token part (the mean's rate)."""

    def moments(pts: Sequence[tuple[int, float]]) -> tuple[float, float, float, float]:
        mx = sum(n for n, _ in pts) / len(pts)
        my = sum(t for _, t in pts) / len(pts)
        return mx, my, sum((n - mx) ** 2 for n, _ in pts), sum((n - mx) * (t - my) for n, t in pts)

    sets = [m for m in (calibration, samples) if m]
    if not sets:
        return None
    fits = [moments(pts) for pts in sets]
    sxx, sxy = sum(f[2] for f in fits), sum(f[3] for f in fits)
    if sxx == 0:
        return None
    mx, my = fits[-1][:2]  # the samples' own level when there are any, else the calibration's
    per_token = max(0.0, sxy / sxx)
    if my - per_token * mx < 0:
        return PrefillCost(0.0, my / mx)
    return PrefillCost(my - per_token * mx, per_token)


def prefill_admits(queued: int, queued_tokens: int, prompt_tokens: int, cost: PrefillCost | None,
                   budget_s: float | None, share: float = PREFILL_ADMIT_SHARE) -> bool:
    """Admission at a Prefill replica. Its prompts run one after another, so a new one finishes
    after the `queued` prefills ahead of it (`queued_tokens` prompt tokens to compute between
    them) and its own, at the replica's fitted `cost` (`fit_prefill_cost`). One that would end
    past its budget would hold its place and then be abandoned: it is refused at once, so the
    router sheds it (503) or retries, instead of queueing work nobody will wait for. An idle
    replica takes any prompt; with no cost fitted yet, it takes everything."""
    if queued <= 0 or budget_s is None or cost is None:
        return True
    return cost.seconds(queued + 1, queued_tokens + prompt_tokens) <= share * budget_s


def catchup_done(remaining_tokens: int, policy: PolicyConfig, previous_tokens: int | None = None) -> bool:
    """Catch-up ends when what is left to hand over fits the final extend (a short stall). Each
    round sends everything pending, so the gap shrinks geometrically while RLD streams, but only
    down to what RLD makes during one round trip to MD: across a WAN it levels off there, and
    once a round no longer shrinks it, the final extend takes the rest."""
    if remaining_tokens <= policy.handoff_batch_tokens:
        return True
    return previous_tokens is not None and remaining_tokens >= previous_tokens
