"""Roofline costs of prefill, decode and extend on a chip, from a model spec.

A forward pass over `tokens` new tokens that attend to `attn_keys` (token, key) pairs and touch
`kv_tokens` tokens of KV costs

    max(FLOPs / (chips x peak x mfu), bytes / (chips x bandwidth x mbu)) + overhead + TP all-reduce

FLOPs = 2 x active_params x tokens (the GEMMs) + 4 x layers x attn_dim x attn_keys (QK^T and AV);
bytes = weights read + KV read/written. An MoE reads at most all of its weights; a forward of few
tokens reads only the experts those tokens touch (bounded by active_params x tokens), which is why
a small forward (a decode step, a tail chunk) is memory-bound and a big chunk compute-bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from evaluations.sim.config import ChipSpec, ModelSpec


def weight_bytes_read(m: ModelSpec, tokens: int) -> float:
    return m.bytes_per_param * min(m.params, m.active_params * max(tokens, 1))


def tp_allreduce_s(chip: ChipSpec, m: ModelSpec, n_chips: int, tokens: int) -> float:
    """Two ring all-reduces of the hidden state per layer when an instance spans several chips."""
    if n_chips <= 1:
        return 0.0
    nbytes = 2 * m.layers * tokens * m.hidden * m.act_bytes * 2 * (n_chips - 1) / n_chips
    return nbytes / chip.interconnect_bw


def forward_time(chip: ChipSpec, m: ModelSpec, n_chips: int, tokens: int, attn_keys: float, kv_tokens: float) -> float:
    flops = 2.0 * m.active_params * tokens + 4.0 * m.layers * m.attn_dim * attn_keys
    nbytes = weight_bytes_read(m, tokens) + m.kv_bytes_per_token * kv_tokens
    return (max(flops / (n_chips * chip.flops), nbytes / (n_chips * chip.bw))
            + chip.overhead_s + tp_allreduce_s(chip, m, n_chips, tokens))


def causal_keys(new: int, ctx: int) -> float:
    """(token, key) pairs when `new` tokens follow `ctx` cached ones: token j sees ctx + j + 1 keys."""
    return new * ctx + new * (new + 1) / 2


def prefill_time(chip: ChipSpec, m: ModelSpec, n_chips: int, pieces: list[tuple[int, int]]) -> float:
    """One batched prefill/extend forward over pieces (new tokens, cached context before them)."""
    tokens = sum(n for n, _ in pieces)
    keys = sum(causal_keys(n, c) for n, c in pieces)
    kv = sum(n + c for n, c in pieces)
    return forward_time(chip, m, n_chips, tokens, keys, kv)


def decode_step_time(chip: ChipSpec, m: ModelSpec, n_chips: int, batch: int, ctx_total: int) -> float:
    """One decode step: `batch` sequences holding `ctx_total` tokens of KV between them."""
    return forward_time(chip, m, n_chips, batch, ctx_total + batch, ctx_total)


def kv_copy_time(nbytes: float, src: ChipSpec, dst: ChipSpec) -> float:
    """KV copy inside a site (RDMA): limited by the slower NIC."""
    return 0.0 if nbytes <= 0 else nbytes / min(src.interconnect_bw, dst.interconnect_bw)


def kv_capacity_tokens(chip: ChipSpec, m: ModelSpec, n_chips: int, reserve_fraction: float) -> int:
    """Tokens of KV an instance holds beside its weights."""
    free = n_chips * chip.mem_bytes * (1 - reserve_fraction) - m.weight_bytes
    return max(0, int(free // m.kv_bytes_per_token))


def check_fits(chip: ChipSpec, m: ModelSpec, n_chips: int, reserve_fraction: float) -> None:
    if kv_capacity_tokens(chip, m, n_chips, reserve_fraction) < 1:
        raise ValueError(f"{m.name} ({m.weight_bytes / 1e9:.0f} GB of weights) does not fit on {n_chips} x "
                         f"{chip.name} ({chip.mem_gb:g} GB each, {reserve_fraction:.0%} reserved)")


# ---------------------------------------------------------------- closed-form decode segments


@dataclass(frozen=True)
class StepSeries:
    """Step k (k = 0, 1, ...) of a decode batch whose membership doesn't change lasts
    max(a1 + s1 k, a2 + s2 k) + c: context grows by `batch` tokens a step, so both the compute and
    the memory arm grow linearly. Sums and inverses are closed-form, so an instance jumps from one
    membership change to the next instead of simulating every step."""

    a1: float
    s1: float
    a2: float
    s2: float
    c: float

    def step(self, k: int) -> float:
        return max(self.a1 + self.s1 * k, self.a2 + self.s2 * k) + self.c

    def time(self, n: int) -> float:
        """Duration of steps 0..n-1."""
        if n <= 0:
            return 0.0
        if self.s1 == self.s2:
            return _arith(max(self.a1, self.a2), self.s1, n) + self.c * n
        # the arms cross at k = kx; below it the arm with the smaller slope dominates
        kx = (self.a2 - self.a1) / (self.s1 - self.s2)
        hi_a, hi_s, lo_a, lo_s = ((self.a1, self.s1, self.a2, self.s2) if self.s1 > self.s2
                                  else (self.a2, self.s2, self.a1, self.s1))
        m = min(n, max(0, math.ceil(kx)))
        return _arith(lo_a, lo_s, m) + _arith(hi_a + hi_s * m, hi_s, n - m) + self.c * n

    def steps_within(self, dt: float, cap: int) -> int:
        """The number of whole steps (<= cap) completed within dt: closed form per linear piece,
        then nudged by one either way against float rounding."""
        if dt <= 0 or cap <= 0:
            return 0
        eps = 1e-12 + 1e-9 * dt
        if self.time(cap) <= dt + eps:
            return cap
        if self.s1 == self.s2:
            pieces = [(max(self.a1, self.a2), self.s1, 0, cap)]
        else:
            kx = (self.a2 - self.a1) / (self.s1 - self.s2)
            hi_a, hi_s, lo_a, lo_s = ((self.a1, self.s1, self.a2, self.s2) if self.s1 > self.s2
                                      else (self.a2, self.s2, self.a1, self.s1))
            m = min(cap, max(0, math.ceil(kx)))
            pieces = [(lo_a, lo_s, 0, m), (hi_a + hi_s * m, hi_s, m, cap)]
        n = 0
        for a, d, start, end in pieces:
            rest = dt - self.time(start)
            if end <= start or rest < self.step(start) - eps:
                n = start
                break
            # n steps of this piece: (a + c) n + d n (n - 1) / 2 <= rest
            A, B = d / 2, a + self.c - d / 2
            k = rest / B if A == 0 else (-B + math.sqrt(B * B + 4 * A * rest)) / (2 * A)
            n = min(end, start + max(0, int(k)))
            if n < end:
                break
        while n < cap and self.time(n + 1) <= dt + eps:
            n += 1
        while n > 0 and self.time(n) > dt + eps:
            n -= 1
        return n


def _arith(a: float, d: float, n: int) -> float:
    return n * a + d * n * (n - 1) / 2 if n > 0 else 0.0


def decode_series(chip: ChipSpec, m: ModelSpec, n_chips: int, batch: int, ctx_total: int) -> StepSeries:
    """StepSeries of `batch` sequences holding `ctx_total` tokens at step 0 (see decode_step_time)."""
    f = n_chips * chip.flops
    b = n_chips * chip.bw
    attn = 4.0 * m.layers * m.attn_dim
    a1 = (2.0 * m.active_params * batch + attn * (ctx_total + batch)) / f
    s1 = attn * batch / f
    a2 = (weight_bytes_read(m, batch) + m.kv_bytes_per_token * ctx_total) / b
    s2 = m.kv_bytes_per_token * batch / b
    return StepSeries(a1, s1, a2, s2, chip.overhead_s + tp_allreduce_s(chip, m, n_chips, batch))
