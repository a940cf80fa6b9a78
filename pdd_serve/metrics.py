"""Prometheus metrics through Ray Serve's metrics API (scraped from Ray's metrics endpoint)."""

from __future__ import annotations

from typing import Any

_LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
_TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]


class RouterMetrics:
    """What PDD did, per request: TTFT/TPOT, handoffs by mode, eager-token share, WAN bytes,
    requests by pipeline, fallbacks and rejections."""

    def __init__(self) -> None:
        from ray.serve.metrics import Counter, Histogram

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
        if info.wan_bytes:
            self.wan_bytes.inc(info.wan_bytes)
        for kind in info.fallbacks:
            if kind == "index_miss":
                self.index_misses.inc()
            else:
                self.fallbacks.inc(tags={"kind": kind})
