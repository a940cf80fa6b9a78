"""KV blocks <-> Arrow record batches: the one wire format of KV bytes between sites.

One row is one block. The data column is `fixed_size_binary(layout.block_bytes)` built over the
numpy buffer itself (`pa.py_buffer`, no copy); decoding gives a numpy view over the Arrow buffer
(`np.frombuffer`, no copy). The schema's metadata carries the format version and the KVLayout, so a
receiver rejects KV cut for another model before it looks at a byte of it.

Decoding trusts nothing: every failure is a `CodecError` (a `KVError`), never a crash or a hang.

Integrity is not authenticity: a CRC stops corruption, not a holder of the Flight token writing
KV that MD then caches under a shared prefix's hash. So each batch carries a keyed MAC (BLAKE2b,
the graph's `flight.mac_key`) over what MD files it under: request id, block positions and token
counts, block hashes and the CRCs that stand for the bytes. Not over the bytes themselves: CRC32
is no cryptographic hash, so an attacker *on the path* who saw a real batch could swap in bytes
with the same CRCs; that attacker is TLS's to stop (config refuses plaintext Flight off
loopback). Hashing every byte instead would cost ~1 GB/s per core (evaluations/bench/mac.py).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from pdd_serve.engine.kv import KVBlocks, KVError, KVLayout, bytes_checksum, concat_blocks

SCHEMA_VERSION = 2  # 2: the `mac` column
MAC_BYTES = 32
_META_PREFIX = "pdd.kv."
_LAYOUT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")


class CodecError(KVError):
    """A record batch is not a valid KV batch for this receiver."""


class SchemaMismatch(CodecError):
    """Wrong columns, column types or missing metadata."""


class VersionMismatch(SchemaMismatch):
    """The batch speaks another version of the KV wire format."""


class LayoutMismatch(CodecError):
    """The batch carries KV of another layout (another model, dtype or block size)."""


class MalformedBatch(CodecError):
    """Right schema, wrong content: nulls, short buffers, bad indices or token counts."""


class ChecksumMismatch(CodecError):
    """A block's bytes do not match its CRC32: corrupted in flight."""


class RequestMismatch(CodecError):
    """A row names another request than the one being written."""


class MacMismatch(CodecError):
    """The batch's MAC does not verify: its sender does not hold this graph's key, or it was altered."""


def kv_schema(layout: KVLayout) -> pa.Schema:
    """The versioned wire schema of KV blocks for `layout`."""
    meta = {f"{_META_PREFIX}version": str(SCHEMA_VERSION)}
    meta.update({f"{_META_PREFIX}{f}": str(getattr(layout, f)) for f in _LAYOUT_FIELDS})
    return pa.schema(
        [
            pa.field("request_id", pa.string(), nullable=False),
            pa.field("block_index", pa.int64(), nullable=False),
            pa.field("block_hash", pa.uint64(), nullable=False),
            pa.field("num_tokens", pa.int32(), nullable=False),
            pa.field("checksum", pa.uint32(), nullable=False),
            pa.field("mac", pa.binary(MAC_BYTES), nullable=False),  # the batch's MAC, on every row
            pa.field("data", pa.binary(layout.block_bytes), nullable=False),
        ],
        metadata=meta,
    )


def layout_from_schema(schema: pa.Schema) -> KVLayout:
    """Read the version and KVLayout a schema announces (raises on anything off)."""
    meta = {k.decode(errors="replace"): v.decode(errors="replace") for k, v in (schema.metadata or {}).items()}
    version = meta.get(f"{_META_PREFIX}version")
    if version is None:
        raise SchemaMismatch("schema has no pdd.kv.version metadata: not a KV batch")
    if version != str(SCHEMA_VERSION):
        raise VersionMismatch(f"KV wire format version {version!r}, this receiver speaks {SCHEMA_VERSION}")
    try:
        vals = {f: meta[f"{_META_PREFIX}{f}"] for f in _LAYOUT_FIELDS}
        return KVLayout(**{f: (v if f == "dtype" else int(v)) for f, v in vals.items()})
    except (KeyError, ValueError, TypeError) as e:  # KVError is a ValueError
        raise SchemaMismatch(f"schema metadata does not describe a KV layout: {e}") from e


def check_schema(schema: pa.Schema, layout: KVLayout) -> None:
    """Raise unless `schema` is exactly the wire schema for `layout` (version included)."""
    got = layout_from_schema(schema)
    if got != layout:
        raise LayoutMismatch(f"sender's KV layout {got} != receiver's {layout}")
    want = kv_schema(layout)
    if not schema.remove_metadata().equals(want.remove_metadata(), check_metadata=False):
        raise SchemaMismatch(f"KV columns {schema.remove_metadata()} != expected {want.remove_metadata()}")


# ---------------------------------------------------------------- the MAC


