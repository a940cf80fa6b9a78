"""Frozen configuration, one dataclass per concern, loaded from a graph YAML's `args` (or a dict).

Data only: the code that uses a runtime object builds it from here (`serve.common.graph_link`,
`emulation.pacer.build_emulation`, `emulation.clock.Clock(cfg.time_scale)`). Every check lives in
`__post_init__` so a bad value fails where it is written, with the field's dotted name in the
message; a check may read the catalogs it names (the chip and model catalog, the link presets).
Environment variables are read here and nowhere deeper.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdd_serve.emulation import costmodel
from pdd_serve.emulation.clock import MAX_TIME_SCALE
from pdd_serve.transport.link import LineConfig, preset_config, trace_values

PIPELINES = ("P-MD", "P-RLD-MD", "P-RLD")
MAX_CONTEXT_SCALE = 1024  # one real prompt token for at most this many emulated ones
DEFAULT_MAX_BATCH = 32  # an engine's batch cap where the graph sets none and no emulated chip gives one
ENGINE_ROLES = ("prefill", "relay", "main_decode")  # the roles that run an engine (`engines:` keys)
HANDOFF_MODES = ("auto", "one-shot", "catch-up")


class ConfigError(ValueError):
    """A configuration value that can't be used; the message names the field."""


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


@dataclass(frozen=True)
class ModelConfig:
    path: str = "default"  # a local HF checkpoint dir, or "default" for the embedded small Llama
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16
    kv_cache_bytes: int = 512 << 20
    prefix_cache_bytes: int | None = None  # None: half of kv_cache_bytes
    # batch cap per replica; None: DEFAULT_MAX_BATCH, or on emulated chips the largest decode batch
    # they step within policy.tpot_slo_s and hold in their pool (emulation.pacer.decode_batch_cap)
    max_batch: int | None = None
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    threads: int | None = None  # torch intra-op threads per replica; None: the role's default (P 2, RLD/MD 1)
    # float32: every op whose result depends on the kernel (and so on the batch) in float64, rounded
    # once, so greedy tokens never depend on batching or chunking (the master invariant); ~2x CPU prefill
    batch_invariant: bool = True
    backend: str = "torch"  # torch: our engine (the reference) | vllm: vLLM (pip install -e '.[vllm]')
    vllm: Any = ()  # backend vllm: vLLM engine arguments passed through ({max_num_seqs: 64, ...})

    def __post_init__(self) -> None:
        _require(isinstance(self.device, str) and (self.device == "cpu" or self.device.startswith("cuda")),
                 f"model.device must be cpu or cuda[:N], got {self.device!r}")
        _check_backend(self, "model.")
        _require(self.dtype in (None, "float32", "float16", "bfloat16"), f"model.dtype must be float32|float16|bfloat16, got {self.dtype!r}")
        _require(self.block_size > 0 and self.block_size & (self.block_size - 1) == 0, f"model.block_size must be a power of two, got {self.block_size}")
        _require(self.kv_cache_bytes > 0, "model.kv_cache_bytes must be > 0")
        _require(self.max_batch is None or (_is_int(self.max_batch) and self.max_batch > 0),
                 f"model.max_batch must be an int > 0 (or unset), got {self.max_batch!r}")
        _require(self.prefix_cache_bytes is None or 0 <= self.prefix_cache_bytes <= self.kv_cache_bytes,
                 "model.prefix_cache_bytes must be within [0, kv_cache_bytes]")
        _require(isinstance(self.batch_invariant, bool), f"model.batch_invariant must be true or false, got {self.batch_invariant!r}")
        _require(self.threads is None or (_is_int(self.threads) and self.threads >= 1),
                 f"model.threads must be an int >= 1, got {self.threads!r}")

    @property
    def kv_dtype(self) -> str:
        """The dtype the engine runs and its KV travels in (dtype None: float32 on CPU, bfloat16 on CUDA)."""
        return self.dtype or ("bfloat16" if self.device.startswith("cuda") else "float32")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


BACKENDS = ("torch", "vllm")


