"""KV over Arrow Flight: round trips, auth, TLS, resume after a broken stream, hostile input."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import pytest

from pdd_serve.engine.kv import KVBlocks, KVLayout
from pdd_serve.transport import flight as kv_flight
from pdd_serve.transport import flight_client
from pdd_serve.transport.codec import encode, kv_schema
from pdd_serve.transport.flight import (
    AuthError,
    CapacityError,
    KVFlightClient,
    KVFlightServer,
    RejectedError,
    TransferTimeout,
    UnknownRequestError,
    kv_descriptor,
)
from pdd_serve.transport.link import BandwidthEstimator
from tests.helpers import assert_same, make_blocks

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)  # 1 KiB blocks
TOKEN = "test-token"


@pytest.fixture
def server() -> Iterator[KVFlightServer]:
    with KVFlightServer("127.0.0.1", layout=LAYOUT, token=TOKEN, max_bytes_per_request=1 << 20,
                        max_bytes_total=2 << 20) as srv:
        yield srv


def client(srv: KVFlightServer, **kw: object) -> KVFlightClient:
    kw.setdefault("deadline_s", 10.0)
    return KVFlightClient(srv.location, TOKEN, layout=LAYOUT, **kw)  # type: ignore[arg-type]


def raw_put(srv: KVFlightServer, rid: str, batches: list[pa.RecordBatch], schema: pa.Schema | None = None,
            token: str | None = TOKEN) -> list[bytes]:
    """A hand-rolled DoPut (no client-side checks): what a hostile or buggy peer could send."""
    c = flight.FlightClient(srv.location)
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    writer, reader = c.do_put(kv_descriptor(rid), schema or batches[0].schema,
                              flight.FlightCallOptions(timeout=5, headers=headers))
    acks = []
    try:
        for b in batches:
            writer.write_batch(b)
            buf = reader.read()
            if buf is not None:
                acks.append(buf.to_pybytes())
        writer.done_writing()
    finally:
        writer.close()
        c.close()
    return acks


def test_round_trip_bitwise(server: KVFlightServer) -> None:
    kv = make_blocks(LAYOUT, 23, start=5, partial=3)
    server.expect("r1", 23, start_block=5, num_tokens=kv.num_tokens, hashes=kv.hashes)
    est = BandwidthEstimator()
    res = client(server, batch_blocks=4, window_batches=2, estimator=est).push("r1", [kv.slice(0, 9), kv.slice(9, 23)])
    got = server.wait_complete_sync("r1", 5)
    assert_same(got.blocks, kv)
    assert res.blocks_sent == 23 and res.batches_sent == 3 + 4 and res.resumes == 0
    assert got.blocks_received == 23 and got.bytes_received == kv.nbytes
    assert est.samples == 1 and est.bps > 0
    assert server.release("r1") and server.bytes_reserved == 0


def test_parallel_streams_share_one_bounded_pool(server: KVFlightServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Extra streams of every push share the process's pool (before: a pool per push); stream 0
    runs on the caller's thread, so pushes complete even when the pool is smaller than their
    streams, and the pool's threads never outnumber its size."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(flight_client, "_STREAM_POOL", ThreadPoolExecutor(1, thread_name_prefix="kv-push-test"))
    kv = make_blocks(LAYOUT, 24, seed=3)
    for i in range(4):
        server.expect(f"shared{i}", 24)
    results: list = [None] * 4

    def push(i: int) -> None:
        results[i] = client(server, batch_blocks=2, parallel_streams=3).push(f"shared{i}", [kv])

    threads = [threading.Thread(target=push, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, sum(1 for t in threading.enumerate() if t.name.startswith("kv-push-test")))
        time.sleep(0.001)
    for i in range(4):
        assert results[i] is not None and results[i].blocks_sent == 24
        assert_same(server.wait_complete_sync(f"shared{i}", 5).blocks, kv)
        server.release(f"shared{i}")
    assert peak <= 1


def test_a_late_extra_stream_does_not_fail_a_finished_push(server: KVFlightServer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An extra stream queued in the shared pool may start after stream 0 sent everything and MD
    released the request: it must not dial (the receiver would answer "unknown request" after its
    expect wait, failing a transfer that was whole). Before the fix: 16 of 20 failed here."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(flight_client, "_STREAM_POOL", ThreadPoolExecutor(1, thread_name_prefix="kv-push-late"))
    kv = make_blocks(LAYOUT, 60, seed=4)
    for i in range(10):
        rid = f"late{i}"
        server.expect(rid, 60)
        md = threading.Thread(target=lambda r=rid: (server.wait_complete_sync(r, 10), server.release(r)))
        md.start()
        t0 = time.monotonic()
        res = client(server, batch_blocks=2, parallel_streams=3).push(rid, [kv])
        assert res.blocks_sent >= 60 and time.monotonic() - t0 < server.expect_wait_s
        md.join()


def test_parallel_streams_and_async_feed(server: KVFlightServer) -> None:
    kv = make_blocks(LAYOUT, 40, seed=1)
    server.expect("par", 40)
    res = client(server, batch_blocks=3, parallel_streams=3).push("par", (kv.slice(i, i + 5) for i in range(0, 40, 5)))
    assert_same(server.wait_complete_sync("par", 5).blocks, kv)
    assert res.blocks_sent == 40

    async def main() -> None:
        server.expect("async", 40)

        async def feed():  # prefill producing blocks over time: the transfer overlaps it
            for i in range(0, 40, 8):
                await asyncio.sleep(0.005)
                yield kv.slice(i, i + 8)

        waiter = asyncio.create_task(server.wait_complete("async", 5))
        await client(server, batch_blocks=4).push_async("async", feed())
        assert_same((await waiter).blocks, kv)

    asyncio.run(main())


def test_auth_rejects_missing_and_wrong_token(server: KVFlightServer) -> None:
    kv = make_blocks(LAYOUT, 2)
    server.expect("a", 2)
    with pytest.raises(flight.FlightUnauthenticatedError):
        raw_put(server, "a", [encode("a", kv)], token=None)
    with pytest.raises(AuthError):
        KVFlightClient(server.location, "wrong", layout=LAYOUT, deadline_s=5).push("a", [kv])
    with pytest.raises(AuthError):
        KVFlightClient(server.location, "", layout=LAYOUT, deadline_s=5).missing("a")
    assert server.stats("a").have == 0


@pytest.fixture(scope="module")
def tls_cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    try:  # the `cryptography` package if the venv has it, else the openssl CLI
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        k = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
        now = datetime.datetime.now(datetime.timezone.utc)
        san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        c = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(k.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1)).add_extension(san, critical=False)
             .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(k, hashes.SHA256()))
        cert.write_bytes(c.public_bytes(serialization.Encoding.PEM))
        key.write_bytes(k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()))
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither cryptography nor openssl available to make a test certificate")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def test_tls_round_trip(tls_cert: tuple[Path, Path]) -> None:
    cert, key = tls_cert
    with KVFlightServer("127.0.0.1", layout=LAYOUT, token=TOKEN, tls_cert=cert, tls_key=key) as srv:
        assert srv.location.startswith("grpc+tls://")
        kv = make_blocks(LAYOUT, 7, partial=1)
        srv.expect("tls", 7)
        KVFlightClient(srv.location, TOKEN, layout=LAYOUT, tls_root_cert=cert, deadline_s=10).push("tls", [kv])
        assert_same(srv.wait_complete_sync("tls", 5).blocks, kv)
        with pytest.raises(AuthError):  # TLS does not replace the token
            KVFlightClient(srv.location, "nope", layout=LAYOUT, tls_root_cert=cert, deadline_s=5).push("tls", [kv])


def test_resume_after_killed_stream_sends_only_missing(server: KVFlightServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server kills the first stream after 3 batches; the resume carries exactly the rest."""
    kv = make_blocks(LAYOUT, 20, seed=2)
    server.expect("cut", 20)
    seen: list[list[int]] = [[]]  # blocks the server received, per stream
    accept = server._accept

    def cutting_accept(t, batch):  # noqa: ANN001
        if len(seen) == 1 and len(seen[0]) == 6:  # mid-way: the 4th batch of the 1st stream
            seen.append([])
            raise flight.FlightUnavailableError("stream killed by the test")
        lo, hi = accept(t, batch)
        seen[-1].extend(range(lo, hi))
        return lo, hi

    monkeypatch.setattr(server, "_accept", cutting_accept)
    res = client(server, batch_blocks=2, window_batches=3).push("cut", [kv])
    got = server.wait_complete_sync("cut", 5)
    assert_same(got.blocks, kv)
    assert res.resumes == 1
    assert seen[0] == list(range(6)) and sorted(seen[1]) == list(range(6, 20))  # nothing received twice
    assert got.blocks_received == 20


