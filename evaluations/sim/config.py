"""The simulator's assumptions as frozen dataclasses, loaded from YAML with errors that name the
file and the field (`report.yaml: deployments.pdd.main_decode.count: must be >= 1, got 0`).

Numbers live in `chips.yaml` and `scenarios/*.yaml`, never in code: a chip is judged on PDD.md's
four dimensions (peak FLOP/s, memory capacity, memory bandwidth, interconnect bandwidth) plus a
price; a model on parameters, active parameters, layers and KV bytes per token.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdd_serve.config import ConfigError, LinkConfig, PolicyConfig
from pdd_serve.emulation.costmodel import ChipSpec, CostModelError, _pos, check_fits
from pdd_serve.emulation.costmodel import ModelShape as ModelSpec

SIM_DIR = Path(__file__).resolve().parent
SCENARIO_DIR = SIM_DIR / "scenarios"
TAIL_CHUNK_MODES = ("alone", "packed", "padded")
TTFT_FROM = ("decoder", "prefill", "client")


class SimConfigError(ValueError):
    """A simulator config value that can't be used; the message names the file and field."""


def _check(cond: bool, field_: str, msg: str) -> None:
    if not cond:
        raise SimConfigError(f"{field_}: {msg}")


# ---------------------------------------------------------------- workload, SLA, scheduler, link


@dataclass(frozen=True)
class WorkloadSpec:
    """Synthetic traffic (the report's fixed-length, skewed-hit benchmark) or a trace."""

    kind: str = "synthetic"  # synthetic | trace
    requests: int = 1000
    rate_rps: float = 10.0  # Poisson arrivals (synthetic)
    input_tokens: int = 64512
    output_tokens: int = 1024
    block_size: int = 512  # prefix-cache block (Mooncake's hash_ids are 512-token blocks)
    families: int = 400  # distinct shared prefixes (sessions); caches are warmed with them
    # hit rate of a request = a draw from this mixture of uniforms: [[weight, lo, hi], ...]
    hit_mixture: tuple[tuple[float, float, float], ...] = ((1.0, 0.9, 0.9),)
    anomalous_fraction: float = 0.0  # long input, short output (PDD.md: ~3-4%)
    anomalous_output_tokens: int = 200
    anomalous_hit: tuple[float, float] = (0.0, 0.3)
    trace_path: str | None = None
    trace_time_scale: float = 1.0  # >1 stretches the trace (slower arrivals)
    trace_limit: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.kind in ("synthetic", "trace"), "kind", f"must be synthetic|trace, got {self.kind!r}")
        for f in ("requests", "input_tokens", "output_tokens", "block_size", "families", "anomalous_output_tokens"):
            _check(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, f"must be an integer > 0, got {getattr(self, f)!r}")
        _check(_pos(self.rate_rps), "rate_rps", f"must be > 0, got {self.rate_rps!r}")
        _check(_pos(self.trace_time_scale), "trace_time_scale", "must be > 0")
        _check(bool(self.hit_mixture), "hit_mixture", "must list at least one [weight, lo, hi]")
        for i, comp in enumerate(self.hit_mixture):
            _check(len(comp) == 3 and comp[0] > 0 and 0 <= comp[1] <= comp[2] <= 1, f"hit_mixture[{i}]",
                   f"must be [weight > 0, lo, hi] with 0 <= lo <= hi <= 1, got {list(comp)}")
        _check(0 <= self.anomalous_fraction < 1, "anomalous_fraction", "must be in [0, 1)")
        _check(len(self.anomalous_hit) == 2 and 0 <= self.anomalous_hit[0] <= self.anomalous_hit[1] <= 1,
               "anomalous_hit", "must be [lo, hi] within [0, 1]")
        _check(self.kind != "trace" or bool(self.trace_path), "trace_path", "is required when kind is trace")
        _check(self.trace_limit is None or self.trace_limit > 0, "trace_limit", "must be > 0")

    @property
    def mean_hit(self) -> float:
        w = sum(c[0] for c in self.hit_mixture)
        return sum(c[0] * (c[1] + c[2]) / 2 for c in self.hit_mixture) / w


