"""The simulator's assumptions as frozen dataclasses, loaded from YAML with errors that name the
file and the field (`report.yaml: deployments.pdd.main_decode.count: must be >= 1, got 0`).

Numbers live in YAML, never in code: chips (and model shapes a scenario names) in the one catalog,
pdd_serve/emulation/costmodel.yaml (a scenario's `catalog: FILE` adds its own through the same
loader); the rest in `scenarios/*.yaml`. A chip is judged on docs/pdd.md's four dimensions (peak
FLOP/s, memory capacity, memory bandwidth, interconnect bandwidth) plus a price; a model on
parameters, active parameters, layers and KV bytes per token. The SLA is evaluations.loadgen's, the
link pdd_serve's `LinkConfig`, so a scenario says them as a graph and `pdd compare` do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from evaluations.loadgen import SLA
from pdd_serve.config import ConfigError, LinkConfig, PolicyConfig
from pdd_serve.emulation.costmodel import (
    Catalog,
    ChipSpec,
    CostModelError,
    ModelShape,
    check_fits,
    positive,
    user_catalog,
)

SIM_DIR = Path(__file__).resolve().parent
SCENARIO_DIR = SIM_DIR / "scenarios"
TAIL_CHUNK_MODES = ("alone", "packed", "padded")
# a scenario's SLA where it says nothing: the report's PD convention (the decode side streams the
# first token) and bounds for its 64K-token requests; `pdd compare`'s are SLA()'s own
SCENARIO_SLA_DEFAULTS = {"ttft_s": 5.0, "tpot_s": 0.05, "ttft_from": "decoder"}


class ScenarioError(ValueError):
    """A scenario value that can't be used; the message names the file and field."""


def _check(cond: bool, field_: str, msg: str) -> None:
    if not cond:
        raise ScenarioError(f"{field_}: {msg}")


# ---------------------------------------------------------------- workload, scheduler, link


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
    anomalous_fraction: float = 0.0  # long input, short output (docs/pdd.md: ~3-4%)
    anomalous_output_tokens: int = 200
    anomalous_hit: tuple[float, float] = (0.0, 0.3)
    trace_path: str | None = None
    trace_gap_scale: float = 1.0  # >1 stretches the trace's gaps (slower arrivals)
    trace_limit: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.kind in ("synthetic", "trace"), "kind", f"must be synthetic|trace, got {self.kind!r}")
        for f in ("requests", "input_tokens", "output_tokens", "block_size", "families", "anomalous_output_tokens"):
            _check(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, f"must be an integer > 0, got {getattr(self, f)!r}")
        _check(positive(self.rate_rps), "rate_rps", f"must be > 0, got {self.rate_rps!r}")
        _check(positive(self.trace_gap_scale), "trace_gap_scale", "must be > 0")
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
class SchedulerSpec:
    prefill_chunk_tokens: int = 8192  # token budget of one prefill forward
    # a long prompt's leftover chunk: alone (can't be batched with other requests, docs/pdd.md's tail
    # chunks), packed (filled up with the next requests), padded (static shapes: costs a full chunk)
    tail_chunk: str = "alone"
    prefill_batch_requests: bool = True  # False: a forward holds one request's chunk (pdd_serve's Prefill)
    decode_max_batch: int = 256
    mem_reserve_fraction: float = 0.1  # HBM kept for activations, graphs, fragmentation
    prefix_cache_gb: float = 1000.0  # per P / MD instance (HBM + host pool), for the radix caches
    # one role's own (None: prefix_cache_gb): an emulated graph's pools follow each role's chips
    prefix_cache_gb_prefill: float | None = None
    prefix_cache_gb_main_decode: float | None = None
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
        for f in ("prefix_cache_gb_prefill", "prefix_cache_gb_main_decode"):
            _check(getattr(self, f) is None or getattr(self, f) >= 0, f, "must be >= 0 or null")
        _check(0 <= self.cache_slack < 0.5, "cache_slack", "must be in [0, 0.5)")
        _check(self.request_overhead_s >= 0, "request_overhead_s", "must be >= 0")
        _check(positive(self.compute_slowdown), "compute_slowdown", "must be > 0")
        _check(self.decode_step_overhead_ms >= 0, "decode_step_overhead_ms", "must be >= 0")
        _check(self.md_call_overhead_s >= 0, "md_call_overhead_s", "must be >= 0")


