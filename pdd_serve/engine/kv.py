"""Block KV: layout, hash-chain identity, checksums, the block pool, and export/import buffers.

A *block* holds K and V of `block_size` consecutive tokens for every layer, laid out
`[num_layers, 2, block_size, num_kv_heads, head_dim]` and contiguous in memory, so that one
block is one flat byte range: what the object store and an Arrow Flight stream carry.
Blocks are named by a hash chain over token ids (like vLLM/SGLang prefix hashing): the same
prefix gives the same hashes in every process, which is what radix caches, the router's hit
estimate and the Flight stream speak.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from isal import isal_zlib

# block identity and token math live apart (no torch): the Router hashes prompts with them
from pdd_serve.engine.blocks import (  # noqa: F401 - re-exported: the engine's callers import them from here
    ROOT_HASH,
    KVError,
    OutOfBlocksError,
    PoolFullError,
    block_hashes,
    blocks_needed,
    chain_hash,
    num_full_blocks,
)

_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": None}
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, td in _TORCH_DTYPES.items():
        if td == dtype:
            return name
    raise KVError(f"unsupported KV dtype {dtype}")


@dataclass(frozen=True)
class KVLayout:
    """Shape of one KV block; identical on every site that exchanges KV for one model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float32"  # float32 | float16 | bfloat16 (carried as uint16 bits)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise KVError(f"KVLayout.{name} must be > 0, got {getattr(self, name)}")
        if self.dtype not in _TORCH_DTYPES:
            raise KVError(f"KVLayout.dtype must be one of {sorted(_TORCH_DTYPES)}, got {self.dtype!r}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def itemsize(self) -> int:
        return 4 if self.dtype == "float32" else 2

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self.dtype]

    @property
    def numpy_dtype(self) -> np.dtype:
        # bfloat16 has no numpy dtype: its bits travel as uint16 and are reinterpreted on import
        return np.dtype(np.uint16) if self.dtype == "bfloat16" else np.dtype(_NP_DTYPES[self.dtype])


def bytes_checksum(buf: bytes | memoryview) -> int:
    """The KV checksum: CRC32 (ISA-L's equals zlib's, bit for bit, at several times the speed)."""
    return isal_zlib.crc32(buf)


def block_checksum(block: np.ndarray) -> int:
    """`bytes_checksum` of a block's bytes, read in place (no copy for a contiguous block)."""
    return bytes_checksum(memoryview(np.ascontiguousarray(block)).cast("B"))


# ---------------------------------------------------------------- the export format


@dataclass
class KVBlocks:
    """A run of a request's consecutive KV blocks as one contiguous numpy buffer.

    `data[i]` is block `start_block + i`; `hashes[i]` its chain hash (0 for a trailing partial
    block, which has no identity); `checksums[i]` its CRC32; `num_tokens` counts valid token
    slots over the run (the last block may be partial).
    """

    layout: KVLayout
    start_block: int
    data: np.ndarray  # [n, *layout.block_shape], layout.numpy_dtype, C-contiguous
    hashes: list[int]
    checksums: list[int] = field(default_factory=list)
    num_tokens: int = -1

    def __post_init__(self) -> None:
        n = len(self.hashes)
        if self.data.shape != (n, *self.layout.block_shape):
            raise KVError(f"KV data shape {self.data.shape} != {(n, *self.layout.block_shape)}")
        if self.data.dtype != self.layout.numpy_dtype:
            raise KVError(f"KV data dtype {self.data.dtype} != {self.layout.numpy_dtype}")
        if not self.data.flags.c_contiguous:
            raise KVError("KV data must be C-contiguous")
        if not self.checksums:
            self.checksums = [block_checksum(self.data[i]) for i in range(n)]
        if len(self.checksums) != n:
            raise KVError(f"{len(self.checksums)} checksums for {n} blocks")
        if self.num_tokens < 0:
            self.num_tokens = n * self.layout.block_size
        if not (n - 1) * self.layout.block_size < self.num_tokens <= n * self.layout.block_size and n:
            raise KVError(f"num_tokens={self.num_tokens} does not fit {n} blocks")

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def verify(self) -> None:
        for i in range(self.num_blocks):
            got = block_checksum(self.data[i])
            if got != self.checksums[i]:
                raise KVError(f"checksum mismatch in block {self.start_block + i}: {got} != {self.checksums[i]}")

    def slice(self, lo: int, hi: int) -> KVBlocks:
        """Blocks [lo, hi) of this run (relative indices), sharing memory."""
        hi = min(hi, self.num_blocks)
        last = hi == self.num_blocks
        ntok = (self.num_tokens - lo * self.layout.block_size) if last else (hi - lo) * self.layout.block_size
        return KVBlocks(self.layout, self.start_block + lo, self.data[lo:hi], self.hashes[lo:hi],
                        self.checksums[lo:hi], ntok)


