"""KV blocks <-> Arrow: bitwise round trips, zero copy, and a decoder that only ever raises CodecError."""

from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd_serve.engine.kv import KVBlocks, KVError, KVLayout, block_checksum
from pdd_serve.transport import codec
from pdd_serve.transport.codec import (
    ChecksumMismatch,
    CodecError,
    LayoutMismatch,
    MalformedBatch,
    RequestMismatch,
    SchemaMismatch,
    VersionMismatch,
    decode,
    decode_ipc,
    encode,
    kv_schema,
    to_ipc,
)
from tests.helpers import assert_same, make_blocks

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=2)  # 32 B blocks, for fuzzing


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_bitwise(dtype: str) -> None:
    layout = KVLayout(2, 2, 4, 4, dtype)
    kv = make_blocks(layout, 5, start=7, partial=3)
    assert_same(decode(encode("req-1", kv), layout, request_id="req-1", start_block=7), kv)
    assert_same(decode_ipc(to_ipc([encode("req-1", kv)]), layout, "req-1"), kv)


def test_chunks_and_stream_round_trip() -> None:
    kv = make_blocks(LAYOUT, 11, start=2, partial=1)
    batches = list(codec.encode_chunks("r", kv, 4))
    assert [b.num_rows for b in batches] == [4, 4, 3]
    assert_same(codec.decode_stream(batches, LAYOUT, "r"), kv)
    assert_same(decode_ipc(to_ipc(batches), LAYOUT, "r"), kv)


def test_zero_copy_both_ways() -> None:
    kv = make_blocks(LAYOUT, 3)
    batch = encode("r", kv)
    buf = batch.column("data").buffers()[1]
    assert buf.address == kv.data.ctypes.data  # the data column *is* the numpy memory
    out = decode(batch, LAYOUT)
    assert out.data.ctypes.data == buf.address  # and decoding gives it back as a view
    sliced = decode(batch.slice(1, 2), LAYOUT)  # a sliced batch decodes to a view at its offset
    assert sliced.start_block == 1 and sliced.data.ctypes.data == buf.address + LAYOUT.block_bytes
    assert np.array_equal(sliced.data, kv.data[1:])


def test_fast_crc_is_zlib_crc32() -> None:
    """The KV checksum (ISA-L) must equal zlib's CRC32 bit for bit: the wire format names CRC32."""
    kv = make_blocks(LAYOUT, 4, seed=3)
    assert [block_checksum(b) for b in kv.data] == [zlib.crc32(kv.data[i].tobytes()) for i in range(4)]


@pytest.mark.parametrize("rid", ["", "r", "réq-ü", "x" * 256])
def test_request_id_column(rid: str) -> None:
    col = encode(rid, make_blocks(LAYOUT, 3)).column("request_id")
    col.validate(full=True)
    assert col.type == pa.string() and col.to_pylist() == [rid] * 3


def test_schema_carries_version_and_layout() -> None:
    meta = kv_schema(LAYOUT).metadata
    assert meta[b"pdd.kv.version"] == str(codec.SCHEMA_VERSION).encode()
    assert codec.layout_from_schema(kv_schema(LAYOUT)) == LAYOUT


def _replace(batch: pa.RecordBatch, name: str, arr: pa.Array, field: pa.Field | None = None) -> pa.RecordBatch:
    i = batch.schema.get_field_index(name)
    schema = batch.schema.set(i, field or batch.schema.field(i))
    cols = [arr if j == i else c for j, c in enumerate(batch.columns)]
    return pa.RecordBatch.from_arrays(cols, schema=schema)