@dataclass(frozen=True)
class SimLink:
    """A scenario's line: the link pdd_serve runs (`LinkConfig`: a preset of transport/link.py and
    its overrides; evaluations/sim/line.py builds the model), plus what the simulator adds at
    cluster scale: how transfers share the line and what it costs."""

    link: LinkConfig = field(default_factory=LinkConfig)
    line_gbps: float | None = None  # aggregate capacity of the line (None: only the per-transfer model)
    paced_line: bool = False  # every P replica's transfers share one pacer (pdd_serve's Line deployment)
    # with paced_line: a push's parallel Flight streams (flight.streams) and the bytes one
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
        _check(self.line_gbps is None or positive(self.line_gbps), "line_gbps", "must be > 0 or null")
        _check(self.wire_bps is None or positive(self.wire_bps), "wire_bps", "must be > 0 or null")
        _check(0 < self.wire_goodput <= 1, "wire_goodput", "must be in (0, 1]")
        _check(isinstance(self.streams, int) and 1 <= self.streams <= 16, "streams", "must be an int in [1, 16]")
        _check(self.stream_unit_bytes is None or positive(self.stream_unit_bytes), "stream_unit_bytes", "must be > 0 or null")
        _check(self.price_per_hour >= 0, "price_per_hour", "must be >= 0")

    @property
    def cross_site(self) -> bool:
        return self.link.preset != "same_dc"


# ---------------------------------------------------------------- deployments


@dataclass(frozen=True)
class RoleSpec:
    chip: str
    count: int  # chips
    chips_per_instance: int = 1
    max_batch: int | None = None  # a decoder's batch cap (None: scheduler.decode_max_batch)

    def __post_init__(self) -> None:
        _check(bool(self.chip), "chip", "must name a chip of the catalog")
        _check(self.max_batch is None or (isinstance(self.max_batch, int) and self.max_batch > 0), "max_batch",
               f"must be an integer > 0 or null, got {self.max_batch!r}")
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
               "must include P-MD or P-RLD-MD: ordinary traffic ends at main decode (docs/pdd.md)")

    def roles(self) -> dict[str, RoleSpec]:
        r = {"prefill": self.prefill, "main_decode": self.main_decode}
        if self.relay is not None and any(p in self.policy.pipelines for p in ("P-RLD-MD", "P-RLD")):
            r["relay"] = self.relay
        return r


@dataclass(frozen=True, kw_only=True)
class BaseScenario:
    """What every scenario file says: its name, the model shape it runs (a catalog name or inline)
    and the SLA, every duration in (emulated) seconds. Two kinds build on it: `Scenario` below (the
    simulator's deployments at cluster scale) and `EmulatedScenario` (evaluations/sim/emulated.py:
    `pdd compare --emulate`, the four graphs on emulated chips in slow motion)."""

    name: str
    path: str
    model: ModelShape
    sla: SLA
    description: str = ""


