"""Prometheus metrics through Ray Serve's metrics API, and the Router's cluster-wide `GET /metrics`.

Every replica records into Ray's metrics (Ray prefixes the names with `ray_`; each node's metrics
agent exports what that node's processes recorded, on the node's `MetricsExportPort`, a few seconds
after they were recorded). `GET /metrics` on the API port gathers those node exports
(`cluster_metrics_text`), keeps the PDD (`ray_pdd_*`) and Serve (`ray_serve_*`) families and adds
the vLLM names for the quantities that are the same (`VLLM_ALIASES`): what a client built for vLLM
(AIPerf, vLLM's benchmark scripts, a Prometheus scrape job) looks for there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pdd_serve.emulation.clock import Clock

_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
_TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
_E2E_BUCKETS = [0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]
log = logging.getLogger("pdd_serve.metrics")


class RouterMetrics:
    """What PDD did, per request: TTFT/TPOT, handoffs by mode, eager-token share, WAN bytes,
    requests by pipeline, fallbacks and rejections."""

    def __init__(self, clock: Clock = Clock()) -> None:
        from ray.serve.metrics import Counter, Histogram

        self.clock = clock  # emulated graphs: every latency is reported in emulated seconds

        self.ttft = Histogram("pdd_ttft_seconds", "time to first token", boundaries=_LATENCY_BUCKETS,
                              tag_keys=("pipeline",))
        self.tpot = Histogram("pdd_tpot_seconds", "time per output token", boundaries=_TPOT_BUCKETS,
                              tag_keys=("pipeline",))
        self.requests = Counter("pdd_requests_total", "finished requests by pipeline and finish reason",
                                tag_keys=("pipeline", "finish_reason"))
        self.handoffs = Counter("pdd_handoffs_total", "RLD->MD handoffs by mode", tag_keys=("mode",))
        self.eager_tokens = Counter("pdd_eager_tokens_total", "output tokens produced by relay decode")
        self.output_tokens = Counter("pdd_output_tokens_total", "output tokens streamed to clients")
        self.wan_bytes = Counter("pdd_wan_bytes_total", "KV bytes sent across sites")
        self.fallbacks = Counter("pdd_fallbacks_total", "fault fallbacks by kind", tag_keys=("kind",))
        self.rejected = Counter("pdd_rejected_total", "requests rejected before admission", tag_keys=("reason",))
        self.index_misses = Counter("pdd_router_index_misses_total",
                                    "requests whose MD held less of the prompt than the router's view said")
        self.prompt_tokens = Counter("pdd_prompt_tokens_total", "prompt tokens of requests that got a first token")
        self.e2e = Histogram("pdd_e2e_request_latency_seconds", "arrival at the router to the last token",
                             boundaries=_E2E_BUCKETS, tag_keys=("pipeline",))
        self.request_tpot = Histogram("pdd_request_tpot_seconds", "per request: (last token - first token) / "
                                      "(output tokens - 1)", boundaries=_TPOT_BUCKETS, tag_keys=("pipeline",))

    def record(self, st: Any) -> None:
        info = st.info
        pipeline = info.pipeline or "none"
        self.requests.inc(tags={"pipeline": pipeline, "finish_reason": st.finish_reason or "abort"})
        if info.handoff_mode != "none":
            self.handoffs.inc(tags={"mode": info.handoff_mode})
        if info.eager_tokens:
            self.eager_tokens.inc(info.eager_tokens)
        if st.committed:
            self.output_tokens.inc(len(st.committed))
            self.prompt_tokens.inc(len(st.gen.prompt_token_ids))
        e2e = self.clock.emulated(time.monotonic() - st.t0)
        self.e2e.observe(e2e, tags={"pipeline": pipeline})
        if len(st.committed) > 1 and info.ttft_s:
            self.request_tpot.observe(max(0.0, e2e - info.ttft_s) / (len(st.committed) - 1),
                                      tags={"pipeline": pipeline})
        if info.wan_bytes:
            self.wan_bytes.inc(info.wan_bytes)
        for kind in info.fallbacks:
            if kind == "index_miss":
                self.index_misses.inc()
            else:
                self.fallbacks.inc(tags={"kind": kind})


def kv_usage(free_blocks: int, total_blocks: int) -> float:
    """The fraction of a KV pool's blocks in use (0 for an empty pool)."""
    return 0.0 if total_blocks <= 0 else min(1.0, max(0.0, 1.0 - free_blocks / total_blocks))