def test_typed_errors() -> None:
    kv = make_blocks(LAYOUT, 3)
    good = encode("r", kv)
    with pytest.raises(VersionMismatch):
        decode(good.replace_schema_metadata({**good.schema.metadata, b"pdd.kv.version": b"99"}), LAYOUT)
    with pytest.raises(SchemaMismatch):
        decode(good.replace_schema_metadata({}), LAYOUT)
    with pytest.raises(LayoutMismatch):
        decode(good, KVLayout(2, 2, 4, 4, "float16"))
    with pytest.raises(RequestMismatch):
        decode(good, LAYOUT, request_id="other")
    with pytest.raises(RequestMismatch):
        decode(_replace(good, "request_id", pa.array(["r", "x", "r"])), LAYOUT)
    with pytest.raises(MalformedBatch):
        decode(good, LAYOUT, start_block=1)
    with pytest.raises(MalformedBatch):  # not consecutive
        decode(_replace(good, "block_index", pa.array([0, 2, 3], pa.int64())), LAYOUT)
    with pytest.raises(MalformedBatch):  # a partial block in the middle
        decode(_replace(good, "num_tokens", pa.array([4, 2, 4], pa.int32())), LAYOUT)
    with pytest.raises(MalformedBatch):  # nulls
        decode(_replace(good, "checksum", pa.array([1, None, 3], pa.uint32())), LAYOUT)
    with pytest.raises(ChecksumMismatch):
        decode(_replace(good, "checksum", pa.array([c ^ 1 for c in kv.checksums], pa.uint32())), LAYOUT)
    bad = kv.data.copy()
    bad.view(np.uint8).reshape(-1)[5] ^= 0x10
    flipped = pa.Array.from_buffers(pa.binary(LAYOUT.block_bytes), 3, [None, pa.py_buffer(bad)])
    with pytest.raises(ChecksumMismatch):
        decode(_replace(good, "data", flipped), LAYOUT)
    narrow = pa.binary(LAYOUT.block_bytes - 4)  # rows of the wrong size
    short = pa.Array.from_buffers(narrow, 3, [None, pa.py_buffer(bad)])
    with pytest.raises(SchemaMismatch):
        decode(_replace(good, "data", short, pa.field("data", narrow, nullable=False)), LAYOUT)
    with pytest.raises(SchemaMismatch):  # variable-width data is not the wire schema
        decode(_replace(good, "data", pa.array([bytes(LAYOUT.block_bytes)] * 3, pa.binary()),
                        pa.field("data", pa.binary(), nullable=False)), LAYOUT)
    with pytest.raises(CodecError):
        decode("not a batch", LAYOUT)  # type: ignore[arg-type]
    assert issubclass(CodecError, KVError)


# ---------------------------------------------------------------- fuzzing the decoder

_GOOD = make_blocks(TINY, 3, start=0, partial=1, seed=3)
_GOOD_BATCH = encode("r", _GOOD)

_TYPES = [pa.int8(), pa.int32(), pa.int64(), pa.uint32(), pa.uint64(), pa.string(), pa.binary(),
          pa.binary(16), pa.binary(TINY.block_bytes), pa.float32(), pa.bool_(), pa.null()]


@st.composite
def column_of(draw: st.DrawFn, typ: pa.DataType, n: int) -> pa.Array:
    if pa.types.is_null(typ):
        return pa.nulls(n)
    if pa.types.is_fixed_size_binary(typ):
        vals = [draw(st.binary(min_size=typ.byte_width, max_size=typ.byte_width)) for _ in range(n)]
    elif pa.types.is_binary(typ):
        vals = [draw(st.binary(max_size=40)) for _ in range(n)]
    elif pa.types.is_string(typ):
        vals = [draw(st.sampled_from(["r", "x", "", "é"])) for _ in range(n)]
    elif pa.types.is_floating(typ):
        vals = [draw(st.floats(allow_nan=True, width=32)) for _ in range(n)]
    elif pa.types.is_boolean(typ):
        vals = [draw(st.booleans()) for _ in range(n)]
    else:
        info = np.iinfo(typ.to_pandas_dtype())
        vals = [draw(st.integers(int(info.min), int(info.max))) for _ in range(n)]
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n)) if draw(st.booleans()) else None
    return pa.array(vals, typ, mask=np.array(mask) if mask else None)


@st.composite
def malformed_batches(draw: st.DrawFn) -> pa.RecordBatch:
    """A valid batch with one or more random mutations (a few mutations are no-ops: fine)."""
    batch = _GOOD_BATCH
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["column", "metadata", "drop", "bytes", "shape", "rows"]))
        n = batch.num_rows
        if kind == "column":  # one column replaced by random values of a random type
            name = draw(st.sampled_from(batch.schema.names))
            typ = draw(st.sampled_from(_TYPES + [batch.schema.field(name).type] * 3))
            batch = _replace(batch, name, draw(column_of(typ, n)), pa.field(name, typ))
        elif kind == "metadata":
            meta = dict(batch.schema.metadata or {})
            key = draw(st.sampled_from(list(meta) + [b"pdd.kv.extra"]))
            if draw(st.booleans()):
                meta.pop(key, None)
            else:
                meta[key] = draw(st.sampled_from([b"0", b"1", b"2", b"-1", b"x", b"", b"float16", b"99999999999"]))
            batch = batch.replace_schema_metadata(meta)
        elif kind == "drop" and batch.num_columns > 1:
            batch = batch.drop_columns([draw(st.sampled_from(batch.schema.names))])
        elif kind == "bytes" and "data" in batch.schema.names:  # raw buffer bytes flipped or cut short
            col = batch.column("data")
            raw = bytearray(col.buffers()[1].to_pybytes())
            for _ in range(draw(st.integers(1, 4))):
                if raw:
                    raw[draw(st.integers(0, len(raw) - 1))] ^= draw(st.integers(1, 255))
            raw = raw[: draw(st.integers(0, len(raw)))] if draw(st.booleans()) else raw
            try:
                arr = pa.Array.from_buffers(col.type, n, [None, pa.py_buffer(bytes(raw))], offset=col.offset)
            except (pa.ArrowException, ValueError, TypeError):
                continue
            batch = _replace(batch, "data", arr)
        elif kind == "shape":
            batch = batch.slice(draw(st.integers(0, n)), draw(st.integers(0, n)))
        elif kind == "rows" and "block_index" in batch.schema.names:
            idx = draw(st.lists(st.integers(-3, 6), min_size=n, max_size=n))
            batch = _replace(batch, "block_index", pa.array(idx, pa.int64()), pa.field("block_index", pa.int64()))
    return batch