def _check_backend(cfg: Any, where: str) -> None:
    """`backend` names an engine; `vllm` is a mapping of real vLLM engine arguments (checked against
    vLLM's own `EngineArgs`, so a typo fails at load, naming the field), frozen as sorted pairs."""
    _require(cfg.backend is None or cfg.backend in BACKENDS,
             f"{where}backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    args = cfg.vllm
    if args is None:
        return
    if isinstance(args, dict):
        args = tuple(sorted(args.items()))
    _require(isinstance(args, tuple) and all(isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str)
                                             for a in args),
             f"{where}vllm must be a mapping of vLLM engine arguments, got {cfg.vllm!r}")
    object.__setattr__(cfg, "vllm", args)
    if args and cfg.backend == "torch":
        raise ConfigError(f"{where}vllm sets vLLM engine arguments but {where}backend is torch: set backend: vllm")
    if args or cfg.backend == "vllm":
        try:
            from pdd_serve.engine.vllm.engine import check_engine_args
            check_engine_args(dict(args))
        except ImportError:
            raise ConfigError(f"{where}backend vllm needs vLLM installed: pip install -e '.[vllm]' "
                              "(CPU: see the README's vLLM section)") from None
        except ValueError as e:
            raise ConfigError(f"{where}{e}") from None


# `model` keys an `engines:` entry may not change, and why: every engine must agree on them.
_ENGINE_FIXED = {
    "path": "every engine serves one model (KV and token ids cross between them)",
    "block_size": "KV crosses sites block by block, so every engine must use model.block_size",
    "max_model_len": "the Router admits requests against one model.max_model_len",
    "batch_invariant": "a request moves between engines by token ids: every engine must round the same way",
}


@dataclass(frozen=True)
class EngineOverrides:
    """One `engines.<role|site>` entry: the engine settings a role or a site changes from `model`.

    Unset (None) fields keep what the lower level says. Precedence, lowest to highest: `model`,
    `engines.<site>` (the site the role runs at, `sites.<role>`), `engines.<role>`.
    """

    device: str | None = None  # cpu | cuda | cuda:N
    dtype: str | None = None  # float32 | float16 | bfloat16: one KV dtype across P, RLD and MD (checked)
    max_batch: int | None = None
    kv_cache_bytes: int | None = None
    prefix_cache_bytes: int | None = None
    threads: int | None = None
    backend: str | None = None  # torch | vllm
    vllm: Any = None  # vLLM engine arguments (replace model.vllm's)

    def __post_init__(self) -> None:
        if self.backend is not None or self.vllm is not None:
            _check_backend(self, "")
        _require(self.device is None or (isinstance(self.device, str)
                                         and (self.device == "cpu" or self.device.startswith("cuda"))),
                 f"device must be cpu or cuda[:N], got {self.device!r}")
        _require(self.dtype in (None, "float32", "float16", "bfloat16"),
                 f"dtype must be float32|float16|bfloat16, got {self.dtype!r}")
        for name in ("max_batch", "kv_cache_bytes", "threads"):
            v = getattr(self, name)
            _require(v is None or (_is_int(v) and v > 0), f"{name} must be an int > 0, got {v!r}")
        _require(self.prefix_cache_bytes is None or (_is_int(self.prefix_cache_bytes) and self.prefix_cache_bytes >= 0),
                 f"prefix_cache_bytes must be an int >= 0, got {self.prefix_cache_bytes!r}")

    def set_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


EMULATE_FIELDS = ("model", "chip", "tp", "batch_context_tokens")
# HBM an emulated chip keeps for activations, graphs and fragmentation (the simulator's default):
# the KV room left is checked here at load, and the pacer's engine pool holds it (emulation/pacer.py)
MEM_RESERVE_FRACTION = 0.1


@dataclass(frozen=True)
class EmulateEntry:
    """One `emulate:` level (the shared top of the mapping, a site, or a role): the emulated
    accelerator an engine paces its real steps to (pdd_serve/emulation/pacer.py). Unset fields keep what
    the lower level says; precedence as `engines:`, lowest to highest: `emulate` itself,
    `emulate.<site>`, `emulate.<role>`."""

    model: Any = None  # a shape of pdd_serve/emulation/costmodel.yaml by name, or one inline (a mapping)
    chip: str | None = None  # a chip of the same catalog
    tp: int | None = None  # chips per replica (tensor parallel); must divide the attention heads
    # the context per sequence (emulated tokens) a decoder's batch cap is sized for: every sequence
    # of a capped batch at this length still steps within the TPOT SLO. What a vLLM user sets as
    # --max-model-len for their workload; None: the engine's context limit x context_scale
    batch_context_tokens: int | None = None

    def __post_init__(self) -> None:
        _require(self.model is None or (isinstance(self.model, str) and self.model) or isinstance(self.model, dict),
                 f"model must name a model shape or give one inline, got {self.model!r}")
        _require(self.chip is None or (isinstance(self.chip, str) and bool(self.chip)),
                 f"chip must name a chip, got {self.chip!r}")
        _require(self.tp is None or (_is_int(self.tp) and self.tp >= 1), f"tp must be an int >= 1, got {self.tp!r}")
        _require(self.batch_context_tokens is None or (_is_int(self.batch_context_tokens) and self.batch_context_tokens >= 1),
                 f"batch_context_tokens must be an int >= 1 (emulated tokens), got {self.batch_context_tokens!r}")

    def set_fields(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in EMULATE_FIELDS if getattr(self, f) is not None}