def batch_mac(key: str | bytes, request_id: str, start_block: int, num_tokens: np.ndarray,
              hashes: np.ndarray, checksums: np.ndarray) -> bytes:
    """Keyed BLAKE2b over a batch's request id, first block, per-block token counts, block hashes
    and CRCs: a few microseconds per batch, whatever its size."""
    k = key.encode() if isinstance(key, str) else key
    h = hashlib.blake2b(key=hashlib.sha256(k).digest(), digest_size=MAC_BYTES, person=b"pdd.kv.batch.v2")
    rid = request_id.encode()
    h.update(len(rid).to_bytes(4, "little") + rid + int(start_block).to_bytes(8, "little", signed=True))
    for a, dt in ((num_tokens, "<i4"), (hashes, "<u8"), (checksums, "<u4")):
        h.update(np.ascontiguousarray(a, dtype=dt).tobytes())
    return h.digest()


# ---------------------------------------------------------------- encode (sender, zero-copy)


def encode(request_id: str, blocks: KVBlocks, mac_key: str | bytes | None = None) -> pa.RecordBatch:
    """One record batch of `blocks`; the data column aliases `blocks.data` (no copy). With
    `mac_key` the batch is authenticated (without, its MAC is zeros: only a keyless receiver,
    a test or a benchmark, takes it)."""
    layout, n = blocks.layout, blocks.num_blocks
    if n == 0:
        raise CodecError("nothing to encode: empty run")
    bs = layout.block_size
    ntok = np.full(n, bs, dtype=np.int32)
    ntok[-1] = blocks.num_tokens - (n - 1) * bs
    hashes = np.asarray(blocks.hashes, dtype=np.uint64)
    crcs = np.asarray(blocks.checksums, dtype=np.uint32)
    mac = bytes(MAC_BYTES) if mac_key is None else batch_mac(mac_key, request_id, blocks.start_block, ntok, hashes, crcs)
    # py_buffer takes the numpy memory through the buffer protocol: the batch keeps it alive
    data = pa.Array.from_buffers(pa.binary(layout.block_bytes), n, [None, pa.py_buffer(blocks.data)])
    cols = [
        _repeat_string(request_id, n),
        pa.array(np.arange(blocks.start_block, blocks.start_block + n, dtype=np.int64)),
        pa.array(hashes),
        pa.array(ntok),
        pa.array(crcs),
        pa.Array.from_buffers(pa.binary(MAC_BYTES), n, [None, pa.py_buffer(mac * n)]),
        data,
    ]
    return pa.RecordBatch.from_arrays(cols, schema=kv_schema(layout))


def _repeat_string(value: str, n: int) -> pa.Array:
    """`value` n times as a string column, built from buffers (pa.array on a list costs ~1 ms per 256)."""
    raw = value.encode()
    offsets = np.arange(0, (n + 1) * len(raw), len(raw), dtype=np.int32) if raw else np.zeros(n + 1, np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(raw * n)])


def encode_chunks(request_id: str, blocks: KVBlocks, batch_blocks: int,
                  mac_key: str | bytes | None = None) -> Iterator[pa.RecordBatch]:
    """`blocks` as batches of at most `batch_blocks` rows (slices share memory)."""
    if batch_blocks <= 0:
        raise CodecError(f"batch_blocks must be > 0, got {batch_blocks}")
    for lo in range(0, blocks.num_blocks, batch_blocks):
        yield encode(request_id, blocks.slice(lo, lo + batch_blocks), mac_key)


# ---------------------------------------------------------------- decode (receiver, validating)


def _column(batch: pa.RecordBatch, name: str) -> pa.Array:
    col = batch.column(name)
    if col.null_count:
        raise MalformedBatch(f"column {name!r} has {col.null_count} nulls")
    return col


