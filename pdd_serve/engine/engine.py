"""Engine: prefill, extend and batched decode over a paged KV pool with a radix prefix cache.

No Ray here. The serving layer composes these operations:
  Prefill:     add -> prefill (computes only the suffix past a prefix-cache hit) -> export_kv
  Relay:       add -> import_kv -> append_tokens(first) -> decode_step ... (stops at the handoff)
  Main decode: add -> match_prefix (DRC) -> import_kv (the blocks it lacked) -> extend(handed-off ids)
               -> decode_step ...
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdd_serve.engine.kv import (
    ROOT_HASH,
    BlockPool,
    KVBlocks,
    KVError,
    KVLayout,
    OutOfBlocksError,
    PoolFullError,
    block_hashes,
    blocks_needed,
    chain_hash,
    dtype_name,
    num_full_blocks,
)
from pdd_serve.engine.model import AttnContext, LlamaModel, ModelArgs, load_model
from pdd_serve.engine.protocol import EngineBase, ForwardWork, prompt_split
from pdd_serve.engine.radix_cache import PrefixMatch, RadixCache
from pdd_serve.engine.sampling import RequestError, SamplingParams, check_prompt_ids, sample

log = logging.getLogger("pdd_serve")


@dataclass
class Sequence:
    """One request's state inside an engine. `token_ids` = prompt + output so far;
    KV exists for the first `num_computed` of them; the rest are pending (fed next forward)."""

    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    prefix_hit_tokens: int = 0
    locked_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # None while running | "stop" | "length" | "abort"
    arrival: int = 0  # admission order: the youngest sequence is preempted first
    preempted: bool = False  # KV freed for others; `Engine.resume` recomputes it from token_ids
    # the hash chain of its full blocks: computed once (or carried in from the Router) and only
    # extended as tokens are appended; token ids are append-only, so a hash never goes stale
    hashes: list[int] = field(default_factory=list, repr=False)

    def chain(self, block_size: int, num_tokens: int | None = None) -> list[int]:
        """Hashes of the full blocks among the first `num_tokens` token ids (all of them by default)."""
        n = num_full_blocks(len(self.token_ids) if num_tokens is None else num_tokens, block_size)
        if n > len(self.hashes):
            done = len(self.hashes)
            parent = self.hashes[-1] if done else ROOT_HASH
            self.hashes.extend(block_hashes(self.token_ids[done * block_size : n * block_size], block_size, parent))
        return self.hashes[:n]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def check_import(seq: Sequence, blocks: KVBlocks, block_size: int) -> int:
    """Received blocks must continue the sequence's computed KV (block-aligned) and carry the hash
    chain of its own tokens, so KV can only be imported into the request whose tokens produced it.
    Returns the computed length after the import. (Every engine behind the seam checks the same.)"""
    bs = block_size
    if seq.num_computed % bs or blocks.start_block != seq.num_computed // bs:
        raise KVError(f"{seq.request_id}: received blocks start at {blocks.start_block} but "
                      f"{seq.num_computed} tokens are computed")
    end = seq.num_computed + blocks.num_tokens
    if end > len(seq.token_ids):
        raise KVError(f"{seq.request_id}: received KV for {end} tokens, the request has {len(seq.token_ids)}")
    expect = seq.chain(bs, end)[blocks.start_block :]
    if [h for h in blocks.hashes if h][: len(expect)] != expect:
        raise KVError(f"{seq.request_id}: received KV blocks do not belong to this request's tokens")
    return end


def _default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


class Engine(EngineBase):
    def __init__(self, model: LlamaModel, *, device: str = "cpu", block_size: int = 16,
                 kv_cache_bytes: int = 256 << 20, prefix_cache_bytes: int | None = None,
                 enable_prefix_cache: bool = True) -> None:
        self.model = model
        self.args: ModelArgs = model.args
        self.device = device
        dtype = next(model.parameters()).dtype
        self.layout = KVLayout(self.args.num_layers, self.args.num_kv_heads, self.args.head_dim,
                               block_size, dtype_name(dtype))
        self.block_size = block_size
        self.pool = BlockPool(self.layout, max(1, kv_cache_bytes // self.layout.block_bytes), device)
        budget = kv_cache_bytes // 2 if prefix_cache_bytes is None else prefix_cache_bytes
        self.cache: RadixCache | None = (
            RadixCache(block_size, self.layout.block_bytes, budget, on_evict=lambda b: self.pool.decref([b]))
            if enable_prefix_cache else None
        )
        self.stop_ids = frozenset(self.args.eos_token_ids)
        self._arrivals = itertools.count()
        self.num_preempted = 0  # sequences waiting to resume (they go before new admissions)
        self._decoding: dict[int, Sequence] = {}  # id -> sequence that `step` decodes: preemptible
        self.preemptions = 0  # total, for stats and tests
        self.context_mismatches = 0  # KV found not to be its request's context, recomputed (`check_context`)
        self.failed: str | None = None  # a request's error never breaks this engine (the seam's health)
        # told of every forward this engine runs (the seam's report, `protocol.ForwardWork`): an
        # emulated chip (`emulation.PacedEngine`) holds each call to the modeled time of that work
        self.on_forward: Callable[[ForwardWork], None] | None = None

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = None,
                        block_size: int = 16, batch_invariant: bool = True, **kwargs) -> Engine:
        """`batch_invariant` (float32 models): a token's logits do not depend on its batch or its
        prefill chunking, so every path through the graph gives one engine's greedy tokens
        (model.py, `make_exact`); off: float32 kernels throughout, ~2x faster prefill on CPU."""
        if isinstance(dtype, str):
            dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        model = load_model(path, device, dtype or _default_dtype(device), batch_invariant)
        return cls(model, device=device, block_size=block_size, **kwargs)

    # ------------------------------------------------------------ requests

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            prompt_hashes: Iterable[int] | None = None) -> Sequence:
        """Validate a request and create its state (no KV yet). `prompt_hashes`: the prompt's hash
        chain as the Router computed it (carried, so no replica hashes the prompt again)."""
        check_prompt_ids(prompt_token_ids, self.args.vocab_size)
        ctx = self.args.max_position_embeddings
        if len(prompt_token_ids) + params.max_tokens > ctx:
            raise RequestError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                               f"exceeds the model's context of {ctx} tokens")
        need = blocks_needed(len(prompt_token_ids) + params.max_tokens, self.block_size)
        if need > self.pool.num_blocks:  # never fits: the client's request is at fault
            raise RequestError(f"the request needs {need} KV blocks but the pool holds {self.pool.num_blocks}; "
                               "lower max_tokens or raise kv_cache_bytes")
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), params,
                       hashes=self._carried(prompt_token_ids, prompt_hashes))
        # fits, but maybe not now: admit by free blocks, and never ahead of preempted sequences
        # (running work first, as vLLM), so a full pool refuses new work instead of failing old
        if self.num_preempted or not self._fits(seq):
            raise PoolFullError(f"the KV pool is full ({self.pool.num_free} of {self.pool.num_blocks} blocks free, "
                                f"{self.num_preempted} preempted requests waiting): retry later or on another replica")
        seq.arrival = next(self._arrivals)
        return seq

    def _carried(self, prompt: list[int], hashes: Iterable[int] | None) -> list[int]:
        """A carried hash chain (the Router's, computed once from the same tokens), checked in
        O(block): one hash per full block, and its first and last links recomputed from their
        parents and their own tokens. A chain sent with the wrong prompt fails this unless both
        prompts share their first and last blocks and their length; a full recheck would cost
        the hashing the carry saves."""
        chain = list(hashes or ())
        if not chain:
            return []
        bs, n = self.block_size, num_full_blocks(len(prompt), self.block_size)
        if (len(chain) != n or chain_hash(ROOT_HASH, prompt[:bs]) != chain[0]
                or chain_hash(chain[-2] if n > 1 else ROOT_HASH, prompt[(n - 1) * bs : n * bs]) != chain[-1]):
            raise ValueError(f"the carried block hashes ({len(chain)}) are not this prompt's chain of {n} blocks")
        return chain

    def hash_chain(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        return seq.chain(self.block_size, num_tokens)

    def _fits(self, seq: Sequence) -> bool:
        """Whether KV for the sequence's tokens plus one sampled token fits now, counting the
        prefix-cache blocks it would reuse and those the cache could evict."""
        hit: list[int] = []
        ntok = len(seq.token_ids)
        if self.cache is not None:
            hashes = seq.chain(self.block_size, ntok - 1)
            hit = hashes[: self.cache.peek(hashes)]
        need = blocks_needed(ntok + 1, self.block_size) - len(hit)
        if need <= self.pool.num_free:
            return True
        return self.cache is not None and need <= self.pool.num_free + self.cache.evictable(hit)

    def match_prefix(self, seq: Sequence, max_blocks: int | None = None) -> int:
        """Adopt the longest cached prefix of the prompt (at least one prompt token stays to compute),
        at most `max_blocks` blocks of it. Returns the number of hit tokens."""
        assert seq.num_computed == 0 and not seq.block_table
        if self.cache is None:
            return 0
        limit = seq.prompt_len - 1 if max_blocks is None else min(seq.prompt_len - 1, max_blocks * self.block_size)
        m = self._checked(self.cache.match_hashes(seq.chain(self.block_size, limit), limit), seq)
        if m.hashes:
            self.pool.incref(m.values)
            self.cache.lock(m.hashes)
            seq.block_table = list(m.values)
            seq.locked_hashes = list(m.hashes)
            seq.num_computed = m.num_tokens
        seq.prefix_hit_tokens = m.num_tokens
        return m.num_tokens

    def _checked(self, m: PrefixMatch, seq: Sequence) -> PrefixMatch:
        """A cached prefix is adopted only up to its first block that does not hold what the cache
        names it (`check_context`'s test, at the other door): the rest is computed again."""
        tags, refs = self.pool.tags, self.pool.refcount
        good = next((i for i, (h, b) in enumerate(zip(m.hashes, m.values)) if tags[b] != h or refs[b] <= 0),
                    len(m.hashes))
        if good == len(m.hashes):
            return m
        self.context_mismatches += 1
        log.error("%s: the prefix cache names block %d (pool block %d) by a chain its KV is not: adopting "
                  "%d of %d cached blocks, computing the rest", seq.request_id, good, m.values[good], good, len(m.hashes))
        self.cache.discard(m.hashes[good])  # nothing hits it again
        return PrefixMatch(m.hashes[:good], m.values[:good], good * self.block_size)

    def append_tokens(self, seq: Sequence, token_ids: Iterable[int]) -> None:
        """Append committed tokens whose KV is not yet computed (fed by the next forward)."""
        seq.token_ids.extend(token_ids)

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Free a request's KV; its full computed blocks go to the prefix cache first."""
        self._free_kv(seq, cache and seq.finish_reason != "abort")
        if seq.preempted:
            seq.preempted, self.num_preempted = False, self.num_preempted - 1
        if seq.finish_reason is None:
            seq.finish_reason = "abort"

    def _free_kv(self, seq: Sequence, cache: bool) -> None:
        self._decoding.pop(id(seq), None)
        if cache and self.cache is not None:
            self._cache_blocks(seq)
        if self.cache is not None and seq.locked_hashes:
            self.cache.unlock(seq.locked_hashes)
        self.pool.decref(seq.block_table)
        seq.block_table, seq.locked_hashes = [], []

    # ------------------------------------------------------------ preemption (vLLM's recompute)

    def preempt(self, seq: Sequence) -> None:
        """Free a decoding sequence's KV for others but keep its tokens: `resume` recomputes the
        KV from them later (one forward: cheaper than a failed batch, and no KV to park). Its
        full blocks go to the prefix cache, so the recompute hits them if they survive."""
        self._free_kv(seq, cache=True)
        seq.num_computed = 0
        seq.preempted = True
        self.num_preempted += 1
        self.preemptions += 1

    def can_resume(self, seq: Sequence) -> bool:
        return self._fits(seq)

    def resume(self, seq: Sequence) -> int:
        """Recompute a preempted sequence's KV from its token ids and sample its next token:
        the token the decode steps it missed would have produced (same logits, same step
        seed), so its stream goes on with nothing lost or repeated."""
        assert seq.preempted and not seq.finished and not seq.block_table
        if self.cache is not None:  # reuse what survived of its blocks (not counted as a request's hit)
            m = self._checked(self.cache.match_hashes(seq.chain(self.block_size, len(seq.token_ids) - 1),
                                                      record=False), seq)
            if m.hashes:
                self.pool.incref(m.values)
                self.cache.lock(m.hashes)
                seq.block_table, seq.locked_hashes, seq.num_computed = list(m.values), list(m.hashes), m.num_tokens
        return self._forward(seq, len(seq.token_ids))

    def reserve_decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """Give each sequence a slot for its pending token. When the pool runs short (after the
        prefix cache evicted what it could), preempt the youngest until the rest fit, instead
        of failing the step for the whole batch. Returns the sequences that run, oldest first."""
        run = sorted(seqs, key=lambda s: s.arrival)
        bs = self.block_size
        while run:
            need = sum(max(0, blocks_needed(len(s.token_ids), bs) - len(s.block_table)) for s in run)
            if need > self.pool.num_free and self.cache is not None:
                self.cache.evict((need - self.pool.num_free) * self.layout.block_bytes)
            if need <= self.pool.num_free:
                break
            self.preempt(run.pop())
        for s in run:
            self._ensure_blocks(s, len(s.token_ids))
        return run

    def step(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """One scheduling step over decoding sequences (each has one pending token, or is
        preempted): a batched decode step over the running ones (preempting the youngest if the
        pool runs short), then resume preempted ones that fit, oldest first. Returns (sequence,
        token) per sequence that produced a token; a sequence waiting to resume produces none."""
        was_waiting = [s for s in seqs if s.preempted]
        run = self.reserve_decode([s for s in seqs if not s.preempted and not s.finished])
        out = list(zip(run, self.decode_step(run))) if run else []
        self._decoding.update((id(s), s) for s in run)
        for s in sorted(was_waiting, key=lambda s: s.arrival):  # not those preempted just now: no thrash
            if not self.can_resume(s):
                break
            out.append((s, self.resume(s)))
            self._decoding[id(s)] = s
        return out

    # ------------------------------------------------------------ compute

    def prefill(self, seq: Sequence, use_cache: bool = True, chunk_tokens: int | None = None,
                on_chunk: Callable[[Sequence], None] | None = None) -> int:
        """Compute the prompt's KV (only the suffix past a prefix-cache hit), sample the first
        output token and append it. With `chunk_tokens`, the prompt is computed in chunks and
        `on_chunk(seq)` runs after each, so finished blocks can leave while the rest computes.
        The prompt's blocks are offered to the prefix cache at once."""
        if use_cache and seq.num_computed == 0 and not seq.block_table:
            self.match_prefix(seq)
        end = len(seq.token_ids)
        step = chunk_tokens or end
        while seq.num_computed + step < end:
            self._forward(seq, seq.num_computed + step, sample=False)
            if on_chunk is not None:
                on_chunk(seq)
        tok = self._forward(seq, end)
        if self.cache is not None:
            self._cache_blocks(seq)
        if on_chunk is not None:
            on_chunk(seq)
        return tok

    def extend(self, seq: Sequence, token_ids: list[int], sample: bool = True) -> int | None:
        """One multi-token forward over `token_ids` on top of the existing KV (MD's handoff: the
        relay's committed tokens), then sample and append the next token. With `sample=False`
        only the KV is built (a catch-up handoff batch: more committed tokens follow)."""
        self.append_tokens(seq, token_ids)
        return self._forward(seq, len(seq.token_ids), sample=sample)

    def decode_step(self, seqs: list[Sequence]) -> list[int]:
        """One batched decode step: each sequence has exactly one pending token (the last one);
        compute its KV and sample the next. Requests may join or leave between steps."""
        if not seqs:
            return []
        t0 = time.perf_counter()  # the whole step is the chip's time
        for s in seqs:
            if s.num_pending != 1:
                raise RuntimeError(f"decode_step needs exactly one pending token, {s.request_id} has {s.num_pending}")
            self._ensure_blocks(s, len(s.token_ids))
        bs = self.block_size
        pos = [s.num_computed for s in seqs]
        nb = max(len(s.block_table) for s in seqs)
        dev = self.device
        tables = torch.tensor([s.block_table + [s.block_table[0]] * (nb - len(s.block_table)) for s in seqs],
                              dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        ctx = AttnContext(
            slot_blocks=torch.tensor([s.block_table[p // bs] for s, p in zip(seqs, pos)], dtype=torch.long, device=dev),
            slot_offsets=positions % bs,
            gather_tables=tables,
            mask=(torch.arange(nb * bs, device=dev)[None, :] <= positions[:, None])[:, None, None, :],
        )
        ids = torch.tensor([[s.token_ids[-1]] for s in seqs], dtype=torch.long, device=dev)
        logits = self.model(ids, positions[:, None], self.pool, ctx)
        for s, p in zip(seqs, pos):
            s.num_computed += 1
            self._tag(s, p, p + 1)
        toks = self._append_sampled(seqs, logits)
        if self.on_forward is not None:  # after sampling: the step's tokens exist before its time is up
            self.on_forward(ForwardWork("decode", len(seqs), len(seqs), sum(pos), time.perf_counter() - t0,
                                        prompt_context=sum(min(p, s.prompt_len) for s, p in zip(seqs, pos))))
        return toks

    def _forward(self, seq: Sequence, end: int, sample: bool = True) -> int | None:
        """Compute KV for tokens [num_computed, end) in one forward; sample the next token when
        `end` is the last token (`sample`)."""
        if seq.finished:
            raise RuntimeError(f"request {seq.request_id} is finished ({seq.finish_reason})")
        t0 = time.perf_counter()  # the whole forward is the chip's time
        if seq.preempted:  # recomputed from its token ids now (`resume`, or an extend that came first)
            seq.preempted, self.num_preempted = False, self.num_preempted - 1
        start = seq.num_computed
        if not start < end <= len(seq.token_ids):
            raise RuntimeError(f"request {seq.request_id}: nothing to compute in [{start}, {end})")
        if end > self.args.max_position_embeddings:
            raise RequestError(f"request {seq.request_id} exceeds the model's context")
        self._ensure_blocks(seq, end, preempt=True)
        bs, dev = self.block_size, self.device
        pos = torch.arange(start, end, device=dev)
        table = torch.tensor(seq.block_table[: blocks_needed(end, bs)], dtype=torch.long, device=dev)
        ctx = AttnContext(
            slot_blocks=table[pos // bs],
            slot_offsets=pos % bs,
            gather_tables=table[None],
            mask=(torch.arange(len(table) * bs, device=dev)[None, :] <= pos[:, None])[None, None],
        )
        ids = torch.tensor([seq.token_ids[start:end]], dtype=torch.long, device=dev)
        sample = sample and end == len(seq.token_ids)
        logits = self.model(ids, pos[None], self.pool, ctx) if sample else self.model.fill_kv(ids, pos[None], self.pool, ctx)
        seq.num_computed = end
        self._tag(seq, start, end)
        tok = self._append_sampled([seq], logits)[0] if sample else None
        if self.on_forward is not None:
            pn, pc = prompt_split(seq.prompt_len, start, end)
            self.on_forward(ForwardWork("prefill", 1, end - start, start, time.perf_counter() - t0, pn, pc))
        return tok

    def _append_sampled(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        toks = sample(logits, [s.params for s in seqs], [len(s.token_ids) - s.prompt_len for s in seqs])
        for s, t in zip(seqs, toks):
            s.token_ids.append(t)
            self._check_stop(s, t)
        return toks

    def _check_stop(self, seq: Sequence, tok: int) -> None:
        p = seq.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.stop_ids):
            seq.finish_reason = "stop"
        elif len(seq.token_ids) - seq.prompt_len >= p.max_tokens:
            seq.finish_reason = "length"

    def _ensure_blocks(self, seq: Sequence, num_tokens: int, preempt: bool = False) -> None:
        """Blocks for `num_tokens`: from the free list, then what the prefix cache can evict, then
        (`preempt`: an extend or import of a request already in flight) by preempting decoding
        sequences younger than `seq`, youngest first. A new request is the youngest, so it
        preempts nothing: admission (`add`) is where it waits."""
        need = blocks_needed(num_tokens, self.block_size) - len(seq.block_table)
        if need <= 0:
            return
        while need > self.pool.num_free:
            if self.cache is not None:
                self.cache.evict((need - self.pool.num_free) * self.layout.block_bytes)
                if need <= self.pool.num_free:
                    break
            younger = [s for s in self._decoding.values() if s.arrival > seq.arrival and not s.finished]
            if not preempt or not younger:
                break  # allocate raises OutOfBlocksError
            self.preempt(max(younger, key=lambda s: s.arrival))
        seq.block_table.extend(self.pool.allocate(need))

    def _tag(self, seq: Sequence, start: int, end: int) -> None:
        """Name the blocks that writing tokens [start, end) filled by the chain of their tokens."""
        bs = self.block_size
        lo, hi = start // bs, end // bs
        if hi > lo:
            chain = seq.chain(bs, hi * bs)
            for i in range(lo, hi):
                self.pool.tags[seq.block_table[i]] = chain[i]

    def check_context(self, seq: Sequence) -> list[int]:
        """The sequence's blocks that do not hold its own context: a full computed block whose tag
        is not its chain hash, or any block the pool counts as free. Empty when the KV it holds is
        exactly that of prompt + committed tokens (as far as blocks are named: a partial block has
        no name yet). O(blocks): run before a decoder continues a request it did not start."""
        n = num_full_blocks(seq.num_computed, self.block_size)
        chain = seq.chain(self.block_size, n * self.block_size)
        tags, refs = self.pool.tags, self.pool.refcount
        return [i for i, b in enumerate(seq.block_table) if refs[b] <= 0 or (i < n and tags[b] != chain[i])]

    def reset_kv(self, seq: Sequence) -> None:
        """Drop the sequence's KV (nothing offered to the prefix cache): the next forward over its
        tokens (`extend`) recomputes the whole context from the token ids."""
        self._free_kv(seq, cache=False)
        seq.num_computed = 0

    def _cache_blocks(self, seq: Sequence) -> None:
        """Offer the sequence's full computed blocks to the prefix cache and lock the ones it shares."""
        n = num_full_blocks(seq.num_computed, self.block_size)
        if n == 0:
            return
        hashes = seq.chain(self.block_size, n * self.block_size)
        # the cache's insert never evicts the chain it just took (radix_cache.insert): the
        # references below are taken before any eviction can give one back
        adopted = self.cache.insert(hashes, seq.block_table[:n])
        mine = [h for h, a in zip(hashes, adopted) if a]
        self.pool.incref([b for b, a in zip(seq.block_table, adopted) if a])
        self.cache.lock(mine)
        seq.locked_hashes.extend(mine)

    # ------------------------------------------------------------ KV in and out

    def export_kv(self, seq: Sequence, start_block: int = 0, end_block: int | None = None) -> KVBlocks:
        """Blocks [start_block, end_block) of the computed KV as one contiguous host buffer."""
        nb = blocks_needed(seq.num_computed, self.block_size)
        end_block = nb if end_block is None else min(end_block, nb)
        if not 0 <= start_block <= end_block:
            raise KVError(f"bad block range [{start_block}, {end_block}) for {nb} computed blocks")
        full = seq.chain(self.block_size, seq.num_computed)
        hashes = [full[i] if i < len(full) else 0 for i in range(start_block, end_block)]
        ntok = min(seq.num_computed, end_block * self.block_size) - start_block * self.block_size
        return self.pool.export(seq.block_table[start_block:end_block], hashes, start_block, ntok)

    def import_kv(self, seq: Sequence, blocks: KVBlocks, verify: bool = True) -> None:
        """Load received blocks that continue the sequence's computed KV (block-aligned).
        The hash chain is checked against the sequence's own tokens, so KV can only be
        imported into the request whose tokens produced it."""
        end = check_import(seq, blocks, self.block_size)
        if verify:
            blocks.verify()
        self._ensure_blocks(seq, end, preempt=True)
        ids = seq.block_table[blocks.start_block : blocks.start_block + blocks.num_blocks]
        self.pool.load(ids, blocks)
        for b, h in zip(ids, blocks.hashes):  # check_import matched every named block to our chain
            self.pool.tags[b] = h
        seq.num_computed = end

    # ------------------------------------------------------------ convenience

    def run_to_end(self, seq: Sequence, use_cache: bool = True) -> None:
        """`generate`'s request (EngineBase): its prompt, then one decode step at a time."""
        self.prefill(seq, use_cache=use_cache)
        while not seq.finished:
            self.decode_step([seq])

    def generate_batch(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Continuous batching over many requests: all decode together, each leaves when done."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs: list[Sequence] = []
        running: list[Sequence] = []
        try:
            while len(seqs) < len(prompts) or running:
                while len(seqs) < len(prompts):  # admit in order while the pool has room
                    i = len(seqs)
                    try:
                        s = self.add(f"b{i}", prompts[i], plist[i])
                    except PoolFullError:
                        if running:
                            break  # wait for running requests to finish
                        raise
                    seqs.append(s)
                    running.append(s)
                    self.prefill(s)
                live = [s for s in running if not s.finished]
                if live and not self.step(live) and not any(s.preempted and self.can_resume(s) for s in live):
                    raise OutOfBlocksError("every running request is preempted and none fits the pool")
                for s in [s for s in running if s.finished]:
                    self.release(s)  # at once: its blocks let preempted requests resume
                running = [s for s in running if not s.finished]
            return [s.output_ids for s in seqs]
        finally:
            for s in running:
                self.release(s)

    def warmup(self) -> None:
        """One small prefill, extend and decode so the first real request pays no first-call costs
        (the extend's too: EngineBase's short generate would not run one)."""
        seq = self.add("warmup", self.warmup_prompt(), SamplingParams(4, ignore_eos=True))
        self.prefill(seq, use_cache=False)
        self.extend(seq, [seq.token_ids[-1]])
        self.decode_step([seq])
        seq.finish_reason = "abort"
        self.release(seq, cache=False)


__all__ = ["Engine", "Sequence", "SamplingParams", "RequestError", "OutOfBlocksError", "PoolFullError"]
