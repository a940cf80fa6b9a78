"""Block identity and token math, with no torch: the hash chain that names a block by its tokens
(the same prefix gives the same hashes in every process, which the radix caches, the Router's hit
estimate and the Flight stream speak) and the errors a block pool raises. `kv.py` holds the KV
itself; the Router needs only this, so its replicas never import torch.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROOT_HASH = 0  # parent of the first block of every sequence


class KVError(ValueError):
    """A KV buffer does not match the layout it claims (shape, dtype, checksum, hash)."""


class OutOfBlocksError(RuntimeError):
    """The block pool has no free block left (after evicting what the prefix cache could)."""


class PoolFullError(OutOfBlocksError):
    """A request that fits the pool, but not *now*: running requests hold the blocks. Not the
    client's fault (a request that can never fit is a RequestError): retry it later or on another
    replica."""


# ---------------------------------------------------------------- token math (pure functions)


def num_full_blocks(num_tokens: int, block_size: int) -> int:
    return num_tokens // block_size


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def chain_hash(parent: int, block_token_ids: list[int] | tuple[int, ...]) -> int:
    """64-bit identity of a block given its parent's identity and its own token ids."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little", signed=False))
    h.update(np.asarray(block_token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little", signed=False)


def block_hashes(token_ids: list[int], block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Hash chain over the *full* blocks of `token_ids` (a trailing partial block has no identity)."""
    out: list[int] = []
    for i in range(num_full_blocks(len(token_ids), block_size)):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