class CuttingProxy:
    """A TCP proxy that drops its first connection after `cut_after` bytes upstream (a real break)."""

    def __init__(self, target_port: int, cut_after: int) -> None:
        self.target_port, self.cut_after = target_port, cut_after
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.cuts = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                down, _ = self.sock.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.target_port))
            limit = self.cut_after if self.cuts == 0 else None
            self.cuts += limit is not None
            threading.Thread(target=self._pipe, args=(down, up, limit), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, down, None), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if limit is not None and sent + len(data) > limit:
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.sock.close()


def test_resume_after_tcp_connection_cut(server: KVFlightServer) -> None:
    kv = make_blocks(LAYOUT, 64, seed=4)
    server.expect("tcp", 64)
    proxy = CuttingProxy(server.port, cut_after=24 * LAYOUT.block_bytes)
    try:
        c = KVFlightClient(f"grpc://127.0.0.1:{proxy.port}", TOKEN, layout=LAYOUT, batch_blocks=4, deadline_s=10,
                           retry_backoff_s=0.01)
        res = c.push("tcp", [kv])
    finally:
        proxy.close()
    got = server.wait_complete_sync("tcp", 5)
    assert_same(got.blocks, kv)
    assert res.resumes >= 1 and proxy.cuts == 1
    # the verified prefix is kept; at most the batch being processed at the cut can arrive twice
    assert got.blocks_received <= 64 + 4