@dataclass(frozen=True)
class LinkConfig:
    """The inter-site link as the application sees it: a named preset of transport/link.py plus
    overrides of its parameters (`bandwidth_bps` in bits/s, `one_way_latency_s`, `jitter`, ...).
    Presets other than same_dc are scaled to the model's KV bytes per token (link.py says how)."""

    preset: str = "same_dc"  # same_dc | wan_10g | wan_100g | pdd_report
    scale_to_model: bool = True
    overrides: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        line = self.line(kv_bytes_per_token=2048)  # surfaces a bad preset or parameter here, with its name
        try:
            trace_values(line)  # and a trace the line can't run on
        except (ValueError, TypeError) as e:
            raise ConfigError(f"link: {e}") from None

    def line(self, kv_bytes_per_token: int, raw: bool = False) -> LineConfig:
        """The line's parameters for a model of `kv_bytes_per_token` (`transport.link.LinkModel`
        paces them). `raw`: the line's own rate, never scaled to the model (an emulated graph's KV
        bytes are already the emulated model's)."""
        try:
            return preset_config(self.preset, kv_bytes_per_token if self.scale_to_model and not raw else None,
                                 **dict(self.overrides))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"link: {e}") from None


@dataclass(frozen=True)
class PolicyConfig:
    pipelines: tuple[str, ...] = PIPELINES  # which pipelines this graph may use
    wan_budget_s: float = 0.5  # P->MD when the estimated KV transfer fits in this
    handoff_mode: str = "auto"
    handoff_token_threshold: int = 64  # more eager tokens than this -> catch-up (docs/pdd.md)
    handoff_batch_tokens: int = 8  # catch-up ends when this few tokens remain (the final extend)
    relay_busy_fraction: float = 0.75  # relay load above this -> one-shot (free RLD sooner)
    relay_max_running: int = 8  # relay admission control (docs/pdd.md: RLD overload is the failure mode)
    # anomalous traffic (docs/pdd.md: ultra-long input, ultra-short output, ~3-4% of requests): RLD runs
    # it alone and its cross-site transfer is blocked. Defaults sized for the small CPU model.
    anomalous_min_input_tokens: int = 1536
    anomalous_max_output_tokens: int = 8
    anomalous_min_transfer_s: float = 1.0
    kv_wait_timeout_s: float = 30.0  # a cross-site wait (KV, a decoder's next chunk) longer than this falls back
    max_migrations: int = 2  # MD failures a request survives by moving to another MD before RLD finishes it
    prefill_retries: int = 2
    allow_fault_injection: bool = False  # the `inject` control calls the tests and the soak use (dev graphs)
    allow_overrides: bool = False  # honour a request body's `pdd: {pipeline, handoff_mode}`
    stream_first_token: bool = False  # P->MD: send P's first token before MD has the KV (not what PD systems do)
    drc: bool = True  # decode-side radix cache at MD
    # MDs publish their DRC and load to the routers this often (a cross-site poll in the background):
    # the router picks MD and pipeline from that view, with no round trip before prefill
    drc_view_period_s: float = 0.1
    # P->MD requests also leave their KV for the relay, so a request whose real delta turns out
    # larger than the view promised can still take P->RLD->MD at the end of prefill
    late_relay: bool = True
    # the time per output token the graph promises (emulated seconds): on emulated chips each
    # decoder's batch stops where its step would take longer (None: the default batch cap)
    tpot_slo_s: float | None = None

    def __post_init__(self) -> None:
        _require(bool(self.pipelines) and all(p in PIPELINES for p in self.pipelines),
                 f"policy.pipelines must be a non-empty subset of {PIPELINES}, got {self.pipelines}")
        _require(self.handoff_mode in HANDOFF_MODES, f"policy.handoff_mode must be one of {HANDOFF_MODES}")
        _require(self.wan_budget_s >= 0, "policy.wan_budget_s must be >= 0")
        _require(self.handoff_token_threshold >= 0, "policy.handoff_token_threshold must be >= 0")
        _require(self.handoff_batch_tokens > 0, "policy.handoff_batch_tokens must be > 0")
        _require(0 < self.relay_busy_fraction <= 1, "policy.relay_busy_fraction must be in (0, 1]")
        _require(self.relay_max_running > 0, "policy.relay_max_running must be > 0")
        _require(self.kv_wait_timeout_s > 0, "policy.kv_wait_timeout_s must be > 0")
        _require(0 < self.drc_view_period_s <= 60, "policy.drc_view_period_s must be in (0, 60]")
        _require(self.tpot_slo_s is None or (isinstance(self.tpot_slo_s, (int, float)) and self.tpot_slo_s > 0),
                 f"policy.tpot_slo_s must be > 0 seconds (or unset), got {self.tpot_slo_s!r}")
        _require(self.max_migrations >= 0 and self.prefill_retries >= 0,
                 "policy.max_migrations and policy.prefill_retries must be >= 0")


