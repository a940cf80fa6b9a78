"""The engine seam: what PDD's deployments need from an engine, as one typed protocol.

Prefill, Relay and Main decode (and `EngineWorker`, which batches decode for them) speak only
`EngineBackend`; `tests/test_layout.py` checks that they touch nothing else. Our torch `Engine`
(engine.py) is the reference implementation; vLLM (vllm/engine.py) goes behind the same protocol,
with its KV moved in our block format. Every call runs on the engine's one thread.

The primitives, by what a request goes through:

  admit        add(request_id, prompt, params, prompt_hashes)  -> Sequence; PoolFullError if
               its KV can't fit now
               hash_chain(seq, num_tokens)     PDD's block identity: the chained hashes PDD routes on
               match_prefix(seq, max_blocks)   adopt the longest cached prefix (main decode's DRC)
  compute      prefill(seq, use_cache, chunk_tokens, on_chunk)  the prompt's KV and first token
               extend(seq, token_ids, sample)  one forward over committed ids (the token-id handoff)
               append_tokens(seq, token_ids)   tokens whose KV is not computed yet (relay's first)
               step(seqs)                      one batched decode step, preempting and resuming
  move KV      export_kv(seq, start, end)      blocks out, in PDD's format (`KVBlocks`)
               import_kv(seq, blocks, verify)  received blocks in, as computed KV
               check_context(seq)              the blocks that are not this request's context
               reset_kv(seq)                   drop the KV: the next extend recomputes it
  finish       release(seq, cache)             free the blocks (offered to the prefix cache)
  serve        warmup()                        pay the first-call costs before serving
  read         block_size, layout, pool (free/total blocks), cache (the prefix cache's view, or
               None), on_forward (each forward reported as `ForwardWork`), preemptions,
               context_mismatches, failed (why the engine can no longer serve, or None)

`EngineBase` builds the rest once on top of these: the single-request reference `generate`
(admit, run to the end, release whatever happens) and the default `warmup`; an engine adds
`run_to_end` and its own `generate_batch`.

Emulated chips sit *above* the seam (`emulation.PacedEngine`): an engine only reports each forward
it ran (`on_forward(ForwardWork)`: what kind, how many sequences and tokens, how much context,
how long it really took), and the pacer holds the engine call to the modeled time of that work.
So pacing needs nothing from an engine's internals, only that it can say what it computed (vLLM's
scheduler output says the same: tokens scheduled per request, and their computed context).

Pure: no torch at import (the protocol names the engine's types for checkers only).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pdd_serve.engine.engine import Sequence
    from pdd_serve.engine.kv import KVBlocks, KVLayout
    from pdd_serve.engine.sampling import SamplingParams

FORWARD_KINDS = ("prefill", "decode")  # prefill: any multi-token forward (chunk, extend, resume)


@dataclass(frozen=True)
class ForwardWork:
    """One forward an engine ran, as it reports it through `on_forward`."""

    kind: str  # "prefill" (several new tokens: one sequence, or a mixed vLLM step) | "decode" (a batch, one token each)
    seqs: int
    new_tokens: int  # tokens whose KV this forward computed
    context_tokens: int  # KV it attended over before them (decode: summed over the batch)
    real_s: float  # wall seconds the forward took on this machine
    # of new_tokens and context_tokens, those that are prompt tokens (the rest were generated): an
    # emulation at context_scale k counts a prompt token as k tokens (config.PDDConfig.context_scale)
    prompt_new: int = 0
    prompt_context: int = 0
    # a batched forward's sequences, each (new, context, prompt_new, prompt_context), summing to the
    # totals above: a step that mixes prefill chunks and decodes (vLLM's) attends per sequence, not
    # over the summed context. Empty: one sequence's, or a decode batch's (whose cost is the sums')
    parts: tuple[tuple[int, int, int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in FORWARD_KINDS:
            raise ValueError(f"kind must be one of {FORWARD_KINDS}, got {self.kind!r}")
        if self.seqs < 1 or self.new_tokens < 1 or self.context_tokens < 0 or self.real_s < 0:
            raise ValueError(f"a forward computes >= 1 token of >= 1 sequence: {self}")
        if not (0 <= self.prompt_new <= self.new_tokens and 0 <= self.prompt_context <= self.context_tokens):
            raise ValueError(f"a forward's prompt tokens are some of its new and context tokens: {self}")
        if self.parts and (len(self.parts) != self.seqs or tuple(map(sum, zip(*self.parts))) != (
                self.new_tokens, self.context_tokens, self.prompt_new, self.prompt_context)):
            raise ValueError(f"a forward's parts are its sequences and sum to its totals: {self}")


def prompt_split(prompt_len: int, start: int, end: int) -> tuple[int, int]:
    """(prompt tokens among positions [start, end), prompt tokens among [0, start)) of a sequence
    whose first `prompt_len` tokens are its prompt: what `ForwardWork.prompt_new` and
    `prompt_context` count for one sequence's forward."""
    return max(0, min(end, prompt_len) - start), min(start, prompt_len)


class PoolView(Protocol):
    """The KV block pool, as the deployments' stats and admission read it."""

    num_free: int
    num_blocks: int