@dataclass(frozen=True)
class SLASpec:
    ttft_s: float = 5.0
    tpot_s: float = 0.05
    attainment: float = 0.9  # goodput = the highest rate at which this fraction meets both bounds
    # decoder: the first token reaches the client when a decoder starts streaming (PD systems such as
    # the report's, where the decode side returns every token); prefill: P streams its own token
    # first (pdd_serve's Router with policy.stream_first_token on); client: what pdd_serve's Router
    # sends by default (P->MD holds P's token until MD's first chunk; the relay pipelines send it at once).
    ttft_from: str = "decoder"

    def __post_init__(self) -> None:
        _check(_pos(self.ttft_s), "ttft_s", "must be > 0")
        _check(_pos(self.tpot_s), "tpot_s", "must be > 0")
        _check(0 < self.attainment <= 1, "attainment", "must be in (0, 1]")
        _check(self.ttft_from in TTFT_FROM, "ttft_from", f"must be one of {TTFT_FROM}")


@dataclass(frozen=True)
class SchedulerSpec:
    prefill_chunk_tokens: int = 8192  # token budget of one prefill forward
    # a long prompt's leftover chunk: alone (can't be batched with other requests, PDD.md's tail
    # chunks), packed (filled up with the next requests), padded (static shapes: costs a full chunk)
    tail_chunk: str = "alone"
    prefill_batch_requests: bool = True  # False: a forward holds one request's chunk (pdd_serve's Prefill)
    decode_max_batch: int = 256
    mem_reserve_fraction: float = 0.1  # HBM kept for activations, graphs, fragmentation
    prefix_cache_gb: float = 1000.0  # per P / MD instance (HBM + host pool), for the radix caches
    cache_slack: float = 0.05  # evict in bulk down to (1 - slack) once (1 + slack) is reached
    # the platform, not the chip: control-plane time before a request reaches P (router RPCs, HTTP),
    # and a factor on every forward's time (compute shared with other processes)
    request_overhead_s: float = 0.0
    compute_slowdown: float = 1.0
    # per decode-side forward (MD, RLD steps and extends): the serving loop around the engine
    # (asyncio, streaming each step's tokens through Serve), which engine timings can't see
    decode_step_overhead_ms: float = 0.0
    # per Router -> MD call (decode, wait_kv, handoff batches) on top of the line's latency: Serve's
    # handle, the cross-site wrapper and asyncio under the machine's load
    md_call_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        _check(isinstance(self.prefill_chunk_tokens, int) and self.prefill_chunk_tokens > 0,
               "prefill_chunk_tokens", "must be an integer > 0")
        _check(self.tail_chunk in TAIL_CHUNK_MODES, "tail_chunk", f"must be one of {TAIL_CHUNK_MODES}")
        _check(isinstance(self.decode_max_batch, int) and self.decode_max_batch > 0, "decode_max_batch", "must be > 0")
        _check(0 <= self.mem_reserve_fraction < 1, "mem_reserve_fraction", "must be in [0, 1)")
        _check(self.prefix_cache_gb >= 0, "prefix_cache_gb", "must be >= 0")
        _check(0 <= self.cache_slack < 0.5, "cache_slack", "must be in [0, 0.5)")
        _check(self.request_overhead_s >= 0, "request_overhead_s", "must be >= 0")
        _check(_pos(self.compute_slowdown), "compute_slowdown", "must be > 0")
        _check(self.decode_step_overhead_ms >= 0, "decode_step_overhead_ms", "must be >= 0")
        _check(self.md_call_overhead_s >= 0, "md_call_overhead_s", "must be >= 0")


