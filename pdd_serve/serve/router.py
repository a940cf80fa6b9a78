"""Router, site A, the Serve ingress: the OpenAI-compatible HTTP API over the orchestrator.

No `from __future__ import annotations` here: FastAPI reads the route signatures at runtime.
"""

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from pdd_serve.config import PDDConfig
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.pacer import kv_scale
from pdd_serve.engine.blocks import block_hashes
from pdd_serve.engine.sampling import SamplingParams
from pdd_serve.metrics import RouterMetrics
from pdd_serve.policy import LinkEstimate
from pdd_serve.serve import openai_api as oai
from pdd_serve.serve import openai_output as reply
from pdd_serve.serve.common import graph_link, logger
from pdd_serve.serve.crosssite import STREAM_QUEUE_BOUND, site_handle
from pdd_serve.serve.messages import GenRequest
from pdd_serve.serve.orchestrator import Orchestrator
from pdd_serve.serve.pinning import ReplicaGone, live_replicas, pin, replica_stats, this_replica
from pdd_serve.serve.request_state import RequestState, is_overloaded, refusal

api = FastAPI(title="pdd_serve", description="PDD: Prefill -> Relay decode -> Main decode, OpenAI-compatible API")
POOL_FULL_RETRY_AFTER_S = 1.0  # a pool frees as its requests finish: seconds, not minutes


def client_error(e: BaseException, request_id: str) -> oai.APIError:
    """What a client sees of a failed request: 503 + Retry-After when the graph is at capacity
    (every KV pool that could take it was full, or Prefill's queue would not reach it within its
    budget: not a fault, retry), naming what refused it (`refusal`), a 400 for a request the
    engine refuses, a generic 500 naming the request id otherwise (oai.internal_error)."""
    if is_overloaded(e):
        reason, told, _ = refusal(e)
        return oai.APIError(503, "overloaded_error", f"the graph is at capacity now: {told} ({reason}); retry later",
                            code="pool_full", retry_after=POOL_FULL_RETRY_AFTER_S)
    return oai.internal_error(e, request_id)


def _pin(replica: str | None) -> str | None:
    return None if replica is None else pin(replica)


def known_gone(replica: str | None, live: list[str] | tuple[str, ...] | None) -> bool:
    """A pinned call would reach a replica that Serve's replica set no longer has (scaled down,
    dead): it is refused there, one WAN round trip for nothing. None (unpinned) or no set yet: no."""
    return replica is not None and live is not None and replica not in live


async def _refused(e: Exception) -> AsyncIterator[Any]:
    raise e
    yield  # an async generator: the stream fails where a remote refusal would, on iteration


def _live(deployment: tuple[str, str]) -> list[str] | None:
    live = live_replicas(*deployment)  # None until Serve's request router for it has started
    return None if live is None else list(live)