class CacheView(Protocol):
    """The prefix cache, as the router's DRC view reads it (block hashes, change counters)."""

    nodes: Any  # block hash -> node: the cached prefix blocks, by the chained hash PDD routes on
    stats: Any  # inserted_blocks, evicted_blocks, hit_rate
    num_blocks: int
    hit_unit: int  # a hit is a whole number of these many blocks (vLLM's cache: its 32-token block)

    def refresh(self, wait: bool = True) -> None:
        """Catch up with the engine's cache where the view trails it (vLLM's events); safe off the
        engine thread; `wait=False` returns at once if another thread is catching up."""


@runtime_checkable
class EngineBackend(Protocol):
    """The contract. Every method runs on the engine's one thread (`EngineWorker.call`)."""

    block_size: int
    layout: KVLayout
    pool: PoolView
    cache: CacheView | None  # None: no prefix cache (no DRC)
    on_forward: Callable[[ForwardWork], None] | None
    preemptions: int  # requests preempted for lack of KV blocks, in total (stats)
    # KV found not to be its request's context (a cached prefix, a takeover's blocks) and
    # recomputed from token ids instead: any count is a bug upstream (`check_context`)
    context_mismatches: int
    # None while the engine can serve; else why it can't (a vLLM step that raised leaves vLLM's
    # scheduler state undefined): each call then raises, and the replica's check_health tells Serve
    # to replace it, so a broken engine fails requests over instead of decoding wrong tokens
    failed: str | None

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            prompt_hashes: Iterable[int] | None = None) -> Sequence:
        """Admit a request (raises PoolFullError when its KV can't fit now). `prompt_hashes`: the
        prompt's block-hash chain as the Router computed it, carried so no replica recomputes it."""

    def hash_chain(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        """PDD's block identity: the hash chain of the full blocks among the first `num_tokens`."""

    def match_prefix(self, seq: Sequence, max_blocks: int | None = None) -> int:
        """Adopt the longest cached prefix (at most max_blocks); returns the tokens it covers."""

    def prefill(self, seq: Sequence, use_cache: bool = True, chunk_tokens: int | None = None,
                on_chunk: Callable[[Sequence], None] | None = None) -> int:
        """Compute the prompt's KV (chunked: on_chunk after each chunk) and sample the first token."""

    def extend(self, seq: Sequence, token_ids: list[int], sample: bool = True) -> int | None:
        """One forward over committed token ids on top of the KV held (the token-id handoff)."""

    def append_tokens(self, seq: Sequence, token_ids: Iterable[int]) -> None:
        """Append tokens whose KV is not computed yet (the relay's first token)."""

    def step(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """One batched decode step (preempting and resuming as the pool allows)."""

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Free a request's blocks (offering them to the prefix cache when `cache`)."""

    def export_kv(self, seq: Sequence, start_block: int = 0, end_block: int | None = None) -> KVBlocks:
        """Copy out blocks [start_block, end_block) of a request's KV in PDD's block format."""

    def import_kv(self, seq: Sequence, blocks: KVBlocks, verify: bool = True) -> None:
        """Load received blocks (checksums verified unless a hop already did) as computed KV."""

    def check_context(self, seq: Sequence) -> list[int]:
        """The request's blocks that do not hold its own context (prompt + committed tokens by
        their hash chain); empty when all do. Run before a decoder continues a request."""

    def reset_kv(self, seq: Sequence) -> None:
        """Drop the request's KV: its next `extend` recomputes the whole context from token ids."""

    def warmup(self) -> None:
        """Run the first-call costs (kernels, allocations) before serving."""


class EngineBase:
    """What every engine builds the same way on the protocol's primitives. A subclass implements
    the primitives, `run_to_end` and `generate_batch` (its own batching)."""

    block_size: int
    layout: KVLayout
    args: Any  # the model's shape (`ModelArgs`): vocab_size

    def run_to_end(self, seq: Sequence, use_cache: bool = True) -> None:
        """Compute an admitted request's prompt and decode it until it finishes."""
        raise NotImplementedError

    def generate(self, prompt_token_ids: list[int], max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 stop_token_ids: list[int] | None = None, use_cache: bool = True) -> list[int]:
        """Single-request generate: the reference every pipeline must match token for token."""
        from pdd_serve.engine.sampling import SamplingParams

        params = SamplingParams(max_tokens, temperature, top_p, top_k, seed, tuple(stop_token_ids or ()))
        seq = self.add("generate", prompt_token_ids, params)  # type: ignore[attr-defined]
        try:
            self.run_to_end(seq, use_cache)
            return seq.output_ids
        finally:
            self.release(seq)  # type: ignore[attr-defined]

    def warmup_prompt(self) -> list[int]:
        """Two blocks of token ids any vocabulary holds (from 3: past the special tokens)."""
        vocab = self.args.vocab_size
        return [i % vocab for i in range(3, 3 + 2 * self.block_size)]

    def warmup(self) -> None:
        """Run the first-call costs (kernels, allocations) before serving: one short request."""
        self.generate(self.warmup_prompt(), 4)


def engine_members() -> frozenset[str]:
    """Every name the protocol defines: what the serving layer may use of an engine."""
    names: set[Hashable] = set(EngineBackend.__annotations__)
    names |= {n for n, v in vars(EngineBackend).items() if callable(v) and not n.startswith("_")}
    return frozenset(str(n) for n in names)


__all__ = ["CacheView", "EngineBackend", "EngineBase", "FORWARD_KINDS", "ForwardWork", "PoolView", "engine_members", "prompt_split"]