@dataclass(frozen=True)
class LinkSpec:
    """The inter-site line: a LinkModel preset (+ overrides) for one transfer, plus how transfers share."""

    preset: str = "same_dc"
    scale_to_model: bool = True
    overrides: tuple[tuple[str, Any], ...] = ()
    line_gbps: float | None = None  # aggregate capacity of the line (None: only the per-transfer model)
    per_prefill_bucket: bool = False  # transfers of one P replica share its pacer (pdd_serve's Prefill)
    # with per_prefill_bucket: a push's parallel Flight streams (flight.streams) and the bytes one
    # stream sends at a time (a batch, never more than one prefill chunk's blocks): the line is
    # shared per stream, so a push of one batch has one share, a large one up to `streams`
    streams: int = 1
    stream_unit_bytes: float | None = None
    # Router <-> MD messages (tokens, handoffs) pay the one-way latency too; false for pdd_serve's
    # emulated WAN on one machine, which delays only the paced KV stream
    control_latency: bool = True
    price_per_hour: float = 0.0
    # a kernel-shaped wire under the pacer (`pdd cluster up --shaped-link`: tbf at this on-wire
    # rate, bits/s): streams never get more than its TCP goodput, wire_bps x wire_goodput
    wire_bps: float | None = None
    wire_goodput: float = 0.95

    def __post_init__(self) -> None:
        try:
            LinkConfig(self.preset, self.scale_to_model, self.overrides)
        except ConfigError as e:
            raise SimConfigError(f"preset: {e}") from None
        _check(self.line_gbps is None or _pos(self.line_gbps), "line_gbps", "must be > 0 or null")
        _check(self.wire_bps is None or _pos(self.wire_bps), "wire_bps", "must be > 0 or null")
        _check(0 < self.wire_goodput <= 1, "wire_goodput", "must be in (0, 1]")
        _check(isinstance(self.streams, int) and 1 <= self.streams <= 16, "streams", "must be an int in [1, 16]")
        _check(self.stream_unit_bytes is None or _pos(self.stream_unit_bytes), "stream_unit_bytes", "must be > 0 or null")
        _check(self.price_per_hour >= 0, "price_per_hour", "must be >= 0")

    @property
    def cross_site(self) -> bool:
        return self.preset != "same_dc"

    def build(self, kv_bytes_per_token: int):  # -> pdd_serve.transport.link.LinkModel (or it under a wire)
        link = LinkConfig(self.preset, self.scale_to_model, self.overrides).build(kv_bytes_per_token)
        if self.wire_bps is None:
            return link
        from evaluations.sim.simulator import WireCap

        return WireCap(link, self.wire_bps * self.wire_goodput / 8)


# ---------------------------------------------------------------- deployments


@dataclass(frozen=True)
class RoleSpec:
    chip: str
    count: int  # chips
    chips_per_instance: int = 1

    def __post_init__(self) -> None:
        _check(bool(self.chip), "chip", "must name a chip of the catalog")
        _check(isinstance(self.count, int) and self.count >= 1, "count", f"must be an integer >= 1, got {self.count!r}")
        _check(isinstance(self.chips_per_instance, int) and self.chips_per_instance >= 1, "chips_per_instance", "must be >= 1")
        _check(self.count % self.chips_per_instance == 0, "count",
               f"{self.count} is not a multiple of chips_per_instance {self.chips_per_instance}")

    @property
    def instances(self) -> int:
        return self.count // self.chips_per_instance


@dataclass(frozen=True)
class DeploymentSpec:
    name: str
    prefill: RoleSpec
    main_decode: RoleSpec
    link: str  # a key of the scenario's links
    relay: RoleSpec | None = None
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    def __post_init__(self) -> None:
        uses_relay = any(p in self.policy.pipelines for p in ("P-RLD-MD", "P-RLD"))
        _check(not uses_relay or self.relay is not None, "relay", "is required when policy.pipelines uses RLD")
        _check("P-MD" in self.policy.pipelines or "P-RLD-MD" in self.policy.pipelines, "policy.pipelines",
               "must include P-MD or P-RLD-MD: ordinary traffic ends at main decode (PDD.md)")

    def roles(self) -> dict[str, RoleSpec]:
        r = {"prefill": self.prefill, "main_decode": self.main_decode}
        if self.relay is not None and any(p in self.policy.pipelines for p in ("P-RLD-MD", "P-RLD")):
            r["relay"] = self.relay
        return r


@dataclass(frozen=True)
class Scenario:
    name: str
    path: str
    chips: dict[str, ChipSpec]
    model: ModelSpec
    workload: WorkloadSpec
    sla: SLASpec
    scheduler: SchedulerSpec
    links: dict[str, LinkSpec]
    deployments: dict[str, DeploymentSpec]
    compare: dict[str, Any] = field(default_factory=dict)
    goodput: dict[str, Any] = field(default_factory=dict)
    bathtub: dict[str, Any] = field(default_factory=dict)
    price_sensitivity: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, float] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)

    def cost_per_hour(self, dep: DeploymentSpec, prices: dict[str, float] | None = None) -> float:
        prices = prices or {}
        total = sum(r.count * prices.get(r.chip, self.chips[r.chip].price_per_hour) for r in dep.roles().values())
        return total + self.links[dep.link].price_per_hour


# ---------------------------------------------------------------- loading