def test_connection_kept_across_pushes_and_redialled_after_a_break(server: KVFlightServer) -> None:
    """Pushes to one endpoint share a connection (no handshake, full flow-control window); a broken
    one is dropped so the resume dials afresh."""
    kv = make_blocks(LAYOUT, 8, seed=5)
    for rid in ("keep-1", "keep-2"):
        server.expect(rid, 8)
    a, b = client(server, batch_blocks=4), client(server, batch_blocks=4)
    a.push("keep-1", [kv])
    conn = a._connect()
    b.push("keep-2", [kv])  # another client object, as prefill makes per request
    assert b._connect() is conn
    assert_same(server.wait_complete_sync("keep-2", 5).blocks, kv)

    server.expect("keep-3", 8)
    proxy = CuttingProxy(server.port, cut_after=4 * LAYOUT.block_bytes)
    try:
        c = KVFlightClient(f"grpc://127.0.0.1:{proxy.port}", TOKEN, layout=LAYOUT, batch_blocks=2, deadline_s=10,
                           retry_backoff_s=0.01)
        first = c._connect()
        res = c.push("keep-3", [kv])
    finally:
        proxy.close()
    assert res.resumes >= 1 and c._connect() is not first  # the cut connection was dropped
    assert_same(server.wait_complete_sync("keep-3", 5).blocks, kv)
    assert len(flight_client.CHANNELS) <= flight_client.MAX_CHANNELS