class ServeBackends:
    """Adapts Serve deployment handles to the orchestrator's Backends protocol. Every call to a
    deployment in another site crosses the emulated WAN (`crosssite.site_handle`)."""

    def __init__(self, cfg: PDDConfig, prefill: Any, relay: Any, md: Any, link: Any) -> None:
        here = cfg.sites.router
        self.p = site_handle(prefill, cfg.sites.prefill == here, link)
        self.r = None if relay is None else site_handle(relay, cfg.sites.relay == here, link)
        self.md = site_handle(md, cfg.sites.main_decode == here, link)
        self._md_id = (md.deployment_id.app_name, md.deployment_id.name)
        self._p_id = (prefill.deployment_id.app_name, prefill.deployment_id.name)
        self._r_id = None if relay is None else (relay.deployment_id.app_name, relay.deployment_id.name)
        self.gone_pins = 0  # calls not sent: pinned to an MD replica Serve no longer has

    @property
    def control_messages_delayed(self) -> int:
        return sum(h.messages for h in (self.p, self.r, self.md) if h is not None)

    @property
    def max_stream_queue(self) -> int:
        """The most chunks a cross-site stream held for a slow reader (bounded: STREAM_QUEUE_BOUND)."""
        return max((getattr(h, "max_stream_queue", 0) for h in (self.p, self.r, self.md) if h is not None), default=0)

    def md_replicas(self):  # noqa: ANN201 - signatures in backends.Backends
        return _live(self._md_id)

    # every call about a request is pinned to the MD replica that holds it (`pinning.py`);
    # i None (no view of any MD yet): Serve's request router picks the least loaded. A pin to a
    # replica Serve no longer has fails here, as the replica would have refused it over the line
    def _md_pin(self, i: str | None) -> str | None:
        if known_gone(i, live_replicas(*self._md_id)):
            self.gone_pins += 1
            raise ReplicaGone(f"main decode replica {i} is gone (no longer in Serve's replica set); the call was "
                              "not sent")
        return _pin(i)

    async def md_view(self, i, known):  # noqa: ANN001, ANN201
        return await self.md.call("routing_view", known, session_id=self._md_pin(i))

    async def md_prepare(self, i, req, planned_start):  # noqa: ANN001, ANN201
        return await self.md.call("prepare", req, planned_start, session_id=self._md_pin(i))

    async def md_wait_kv(self, i, request_id, timeout_s):  # noqa: ANN001, ANN201
        return await self.md.call("wait_kv", request_id, timeout_s, session_id=self._md_pin(i))

    async def md_handoff_batch(self, i, request_id, token_ids, timeout_s):  # noqa: ANN001, ANN201
        return await self.md.call("handoff_batch", request_id, token_ids, timeout_s, session_id=self._md_pin(i))

    def md_decode(self, i, request_id, committed, timeout_s):  # noqa: ANN001, ANN201
        try:
            sid = self._md_pin(i)
        except ReplicaGone as e:
            return _refused(e)
        return self.md.stream("decode", request_id, committed, timeout_s, session_id=sid)

    async def md_absorb(self, i, request_id, output_ids, timeout_s):  # noqa: ANN001, ANN201
        return await self.md.call("absorb", request_id, output_ids, timeout_s, session_id=self._md_pin(i))

    async def md_abort(self, i, request_id, attempt=None):  # noqa: ANN001, ANN201
        return await self.md.call("abort", request_id, attempt, session_id=self._md_pin(i))

    async def prefill(self, preq):  # noqa: ANN001, ANN201
        return await self.p.call("prefill", preq)

    def prefill_replicas(self):  # noqa: ANN201
        return _live(self._p_id)

    async def line_state(self, i):  # noqa: ANN001, ANN201
        return await self.p.call("line_state", session_id=_pin(i))

    def relay_load(self):  # noqa: ANN201
        stats = replica_stats(*self._r_id) if self._r_id is not None else {}
        return sum(s.get("running", 0) for s in stats.values()) if stats else None

    def relay(self, rreq):  # noqa: ANN001, ANN201
        if self.r is None:
            raise RuntimeError("this graph has no relay deployment")
        return self.r.stream("generate", rreq)