def _build(cls: type, data: Any, where: str, path: Path, **extra: Any) -> Any:
    if not isinstance(data, dict):
        raise SimConfigError(f"{path}: {where}: must be a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise SimConfigError(f"{path}: {where}.{unknown[0]}: unknown key; valid: {', '.join(sorted(names - set(extra)))}")
    kw = {k: _tuplify(v) for k, v in data.items()}
    try:
        return cls(**kw, **extra)
    except SimConfigError as e:
        raise SimConfigError(f"{path}: {where}.{e}") from None
    except (ConfigError, CostModelError) as e:
        raise SimConfigError(f"{path}: {where}.{e}") from None
    except TypeError as e:
        raise SimConfigError(f"{path}: {where}: {e}") from None


def _tuplify(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_tuplify(x) for x in v)
    return v


def _read_yaml(path: Path) -> dict:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise SimConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise SimConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise SimConfigError(f"{path}: must hold a mapping at the top level")
    return doc


def load_chips(path: str | Path) -> dict[str, ChipSpec]:
    path = Path(path)
    doc = _read_yaml(path)
    chips = doc.get("chips")
    if not isinstance(chips, dict) or not chips:
        raise SimConfigError(f"{path}: chips: must map chip names to their specs")
    return {name: _build(ChipSpec, _from_price_catalog(spec), f"chips.{name}", path, name=name)
            for name, spec in chips.items()}


def _from_price_catalog(spec: Any) -> Any:
    """evaluations/chips.yaml's entries (the BCR price catalog of `pdd compare`: peak_tflops,
    memory_gb, memory_bw_tbps, interconnect_gbps, price_per_hour) as ChipSpec fields; mfu, mbu
    and the per-forward overhead keep ChipSpec's defaults. That catalog's `interconnect_gbps` is
    the scale-UP (NVLink) figure: it feeds tensor-parallel all-reduces, never in-site KV copies,
    which take a 400 Gb/s NIC (50 GB/s) unless the entry names `nic_gb_s`."""
    if not isinstance(spec, dict) or "memory_gb" not in spec:
        return spec
    known = {"peak_tflops", "memory_gb", "memory_bw_tbps", "interconnect_gbps", "nic_gb_s", "price_per_hour"}
    out = {k: v for k, v in spec.items() if k not in known}
    out.update(peak_tflops=spec.get("peak_tflops"), mem_gb=spec.get("memory_gb"),
               mem_bw_gb_s=None if spec.get("memory_bw_tbps") is None else spec["memory_bw_tbps"] * 1000,
               scaleup_gb_s=spec.get("interconnect_gbps"), interconnect_gb_s=spec.get("nic_gb_s", 50.0),
               price_per_hour=spec.get("price_per_hour"))
    return out


def _policy(data: Any, where: str, path: Path) -> PolicyConfig:
    if data is None:
        return PolicyConfig()
    try:
        return _build(PolicyConfig, data, where, path)
    except SimConfigError:
        raise


def _link(data: Any, where: str, path: Path) -> LinkSpec:
    if isinstance(data, str):
        data = {"preset": data}
    if not isinstance(data, dict):
        raise SimConfigError(f"{path}: {where}: must be a preset name or a mapping")
    own = {f.name for f in dataclasses.fields(LinkSpec)} - {"overrides"}
    kw = {k: v for k, v in data.items() if k in own}
    over = tuple(sorted((k, _tuplify(v)) for k, v in data.items() if k not in own))
    return _build(LinkSpec, {**kw, "overrides": over}, where, path)


def _role(data: Any, where: str, path: Path, chips: dict[str, ChipSpec]) -> RoleSpec:
    r = _build(RoleSpec, data, where, path)
    if r.chip not in chips:
        raise SimConfigError(f"{path}: {where}.chip: unknown chip {r.chip!r}; the catalog has {', '.join(sorted(chips))}")
    return r


def build_deployment(name: str, data: Any, path: Path, chips: dict[str, ChipSpec], links: dict[str, LinkSpec]) -> DeploymentSpec:
    where = f"deployments.{name}"
    if not isinstance(data, dict):
        raise SimConfigError(f"{path}: {where}: must be a mapping")
    valid = {"prefill", "relay", "main_decode", "link", "policy"}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise SimConfigError(f"{path}: {where}.{unknown[0]}: unknown key; valid: {', '.join(sorted(valid))}")
    for req in ("prefill", "main_decode", "link"):
        if req not in data:
            raise SimConfigError(f"{path}: {where}.{req}: is required")
    if data["link"] not in links:
        raise SimConfigError(f"{path}: {where}.link: unknown link {data['link']!r}; defined: {', '.join(sorted(links))}")
    relay = _role(data["relay"], f"{where}.relay", path, chips) if data.get("relay") is not None else None
    try:
        return DeploymentSpec(name, _role(data["prefill"], f"{where}.prefill", path, chips),
                              _role(data["main_decode"], f"{where}.main_decode", path, chips), data["link"], relay,
                              _policy(data.get("policy"), f"{where}.policy", path))
    except SimConfigError as e:
        if str(e).startswith(str(path)):
            raise
        raise SimConfigError(f"{path}: {where}.{e}") from None


_SCENARIO_KEYS = {"name", "chips", "model", "workload", "sla", "scheduler", "links", "deployments", "compare",
                  "goodput", "bathtub", "price_sensitivity", "reference", "plan", "description"}


def resolve_scenario_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    cand = SCENARIO_DIR / f"{name_or_path}.yaml"
    if not cand.exists():
        known = sorted(x.stem for x in SCENARIO_DIR.glob("*.yaml"))
        raise SimConfigError(f"unknown scenario {name_or_path!r}; built-in: {', '.join(known)} (or a path to a YAML file)")
    return cand


def load_scenario(name_or_path: str | Path) -> Scenario:
    """Read and validate a scenario YAML (and the chip catalog it names, relative to it)."""
    path = resolve_scenario_path(name_or_path)
    doc = _read_yaml(path)
    unknown = sorted(set(doc) - _SCENARIO_KEYS)
    if unknown:
        raise SimConfigError(f"{path}: {unknown[0]}: unknown key; valid: {', '.join(sorted(_SCENARIO_KEYS))}")
    for req in ("chips", "model", "deployments", "links"):
        if req not in doc:
            raise SimConfigError(f"{path}: {req}: is required")
    chips_ref = doc["chips"]
    if isinstance(chips_ref, str):
        chips = load_chips((path.parent / chips_ref).resolve())
    elif isinstance(chips_ref, dict):
        chips = {n: _build(ChipSpec, s, f"chips.{n}", path, name=n) for n, s in chips_ref.items()}
    else:
        raise SimConfigError(f"{path}: chips: must be a catalog path or a mapping")
    model = _build(ModelSpec, doc["model"], "model", path)
    wl = dict(doc.get("workload") or {})
    if wl.get("trace_path") and not Path(wl["trace_path"]).is_absolute():
        wl["trace_path"] = str((path.parent / wl["trace_path"]).resolve())
    workload = _build(WorkloadSpec, wl, "workload", path)
    sla = _build(SLASpec, doc.get("sla") or {}, "sla", path)
    sched = _build(SchedulerSpec, doc.get("scheduler") or {}, "scheduler", path)
    if not isinstance(doc["links"], dict) or not doc["links"]:
        raise SimConfigError(f"{path}: links: must map link names to presets")
    links = {n: _link(v, f"links.{n}", path) for n, v in doc["links"].items()}
    if not isinstance(doc["deployments"], dict) or not doc["deployments"]:
        raise SimConfigError(f"{path}: deployments: must map names to deployments")
    deps = {n: build_deployment(n, v, path, chips, links) for n, v in doc["deployments"].items()}
    compare = dict(doc.get("compare") or {})
    for k in ("subject", "cost_baseline", "latency_baseline", "naive_baseline"):
        if k in compare and compare[k] not in deps:
            raise SimConfigError(f"{path}: compare.{k}: unknown deployment {compare[k]!r}; defined: {', '.join(deps)}")
    ps = dict(doc.get("price_sensitivity") or {})
    if ps and ps.get("chip") not in chips:
        raise SimConfigError(f"{path}: price_sensitivity.chip: unknown chip {ps.get('chip')!r}")
    sc = Scenario(str(doc.get("name", path.stem)), str(path), chips, model, workload, sla, sched, links, deps,
                  compare, dict(doc.get("goodput") or {}), dict(doc.get("bathtub") or {}), ps,
                  dict(doc.get("reference") or {}), dict(doc.get("plan") or {}))

    for d in deps.values():
        for role, r in d.roles().items():
            try:
                check_fits(chips[r.chip], model, r.chips_per_instance, sched.mem_reserve_fraction)
            except ValueError as e:
                raise SimConfigError(f"{path}: deployments.{d.name}.{role}: {e}") from None
    return sc