class ReplicaGauges:
    """The load of one serving replica, for the dashboard's relay and MD load panels:
    `pdd_replica_requests{role}` (the requests the replica holds: `ReplicaStats.running`, what the
    router balances on) and `pdd_replica_kv_usage{role}` (the fraction of its KV pool in use).

    `ReplicaGauges.watch(role, self.stats)` in a deployment's `__init__` polls `stats()` (a
    `ReplicaStats`) every `period_s` on the replica's event loop (Serve runs `__init__` there), so
    `stats` reads the replica's state on the loop that changes it."""

    def __init__(self, role: str, stats: Callable[[], Any], period_s: float = 2.0) -> None:
        from ray.serve.metrics import Counter, Gauge

        self.role, self._stats, self.period_s = role, stats, period_s
        self.requests = Gauge("pdd_replica_requests", "requests the replica holds", tag_keys=("role",))
        self.kv = Gauge("pdd_replica_kv_usage", "fraction of the replica's KV pool blocks in use", tag_keys=("role",))
        for g in (self.requests, self.kv):
            g.set_default_tags({"role": role})
        # emulated accelerators (pdd_serve/emulation/pacer.py): the share of engine steps whose real work
        # took longer than the emulated chip's modeled time, per step kind; above ~5% the run
        # measures this machine's CPU, not the chip
        self.overrun = Gauge("pdd_emulation_overrun_share", "share of engine steps slower than the emulated "
                             "chip's modeled time", tag_keys=("role", "kind"))
        self.steps = Gauge("pdd_emulation_steps", "engine steps paced to the emulated chip", tag_keys=("role", "kind"))
        # a decoder that continued a request found KV that was not the request's own context and
        # recomputed it from the token ids (`common.verify_context`): any count here is a bug upstream
        self.context_mismatches = Counter("pdd_context_mismatches_total", "takeovers whose KV was not their "
                                          "context (recomputed, never decoded)", tag_keys=("role",))
        self.context_mismatches.set_default_tags({"role": role})
        self._mismatches_seen = 0
        self._task: asyncio.Task | None = None

    @classmethod
    def watch(cls, role: str, stats: Callable[[], Any], period_s: float = 2.0) -> ReplicaGauges:
        g = cls(role, stats, period_s)
        try:
            g._task = asyncio.get_running_loop().create_task(g._loop())
        except RuntimeError:  # no loop here: the owner calls update() itself
            log.warning("ReplicaGauges(%s): no running event loop; call update() to set the gauges", role)
        return g

    def update(self) -> None:
        s = self._stats()
        self.requests.set(s.running)
        self.kv.set(kv_usage(s.free_blocks, s.total_blocks))
        extra = getattr(s, "extra", None) or {}
        seen = extra.get("context_mismatches", 0)
        if seen > self._mismatches_seen:
            self.context_mismatches.inc(seen - self._mismatches_seen)
            self._mismatches_seen = seen
        emu = extra.get("emulation")
        if emu:
            from pdd_serve.emulation.pacer import PACED_KINDS

            for kind in PACED_KINDS:  # the forwards, and KV imports and exports
                tags = {"role": self.role, "kind": kind}
                self.overrun.set(emu.get(f"overrun_share_{kind}", 0.0), tags=tags)
                self.steps.set(emu.get(f"{kind}_steps", 0), tags=tags)

    async def _loop(self) -> None:
        failed = False
        while True:
            try:
                self.update()
                failed = False
            except Exception:  # noqa: BLE001 - a gauge never takes its replica down
                if not failed:
                    log.debug("ReplicaGauges(%s): stats() failed", self.role, exc_info=True)
                failed = True
            await asyncio.sleep(self.period_s)


# ------------------------------------------------------------------ GET /metrics: the cluster's view

