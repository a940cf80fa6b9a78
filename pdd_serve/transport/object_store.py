"""KV inside a site (Prefill -> Relay Decode): the Ray object store.

`put_kv` stores a request's KV blocks as a small dataclass around the numpy buffer; Ray pickles
numpy arrays out-of-band, so `get_kv` on the reader hands back a read-only numpy view straight
over the shared-memory object (zero copy), then checks layout and checksums.

Freeing: Ray 2.60 has no explicit delete; an object goes when its last reference does. Drop every
`ObjectRef` to it *and* every array `get_kv` returned (a view pins the object while it lives).
Serve handles pass refs by value, so the Prefill replica should not keep the ref once Relay has it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import ray

from pdd_serve.engine.kv import KVBlocks, KVError, KVLayout


@dataclass(frozen=True)
class KVObject:
    """What sits in the object store: the block buffer plus what `KVBlocks` needs to rebuild."""

    layout: KVLayout
    start_block: int
    data: np.ndarray  # [n, *layout.block_shape]; out-of-band in Ray's pickle: zero-copy on read
    hashes: tuple[int, ...]
    checksums: tuple[int, ...]
    num_tokens: int


def put_kv(blocks: KVBlocks) -> ray.ObjectRef:
    """Put `blocks` in this node's object store (one copy: process memory -> shared memory)."""
    return ray.put(KVObject(blocks.layout, blocks.start_block, blocks.data, tuple(blocks.hashes),
                            tuple(blocks.checksums), blocks.num_tokens))


def get_kv(ref: ray.ObjectRef, timeout_s: float, *, layout: KVLayout | None = None,
           verify: bool = True) -> KVBlocks:
    """Read KV put by `put_kv`: a zero-copy view, checked against `layout` and the checksums.

    Raises `TimeoutError` after `timeout_s` (the caller owns the fallback) and `KVError` when the
    object is not KV, or not KV of `layout`, or corrupted.
    """
    try:
        obj = ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(f"KV object {ref.hex()[:16]} not available after {timeout_s}s") from e
    if not isinstance(obj, KVObject):
        raise KVError(f"object {ref.hex()[:16]} holds {type(obj).__name__}, not KV")
    if layout is not None and obj.layout != layout:
        raise KVError(f"KV layout {obj.layout} != expected {layout}")
    blocks = KVBlocks(obj.layout, obj.start_block, obj.data, list(obj.hashes), list(obj.checksums), obj.num_tokens)
    if verify:
        blocks.verify()
    return blocks
