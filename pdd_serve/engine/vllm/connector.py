"""PDD's KV connector for vLLM: vLLM's paged KV in and out of PDD's blocks, through vLLM's own
extension point (`KVConnectorBase_V1`, loaded by `kv_connector_module_path`), not a patch.

The connector moves KV between vLLM's paged cache and a `KVStore` that `VllmEngine` owns; the
store holds each request's KV token-major (`[tokens, layers, 2, kv_heads, head_dim]`), which is
PDD's block format before it is cut into blocks (`tokens_to_blocks`). What crosses a process or a
site is still PDD's `KVBlocks` (checksums, MAC, object store, Flight): vLLM never sees a socket.

- Load (the relay's and main decode's imported KV, the token-id handoff's prompt KV): the
  scheduler asks `get_num_new_matched_tokens`; the store offers the tokens it holds for that
  request, vLLM allocates blocks for them, and `start_load_kv` writes them into those blocks
  before the forward that computes the rest.
- Save (prefill's KV): after each forward (`wait_for_save`) the connector copies the tokens the
  forward computed for requests the engine asked to save, so a chunked prefill's finished
  blocks can leave before the last chunk runs.

The engine runs vLLM in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the scheduler-side and
worker-side connectors and the engine share one `KVStore`, found by the `store` key in
`kv_connector_extra_config`. vLLM's CPU attention keeps one layer's cache as `[num_blocks,
kv_heads, block_size, 2 * head_dim]`; per (block, head) its memory is K transposed (`[head_dim,
block_size]`, what the vectorized kernel reads) then V (`[block_size, head_dim]`). `paged_view`
reads that layout, and `tests/engine/test_vllm.py` checks it against our engine's KV, value for value.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


# ---------------------------------------------------------------- the store the engine shares


@dataclass
class StepWork:
    """What one scheduled step computes per request: (request id, context tokens, new tokens)."""

    reqs: list[tuple[str, int, int]] = field(default_factory=list)


class KVStore:
    """KV the engine holds outside vLLM's cache, per vLLM request id (token-major tensors)."""

    def __init__(self) -> None:
        # request -> (first token, KV of tokens [first, ...)) to load; `first` > 0 when main decode's
        # DRC matched the prompt's first tokens in vLLM's own prefix cache and received only the rest
        self.offers: dict[str, tuple[int, torch.Tensor]] = {}
        self.save: set[str] = set()  # requests whose computed KV is copied out after each forward
        self.saved: dict[str, torch.Tensor] = {}  # request -> KV copied out so far (token-major)
        self.loaded: dict[str, int] = {}  # request -> tokens vLLM took from its offer
        self.last_step = StepWork()  # the step the scheduler built last (for `ForwardWork`)
        self.load_failures = 0  # loads that failed and were recomputed (stats, tests)
        self.drc_lost = 0  # offers past a DRC hit that vLLM evicted before the load: recomputed

    def forget(self, req_id: str) -> None:
        for d in (self.offers, self.saved, self.loaded):
            d.pop(req_id, None)
        self.save.discard(req_id)


logger = logging.getLogger("pdd_serve")
_STORES: dict[str, KVStore] = {}
_LOCK = threading.Lock()


def store_for(key: str) -> KVStore:
    with _LOCK:
        return _STORES.setdefault(key, KVStore())


def drop_store(key: str) -> None:
    with _LOCK:
        _STORES.pop(key, None)


# ---------------------------------------------------------------- layout (pure)