RAY_PREFIX = "ray_"  # Ray's namespace on every application metric it exports
KEEP_PREFIXES = ("ray_pdd_", "ray_serve_")  # the families /metrics serves (Ray's system metrics stay on Ray's port)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SCRAPE_TIMEOUT_S = 2.0
NODES_TTL_S = 10.0
SCRAPE_FAMILY = "pdd_metrics_nodes"  # gauge: {outcome="ok"|"failed"} node exports this /metrics read


@dataclass(frozen=True)
class Alias:
    """A PDD family also served under a vLLM name: the same quantity, PDD's buckets and labels
    (plus `model_name`, as vLLM labels its series), `labels` renamed as vLLM names them."""

    source: str  # the metric as metrics.py names it (Ray exports it as ray_<source>)
    vllm: str
    labels: tuple[tuple[str, str], ...] = ()


# Only where the quantity really is vLLM's (see docs/usage.md "Metrics"). TPOT: PDD observes the gap
# between the chunks the Router streams, per token of the chunk, which is vLLM's inter-token latency
# (`vllm:time_per_output_token_seconds` is its name before vLLM 0.11). No alias for
# `vllm:num_requests_running`/`_waiting`: a PDD request is held by P, RLD and MD at once and MD
# counts requests that still wait for their KV, so no PDD gauge is vLLM's scheduler count.
VLLM_ALIASES: tuple[Alias, ...] = (
    Alias("pdd_ttft_seconds", "vllm:time_to_first_token_seconds"),
    Alias("pdd_tpot_seconds", "vllm:inter_token_latency_seconds"),
    Alias("pdd_tpot_seconds", "vllm:time_per_output_token_seconds"),
    Alias("pdd_request_tpot_seconds", "vllm:request_time_per_output_token_seconds"),
    Alias("pdd_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
    Alias("pdd_prompt_tokens_total", "vllm:prompt_tokens_total"),
    Alias("pdd_output_tokens_total", "vllm:generation_tokens_total"),
    Alias("pdd_requests_total", "vllm:request_success_total", (("finish_reason", "finished_reason"),)),
)


def _family_name(name: str) -> str:
    """A family's name as prometheus_client's parser names it (a counter without `_total`)."""
    return name[: -len("_total")] if name.endswith("_total") else name


def line_metric(line: str) -> str | None:
    """The metric a text-format line is about (None for other comments and blank lines)."""
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) >= 3 and parts[1] in ("HELP", "TYPE") else None
    end = len(line)
    for ch in "{ \t":
        i = line.find(ch)
        if i != -1:
            end = min(end, i)
    return line[:end] or None


def filter_text(text: str, prefixes: Iterable[str] = KEEP_PREFIXES) -> str:
    """The lines of a Prometheus text exposition about metrics named with one of `prefixes`
    (before parsing: a node's export holds hundreds of Ray system series /metrics does not serve)."""
    prefixes = tuple(prefixes)
    keep = [ln for ln in text.splitlines() if (m := line_metric(ln)) is not None and m.startswith(prefixes)]
    return "\n".join(keep) + "\n" if keep else ""


def parse_families(text: str, prefixes: Iterable[str] = KEEP_PREFIXES) -> list[Any]:
    """The metric families (prometheus_client `Metric`s) in one node's export, kept to `prefixes`."""
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(filter_text(text, prefixes)))


def merge_families(groups: Iterable[Iterable[Any]]) -> dict[str, Any]:
    """One family per name across the nodes' exports (the first HELP and TYPE win; a sample seen
    twice, same name and labels, is kept once: Prometheus refuses a scrape with duplicates)."""
    from prometheus_client.core import Metric

    out: dict[str, Any] = {}
    seen: set[tuple] = set()
    for fams in groups:
        for f in fams:
            m = out.get(f.name)
            if m is None:
                m = out[f.name] = Metric(f.name, f.documentation, f.type, getattr(f, "unit", ""))
            elif m.type != f.type:
                log.warning("metric %s is %s on one node and %s on another; keeping %s", f.name, m.type, f.type, m.type)
                continue
            for s in f.samples:
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in seen:
                    seen.add(key)
                    m.samples.append(s)
    return out