def test_unknown_request_and_release(server: KVFlightServer) -> None:
    kv = make_blocks(LAYOUT, 3)
    with pytest.raises(UnknownRequestError):
        client(server).push("ghost", [kv])
    with pytest.raises(UnknownRequestError):  # parallel streams: one error, the siblings stop
        client(server, parallel_streams=3, batch_blocks=1).push("ghost", [kv])
    with pytest.raises(UnknownRequestError):
        server.wait_complete_sync("ghost", 0.1)
    server.expect("gone", 3)
    assert server.release("gone") and not server.release("gone")
    with pytest.raises(UnknownRequestError):
        client(server).push("gone", [kv])


def test_duplicates_idempotent_or_rejected(server: KVFlightServer) -> None:
    kv = make_blocks(LAYOUT, 6)
    server.expect("dup", 6)
    c = client(server, batch_blocks=4)
    c.push("dup", [kv.slice(0, 4)])
    c.push("dup", [kv])  # blocks 0-3 again, identical: fine
    assert_same(server.wait_complete_sync("dup", 5).blocks, kv)
    other = make_blocks(LAYOUT, 6, seed=9)
    with pytest.raises(RejectedError) as e:
        c.push("dup", [other.slice(2, 3)])
    assert e.value.code == "conflict"
    assert_same(server.wait_complete_sync("dup", 1).blocks, kv)  # state unchanged


def test_hostile_batches_leave_state_consistent(server: KVFlightServer) -> None:
    kv = make_blocks(LAYOUT, 8)
    server.expect("h", 8, num_tokens=8 * LAYOUT.block_size)
    raw_put(server, "h", [encode("h", kv.slice(0, 2))])  # a verified prefix to protect
    c = client(server)

    def rejected(code: str, *batches: pa.RecordBatch, schema: pa.Schema | None = None) -> None:
        with pytest.raises(pa.ArrowException, match=f"pdd.kv/{code}"):
            raw_put(server, "h", list(batches), schema=schema)
        assert server.missing("h") == [(2, 8)]  # nothing of a refused batch was stored

    bad = KVBlocks(LAYOUT, 2, kv.data[2:4].copy(), kv.hashes[2:4], kv.checksums[2:4])
    bad.data.reshape(-1)[3] += 1
    rejected("checksum", encode("h", bad))
    rejected("request_mismatch", encode("other", kv.slice(2, 4)))  # a descriptor writes only its own request
    other_layout = KVLayout(2, 2, 4, 4)
    rejected("layout", encode("h", make_blocks(other_layout, 2, start=2)))
    wrong = pa.record_batch([pa.array([1, 2])], names=["x"])
    rejected("schema", wrong)
    rejected("out_of_range", encode("h", make_blocks(LAYOUT, 2, start=7)))
    rejected("partial_block", encode("h", make_blocks(LAYOUT, 2, start=2, partial=1)))
    rejected("num_tokens", encode("h", make_blocks(LAYOUT, 1, start=7, partial=2)))
    server.expect("hashed", 2, hashes=[1, 2])
    with pytest.raises(RejectedError, match="hash_mismatch"):
        c.push("hashed", [make_blocks(LAYOUT, 2)])
    # a good batch after a bad one in the same stream: the stream dies at the bad one
    rejected("checksum", encode("h", bad), encode("h", kv.slice(4, 6)))
    assert server.stats("h").batches_rejected == 6  # layout and schema are refused per stream, not per batch
    c.push("h", [kv.slice(2, 8)])  # a resume of the honest stream still completes
    assert_same(server.wait_complete_sync("h", 5).blocks, kv)


def test_acks_are_per_batch(server: KVFlightServer) -> None:
    kv = make_blocks(LAYOUT, 5)
    server.expect("ack", 5)
    acks = raw_put(server, "ack", [encode("ack", kv.slice(0, 2)), encode("ack", kv.slice(2, 5))])
    assert [json.loads(a) for a in acks] == [{"lo": 0, "hi": 2}, {"lo": 2, "hi": 5}]


