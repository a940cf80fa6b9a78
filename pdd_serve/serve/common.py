"""What every deployment does the same way: threads, engine construction, site pinning."""

from __future__ import annotations

import logging

from pdd_serve.config import ModelConfig, PDDConfig
from pdd_serve.engine.engine import Engine

logger = logging.getLogger("pdd_serve")

SITE_LABEL = "pdd.site"


def load_engine(model: ModelConfig, enable_prefix_cache: bool = True, threads: int = 1) -> Engine:
    """Each replica gets a thread budget: several replicas share few cores on one machine.

    `model` is the role's effective config (`PDDConfig.engine_for(role)`); its `threads`, when the
    graph sets it (`model.threads` or `engines.<role|site>.threads`), wins over the role's default."""
    import torch

    from pdd_serve.models import resolve_model

    torch.set_num_threads(max(1, model.threads if model.threads is not None else threads))
    engine = Engine.from_pretrained(
        resolve_model(model.path), device=model.device, dtype=model.dtype, block_size=model.block_size,
        kv_cache_bytes=model.kv_cache_bytes, prefix_cache_bytes=model.prefix_cache_bytes,
        enable_prefix_cache=enable_prefix_cache,
    )
    engine.warmup()
    return engine


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