def decode(
    batch: pa.RecordBatch,
    layout: KVLayout,
    request_id: str | None = None,
    start_block: int | None = None,
    verify: bool = True,
    mac_key: str | bytes | None = None,
) -> KVBlocks:
    """Validate one batch and return its blocks as a numpy view over the Arrow buffer.

    Rows must be consecutive blocks of one request (`request_id` if given, starting at
    `start_block` if given); every block but the last must be full. With `mac_key`, the batch's
    MAC must verify (before any CRC is computed); with `verify`, each block's CRC32 is
    recomputed. Raises a `CodecError` subclass on anything else.
    """
    try:
        return _decode(batch, layout, request_id, start_block, verify, mac_key)
    except CodecError:
        raise
    except (pa.ArrowException, OSError, ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        # whatever a hostile batch trips inside Arrow or numpy becomes a typed error
        raise MalformedBatch(f"malformed KV batch: {type(e).__name__}: {e}") from e


def _decode(
    batch: pa.RecordBatch, layout: KVLayout, request_id: str | None, start_block: int | None, verify: bool,
    mac_key: str | bytes | None,
) -> KVBlocks:
    if not isinstance(batch, pa.RecordBatch):
        raise SchemaMismatch(f"expected a pyarrow.RecordBatch, got {type(batch).__name__}")
    check_schema(batch.schema, layout)
    n = batch.num_rows
    if n == 0:
        raise MalformedBatch("empty KV batch")
    batch.validate(full=True)  # offsets and buffer sizes of every column, before we read them
    rids = _column(batch, "request_id")
    first_rid = rids[0].as_py()
    if request_id is not None and first_rid != request_id:
        raise RequestMismatch(f"batch is for request {first_rid!r}, stream is for {request_id!r}")
    if n > 1 and len(rids.unique()) != 1:
        raise RequestMismatch("one KV batch mixes several requests")

    idx = _column(batch, "block_index").to_numpy()
    if idx[0] < 0 or (start_block is not None and idx[0] != start_block):
        raise MalformedBatch(f"batch starts at block {idx[0]}, expected {start_block}")
    if not np.array_equal(idx, np.arange(idx[0], idx[0] + n, dtype=np.int64)):
        raise MalformedBatch("block indices in a batch must be consecutive")

    bs = layout.block_size
    ntok = _column(batch, "num_tokens").to_numpy()
    if (ntok[:-1] != bs).any() or not 0 < ntok[-1] <= bs:
        raise MalformedBatch(f"num_tokens per block must be {bs} (the last in 1..{bs}), got {ntok.tolist()}")

    hash_col = _column(batch, "block_hash").to_numpy()
    crc_col = _column(batch, "checksum").to_numpy()
    mac = _column(batch, "mac")[0].as_py()
    if mac_key is not None and not hmac.compare_digest(
            mac, batch_mac(mac_key, first_rid, int(idx[0]), ntok, hash_col, crc_col)):
        raise MacMismatch(f"blocks {idx[0]}..{idx[0] + n - 1} of {first_rid!r}: the batch MAC does not verify; its "
                          "sender lacks this graph's flight.mac_key or the batch was altered (nothing was stored)")
    hashes, checksums = hash_col.tolist(), crc_col.tolist()

    col = _column(batch, "data")
    width = layout.block_bytes
    buf = col.buffers()[1]
    start, end = col.offset * width, (col.offset + n) * width
    if buf is None or buf.size < end:
        raise MalformedBatch(f"data buffer holds {0 if buf is None else buf.size} bytes, rows need {end}")
    # a view, not a copy: the KVBlocks keeps the Arrow buffer alive through numpy's base
    flat = np.frombuffer(buf, dtype=layout.numpy_dtype, count=(end - start) // layout.itemsize, offset=start)
    data = flat.reshape(n, *layout.block_shape)
    if verify:
        _verify_checksums(memoryview(buf)[start:end], width, checksums, int(idx[0]))
    num_tokens = int((n - 1) * bs + ntok[-1])
    return KVBlocks(layout, int(idx[0]), data, hashes, checksums, num_tokens)


def _verify_checksums(view: memoryview, width: int, checksums: list[int], first_block: int) -> None:
    """CRC32 of each `width`-byte block of `view`, straight off the received buffer (no copy)."""
    for i, want in enumerate(checksums):
        got = bytes_checksum(view[i * width : (i + 1) * width])
        if got != want:
            raise ChecksumMismatch(f"block {first_block + i}: CRC32 {got:#010x} != sent {want:#010x}")


def decode_stream(
    batches: list[pa.RecordBatch], layout: KVLayout, request_id: str | None = None,
    mac_key: str | bytes | None = None,
) -> KVBlocks:
    """Decode consecutive batches of one request and join them (one copy, at the join)."""
    runs: list[KVBlocks] = []
    for b in batches:
        nxt = None if not runs else runs[-1].start_block + runs[-1].num_blocks
        if runs and runs[-1].num_tokens != runs[-1].num_blocks * layout.block_size:
            raise MalformedBatch("a partial block may only end the stream")
        runs.append(decode(b, layout, request_id, nxt, mac_key=mac_key))
    if not runs:
        raise MalformedBatch("no KV batches")
    return runs[0] if len(runs) == 1 else concat_blocks(runs)


def to_ipc(batches: list[pa.RecordBatch]) -> pa.Buffer:
    """Batches as one Arrow IPC stream (what a file or a raw socket would carry)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as w:
        for b in batches:
            w.write_batch(b)
    return sink.getvalue()


def decode_ipc(buf: bytes | pa.Buffer, layout: KVLayout, request_id: str | None = None,
               mac_key: str | bytes | None = None) -> KVBlocks:
    """Decode an IPC stream of KV batches; untrusted bytes give a CodecError, nothing else."""
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(buf) if isinstance(buf, bytes) else buf)
        check_schema(reader.schema, layout)
        batches = list(reader)
    except CodecError:
        raise
    except (pa.ArrowException, OSError, ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise MalformedBatch(f"unreadable KV IPC stream: {type(e).__name__}: {e}") from e
    return decode_stream(batches, layout, request_id, mac_key)