@dataclass(frozen=True, kw_only=True)
class Scenario(BaseScenario):
    chips: dict[str, ChipSpec]  # the one catalog's, with the scenario's own `catalog:` over them
    workload: WorkloadSpec
    scheduler: SchedulerSpec
    links: dict[str, SimLink]
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
        raise ScenarioError(f"{path}: {where}: must be a mapping, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ScenarioError(f"{path}: {where}.{unknown[0]}: unknown key; valid: {', '.join(sorted(names - set(extra)))}")
    kw = {k: _tuplify(v) for k, v in data.items()}
    try:
        return cls(**kw, **extra)
    except ValueError as e:  # ours, ConfigError, CostModelError, SLA's: each names its field
        raise ScenarioError(f"{path}: {where}.{e}") from None
    except TypeError as e:
        raise ScenarioError(f"{path}: {where}: {e}") from None


def _tuplify(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_tuplify(x) for x in v)
    return v


def read_yaml(path: Path) -> dict:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ScenarioError(f"{path}: cannot read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ScenarioError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ScenarioError(f"{path}: must hold a mapping at the top level")
    return doc


def _policy(data: Any, where: str, path: Path) -> PolicyConfig:
    if data is None:
        return PolicyConfig()
    try:
        return _build(PolicyConfig, data, where, path)
    except ScenarioError:
        raise


def _link(data: Any, where: str, path: Path) -> SimLink:
    """`wan: pdd_report` or `wan: {preset: pdd_report, line_gbps: 100, one_way_latency_s: 0.02}`: the
    preset and any key the simulator doesn't own (a LinkModel parameter) make the LinkConfig."""
    if isinstance(data, str):
        data = {"preset": data}
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: {where}: must be a preset name or a mapping")
    own = {f.name for f in dataclasses.fields(SimLink)} - {"link"}
    top = ("preset", "scale_to_model")
    over = tuple(sorted((k, _tuplify(v)) for k, v in data.items() if k not in own and k not in top))
    try:
        link = LinkConfig(**{k: data[k] for k in top if k in data}, overrides=over)
    except ConfigError as e:
        raise ScenarioError(f"{path}: {where}.preset: {e}") from None
    return _build(SimLink, {k: v for k, v in data.items() if k in own}, where, path, link=link)


def _role(data: Any, where: str, path: Path, chips: dict[str, ChipSpec]) -> RoleSpec:
    r = _build(RoleSpec, data, where, path)
    if r.chip not in chips:
        raise ScenarioError(f"{path}: {where}.chip: unknown chip {r.chip!r}; the catalog has {', '.join(sorted(chips))}")
    return r


def build_deployment(name: str, data: Any, path: Path, chips: dict[str, ChipSpec], links: dict[str, SimLink]) -> DeploymentSpec:
    where = f"deployments.{name}"
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: {where}: must be a mapping")
    valid = {"prefill", "relay", "main_decode", "link", "policy"}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ScenarioError(f"{path}: {where}.{unknown[0]}: unknown key; valid: {', '.join(sorted(valid))}")
    for req in ("prefill", "main_decode", "link"):
        if req not in data:
            raise ScenarioError(f"{path}: {where}.{req}: is required")
    if data["link"] not in links:
        raise ScenarioError(f"{path}: {where}.link: unknown link {data['link']!r}; defined: {', '.join(sorted(links))}")
    relay = _role(data["relay"], f"{where}.relay", path, chips) if data.get("relay") is not None else None
    try:
        return DeploymentSpec(name, _role(data["prefill"], f"{where}.prefill", path, chips),
                              _role(data["main_decode"], f"{where}.main_decode", path, chips), data["link"], relay,
                              _policy(data.get("policy"), f"{where}.policy", path))
    except ScenarioError as e:
        if str(e).startswith(str(path)):
            raise
        raise ScenarioError(f"{path}: {where}.{e}") from None


_SCENARIO_KEYS = {"name", "catalog", "model", "workload", "sla", "scheduler", "links", "deployments", "compare",
                  "goodput", "bathtub", "price_sensitivity", "reference", "plan", "description"}


def _catalog(own: Any, path: Path) -> Catalog:
    """The one catalog, with the scenario's own (`catalog: FILE`, relative to it) over it."""
    if own is not None and not isinstance(own, (str, Path)):
        raise ScenarioError(f"{path}: catalog: must be the path of a catalog file, got {own!r}")
    try:
        return user_catalog(None if own is None else (path.parent / own).resolve())
    except CostModelError as e:
        raise ScenarioError(f"{path}: catalog: {e}") from None


def scenario_model(data: Any, path: Path, cat: Catalog) -> ModelShape:
    """A model shape of the catalog by name (as an emulated scenario names it), or one inline."""
    if not isinstance(data, str):
        return _build(ModelShape, data, "model", path)
    try:
        return cat.model(data)
    except CostModelError as e:
        raise ScenarioError(f"{path}: {e}") from None


def resolve_scenario_path(name_or_path: str | Path, scenario_dir: Path = SCENARIO_DIR) -> Path:
    """A path as given, else a built-in scenario of `scenario_dir` by name."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    cand = scenario_dir / f"{name_or_path}.yaml"
    if not cand.exists():
        known = sorted(x.stem for x in scenario_dir.glob("*.yaml"))
        raise ScenarioError(f"unknown scenario {name_or_path!r}; built-in: {', '.join(known)} (or a path to a YAML file)")
    return cand


def load_scenario(name_or_path: str | Path, catalog: str | Path | None = None) -> Scenario:
    """Read and validate a scenario YAML (and its own chip catalog, `catalog:`, relative to it).
    `catalog`: a user's catalog file for a scenario that names none (`pdd plan --catalog`), read as
    if the scenario said `catalog:` with it."""
    path = resolve_scenario_path(name_or_path)
    doc = read_yaml(path)
    unknown = sorted(set(doc) - _SCENARIO_KEYS)
    if unknown:
        raise ScenarioError(f"{path}: {unknown[0]}: unknown key; valid: {', '.join(sorted(_SCENARIO_KEYS))}")
    for req in ("model", "deployments", "links"):
        if req not in doc:
            raise ScenarioError(f"{path}: {req}: is required")
    own = doc.get("catalog")
    if catalog is not None:
        if own is not None:
            raise ScenarioError(f"{path}: catalog: the scenario names its own catalog ({own}); "
                                f"put the entries of {catalog} there instead of giving a second one")
        own = Path(catalog).resolve()
    cat = _catalog(own, path)
    chips = dict(cat.chips)
    model = scenario_model(doc["model"], path, cat)
    wl = dict(doc.get("workload") or {})
    if wl.get("trace_path") and not Path(wl["trace_path"]).is_absolute():
        wl["trace_path"] = str((path.parent / wl["trace_path"]).resolve())
    workload = _build(WorkloadSpec, wl, "workload", path)
    sla = _build(SLA, {**SCENARIO_SLA_DEFAULTS, **(doc.get("sla") or {})}, "sla", path)
    sched = _build(SchedulerSpec, doc.get("scheduler") or {}, "scheduler", path)
    if not isinstance(doc["links"], dict) or not doc["links"]:
        raise ScenarioError(f"{path}: links: must map link names to presets")
    links = {n: _link(v, f"links.{n}", path) for n, v in doc["links"].items()}
    if not isinstance(doc["deployments"], dict) or not doc["deployments"]:
        raise ScenarioError(f"{path}: deployments: must map names to deployments")
    deps = {n: build_deployment(n, v, path, chips, links) for n, v in doc["deployments"].items()}
    compare = dict(doc.get("compare") or {})
    for k in ("subject", "cost_baseline", "latency_baseline", "naive_baseline"):
        if k in compare and compare[k] not in deps:
            raise ScenarioError(f"{path}: compare.{k}: unknown deployment {compare[k]!r}; defined: {', '.join(deps)}")
    ps = dict(doc.get("price_sensitivity") or {})
    if ps and ps.get("chip") not in chips:
        raise ScenarioError(f"{path}: price_sensitivity.chip: unknown chip {ps.get('chip')!r}")
    sc = Scenario(name=str(doc.get("name", path.stem)), path=str(path), model=model, sla=sla,
                  description=str(doc.get("description", "")).strip(), chips=chips, workload=workload,
                  scheduler=sched, links=links, deployments=deps, compare=compare,
                  goodput=dict(doc.get("goodput") or {}), bathtub=dict(doc.get("bathtub") or {}),
                  price_sensitivity=ps, reference=dict(doc.get("reference") or {}), plan=dict(doc.get("plan") or {}))

    for d in deps.values():
        for role, r in d.roles().items():
            try:
                check_fits(chips[r.chip], model, r.chips_per_instance, sched.mem_reserve_fraction)
            except ValueError as e:
                raise ScenarioError(f"{path}: deployments.{d.name}.{role}: {e}") from None
    return sc