def paged_view(cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's CPU-attention cache as (K `[blocks, kv_heads, head_dim, block_size]`, V `[blocks,
    kv_heads, block_size, head_dim]`): per (block, head), K is stored transposed, then V."""
    if cache.dim() != 4 or cache.shape[3] != 2 * head_dim:
        # GPU backends keep other layouts (FlashAttention: [2, blocks, block_size, heads, head_dim]);
        # reading one unchecked would move wrong KV, so refuse it until it is mapped and tested
        raise ValueError(f"PDDConnector reads vLLM's CPU attention cache [blocks, kv_heads, block_size, "
                         f"2 * {head_dim}]; this one is {tuple(cache.shape)} (another attention backend)")
    nb, heads, bs, _ = cache.shape
    halves = cache.view(nb, heads, 2, bs * head_dim)
    return halves[:, :, 0].view(nb, heads, head_dim, bs), halves[:, :, 1].view(nb, heads, bs, head_dim)


def slots(block_ids: list[int], block_size: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block id, offset) of tokens [start, end) of a request whose blocks are `block_ids`."""
    pos = torch.arange(start, end)
    return torch.as_tensor(block_ids, dtype=torch.long)[pos // block_size], pos % block_size


def gather(view: tuple[torch.Tensor, torch.Tensor], blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Tokens at (blocks, offsets) of one layer's `paged_view` as `[tokens, 2, kv_heads, head_dim]`."""
    k, v = view
    return torch.stack([k[blocks, :, :, offsets], v[blocks, :, offsets]], dim=1)


def scatter(view: tuple[torch.Tensor, torch.Tensor], blocks: torch.Tensor, offsets: torch.Tensor,
            kv: torch.Tensor) -> None:
    """Write `[tokens, 2, kv_heads, head_dim]` into one layer's `paged_view` at (blocks, offsets)."""
    k, v = view
    k[blocks, :, :, offsets] = kv[:, 0].to(k.dtype)
    v[blocks, :, offsets] = kv[:, 1].to(v.dtype)


def layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"can't tell the layer of KV cache {name!r}")
    return int(m.group(1))


# ---------------------------------------------------------------- the connector


@dataclass
class ReqOp:
    req_id: str
    block_ids: list[int]
    load: tuple[int, int] | None = None  # tokens [start, end) to write from the store's offer
    save_end: int | None = None  # copy out tokens up to here (from what was copied before)


@dataclass
class PDDConnectorMetadata(KVConnectorMetadata):
    ops: list[ReqOp] = field(default_factory=list)


class PDDConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.head_dim = vllm_config.model_config.get_head_size()
        self.store = store_for(self._kv_transfer_config.get_from_extra_config("store", "default"))
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer, paged views (worker side)
        self._blocks: dict[str, list[int]] = {}  # request -> its vLLM blocks (scheduler side)
        self._matched: dict[str, tuple[int, int]] = {}  # request -> (local hit tokens, external tokens)
        self._load: dict[str, tuple[int, int]] = {}  # request -> tokens to load in its next step
        self._failed: set[int] = set()  # blocks whose load failed this step (worker side)
        self._lost: set[str] = set()  # requests whose DRC prefix was gone (counted once each)

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        offer = self.store.offers.get(rid)
        if offer is None:
            self._matched.pop(rid, None)
            return 0, False
        first, kv = offer
        if num_computed_tokens < first:
            # the DRC prefix this offer continues was evicted from vLLM's cache since main decode
            # matched it: loading would leave a hole, so vLLM computes the prompt from its own hit
            # (asked again each step the request waits for blocks: counted once)
            if rid not in self._lost:
                self._lost.add(rid)
                self.store.drc_lost += 1
            self._matched.pop(rid, None)
            return 0, False
        # at least one token is computed by the forward (it samples the next token from it)
        n = max(0, min(first + kv.shape[0], request.num_tokens - 1) - num_computed_tokens)
        self._matched[rid] = (num_computed_tokens, n)
        return n, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        local, _ = self._matched.pop(request.request_id, (request.num_computed_tokens, 0))
        if num_external_tokens > 0:
            self._load[request.request_id] = (local, local + num_external_tokens)
            self.store.loaded[request.request_id] = local + num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PDDConnectorMetadata()
        computed: dict[str, int] = {}
        for r in scheduler_output.scheduled_new_reqs:
            self._blocks[r.req_id] = list(r.block_ids[0])
            computed[r.req_id] = r.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and back: its blocks are all new
                self._blocks[rid] = list(new[0]) if new is not None else []
            elif new is not None:
                self._blocks.setdefault(rid, []).extend(new[0])
            computed[rid] = cached.num_computed_tokens[i]
        work = []
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            ctx = computed.get(rid, 0)
            op = ReqOp(rid, self._blocks.get(rid, []))
            if rid in self._load:
                op.load = self._load.pop(rid)
                ctx = op.load[1]
            if rid in self.store.save:
                op.save_end = ctx + n
            if op.load or op.save_end is not None:
                meta.ops.append(op)
            work.append((rid, ctx, n))
        self.store.last_step = StepWork(work)
        for rid in scheduler_output.finished_req_ids:
            self._blocks.pop(rid, None)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        for d in (self._blocks, self._load, self._matched):
            d.pop(request.request_id, None)
        self._lost.discard(request.request_id)
        return False, None  # saves are synchronous: the blocks can go at once

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        ordered = sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0]))
        self._caches = [paged_view(t, self.head_dim) for _, t in ordered]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Write each request's offered KV into its blocks. A load that fails (the offer gone or
        short, a layout that does not fit) reports its blocks to vLLM, whose
        `kv_load_failure_policy: recompute` computes them instead: slower, never a wrong token."""
        bs = self.block_size
        for op in self._get_connector_metadata().ops:
            if op.load is None:
                continue
            start, end = op.load
            try:
                first, kv = self.store.offers[op.req_id]
                src = kv[max(0, start - first):end - first]  # [tokens, layers, 2, heads, head_dim]
                if start < first or src.shape[0] != end - start or src.shape[1] != len(self._caches):
                    raise ValueError(f"offer holds {tuple(src.shape)} for tokens [{start}, {end})")
                b, o = slots(op.block_ids, bs, start, end)
                for layer, view in enumerate(self._caches):
                    scatter(view, b, o, src[:, layer])
            except Exception as e:  # noqa: BLE001 - any failure: vLLM recomputes these blocks
                logger.warning("PDDConnector: KV load of %s tokens [%d, %d) failed (%s: %s): vLLM recomputes them",
                               op.req_id, start, end, type(e).__name__, e)
                self._failed.update(op.block_ids[start // bs: -(-end // bs)])
                self.store.load_failures += 1

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # copied once per step, in wait_for_save, for all layers at once

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        for op in self._get_connector_metadata().ops:
            if op.save_end is None:
                continue
            have = self.store.saved.get(op.req_id)
            start = 0 if have is None else have.shape[0]
            if op.save_end <= start:
                continue
            b, o = slots(op.block_ids, self.block_size, start, op.save_end)
            new = torch.stack([gather(v, b, o) for v in self._caches], dim=1)  # [t, layers, 2, h, d]
            self.store.saved[op.req_id] = new if have is None else torch.cat([have, new])


__all__ = ["KVStore", "PDDConnector", "PDDConnectorMetadata", "drop_store", "gather", "paged_view",
           "scatter", "slots", "store_for"]
