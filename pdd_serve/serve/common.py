"""What every deployment does the same way: threads, engine construction, the graph's link, site pinning."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pdd_serve.config import ModelConfig, PDDConfig
from pdd_serve.emulation.clock import Clock
from pdd_serve.emulation.pacer import Emulation, PacedEngine, StepPacer, kv_scale
from pdd_serve.engine.protocol import EngineBackend
from pdd_serve.transport.link import LinkModel

if TYPE_CHECKING:  # engines load in the engine roles only: a Router replica never imports torch
    from pdd_serve.engine.engine import Sequence

logger = logging.getLogger("pdd_serve")

SITE_LABEL = "pdd.site"


def host_memory_bytes() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def load_engine(model: ModelConfig, enable_prefix_cache: bool = True, threads: int = 1, *,
                emulation: Emulation | None = None, clock: Clock) -> EngineBackend:
    """Each replica gets a thread budget: several replicas share few cores on one machine.

    `model` is the role's effective config (`PDDConfig.engine_for(role)`); its `threads`, when the
    graph sets it (`model.threads` or `engines.<role|site>.threads`), wins over the role's default.
    With an `emulation` (`emulation.pacer.build_emulation(cfg, role)`) every forward is paced to the
    emulated chip on the graph's `clock` (slow motion; no default, so no role paces at one scale
    while its link runs at another), and the KV pool holds what the emulated chips hold, (HBM x chips
    - weights) / emulated KV per token, in real blocks of the small model. The torch engine's pool is
    mapped on first touch (engine/kv.lazy_zeros), so only the blocks a run fills cost memory; it is
    capped at half this host's memory, and vLLM's (allocated whole) at `kv_cache_bytes`."""
    import torch

    from pdd_serve.checkpoints import resolve_model
    from pdd_serve.engine.engine import Engine
    from pdd_serve.engine.kv import KVLayout, dtype_name

    torch.set_num_threads(max(1, model.threads if model.threads is not None else threads))
    path = resolve_model(model.path)
    kv_bytes, prefix_bytes = model.kv_cache_bytes, model.prefix_cache_bytes
    if emulation is not None:
        from pdd_serve.engine.model import ModelArgs

        a = ModelArgs.from_checkpoint(path)
        real = KVLayout(a.num_layers, a.num_kv_heads, a.head_dim, model.block_size,
                        dtype_name(getattr(torch, model.kv_dtype))).bytes_per_token
        emulated = emulation.real_pool_tokens * real  # at context_scale k, a real token's KV stands for k
        limit = kv_bytes if model.backend == "vllm" else host_memory_bytes() // 2
        if emulated > limit:
            logger.warning("emulated KV capacity %d tokens (%s) exceeds what this host can back (%d bytes): "
                           "admission sees %d real tokens", emulation.kv_capacity_tokens, emulation.label(), limit,
                           limit // real)
        kv_bytes = min(emulated, limit)
        prefix_bytes = None if prefix_bytes is None else min(prefix_bytes, kv_bytes)
    engine: EngineBackend
    if model.backend == "vllm":
        import os

        from pdd_serve.engine.vllm.engine import VllmEngine

        # each replica keeps to its thread budget (vLLM's "auto" binds every core to every replica)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's per-engine INFO lines drown the graph's
        engine = VllmEngine(path, block_size=model.block_size, dtype=model.kv_dtype, kv_cache_bytes=kv_bytes,
                            enable_prefix_cache=enable_prefix_cache,
                            engine_args={"max_model_len": model.max_model_len, **dict(model.vllm)}
                            if model.max_model_len else dict(model.vllm))
    else:
        engine = Engine.from_pretrained(
            path, device=model.device, dtype=model.dtype, block_size=model.block_size,
            batch_invariant=model.batch_invariant, kv_cache_bytes=kv_bytes, prefix_cache_bytes=prefix_bytes,
            enable_prefix_cache=enable_prefix_cache,
        )
    engine.warmup()
    if emulation is not None:  # pacing sits above the engine seam; after warmup: its costs are not the chip's
        return PacedEngine(engine, StepPacer(emulation, clock))
    return engine



def check_engine(engine: EngineBackend) -> None:
    """A replica's `check_health`: an engine that can't serve any more (`failed`) makes Serve
    replace the replica (its requests fail over: P retries, MD migrates by token ids)."""
    if engine.failed is not None:
        raise RuntimeError(f"engine failed: {engine.failed}")


def take_over(engine: EngineBackend, seq: Sequence, token_ids: list[int], who: str, came_from: str) -> int:
    """On the engine thread: a decoder continues a request it did not start (MD after a handoff or
    a migration, the relay after a fallback). The KV it holds must be exactly that of the request's
    prompt + committed tokens, block by block by their hash chain (`check_context`); on a mismatch
    the KV is dropped and counted, and the extend recomputes the whole context from the token ids
    instead of decoding from a wrong one. Then one extend over `token_ids`; returns the next token."""
    bad = engine.check_context(seq)
    if bad:
        logger.error("%s: %s holds KV that is not its own context in %d blocks (first %s; %s): recomputing "
                     "%d tokens from their ids", who, seq.request_id, len(bad), bad[:4], came_from,
                     len(seq.token_ids) + len(token_ids))
        engine.context_mismatches += 1
        engine.reset_kv(seq)
    return engine.extend(seq, token_ids)


def batch_cap(cfg: PDDConfig, role: str, engine: EngineBackend) -> int:
    """The batch cap of a role's engine (`emulation.pacer.decode_batch_cap`): a decoder on emulated
    chips gets what they step within `policy.tpot_slo_s` and hold in the pool it was given (vLLM's:
    no more than its `max_num_seqs`)."""
    from pdd_serve.config import DEFAULT_MAX_BATCH
    from pdd_serve.emulation.pacer import decode_batch_cap

    m = cfg.engine_for(role)
    pacer = getattr(engine, "pacer", None)  # a PacedEngine's
    if role == "prefill" or pacer is None:
        cap = m.max_batch or DEFAULT_MAX_BATCH
    else:
        from pdd_serve.checkpoints import resolve_model
        from pdd_serve.engine.model import ModelArgs

        ctx = m.max_model_len or ModelArgs.from_checkpoint(resolve_model(m.path)).max_position_embeddings
        cap = decode_batch_cap(pacer.emulation, m.max_batch, cfg.policy.tpot_slo_s, ctx,
                               engine.pool.num_blocks * engine.block_size)
        logger.info("%s: decode batch cap %d (%s, TPOT SLO %s, %d-token contexts)", role, cap,
                    pacer.emulation.label(), cfg.policy.tpot_slo_s, ctx)
    vllm_cap = getattr(engine, "max_num_seqs", None)  # vLLM schedules no more than its max_num_seqs
    return min(cap, vllm_cap) if vllm_cap else cap


def emulation_stats(engine: EngineBackend, max_batch: int | None = None) -> dict:
    """The pacer's per-step-kind counts (steps, overruns, modeled seconds) for a replica's stats."""
    p = getattr(engine, "pacer", None)  # a PacedEngine's
    if p is None:
        return {}
    # the pool admission sees: the emulated chips' KV room, or less when kv_cache_bytes caps it
    pool = {"kv_pool_tokens": engine.pool.num_blocks * engine.block_size,
            **({} if max_batch is None else {"batch_cap": max_batch})}
    return {"emulation": {**p.stats(), **p.params(), **pool}}


def kv_bytes_per_token(m: ModelConfig) -> int:
    """Real KV bytes per token of an engine of `m` (a role's effective config), from its
    checkpoint's shape (no engine built)."""
    from pdd_serve.checkpoints import resolve_model
    from pdd_serve.engine.kv import KVLayout
    from pdd_serve.engine.model import ModelArgs

    a = ModelArgs.from_checkpoint(resolve_model(m.path))
    return KVLayout(a.num_layers, a.num_kv_heads, a.head_dim, m.block_size, m.kv_dtype).bytes_per_token


def graph_link(cfg: PDDConfig, real_bytes_per_token: int) -> LinkModel:
    """The inter-site link as this graph paces it: unemulated, scaled to the small model's KV;
    emulated, the line's own rate on the graph's clock, each real KV byte counted as the emulated
    model's (`kv_scale`)."""
    if not cfg.emulated:
        return LinkModel(cfg.link.line(real_bytes_per_token))
    return LinkModel(cfg.link.line(real_bytes_per_token, raw=True), clock=Clock(cfg.time_scale),
                     byte_scale=kv_scale(cfg, real_bytes_per_token))


def actor_options(cfg: PDDConfig, site: str, num_cpus: float | None = None) -> dict:
    """Pin a deployment's replicas to the nodes of one site (a `pdd.site` node label)."""
    return {"num_cpus": cfg.sites.cpus_per_replica if num_cpus is None else num_cpus,
            "label_selector": {SITE_LABEL: site}}


def placement() -> dict[str, str]:
    """The node this replica runs on and that node's `pdd.site` label (pinning is checked on this)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    node = next((n for n in ray.nodes() if n.get("NodeID") == node_id), {})
    return {"node_id": node_id, "site": (node.get("Labels") or {}).get(SITE_LABEL, "")}