@dataclass(frozen=True)
class SiteConfig:
    """Where each role runs (a `pdd.site` node label) and how many replicas it has."""

    prefill: str = "a"
    relay: str = "a"
    main_decode: str = "b"
    router: str = "a"
    prefill_replicas: int = 1
    relay_replicas: int = 1
    main_decode_replicas: int = 1  # the default: the graph's `deployments:` may set num_replicas or autoscaling
    router_replicas: int = 1  # Routers hold no state only they know: any number decide as one would
    cpus_per_replica: float = 0.5
    # the chip each site runs, by name, for the evaluations' cost model (BCR): `chips: {a: h100-sxm,
    # b: h20}`. pdd_serve only stores the names; the catalog (pdd_serve/emulation/costmodel.yaml) checks them.
    chips: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.chips, dict):
            _require(all(isinstance(k, str) and k for k in self.chips),
                     f"sites.chips keys must be site labels, got {sorted(map(repr, self.chips))}")
            object.__setattr__(self, "chips", tuple(sorted(self.chips.items())))
        _require(isinstance(self.chips, tuple)
                 and all(isinstance(c, tuple) and len(c) == 2 and all(isinstance(x, str) and x for x in c)
                         for c in self.chips),
                 f"sites.chips must map site labels to chip names, e.g. {{a: h100-sxm, b: h20}}, got {self.chips!r}")
        for role in ("prefill", "relay", "main_decode", "router"):
            _require(bool(getattr(self, role)), f"sites.{role} must name a site label")
        for role in ("prefill_replicas", "relay_replicas", "main_decode_replicas", "router_replicas"):
            _require(getattr(self, role) >= 1, f"sites.{role} must be >= 1")
        _require(self.cpus_per_replica >= 0, "sites.cpus_per_replica must be >= 0")

    @property
    def chip_map(self) -> dict[str, str]:
        """`sites.chips` as {site: chip name} (empty when the graph names no chips)."""
        return dict(self.chips)


@dataclass(frozen=True)
class FlightConfig:
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None  # None: the bind host (or the node IP when binding 0.0.0.0)
    port: int = 0  # 0: any free port
    token: str | None = None  # None: from $PDD_FLIGHT_TOKEN, else one random token per graph
    # The key of the MAC over each KV batch (request id, block hashes, CRCs): the token lets a
    # client write, the MAC proves P wrote what MD caches. None: one random key per graph.
    mac_key: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_root_cert: str | None = None
    tls_server_name: str | None = None  # the name P checks MD's certificate for (None: MD's address)
    batch_blocks: int = 64  # ~2 MB batches at 32 KB blocks: smaller ones halve Flight throughput
    # parallel Flight streams per KV push (own connections, one shared feed): one stream sends while
    # another waits in gRPC or the pacer; over one stream, +1-2% of line rate at 1 Gbit/s and +9-15%
    # at 10 Gbit/s on the 2-core dev box (evaluations/bench/transport.py); 4 were not reliably better
    streams: int = 2
    deadline_s: float = 60.0
    max_bytes_per_request: int = 256 << 20
    max_bytes_total: int = 1 << 30
    # KV one Prefill replica may hold for transfers still on the line (real bytes). A slow line
    # drains slower than prefill computes: past this, or past what the line drains within
    # policy.kv_wait_timeout_s at its live rate (MD stops waiting then), a prefill that would add
    # to the line is refused at admission (the router retries, or answers 503), instead of its
    # blocks waiting in memory without bound. One transfer always fits, however large
    send_buffer_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        _require(0 <= self.port < 65536, f"flight.port must be in [0, 65535], got {self.port}")
        _require(self.send_buffer_bytes > 0, f"flight.send_buffer_bytes must be > 0, got {self.send_buffer_bytes}")
        _require((self.tls_cert is None) == (self.tls_key is None), "flight.tls_cert and flight.tls_key go together")
        _require(self.batch_blocks > 0 and self.deadline_s > 0, "flight.batch_blocks and flight.deadline_s must be > 0")
        _require(1 <= self.streams <= 16, f"flight.streams must be in [1, 16], got {self.streams}")
        _require(self.max_bytes_per_request > 0 and self.max_bytes_total >= self.max_bytes_per_request,
                 "flight.max_bytes_total must be >= flight.max_bytes_per_request > 0")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str = "pdd-small"  # the id /v1/models reports and requests must name
    api_keys: tuple[str, ...] = ()  # empty: no API key required
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens_limit: int = 4096
    max_stop: int = 8
    max_queue: int = 256  # requests in flight at the router before 503 + Retry-After
    api_keys_file: str | None = None  # more API keys, one a line, read by the Router: keys stay out of YAML
    admin_api_keys: tuple[str, ...] = ()  # these callers also see cache-hit facts (and pass as API keys)
    # prefix_hit_p / prefix_hit_md / wan_bytes in every response: with them any client can probe
    # whether another tenant's prefix is cached, so only dev and measurement graphs turn this on
    expose_cache_hits: bool = False
    # serve HTTP beyond loopback without API keys, or Flight beyond loopback without TLS
    allow_insecure: bool = False

    def __post_init__(self) -> None:
        _require(bool(self.model_name), "server.model_name must not be empty")
        _require(all(isinstance(k, str) and k for k in (*self.api_keys, *self.admin_api_keys)),
                 "server.api_keys and server.admin_api_keys must be non-empty strings")
        _require(self.max_body_bytes > 0 and self.max_tokens_limit > 0 and self.max_queue > 0,
                 "server limits must be > 0")