def test_byte_caps(server: KVFlightServer) -> None:
    with pytest.raises(CapacityError, match="per-request"):
        server.expect("big", (1 << 20) // LAYOUT.block_bytes + 1)
    server.expect("a", 1024)
    server.expect("b", 1024)  # 2 MiB: the server's total
    with pytest.raises(CapacityError, match="cap"):
        server.expect("c", 1)
    server.release("a")
    server.expect("c", 1)
    assert server.bytes_reserved == (1024 + 1) * LAYOUT.block_bytes


def test_wait_timeout_and_client_deadline(server: KVFlightServer) -> None:
    server.expect("slow", 4)
    with pytest.raises(TransferTimeout):
        server.wait_complete_sync("slow", 0.05)
    with pytest.raises(TransferTimeout):
        asyncio.run(server.wait_complete("slow", 0.05))
    kv = make_blocks(LAYOUT, 4)

    def stalled_feed():
        yield kv.slice(0, 1)
        time.sleep(1.0)  # prefill hangs
        yield kv.slice(1, 4)

    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        client(server, batch_blocks=1, deadline_s=0.3).push("slow", stalled_feed())
    assert time.monotonic() - t0 < 3
    assert server.missing("slow") == [(1, 4)]


def test_expect_is_idempotent_and_checked(server: KVFlightServer) -> None:
    server.expect("e", 3, start_block=1)
    server.expect("e", 3, start_block=1)
    with pytest.raises(ValueError):
        server.expect("e", 4)
    with pytest.raises(ValueError):
        server.expect("", 1)
    assert np.all(server.missing("e") == [(1, 4)])
    assert kv_schema(LAYOUT) == server.schema


def test_a_batch_without_the_graph_mac_is_refused_and_nothing_is_stored() -> None:
    kv = make_blocks(LAYOUT, 8)
    with KVFlightServer("127.0.0.1", layout=LAYOUT, token=TOKEN, mac_key="graph-key") as srv:
        for bad_key in (None, "another-graph"):
            srv.expect("r", 8, num_tokens=kv.num_tokens, hashes=kv.hashes)
            with pytest.raises(RejectedError, match="MAC does not verify") as ei:
                KVFlightClient(srv.location, TOKEN, layout=LAYOUT, mac_key=bad_key, deadline_s=10).push("r", [kv])
            assert ei.value.code == "mac"
            t = srv._transfers["r"]
            assert t.batches_rejected >= 1 and t.blocks_received == 0 and not t.runs  # nothing stored
            srv.release("r")
        srv.expect("r", 8, num_tokens=kv.num_tokens, hashes=kv.hashes)
        KVFlightClient(srv.location, TOKEN, layout=LAYOUT, mac_key="graph-key", deadline_s=10).push("r", [kv])
        assert_same(srv.wait_complete_sync("r", 5).blocks, kv)


# ---------------------------------------------------------------- explicit abort (issue 13, item 3)


def test_a_sender_abort_fails_the_receivers_wait_at_once(server: KVFlightServer) -> None:
    """Prefill fails mid-stream: the push ends with an explicit abort, so MD's wait fails now with
    the reason (not at its timeout), later batches are refused, and a re-delivery starts clean."""
    kv = make_blocks(LAYOUT, 12)
    server.expect("ab", 12, num_tokens=kv.num_tokens, hashes=kv.hashes)

    def failing_feed():
        yield kv.slice(0, 4)
        raise kv_flight.SenderAborted("prefill failed: RuntimeError")

    async def main() -> float:
        waiter = asyncio.create_task(server.wait_complete("ab", 30))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(kv_flight.SenderAborted):
            await asyncio.to_thread(client(server, batch_blocks=2).push, "ab", failing_feed())
        with pytest.raises(kv_flight.TransferAborted, match="prefill failed"):
            await waiter
        return time.monotonic() - t0

    assert asyncio.run(main()) < 5  # at once: the wait had 30 s left
    with pytest.raises(kv_flight.TransferAborted):
        server.wait_complete_sync("ab", 0.01)  # a late waiter gets the same answer, immediately
    with pytest.raises(kv_flight.TransferAborted):  # batches after the abort are refused
        client(server).push("ab", [kv.slice(4, 12)])
    assert not server._transfers["ab"].runs  # nothing kept for a transfer nobody will load
    server.release("ab")
    server.expect("ab", 12, num_tokens=kv.num_tokens, hashes=kv.hashes)  # the re-delivery
    client(server).push("ab", [kv])
    assert_same(server.wait_complete_sync("ab", 5).blocks, kv)


def test_a_cancelled_async_push_aborts_and_a_complete_one_cannot_be(server: KVFlightServer) -> None:
    kv = make_blocks(LAYOUT, 8)
    server.expect("c1", 8)

    async def main() -> None:
        async def slow_feed():
            yield kv.slice(0, 2)
            await asyncio.sleep(30)  # prefill hangs; the router gives up on it
            yield kv.slice(2, 8)

        push = asyncio.create_task(client(server, batch_blocks=2).push_async("c1", slow_feed()))
        await asyncio.sleep(0.3)
        push.cancel()
        with pytest.raises(asyncio.CancelledError):
            await push
        with pytest.raises(kv_flight.TransferAborted, match="cancelled"):
            await server.wait_complete("c1", 10)

    asyncio.run(main())
    server.expect("c2", 8)
    client(server).push("c2", [kv])
    assert not client(server).abort("c2", "too late")  # complete: an abort changes nothing
    assert_same(server.wait_complete_sync("c2", 5).blocks, kv)
    assert not client(server).abort("never-expected", "x")


def test_an_abort_needs_the_graph_mac() -> None:
    with KVFlightServer("127.0.0.1", layout=LAYOUT, token=TOKEN, mac_key="graph-key") as srv:
        srv.expect("m", 4)
        for bad_key in (None, "another-graph"):
            with pytest.raises(RejectedError) as ei:
                KVFlightClient(srv.location, TOKEN, layout=LAYOUT, mac_key=bad_key).abort("m", "forged")
            assert ei.value.code == "mac"
        assert srv._transfers["m"].aborted is None
        assert KVFlightClient(srv.location, TOKEN, layout=LAYOUT, mac_key="graph-key").abort("m", "real")
        assert srv._transfers["m"].aborted == "real"


def test_prefills_feed_aborts_the_push_when_prefill_fails(server: KVFlightServer) -> None:
    """Prefill's block feed (serve/prefill.py): a prefill that raises after its first chunk ends the
    push with an abort; MD's wait fails at once instead of at its timeout."""
    from pdd_serve.serve.messages import KVTarget
    from pdd_serve.serve.prefill import BlockFeed

    kv = make_blocks(LAYOUT, 10)
    server.expect("pf", 10)
    feed = BlockFeed(KVTarget(server.location, 0))
    feed.q.put(kv.slice(0, 4))  # the first chunk left for MD
    out: dict = {}
    sender = threading.Thread(target=lambda: out.setdefault("e", _raises(lambda: client(server).push("pf", iter(feed)))),
                              daemon=True)
    sender.start()
    time.sleep(0.2)
    feed.abort("prefill of pf failed: RuntimeError")  # what Prefill.prefill does when it raises
    t0 = time.monotonic()
    with pytest.raises(kv_flight.TransferAborted, match="4/10 blocks arrived"):
        server.wait_complete_sync("pf", 30)
    assert time.monotonic() - t0 < 5
    sender.join(10)
    assert isinstance(out["e"], kv_flight.SenderAborted)


def _raises(fn) -> BaseException | None:  # noqa: ANN001
    try:
        fn()
    except BaseException as e:  # noqa: BLE001
        return e
    return None