def tokens_to_blocks(layout: KVLayout, kv: torch.Tensor, hashes: list[int], start_block: int,
                     num_tokens: int) -> KVBlocks:
    """Token-major KV `[tokens, layers, 2, kv_heads, head_dim]` (tokens from `start_block`'s first)
    as PDD's blocks: how an engine that keeps its own cache layout (vLLM) exports."""
    bs, n = layout.block_size, len(hashes)
    if not 0 < num_tokens <= n * bs or kv.shape[0] < num_tokens or tuple(kv.shape[1:]) != (
            layout.num_layers, 2, layout.num_kv_heads, layout.head_dim):
        raise KVError(f"{tuple(kv.shape)} token-major KV does not fill {num_tokens} tokens of {n} {layout} blocks")
    out = torch.zeros((n * bs, *kv.shape[1:]), dtype=layout.torch_dtype)
    out[:num_tokens] = kv[:num_tokens]
    t = out.view(n, bs, *kv.shape[1:]).permute(0, 2, 3, 1, 4, 5).contiguous()  # -> [n, L, 2, bs, h, d]
    if layout.dtype == "bfloat16":
        t = t.view(torch.uint16)
    return KVBlocks(layout, start_block, t.numpy(), list(hashes), num_tokens=num_tokens)


def blocks_to_tokens(blocks: KVBlocks) -> torch.Tensor:
    """`tokens_to_blocks` undone: the run's valid tokens as `[tokens, layers, 2, kv_heads, head_dim]`."""
    with warnings.catch_warnings():  # read-only object-store/Arrow views: we only read them
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(blocks.data)
    if blocks.layout.dtype == "bfloat16":
        t = t.view(torch.bfloat16)
    n, layers, _, bs, heads, dim = t.shape
    return t.permute(0, 3, 1, 2, 4, 5).reshape(n * bs, layers, 2, heads, dim)[: blocks.num_tokens].clone()


def concat_blocks(runs: list[KVBlocks]) -> KVBlocks:
    """Join consecutive runs (as received in pieces) into one."""
    if not runs:
        raise KVError("nothing to concatenate")
    runs = sorted(runs, key=lambda r: r.start_block)
    for a, b in zip(runs, runs[1:]):
        if a.start_block + a.num_blocks != b.start_block:
            raise KVError(f"runs are not consecutive: {a.start_block}+{a.num_blocks} != {b.start_block}")
    full = runs[-1].num_tokens + sum(r.num_blocks for r in runs[:-1]) * runs[0].layout.block_size
    return KVBlocks(runs[0].layout, runs[0].start_block, np.concatenate([r.data for r in runs]),
                    [h for r in runs for h in r.hashes], [c for r in runs for c in r.checksums], full)


# ---------------------------------------------------------------- the block pool


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device = "cpu") -> torch.Tensor:
    """Zeroed memory for a KV pool. On the CPU it comes from calloc (through numpy), whose pages the
    OS maps on first touch: a pool sized to an emulated chip's HBM costs real memory only for the
    blocks it fills, and still reads as zeros everywhere (torch.zeros writes every page at once)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class BlockPool:
    """All KV memory of one engine: `[num_blocks, *block_shape]` plus reference counts.

    A block is owned by whoever holds a reference: running sequences and the prefix cache.
    It returns to the free list when its count drops to zero.

    `tags[b]` names what a full block holds: the chain hash of the tokens whose KV was written
    into it (0 while it is partial or newly allocated). A decoder that continues a request checks
    its blocks' tags against the request's own chain (`Engine.check_context`): KV that was freed
    and rewritten under it, or adopted under the wrong name, can't reach a client silently.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu") -> None:
        if num_blocks <= 0:
            raise KVError("the KV pool needs at least one block; raise kv_cache_bytes")
        self.layout = layout
        self.num_blocks = num_blocks
        self.data = lazy_zeros((num_blocks, *layout.block_shape), layout.torch_dtype, device)
        self.refcount = [0] * num_blocks
        self.tags = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self.refcount[i] = 1
            self.tags[i] = 0
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            assert self.refcount[i] > 0, f"incref of free block {i}"
            self.refcount[i] += 1

    def decref(self, ids: list[int]) -> None:
        for i in ids:
            assert self.refcount[i] > 0, f"decref of free block {i}"
            self.refcount[i] -= 1
            if self.refcount[i] == 0:
                self._free.append(i)

    def layer_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `[num_blocks, block_size, kv_heads, head_dim]` of one layer's K and V."""
        return self.data[:, layer, 0], self.data[:, layer, 1]

    def export(self, ids: list[int], hashes: list[int], start_block: int, num_tokens: int) -> KVBlocks:
        """Copy blocks out of the pool into one contiguous host buffer."""
        t = self.data[torch.as_tensor(ids, dtype=torch.long, device=self.data.device)].cpu()
        if self.layout.dtype == "bfloat16":
            t = t.view(torch.uint16)
        return KVBlocks(self.layout, start_block, t.numpy(), list(hashes), num_tokens=num_tokens)

    def load(self, ids: list[int], blocks: KVBlocks) -> None:
        """Copy received blocks into pool blocks `ids` (verifying layout, not checksums)."""
        if blocks.layout != self.layout:
            raise KVError(f"KV layout {blocks.layout} does not match this engine's {self.layout}")
        if len(ids) != blocks.num_blocks:
            raise KVError(f"{len(ids)} destination blocks for {blocks.num_blocks} received")
        with warnings.catch_warnings():  # read-only object-store/Arrow views: we only read them
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(blocks.data)
        if self.layout.dtype == "bfloat16":
            src = src.view(torch.bfloat16)
        self.data[torch.as_tensor(ids, dtype=torch.long, device=self.data.device)] = src.to(self.data.device)