def vllm_aliases(families: Mapping[str, Any], model_name: str,
                 aliases: Iterable[Alias] = VLLM_ALIASES) -> list[Any]:
    """The vLLM-named copies of the PDD families present (renamed samples, `model_name` added)."""
    from prometheus_client.core import Metric

    out = []
    for a in aliases:
        src = families.get(_family_name(RAY_PREFIX + a.source))
        if src is None:
            continue
        fam = _family_name(a.vllm) if src.type == "counter" else a.vllm
        m = Metric(fam, f"{src.documentation} (PDD's {a.source}, under vLLM's name)", src.type)
        relabel = dict(a.labels)
        for s in src.samples:
            suffix = s.name[len(src.name):]
            labels = {relabel.get(k, k): v for k, v in s.labels.items()}
            labels.setdefault("model_name", model_name)
            m.samples.append(s._replace(name=fam + suffix, labels=labels))
        out.append(m)
    return out


def render(families: Iterable[Any]) -> str:
    """Prometheus text format (0.0.4) of `families`."""
    from prometheus_client.exposition import generate_latest

    class _Collector:
        def collect(self) -> Iterable[Any]:
            return list(families)

    return generate_latest(_Collector()).decode("utf-8")  # type: ignore[arg-type]


def cluster_exposition(texts: Iterable[str | None], model_name: str) -> str:
    """What `GET /metrics` serves, from every node's export (None: that node did not answer):
    the PDD and Serve families merged across nodes, their vLLM names, and `pdd_metrics_nodes`
    (how many node exports this answer read and how many failed: a partial view says so)."""
    from prometheus_client.core import GaugeMetricFamily

    groups, ok, failed = [], 0, 0
    for t in texts:
        if t is None:
            failed += 1
            continue
        try:
            groups.append(parse_families(t))
            ok += 1
        except Exception:  # noqa: BLE001 - one malformed export does not hide the others
            log.warning("a node's metrics export did not parse", exc_info=True)
            failed += 1
    fams = merge_families(groups)
    nodes = GaugeMetricFamily(SCRAPE_FAMILY, "Ray node metrics exports read by this /metrics answer",
                              labels=["outcome"])
    nodes.add_metric(["ok"], ok)
    nodes.add_metric(["failed"], failed)
    return render([*fams.values(), *vllm_aliases(fams, model_name), nodes])


_nodes_cache: tuple[float, list[str]] = (0.0, [])


def node_metrics_urls(nodes: Iterable[Mapping[str, Any]]) -> list[str]:
    """The metrics export URL of every live node in `ray.nodes()`."""
    urls = []
    for n in nodes:
        host, port = n.get("NodeManagerAddress"), n.get("MetricsExportPort")
        if not n.get("Alive", False) or not host or not port:
            continue
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{int(port)}/metrics"
        if url not in urls:
            urls.append(url)
    return urls


async def _metrics_urls() -> list[str]:
    global _nodes_cache
    t, urls = _nodes_cache
    if not urls or time.monotonic() - t > NODES_TTL_S:
        import ray

        urls = node_metrics_urls(await asyncio.get_running_loop().run_in_executor(None, ray.nodes))
        _nodes_cache = (time.monotonic(), urls)
    return urls


async def fetch_texts(urls: Iterable[str], timeout_s: float = SCRAPE_TIMEOUT_S) -> list[str | None]:
    """Every URL's body, concurrently (None where it failed or took longer than `timeout_s`)."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        async def one(url: str) -> str | None:
            try:
                r = await asyncio.wait_for(client.get(url), timeout_s)
                r.raise_for_status()
                return r.text
            except Exception as e:  # noqa: BLE001 - a node down is a partial answer, not a failed one
                log.warning("metrics export %s: %s: %s", url, type(e).__name__, e)
                return None

        return list(await asyncio.gather(*(one(u) for u in urls)))


async def cluster_metrics_text(model_name: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> str:
    """The body of `GET /metrics`: every Ray node's export, gathered now (see cluster_exposition)."""
    return cluster_exposition(await fetch_texts(await _metrics_urls(), timeout_s), model_name)