@settings(max_examples=100, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(malformed_batches(), st.sampled_from([None, "r", "x"]))
def test_decoder_fuzz_only_typed_errors(batch: pa.RecordBatch, rid: str | None) -> None:
    try:
        out = decode(batch, TINY, request_id=rid)
    except CodecError:
        return
    out.verify()  # whatever was accepted is self-consistent
    assert out.data.shape == (out.num_blocks, *TINY.block_shape)


@settings(max_examples=100, deadline=2000)
@given(st.data())
def test_ipc_fuzz_only_typed_errors(data: st.DataObject) -> None:
    raw = bytearray(to_ipc([_GOOD_BATCH]).to_pybytes())
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    try:
        out = decode_ipc(bytes(raw), TINY)
    except CodecError:
        return
    out.verify()


# ---------------------------------------------------------------- authenticity (the MAC)

KEY = "graph-secret"


def _with_column(batch: pa.RecordBatch, name: str, values: pa.Array) -> pa.RecordBatch:
    cols = [values if f.name == name else batch.column(f.name) for f in batch.schema]
    return pa.RecordBatch.from_arrays(cols, schema=batch.schema)


def test_mac_authenticates_what_md_caches() -> None:
    """A holder of the Flight token without the graph's key can't write KV that verifies: not
    with its own key, not unkeyed, and not by editing a real batch's request id, hashes or CRCs."""
    kv = make_blocks(LAYOUT, 6, start=3, partial=1)
    good = encode("r", kv, mac_key=KEY)
    assert_same(decode(good, LAYOUT, "r", 3, mac_key=KEY), kv)
    assert_same(decode(good, LAYOUT, "r", 3, mac_key=KEY.encode()), kv)  # str and bytes keys agree
    forged = [encode("r", kv), encode("r", kv, mac_key="guessed")]
    n = kv.num_blocks
    hashes = list(kv.hashes)
    hashes[2] ^= 1  # file these bytes under another prefix
    forged.append(_with_column(good, "block_hash", pa.array(np.asarray(hashes, dtype=np.uint64))))
    crcs = list(kv.checksums)
    crcs[0] ^= 1
    forged.append(_with_column(good, "checksum", pa.array(np.asarray(crcs, dtype=np.uint32))))
    forged.append(_with_column(good, "request_id", pa.array(["s"] * n)))
    forged.append(_with_column(good, "block_index", pa.array(np.arange(4, 4 + n, dtype=np.int64))))
    for i, b in enumerate(forged):
        with pytest.raises(codec.MacMismatch, match="MAC does not verify"):
            decode(b, LAYOUT, mac_key=KEY, verify=False)
        assert isinstance(codec.MacMismatch("x"), CodecError), i
    with pytest.raises(codec.MacMismatch):
        full = make_blocks(LAYOUT, 6)  # one stream: a good batch, then one under another key
        decode_ipc(to_ipc([encode("r", full.slice(0, 4), KEY), encode("r", full.slice(4, 6), "other")]), LAYOUT,
                   "r", mac_key=KEY)
    # a keyless receiver (a unit test, a benchmark) still takes any well-formed batch
    assert_same(decode(forged[0], LAYOUT, "r"), kv)


def test_mac_covers_the_checksums_that_cover_the_bytes() -> None:
    """Edited bytes whose CRC is updated to match fail the MAC; with the old CRC, the checksum."""
    kv = make_blocks(LAYOUT, 2)
    good = encode("r", kv, mac_key=KEY)
    data = kv.data.copy()
    data[1].flat[0] += 1.0
    evil = KVBlocks(LAYOUT, 0, data, kv.hashes, num_tokens=kv.num_tokens)  # fresh, matching CRCs
    with pytest.raises(codec.MacMismatch):
        decode(_with_column(encode("r", evil), "mac", good.column("mac")), LAYOUT, mac_key=KEY)
    with pytest.raises(ChecksumMismatch):
        decode(_with_column(good, "data", encode("r", evil).column("data")), LAYOUT, mac_key=KEY)