@dataclass(frozen=True)
class PDDConfig:
    graph: str = "pdd"  # pdd | pd_same_dc | pd_cross_dc (a label for reports)
    model: ModelConfig = field(default_factory=ModelConfig)
    link: LinkConfig = field(default_factory=LinkConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sites: SiteConfig = field(default_factory=SiteConfig)
    flight: FlightConfig = field(default_factory=FlightConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    # per-role / per-site engine settings over `model`, as sorted (key, overrides) pairs; see engine_for
    engines: tuple[tuple[str, EngineOverrides], ...] = ()
    # emulated accelerators per role / site, as sorted (key, entry) pairs ("" is the shared top)
    emulate: tuple[tuple[str, EmulateEntry], ...] = ()
    # slow motion (emulation/clock.py): every modeled step, link delay and cross-site timeout is this
    # many times longer in real time, and reported times divide it back; one for the whole graph
    time_scale: float = 1.0
    # the report's regime on a small model (issue 40): one real PROMPT token stands for this many
    # emulated tokens in every cost (prefill FLOPs and attention, KV bytes on the line, in the pool
    # and copied, decode attention, the policy's prompt-length thresholds); generated tokens count
    # 1:1. 32 maps the 16-token block to 512 and a 256-token chunk to 8,192. Emulated graphs only
    context_scale: int = 1

    def __post_init__(self) -> None:
        cs = self.context_scale
        _require(_is_int(cs) and 1 <= cs <= MAX_CONTEXT_SCALE,
                 f"context_scale must be an int in [1, {MAX_CONTEXT_SCALE}], got {cs!r}")
        _require(cs == 1 or bool(self.emulate),
                 f"context_scale {cs} scales an emulated graph's costs, and this graph has no emulate: block")
        ts = self.time_scale
        _require(isinstance(ts, (int, float)) and not isinstance(ts, bool) and 0 < ts < MAX_TIME_SCALE,
                 f"time_scale must be a number in (0, 1e6), got {ts!r}")
        _require(ts == 1 or bool(self.emulate),
                 f"time_scale {ts:g} slows an emulated graph, and this graph has no emulate: block")
        object.__setattr__(self, "time_scale", float(ts))
        self._check_engines()
        self._check_emulate()
        cross = self.sites.prefill != self.sites.main_decode
        _require(cross or self.link.preset == "same_dc",
                 "prefill and main_decode share a site, so link.preset must be same_dc")
        _require("P-RLD-MD" not in self.policy.pipelines or self.sites.relay == self.sites.prefill,
                 "sites.relay must equal sites.prefill: relay decode sits beside prefill (docs/pdd.md)")
        _require("P-MD" in self.policy.pipelines or "P-RLD-MD" in self.policy.pipelines,
                 "policy.pipelines must include P-MD or P-RLD-MD: ordinary traffic must end at main decode")
        _require(is_loopback(self.flight.bind_host) or self.flight.tls_cert is not None or self.server.allow_insecure,
                 f"flight.bind_host {self.flight.bind_host!r} takes KV from beyond this machine in plaintext: set "
                 "flight.tls_cert, flight.tls_key and flight.tls_root_cert (docs/cluster-launch.md makes them), "
                 "or server.allow_insecure: true on a network you trust")

    @property
    def uses_relay(self) -> bool:
        return any(p in self.policy.pipelines for p in ("P-RLD-MD", "P-RLD"))

    def engine_for(self, role: str) -> ModelConfig:
        """The effective model/engine config of one role: `model`, then `engines.<site>` for the
        site the role runs at, then `engines.<role>` (each later level wins, field by field)."""
        _require(role in ENGINE_ROLES, f"engine_for: role must be one of {ENGINE_ROLES}, got {role!r}")
        site = getattr(self.sites, role)
        entries = dict(self.engines)
        merged: dict[str, Any] = {}
        used = []
        for key in (site, role):
            if key in entries:
                merged.update(entries[key].set_fields())
                used.append(f"engines.{key}")
        if not merged:
            return self.model
        try:
            return dataclasses.replace(self.model, **merged)
        except ConfigError as e:
            raise ConfigError(f"the {role} engine (model + {' + '.join(used)}): {e}") from None

    @property
    def emulated(self) -> bool:
        return bool(self.emulate)

    def emulate_for(self, role: str) -> EmulateEntry | None:
        """One role's emulated accelerator as the graph gives it (model, chip and tp, tp 1 unset;
        None: the graph runs unemulated). emulation/pacer.py's `build_emulation` builds it."""
        if not self.emulate:
            return None
        return EmulateEntry(**{"tp": 1, **self._merged_emulate(role)[0]})

    def _merged_emulate(self, role: str) -> tuple[dict[str, Any], dict[str, str]]:
        """(fields, where each was set): `emulate`, then `emulate.<site>`, then `emulate.<role>`."""
        entries = dict(self.emulate)
        merged: dict[str, Any] = {}
        where: dict[str, str] = {}
        for key in ("", getattr(self.sites, role), role):
            for f, v in (entries[key].set_fields() if key in entries else {}).items():
                merged[f], where[f] = v, f"emulate.{key}.{f}" if key else f"emulate.{f}"
        return merged, where

    def _check_emulate(self) -> None:
        _require(isinstance(self.emulate, tuple) and all(
            isinstance(e, tuple) and len(e) == 2 and isinstance(e[1], EmulateEntry) for e in self.emulate),
                 "emulate must be (key, EmulateEntry) pairs (load_config builds them from `emulate:`)")
        sites = {getattr(self.sites, r) for r in ENGINE_ROLES}
        for key, _ in self.emulate:
            _require(key == "" or key in ENGINE_ROLES or key in sites,
                     f"emulate.{key} is neither a role ({', '.join(ENGINE_ROLES)}) nor a site an engine runs at "
                     f"({', '.join(sorted(sites))})")
        if not self.emulate:
            return
        # every deployed role, against the catalog, with the field named
        cat = costmodel.load_catalog()
        models = {}
        for role in self.engine_roles():
            merged, where = self._merged_emulate(role)
            for f in ("model", "chip"):
                _require(f in merged, f"emulate: the {role} engine has no {f} (set emulate.{f}, "
                         f"emulate.{getattr(self.sites, role)}.{f} or emulate.{role}.{f}): an emulated graph "
                         "emulates every engine, or its unemulated CPU roles would run in slow motion too")
            try:
                chip = cat.chip(merged["chip"])
            except costmodel.CostModelError as e:
                raise ConfigError(f"{where['chip']}: {str(e).removeprefix('chip: ')}") from None
            try:
                model = (costmodel.model_from(merged["model"], where["model"]) if isinstance(merged["model"], dict)
                         else cat.model(merged["model"]))
            except costmodel.CostModelError as e:
                raise ConfigError(f"{where['model']}: {str(e).removeprefix('model: ')}") from None
            tp = merged.get("tp", 1)
            tpw = where.get("tp", "emulate.tp")
            if model.heads is not None:  # KV heads split across chips, or replicated when fewer (as vLLM does)
                kvh = model.kv_heads or model.heads
                _require(model.heads % tp == 0 and (kvh % tp == 0 or tp % kvh == 0),
                         f"{tpw}: tp {tp} does not divide {model.name}'s {model.heads} attention heads "
                         f"({kvh} KV heads): tensor parallelism splits heads across chips")
            room = costmodel.kv_capacity_tokens(chip, model, tp, MEM_RESERVE_FRACTION)
            need = (self.engine_for(role).max_model_len or 4096) * self.context_scale  # emulated tokens
            _require(room >= need,
                     f"{where['chip']}: {model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) on {tp} x "
                     f"{chip.name} ({chip.mem_gb:g} GB each) leaves KV room for {room} tokens, "
                     f"under one {need}-token request: raise {tpw} or pick a larger chip"
                     + (f" (or lower context_scale, now {self.context_scale})" if self.context_scale > 1 else ""))
            models[role] = model
        shapes = {r: m.name for r, m in models.items()}
        _require(len(set(models.values())) == 1,
                 f"emulate.model must be one for the whole graph (KV crosses between the roles), got {shapes}")

    def engine_roles(self) -> tuple[str, ...]:
        """The roles this graph deploys with an engine."""
        return ("prefill", "relay", "main_decode") if self.uses_relay else ("prefill", "main_decode")

    def _check_engines(self) -> None:
        _require(isinstance(self.engines, tuple) and all(
            isinstance(e, tuple) and len(e) == 2 and isinstance(e[1], EngineOverrides) for e in self.engines),
                 "engines must be (key, EngineOverrides) pairs (load_config builds them from `engines:`)")
        sites = {getattr(self.sites, r): r for r in ENGINE_ROLES}
        for key, _ in self.engines:
            _require(key in ENGINE_ROLES or key in sites,
                     f"engines.{key} is neither a role ({', '.join(ENGINE_ROLES)}) nor a site an engine runs at "
                     f"({', '.join(sorted(sites))}, from sites.prefill/relay/main_decode)")
        if self.engines:
            for site, role in sites.items():
                _require(site not in ENGINE_ROLES,
                         f"sites.{role} is {site!r}, a role name: engines.{site} would be ambiguous; rename the site")
        engines = {role: self.engine_for(role) for role in ENGINE_ROLES}
        deployed = self.engine_roles()
        want = self.model.kv_dtype
        bad = [f"{r}: {engines[r].kv_dtype}" for r in deployed if engines[r].kv_dtype != want]
        _require(not bad,
                 f"engines: every engine must run one KV dtype, model's {want} (model.dtype {self.model.dtype}, "
                 f"model.device {self.model.device}), but {', '.join(bad)}: KV crosses from prefill to relay and "
                 "main_decode as raw blocks and the transport refuses another dtype (no conversion), and the Router "
                 "sizes transfers from model. Set model.dtype (a device override to cuda makes dtype None mean "
                 "bfloat16) or drop the dtype override")
        known = set(sites) | {self.sites.router}
        for site, _chip in self.sites.chips:
            _require(site in known, f"sites.chips.{site}: no role runs at site {site!r} (sites: {', '.join(sorted(known))})")


def is_loopback(host: str | None) -> bool:
    """Whether a bind address is reachable only from this machine (None: Serve's default, 127.0.0.1)."""
    import ipaddress

    if host is None or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: assume it resolves beyond loopback


def check_http_bind(http_host: str | None, server: ServerConfig) -> None:
    """The Router's HTTP bind (`http_options.host`, outside `args`): beyond loopback it needs API
    keys unless the graph says `server.allow_insecure: true`. Run where the whole YAML is seen."""
    _require(is_loopback(http_host) or bool(server.api_keys) or server.api_keys_file is not None
             or server.allow_insecure,
             f"http_options.host {http_host!r} serves the API beyond this machine with no API key: set "
             "server.api_keys_file (or server.api_keys), or server.allow_insecure: true on a network you trust")


_SECTIONS = {"model": ModelConfig, "link": LinkConfig, "policy": PolicyConfig, "sites": SiteConfig,
             "flight": FlightConfig, "server": ServerConfig}


def _build(cls: type, data: Any, where: str) -> Any:
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"unknown key(s) {', '.join(where + '.' + k for k in unknown)}; "
                          f"valid: {', '.join(sorted(names))}")
    kw = {}
    for k, v in data.items():
        if isinstance(v, list):
            v = tuple(tuple(x) if isinstance(x, list) else x for x in v)
        kw[k] = v
    try:
        return cls(**kw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def _build_engines(data: Any) -> tuple[tuple[str, EngineOverrides], ...]:
    """`engines: {prefill: {dtype: ..., threads: 4}, b: {kv_cache_bytes: ...}}` -> sorted pairs."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise ConfigError(f"engines must be a mapping of role or site -> settings, got {type(data).__name__}")
    out = []
    for key, entry in data.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"engines keys must be role or site names, got {key!r}")
        if isinstance(entry, dict):
            for k in sorted(set(entry) & set(_ENGINE_FIXED)):
                raise ConfigError(f"engines.{key}.{k} can't be set per role or site: {_ENGINE_FIXED[k]}")
        out.append((key, _build(EngineOverrides, entry, f"engines.{key}")))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def _moved_time_scale(where: str, data: Any) -> None:
    """`time_scale` was once accepted inside `emulate:` (at any level) and the link settings: it is
    one graph-wide key now, and the old spellings are refused with the new one."""
    if isinstance(data, dict) and "time_scale" in data:
        raise ConfigError(f"{where}.time_scale: time_scale is one key for the whole graph now: write "
                          f"`time_scale: {data['time_scale']}` at the top of the graph's args, beside `emulate:`")


def _build_emulate(data: Any) -> tuple[tuple[str, EmulateEntry], ...]:
    """`emulate: {model: llama-3-70b, a: {chip: h100-sxm, tp: 4}, b: {chip: h20, tp: 8}}`
    -> sorted pairs; the shared top level is key ""."""
    if data is None:
        return ()
    if not isinstance(data, dict):
        raise ConfigError(f"emulate must be a mapping ({', '.join(EMULATE_FIELDS)} and role or site entries), "
                          f"got {type(data).__name__}")
    _moved_time_scale("emulate", data)
    for key, entry in data.items():
        _moved_time_scale(f"emulate.{key}", entry)
    top = {k: v for k, v in data.items() if k in EMULATE_FIELDS}
    out = [("", _build(EmulateEntry, top, "emulate"))] if top else []
    for key, entry in data.items():
        if key in EMULATE_FIELDS:
            continue
        if not isinstance(key, str) or not key:
            raise ConfigError(f"emulate keys must be {', '.join(EMULATE_FIELDS)} or role or site names, got {key!r}")
        out.append((key, _build(EmulateEntry, entry, f"emulate.{key}")))
    return tuple(sorted(out, key=lambda kv: kv[0]))


def load_config(args: dict[str, Any] | PDDConfig | None) -> PDDConfig:
    """Build and validate the one config object from a graph YAML's `args` mapping."""
    if isinstance(args, PDDConfig):
        return args
    args = dict(args or {})
    unknown = sorted(set(args) - set(_SECTIONS) - {"graph", "engines", "emulate", "time_scale", "context_scale"})
    if unknown:
        raise ConfigError(f"unknown top-level arg(s) {unknown}; valid: graph, engines, emulate, time_scale, context_scale, "
                          f"{', '.join(_SECTIONS)}")
    model = args.get("model")
    if isinstance(model, str):  # `model: /path/to/ckpt` shorthand
        args["model"] = {"path": model}
    link = args.get("link")
    if isinstance(link, str):  # `link: pdd_report` shorthand
        args["link"] = {"preset": link}
    elif isinstance(link, dict):  # `link: {preset: wan_10g, one_way_latency_s: 0.02}`
        _moved_time_scale("link", link)
        extra = {k: v for k, v in link.items() if k not in ("preset", "scale_to_model")}
        args["link"] = {k: v for k, v in link.items() if k in ("preset", "scale_to_model")}
        args["link"]["overrides"] = tuple(sorted((k, tuple(map(tuple, v)) if k == "stalls" else v)
                                                 for k, v in extra.items()))
    kw = {k: _build(cls, args.get(k), k) for k, cls in _SECTIONS.items()}
    flight: FlightConfig = kw["flight"]
    if flight.token is None and os.environ.get("PDD_FLIGHT_TOKEN"):
        kw["flight"] = dataclasses.replace(flight, token=os.environ["PDD_FLIGHT_TOKEN"])
    return PDDConfig(graph=str(args.get("graph", "pdd")), engines=_build_engines(args.get("engines")),
                     emulate=_build_emulate(args.get("emulate")), time_scale=args.get("time_scale", 1.0),
                     context_scale=args.get("context_scale", 1), **kw)


def load_graph_yaml(path: str | Path, app_index: int = 0) -> PDDConfig:
    """The PDDConfig of a Serve config file (`applications[i].args`), for tools that read graphs."""
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read Serve config: {e}") from None
    try:
        app = doc["applications"][app_index]
    except (TypeError, KeyError, IndexError):
        raise ConfigError(f"{path}: expected `applications: [ {{import_path, args}} ]`") from None
    try:
        cfg = load_config(app.get("args") or {})
    except ConfigError as e:
        raise ConfigError(f"{path}: applications[{app_index}].args: {e}") from None
    try:
        check_http_bind((doc.get("http_options") or {}).get("host"), cfg.server)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return cfg
