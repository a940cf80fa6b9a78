"""The one cost model: roofline step times of a model shape on a chip, and the data behind them.

Pure (no Ray, no torch). Three users, one model (docs/design.md, "Emulated accelerators"):
- an emulating engine paces each real step of the small model to the step time this predicts for
  the emulated model on the emulated chip (`pdd_serve/emulation/pacer.py`);
- KV capacity and the bytes a request's KV puts on the link are the emulated model's;
- the simulator (`evaluations/sim`) imports these functions unchanged, as it does `policy.py`.
The data is the one chip and model catalog, `costmodel.yaml` beside this file: `load_catalog` is the
only reader of chip entries, and `pdd compare`'s BCR takes its prices from the same entries. A
user's own catalog file (`pdd compare`/`pdd sweep`/`pdd plan --catalog`, a scenario's `catalog:`)
comes in one way, `user_catalog`: the shipped catalog with the file's chips, models and line prices
added, the file's entries winning over same-named ones.

A forward over `tokens` new tokens that attend to `attn_keys` (token, key) pairs and touch
`kv_tokens` tokens of KV costs

    max(FLOPs / (chips x peak x mfu), bytes / (chips x bandwidth x mbu)) + overhead + TP all-reduce

FLOPs = 2 x active_params x tokens (the GEMMs) + 4 x layers x attn_dim x attn_keys (QK^T and AV);
bytes = weights read + KV read/written. An MoE reads at most all of its weights; a forward of few
tokens reads only the experts those tokens touch (bounded by active_params x tokens), which is why
a small forward (a decode step, a tail chunk) is memory-bound and a big chunk compute-bound.

Units: YAML and the dataclasses take the units people quote (TFLOP/s, GB, GB/s, $/h); the
properties give SI. Every chip and model number is a published spec or a stated assumption
(`emulation/costmodel.yaml` says which), never a measurement of ours unless marked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

CATALOG_PATH = Path(__file__).with_name("costmodel.yaml")


class CostModelError(ValueError):
    """A chip or model shape that can't be used; the message starts with the field's name."""


def _check(cond: bool, field_: str, msg: str) -> None:
    if not cond:
        raise CostModelError(f"{field_}: {msg}")


def positive(x: Any) -> bool:
    """A finite number > 0 (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 and math.isfinite(x)


@dataclass(frozen=True)
class ChipSpec:
    """One accelerator, judged on docs/pdd.md's four dimensions plus a price."""

    name: str
    peak_tflops: float  # dense FLOP/s at the serving dtype, 1e12
    mem_gb: float  # HBM capacity, 1e9 bytes
    mem_bw_gb_s: float  # HBM bandwidth, 1e9 bytes/s
    interconnect_gb_s: float  # scale-OUT (RDMA NIC) bandwidth per chip, 1e9 bytes/s: KV copies inside a site
    price_per_hour: float  # USD (the simulator's chip-a/b/c: chip-A hours, as their scenarios price)
    mfu: float = 0.5  # achievable fraction of peak compute
    mbu: float = 0.8  # achievable fraction of memory bandwidth
    forward_overhead_ms: float = 0.0  # fixed cost of one forward pass (launch, scheduling, sync)
    # scale-UP (NVLink-class) bandwidth per chip, 1e9 bytes/s: tensor-parallel all-reduces inside an
    # instance. None: the scale-out figure (a catalog that gives one number for both)
    scaleup_gb_s: float | None = None
    description: str = ""

    def __post_init__(self) -> None:
        for f in ("peak_tflops", "mem_gb", "mem_bw_gb_s", "interconnect_gb_s", "price_per_hour"):
            _check(positive(getattr(self, f)), f, f"must be a number > 0, got {getattr(self, f)!r}")
        for f in ("mfu", "mbu"):
            _check(positive(getattr(self, f)) and getattr(self, f) <= 1, f, f"must be in (0, 1], got {getattr(self, f)!r}")
        _check(isinstance(self.forward_overhead_ms, (int, float)) and self.forward_overhead_ms >= 0,
               "forward_overhead_ms", "must be >= 0")
        _check(self.scaleup_gb_s is None or positive(self.scaleup_gb_s), "scaleup_gb_s", "must be > 0 or null")

    @property
    def flops(self) -> float:
        return self.peak_tflops * 1e12 * self.mfu

    @property
    def mem_bytes(self) -> float:
        return self.mem_gb * 1e9

    @property
    def bw(self) -> float:
        return self.mem_bw_gb_s * 1e9 * self.mbu

    @property
    def interconnect_bw(self) -> float:
        return self.interconnect_gb_s * 1e9

    @property
    def scaleup_bw(self) -> float:
        return (self.scaleup_gb_s or self.interconnect_gb_s) * 1e9

    @property
    def overhead_s(self) -> float:
        return self.forward_overhead_ms / 1e3


@dataclass(frozen=True)
class ModelShape:
    """What a model costs to run: parameters, layers and the attention shape.

    Give `heads`, `kv_heads` and `head_dim` (and `kv_bytes` per element) and the attention width
    and KV bytes per token follow; or give `attn_dim` and `kv_bytes_per_token` directly (an MoE or
    MLA model whose KV is not heads x dims)."""

    name: str
    params_b: float  # total parameters, 1e9
    layers: int
    hidden: int
    attn_dim: int = 0  # query heads x head dim: attention FLOPs per (token, key) are 4 x layers x attn_dim
    kv_bytes_per_token: int = 0  # all layers, K and V, at the serving dtype
    active_params_b: float | None = None  # MoE: parameters one token touches (None: dense)
    bytes_per_param: float = 2.0
    act_bytes: float = 2.0  # activation dtype, for tensor-parallel all-reduces
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    intermediate: int | None = None  # MLP width (reported; params_b already counts it)
    kv_bytes: float = 2.0  # bytes per KV element (bf16 2, fp8 1)
    description: str = ""

    def __post_init__(self) -> None:
        have_heads = self.heads is not None and self.kv_heads is not None and self.head_dim is not None
        if have_heads:
            for f in ("heads", "kv_heads", "head_dim"):
                v = getattr(self, f)
                _check(isinstance(v, int) and v > 0, f, f"must be an integer > 0, got {v!r}")
            _check(self.heads % self.kv_heads == 0, "kv_heads", f"must divide heads ({self.heads}), got {self.kv_heads}")
            if not self.attn_dim:
                object.__setattr__(self, "attn_dim", self.heads * self.head_dim)
            if not self.kv_bytes_per_token:
                object.__setattr__(self, "kv_bytes_per_token",
                                   int(self.layers * self.kv_heads * self.head_dim * 2 * self.kv_bytes))
        for f in ("params_b", "layers", "hidden", "attn_dim", "kv_bytes_per_token", "bytes_per_param", "act_bytes",
                  "kv_bytes"):
            _check(positive(getattr(self, f)), f, f"must be a number > 0 (or give heads, kv_heads and head_dim), "
                                              f"got {getattr(self, f)!r}")
        _check(self.active_params_b is None or (positive(self.active_params_b) and self.active_params_b <= self.params_b),
               "active_params_b", f"must be in (0, params_b], got {self.active_params_b!r}")

    @property
    def params(self) -> float:
        return self.params_b * 1e9

    @property
    def active_params(self) -> float:
        return (self.active_params_b or self.params_b) * 1e9

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param


# ---------------------------------------------------------------- the catalog


@dataclass(frozen=True)
class Catalog:
    """One catalog file's chips, model shapes and line prices (the BCR of `pdd compare` prices the
    inter-DC line a cross-site graph rents: `links.cross_dc`, `links.same_dc`)."""

    chips: dict[str, ChipSpec]
    models: dict[str, ModelShape]
    links: dict[str, float] = field(default_factory=dict)  # line name -> price per hour
    path: str = ""

    def chip(self, name: str) -> ChipSpec:
        if name not in self.chips:
            raise CostModelError(f"chip: unknown chip {name!r}; the catalog has {', '.join(sorted(self.chips))}")
        return self.chips[name]

    def model(self, name: str) -> ModelShape:
        if name not in self.models:
            raise CostModelError(f"model: unknown model shape {name!r}; the catalog has {', '.join(sorted(self.models))}")
        return self.models[name]

    def link_price(self, cross_site: bool) -> float:
        return float(self.links.get("cross_dc" if cross_site else "same_dc", 0.0))

    def merged(self, own: Catalog) -> Catalog:
        """This catalog with a user's own added: `own`'s entries win over same-named ones."""
        return Catalog({**self.chips, **own.chips}, {**self.models, **own.models}, {**self.links, **own.links},
                       own.path or self.path)


def _build(cls: type, data: Any, where: str, name: str) -> Any:
    if not isinstance(data, dict):
        raise CostModelError(f"{where}: must be a mapping, got {type(data).__name__}")
    valid = {f.name for f in fields(cls)} - {"name"}
    unknown = sorted(set(data) - valid)
    if unknown:  # e.g. an old price catalog's memory_gb: say which fields this schema has
        raise CostModelError(f"{where}.{unknown[0]}: unknown field; valid: {', '.join(sorted(valid))}")
    try:
        return cls(name=name, **data)
    except CostModelError as e:
        raise CostModelError(f"{where}.{e}") from None
    except TypeError as e:
        raise CostModelError(f"{where}: {e}") from None


def chip_from(data: Any, where: str = "chip", name: str = "inline") -> ChipSpec:
    return _build(ChipSpec, data, where, name)


def model_from(data: Any, where: str = "model", name: str | None = None) -> ModelShape:
    data = dict(data) if isinstance(data, dict) else data
    nm = name or (data.pop("name", "inline") if isinstance(data, dict) else "inline")
    return _build(ModelShape, data, where, nm)


def _line_price(entry: Any, where: str) -> float:
    price = entry.get("price_per_hour") if isinstance(entry, dict) else entry
    _check(isinstance(price, (int, float)) and not isinstance(price, bool) and price >= 0 and math.isfinite(price),
           f"{where}.price_per_hour", f"must be a number >= 0, got {price!r}")
    return float(price)


@lru_cache(maxsize=8)
def load_catalog(path: str | Path = CATALOG_PATH) -> Catalog:
    """The catalog in `path` (default: the shipped one). The one reader of chip entries: a user's
    own catalog comes in here too, through `user_catalog`. Errors name the file and the entry."""
    import yaml

    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise CostModelError(f"{path}: cannot read the catalog: {e}") from None
    try:
        if not isinstance(doc, dict):
            raise CostModelError("must hold a mapping (chips, models, links)")
        parts = {k: doc.get(k) or {} for k in ("chips", "models", "links")}
        for k, v in parts.items():
            _check(isinstance(v, dict), k, f"must map names to entries, got {type(v).__name__}")
        chips = {str(n): chip_from(s, f"chips.{n}", str(n)) for n, s in parts["chips"].items()}
        models = {str(n): model_from(s, f"models.{n}", str(n)) for n, s in parts["models"].items()}
        links = {str(n): _line_price(s, f"links.{n}") for n, s in parts["links"].items()}
    except CostModelError as e:
        raise CostModelError(f"{path}: {e}") from None
    return Catalog(chips, models, links, str(path))


def user_catalog(path: str | Path | None) -> Catalog:
    """The shipped catalog with a user's own catalog file over it (its entries win over same-named
    ones); None: the shipped catalog. The one way a user's catalog comes in (`--catalog FILE`, a
    scenario's `catalog: FILE`)."""
    shipped = load_catalog()
    return shipped if path is None else shipped.merged(load_catalog(path))


# ---------------------------------------------------------------- the roofline


def weight_bytes_read(m: ModelShape, tokens: int) -> float:
    return m.bytes_per_param * min(m.params, m.active_params * max(tokens, 1))


def tp_allreduce_s(chip: ChipSpec, m: ModelShape, n_chips: int, tokens: int) -> float:
    """Two ring all-reduces of the hidden state per layer when an instance spans several chips."""
    if n_chips <= 1:
        return 0.0
    nbytes = 2 * m.layers * tokens * m.hidden * m.act_bytes * 2 * (n_chips - 1) / n_chips
    return nbytes / chip.scaleup_bw


def forward_flops(m: ModelShape, tokens: int, attn_keys: float) -> float:
    return 2.0 * m.active_params * tokens + 4.0 * m.layers * m.attn_dim * attn_keys


def forward_bytes(m: ModelShape, tokens: int, kv_tokens: float) -> float:
    return weight_bytes_read(m, tokens) + m.kv_bytes_per_token * kv_tokens


def forward_time(chip: ChipSpec, m: ModelShape, n_chips: int, tokens: int, attn_keys: float, kv_tokens: float) -> float:
    flops = forward_flops(m, tokens, attn_keys)
    nbytes = forward_bytes(m, tokens, kv_tokens)
    return (max(flops / (n_chips * chip.flops), nbytes / (n_chips * chip.bw))
            + chip.overhead_s + tp_allreduce_s(chip, m, n_chips, tokens))


def causal_keys(new: int, ctx: int) -> float:
    """(token, key) pairs when `new` tokens follow `ctx` cached ones: token j sees ctx + j + 1 keys."""
    return new * ctx + new * (new + 1) / 2


def prefill_time(chip: ChipSpec, m: ModelShape, n_chips: int, pieces: list[tuple[int, int]]) -> float:
    """One batched prefill/extend forward over pieces (new tokens, cached context before them)."""
    tokens = sum(n for n, _ in pieces)
    keys = sum(causal_keys(n, c) for n, c in pieces)
    kv = sum(n + c for n, c in pieces)
    return forward_time(chip, m, n_chips, tokens, keys, kv)


def decode_step_time(chip: ChipSpec, m: ModelShape, n_chips: int, batch: int, ctx_total: int) -> float:
    """One decode step: `batch` sequences holding `ctx_total` tokens of KV between them."""
    return forward_time(chip, m, n_chips, batch, ctx_total + batch, ctx_total)


def kv_copy_time(nbytes: float, src: ChipSpec, dst: ChipSpec) -> float:
    """KV copy inside a site (RDMA): limited by the slower NIC."""
    return 0.0 if nbytes <= 0 else nbytes / min(src.interconnect_bw, dst.interconnect_bw)


def kv_capacity_tokens(chip: ChipSpec, m: ModelShape, n_chips: int, reserve_fraction: float) -> int:
    """Tokens of KV an instance holds beside its weights."""
    free = n_chips * chip.mem_bytes * (1 - reserve_fraction) - m.weight_bytes
    return max(0, int(free // m.kv_bytes_per_token))


def decode_batch_limit(chip: ChipSpec, m: ModelShape, n_chips: int, tpot_s: float, ctx_per_seq: int,
                       pool_tokens: int) -> int:
    """The largest decode batch the emulated chips run within the TPOT SLO, with every sequence
    holding `ctx_per_seq` tokens of KV, and whose KV fits the pool (0: not even one sequence).
    A decode replica's batch cap comes from its chips and the SLO, not from a fixed number."""
    if tpot_s <= 0 or ctx_per_seq < 1:
        raise CostModelError(f"tpot_s must be > 0 and ctx_per_seq >= 1, got {tpot_s}, {ctx_per_seq}")

    def fits(b: int) -> bool:
        return b * ctx_per_seq <= pool_tokens and decode_step_time(chip, m, n_chips, b, b * ctx_per_seq) <= tpot_s

    if not fits(1):
        return 0
    lo, hi = 1, 2  # step time and KV both grow with the batch: find a batch that doesn't fit, then bisect
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def check_fits(chip: ChipSpec, m: ModelShape, n_chips: int, reserve_fraction: float) -> None:
    if kv_capacity_tokens(chip, m, n_chips, reserve_fraction) < 1:
        raise CostModelError(f"{m.name} ({m.weight_bytes / 1e9:.0f} GB of weights) does not fit on {n_chips} x "
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


def decode_series(chip: ChipSpec, m: ModelShape, n_chips: int, batch: int, ctx_total: int) -> StepSeries:
    """StepSeries of `batch` sequences holding `ctx_total` tokens at step 0 (see decode_step_time)."""
    f = n_chips * chip.flops
    b = n_chips * chip.bw
    attn = 4.0 * m.layers * m.attn_dim
    a1 = (2.0 * m.active_params * batch + attn * (ctx_total + batch)) / f
    s1 = attn * batch / f
    a2 = (weight_bytes_read(m, batch) + m.kv_bytes_per_token * ctx_total) / b
    s2 = m.kv_bytes_per_token * batch / b
    return StepSeries(a1, s1, a2, s2, chip.overhead_s + tp_allreduce_s(chip, m, n_chips, batch))