@serve.deployment(max_ongoing_requests=512)
@serve.ingress(api)
class Router:
    def __init__(self, cfg: PDDConfig, prefill: Any, relay: Any, md: Any) -> None:
        from transformers import AutoTokenizer

        from pdd_serve.checkpoints import resolve_model
        from pdd_serve.engine.kv import KVLayout
        from pdd_serve.engine.model import ModelArgs

        self.cfg = cfg
        path = resolve_model(cfg.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        margs = ModelArgs.from_checkpoint(path)
        self.max_model_len = min(cfg.model.max_model_len or margs.max_position_embeddings, margs.max_position_embeddings)
        dtype = cfg.model.dtype or ("float32" if cfg.model.device == "cpu" else "bfloat16")
        self.layout = KVLayout(margs.num_layers, margs.num_kv_heads, margs.head_dim, cfg.model.block_size, dtype)
        link = graph_link(cfg, self.layout.bytes_per_token)
        bps = link.bandwidth_bps  # the configured line until Prefill reports a measured rate
        est = LinkEstimate(float("inf") if bps is None else bps / 8, link.config.one_way_latency_s)
        self.backends = ServeBackends(cfg, prefill, relay, md, link)
        # the link counts KV at the emulated model's size when the graph emulates (kv_scale)
        self.orch = Orchestrator(cfg, self.backends, self.layout.block_bytes * kv_scale(cfg, self.layout.bytes_per_token),
                                 est)
        self._watch: Any = None  # the background view of every MD
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="pdd-parse")
        self.clock = Clock(cfg.time_scale)  # slow motion: every latency is reported in emulated seconds
        self.metrics = RouterMetrics(self.clock)
        self.in_flight = 0
        self.created = int(time.time())
        # Serve builds a replica on its event loop: the view starts now, so no replica's first
        # request waits a round trip to every MD for it (an emulated run measured 2 x the line's
        # one-way latency on the first request each Router replica served). Without a running
        # loop (a unit test) the first request starts it.
        with contextlib.suppress(RuntimeError):
            self._watch_views()

    # ------------------------------------------------------------ routes

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "graph": self.cfg.graph, "in_flight": self.in_flight}

    @api.get("/metrics")
    async def prometheus_metrics(self, request: Request) -> Response:
        """Prometheus text for the whole cluster (every Ray node's metrics export): PDD and Serve
        families plus their vLLM names (pdd_serve/metrics.py; docs/usage.md "Metrics")."""
        from pdd_serve import metrics as pm

        try:
            oai.check_metrics_access(request.headers, self.cfg.server)
        except oai.APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers())
        return Response(await pm.cluster_metrics_text(self.cfg.server.model_name), media_type=pm.CONTENT_TYPE)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            oai.check_api_key(request.headers, self.cfg.server)
        except oai.APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers())
        return JSONResponse(reply.models_response(self.cfg.server.model_name, self.created))

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    def stats(self) -> dict:
        from pdd_serve.serve.common import placement

        line = self.orch.line()
        return {"role": "router", "in_flight": self.in_flight, "relay_running": self.orch.relay_running,
                "relay_pool_running": self.orch.relay_load(), "md_replicas": self.orch.md_replicas(),
                "md_views": self.orch.index.summary(),
                "md_watchers": {str(i): "running" if not t.done() else repr(t.exception() if not t.cancelled() else "cancelled")
                                for i, t in self.orch.watchers.items()},
                "fallbacks": dict(self.orch.fallbacks), "link_bps": line.bandwidth_bps * 8,
                "index_misses": self.orch.index_misses,
                "control_messages_delayed": self.backends.control_messages_delayed,
                "gone_pins_not_sent": self.backends.gone_pins,
                "max_stream_queue": self.backends.max_stream_queue, "stream_queue_bound": STREAM_QUEUE_BOUND,
                "wan_backlog_bytes": sum(line.backlog), "replica": this_replica(), **placement()}

    # ------------------------------------------------------------ request handling

    def _watch_views(self) -> None:
        if self._watch is None or self._watch.done():
            # started inside a request; its calls still get ids of their own (crosssite._remote)
            self._watch = asyncio.get_running_loop().create_task(self.orch.watch_views())

    async def _handle(self, request: Request, kind: str) -> Response:
        self._watch_views()
        try:
            oai.check_api_key(request.headers, self.cfg.server)
            if self.in_flight >= self.cfg.server.max_queue:
                self.metrics.rejected.inc(tags={"reason": "queue_full"})
                logger.warning("a request refused (503, queue_full): the router has %d requests in flight "
                               "(server.max_queue)", self.in_flight)
                raise oai.APIError(503, "overloaded_error", f"the router has {self.in_flight} requests in flight "
                                   f"(server.max_queue); retry later", retry_after=1.0)
        except oai.APIError as e:
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers())
        self.in_flight += 1  # admitted: counted until its generation ends (in _tokens) or it is refused
        try:
            raw = await request.body()
            # tokenizing a large body takes a while: off the event loop, where other streams flow, on
            # one thread (a fast tokenizer used from two threads at once can fail "already borrowed")
            creq, hashes = await asyncio.get_running_loop().run_in_executor(self._parser, functools.partial(
                self._parse, raw, kind, request.headers))
            forced = (creq.pdd_override or {}).get("pipeline")
            if forced is not None and forced not in self.cfg.policy.pipelines:
                raise oai.APIError(400, "invalid_request_error", f"pipeline {forced} is not enabled in this graph "
                                   f"(policy.pipelines: {list(self.cfg.policy.pipelines)})", param="pdd.pipeline")
            params = SamplingParams(creq.max_tokens, creq.temperature, creq.top_p, creq.top_k, creq.seed,
                                    creq.stop_token_ids, creq.ignore_eos)
        except oai.APIError as e:
            self.in_flight -= 1
            return JSONResponse(e.body(), status_code=e.status, headers=e.headers())
        except BaseException:
            self.in_flight -= 1
            raise
        rid = reply.new_request_id(kind)
        st = RequestState(GenRequest(f"{rid}-{uuid.uuid4().hex[:6]}", creq.prompt_token_ids, params,
                                     block_hashes=hashes))
        if not creq.stream:
            return await self._complete(creq, st, rid)
        # admission happens before the first token: wait for it before the 200 goes out, so a
        # request no pool can take now still gets a real 503 (a stream can only report in-band)
        tokens = self._tokens(creq, st)
        try:
            head = [await tokens.__anext__()]
        except StopAsyncIteration:
            head = []
        except Exception as e:
            err = self._refused(e, st)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers())
        return StreamingResponse(self._stream(creq, st, rid, head, tokens), media_type="text/event-stream")

    def _parse(self, raw: bytes, kind: str, headers: Any) -> tuple[oai.CompletionRequest, tuple[int, ...]]:
        """On the parser thread: the request, and its prompt's block-hash chain, computed here once
        for the whole graph (the DRC view, Prefill, the relay and MD all take it from GenRequest)."""
        creq = oai.parse_request(raw, kind, self.cfg.server, self.tokenizer, self.max_model_len,
                                 self.cfg.policy.allow_overrides, headers=headers)
        return creq, tuple(block_hashes(list(creq.prompt_token_ids), self.cfg.model.block_size))

    def _refused(self, e: BaseException, st: RequestState) -> oai.APIError:
        """The client's answer to a failed request, logged: a 503 as one line naming what refused
        it, in the refusal's own words (Prefill's: its queue, its cost estimate, the budget),
        counted by reason in `pdd_rejected_total`; any other failure with its traceback."""
        err = client_error(e, st.gen.request_id)
        if err.status == 503:
            reason, _, words = refusal(e)
            logger.warning("request %s refused (503, %s): %s", st.gen.request_id, reason, words)
            self.metrics.rejected.inc(tags={"reason": reason})
        else:
            logger.error("request %s failed", st.gen.request_id, exc_info=e)
        return err

    async def _tokens(self, creq: oai.CompletionRequest, st: RequestState) -> AsyncIterator[tuple[str, int | None]]:
        """(text delta, token id) per token (id None for the final flush), string stops applied."""
        detok = reply.IncrementalDetokenizer(self.tokenizer, creq.prompt_token_ids, creq.stop)
        gen = self.orch.run(st, creq.pdd_override)
        t_prev = None
        try:
            async for toks in gen:
                now = time.monotonic()
                if t_prev is None:
                    self.metrics.ttft.observe(self.clock.emulated(now - st.t0), tags={"pipeline": st.info.pipeline})
                else:
                    self.metrics.tpot.observe(self.clock.emulated((now - t_prev) / len(toks)),
                                              tags={"pipeline": st.info.pipeline})
                t_prev = now
                for t in toks:
                    delta = detok.push(t)
                    if detok.stopped:
                        st.finish_reason = "stop"
                        yield delta, t
                        return
                    yield delta, t
            yield detok.flush(), None
        finally:
            self.in_flight -= 1
            await gen.aclose()
            self.metrics.record(st)

    async def _complete(self, creq: oai.CompletionRequest, st: RequestState, rid: str) -> Response:
        parts: list[str] = []
        ids: list[int] = []
        try:
            async for delta, tok in self._tokens(creq, st):
                parts.append(delta)
                if tok is not None:
                    ids.append(tok)
        except Exception as e:
            err = self._refused(e, st)  # no exception text to the client
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers())
        body = reply.completion_response(rid, self.created, creq.model, creq.kind, "".join(parts),
                                         st.finish_reason or "stop", len(creq.prompt_token_ids), len(st.committed),
                                         extra={"pdd": reply.pdd_facts(st.info.as_dict(), creq)})
        if creq.return_token_ids:
            body["choices"][0]["token_ids"] = ids
        return JSONResponse(body)

    async def _stream(self, creq: oai.CompletionRequest, st: RequestState, rid: str, head: list,
                      tokens: AsyncGenerator[tuple[str, int | None], None]) -> AsyncIterator[bytes]:
        first = True
        pending: list[int] = []  # token ids whose text the detokenizer still holds back

        async def all_tokens() -> AsyncIterator[tuple[str, int | None]]:
            try:
                for item in head:  # what _handle read before the 200 went out
                    yield item
                async for item in tokens:
                    yield item
            finally:  # the client leaving stops the request now, not at garbage collection
                await tokens.aclose()

        try:
            async with contextlib.aclosing(all_tokens()) as items:
                async for delta, tok in items:
                    if tok is not None:
                        pending.append(tok)
                    if delta or first:
                        chunk = reply.completion_chunk(rid, self.created, creq.model, creq.kind, delta, None, first=first)
                        if creq.return_token_ids:
                            chunk["choices"][0]["token_ids"], pending = pending, []
                        yield reply.sse(chunk)
                        first = False
            last = reply.completion_chunk(rid, self.created, creq.model, creq.kind, "", st.finish_reason or "stop",
                                          extra={"pdd": reply.pdd_facts(st.info.as_dict(), creq)}, first=first)
            if creq.return_token_ids:
                last["choices"][0]["token_ids"] = pending
            yield reply.sse(last)
            if creq.include_usage:
                yield reply.sse(reply.usage_chunk(rid, self.created, creq.model, creq.kind, len(creq.prompt_token_ids),
                                                  len(st.committed)))
        except Exception as e:  # headers are sent: report in-band, OpenAI style
            yield reply.sse(self._refused(e, st).body())  # no exception text to the client
        yield reply.SSE_DONE
