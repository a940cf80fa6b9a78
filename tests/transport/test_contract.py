"""The transport seam's contract (transport/base.py), run over Flight on loopback and the in-process
fake alike: the same calls give the same observable behaviour, which is what keeps the fake faithful."""

from __future__ import annotations

import ast
import asyncio
import inspect
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdd_serve.engine.kv import KVBlocks, KVError, KVLayout
from pdd_serve.transport.base import KVReceiver, KVSender, transport_members
from pdd_serve.transport.fake import InProcessKVLink, InProcessReceiver, InProcessSender
from pdd_serve.transport.flight import (
    CapacityError,
    KVFlightClient,
    KVFlightServer,
    RejectedError,
    SenderAborted,
    TransferAborted,
    TransferTimeout,
    UnknownRequestError,
)
from tests.helpers import assert_same, make_blocks

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)  # 1 KiB blocks
TOKEN = "test-token"
CAPS = {"max_bytes_per_request": 64 << 10, "max_bytes_total": 128 << 10}
EXPECT_WAIT_S = 0.05  # how long a push waits for an expect it may have overtaken (short: tests)


@dataclass
class Link:
    receiver: KVReceiver
    make_sender: Callable[[int, float], KVSender]  # (batch_blocks, deadline_s)

    def sender(self, batch_blocks: int = 4, deadline_s: float = 10.0) -> KVSender:
        return self.make_sender(batch_blocks, deadline_s)

    def wait(self, rid: str, timeout: float = 5.0):  # noqa: ANN201 (a ReceivedKV)
        return asyncio.run(self.receiver.wait_complete(rid, timeout))


@pytest.fixture(params=["flight", "fake"])
def link(request: pytest.FixtureRequest) -> Iterator[Link]:
    if request.param == "flight":
        with KVFlightServer("127.0.0.1", layout=LAYOUT, token=TOKEN, **CAPS) as srv:
            srv.expect_wait_s = EXPECT_WAIT_S
            yield Link(srv, lambda b, d: KVFlightClient(srv.location, TOKEN, layout=LAYOUT, batch_blocks=b,
                                                        deadline_s=d))
    else:
        fake = InProcessKVLink(LAYOUT, **CAPS)
        fake.receiver.expect_wait_s = EXPECT_WAIT_S
        yield Link(fake.receiver, lambda b, d: fake.sender(batch_blocks=b, deadline_s=d))


def test_both_sides_speak_the_seam(link: Link) -> None:
    assert isinstance(link.receiver, KVReceiver) and isinstance(link.sender(), KVSender)


@pytest.mark.parametrize("side, impls", [(KVSender, [KVFlightClient, InProcessSender]),
                                         (KVReceiver, [KVFlightServer, InProcessReceiver])])
def test_the_signatures_match_the_seam(side: type, impls: list[type]) -> None:
    """What isinstance does not check: each method takes the seam's parameters, by name and kind,
    any others it has are optional, and it is async where the seam's is."""
    for name in transport_members(side):
        want = getattr(side, name, None)
        if not callable(want):  # an attribute or a property: isinstance checked it is there
            continue
        for impl in impls:
            got, params = getattr(impl, name), inspect.signature(want).parameters
            have = inspect.signature(got).parameters
            assert all(p in have and have[p].kind == params[p].kind for p in params), (impl, name)
            assert all(q.default is not q.empty for n, q in have.items() if n not in params), (impl, name)
            assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), (impl, name)


def test_a_whole_transfer(link: Link) -> None:
    kv = make_blocks(LAYOUT, 11, start=3, partial=2)
    link.receiver.expect("r", 11, start_block=3, num_tokens=kv.num_tokens, hashes=kv.hashes)
    link.receiver.expect("r", 11, start_block=3, num_tokens=kv.num_tokens, hashes=kv.hashes)  # idempotent
    assert link.receiver.bytes_reserved == 11 * LAYOUT.block_bytes
    res = link.sender(batch_blocks=4).push("r", [kv.slice(0, 5), kv.slice(5, 11)])
    assert (res.blocks_sent, res.bytes_sent, res.batches_sent) == (11, kv.nbytes, 2 + 2)  # 4+1, 4+2
    got = link.wait("r")
    assert_same(got.blocks, kv)
    assert (got.blocks_received, got.bytes_received) == (11, kv.nbytes)
    assert link.receiver.missing("r") == [] and link.sender().missing("r") == []
    assert not link.sender().abort("r", "too late")  # complete: an abort changes nothing
    assert_same(link.wait("r").blocks, kv)


def test_missing_after_a_partial_transfer(link: Link) -> None:
    kv = make_blocks(LAYOUT, 10, start=2)
    link.receiver.expect("p", 10, start_block=2)
    link.sender().push("p", [kv.slice(0, 3), kv.slice(6, 8)])
    assert link.receiver.missing("p") == [(5, 8), (10, 12)]
    assert link.sender().missing("p") == [(5, 8), (10, 12)]
    link.sender().push("p", [kv.slice(3, 6), kv.slice(8, 10)])  # a resume sends only what is missing
    assert_same(link.wait("p").blocks, kv)


def test_an_abort_fails_the_wait_at_once(link: Link) -> None:
    kv = make_blocks(LAYOUT, 8)
    link.receiver.expect("ab", 8)
    link.sender().push("ab", [kv.slice(0, 3)])

    async def main() -> float:
        waiter = asyncio.create_task(link.receiver.wait_complete("ab", 30))
        await asyncio.sleep(0.05)
        assert await asyncio.to_thread(link.sender().abort, "ab", "prefill failed: RuntimeError")
        t0 = time.monotonic()
        with pytest.raises(TransferAborted, match=r"3/8 blocks arrived\): prefill failed"):
            await waiter
        return time.monotonic() - t0

    assert asyncio.run(main()) < 2  # at once: the wait had 30 s left
    with pytest.raises(TransferAborted):
        link.wait("ab", 0.01)  # a late waiter gets the same answer
    with pytest.raises(TransferAborted):  # later batches are refused
        link.sender().push("ab", [kv.slice(3, 8)])
    assert not link.sender().abort("ab", "again") and not link.sender().abort("never-expected", "x")


def test_a_feed_that_gives_up_aborts_the_transfer(link: Link) -> None:
    kv = make_blocks(LAYOUT, 8)
    link.receiver.expect("fa", 8)

    def feed() -> Iterator[KVBlocks]:
        yield kv.slice(0, 4)
        raise SenderAborted("prefill of fa failed")

    with pytest.raises(SenderAborted):
        link.sender().push("fa", feed())
    with pytest.raises(TransferAborted, match="prefill of fa failed"):
        link.wait("fa", 5)


def test_the_wait_and_the_push_time_out(link: Link) -> None:
    kv = make_blocks(LAYOUT, 4)
    link.receiver.expect("slow", 4)
    link.sender(batch_blocks=1).push("slow", [kv.slice(0, 1)])
    with pytest.raises(TransferTimeout):
        link.wait("slow", 0.05)

    def stalled() -> Iterator[KVBlocks]:
        yield kv.slice(1, 2)
        time.sleep(0.5)  # prefill hangs past the push's deadline
        yield kv.slice(2, 4)

    with pytest.raises(TransferTimeout):
        link.sender(batch_blocks=1, deadline_s=0.2).push("slow", stalled())
    assert link.receiver.missing("slow") == [(2, 4)]


def test_a_request_not_expected_is_refused(link: Link) -> None:
    kv = make_blocks(LAYOUT, 3)
    with pytest.raises(UnknownRequestError):
        link.sender().push("ghost", [kv])
    with pytest.raises(UnknownRequestError):
        link.sender().missing("ghost")
    with pytest.raises(UnknownRequestError):
        link.wait("ghost", 0.1)
    link.receiver.expect("gone", 3)
    assert link.receiver.release("gone") and not link.receiver.release("gone")
    with pytest.raises(UnknownRequestError):
        link.sender().push("gone", [kv])


def test_a_re_send_is_idempotent_if_identical_and_a_conflict_if_not(link: Link) -> None:
    kv = make_blocks(LAYOUT, 6)
    link.receiver.expect("dup", 6)
    link.sender().push("dup", [kv.slice(0, 4)])
    link.sender().push("dup", [kv])  # blocks 0-3 again, identical: fine
    assert_same(link.wait("dup").blocks, kv)
    with pytest.raises(RejectedError) as e:
        link.sender().push("dup", [make_blocks(LAYOUT, 6, seed=9).slice(2, 3)])
    assert e.value.code == "conflict"
    assert_same(link.wait("dup", 1).blocks, kv)  # state unchanged


def test_batches_are_checked_whole(link: Link) -> None:
    kv = make_blocks(LAYOUT, 8)
    link.receiver.expect("h", 8, num_tokens=8 * LAYOUT.block_size)
    link.sender().push("h", [kv.slice(0, 2)])

    def rejected(code: str, run: KVBlocks) -> None:
        with pytest.raises(RejectedError) as e:
            link.sender().push("h", [run])
        assert e.value.code == code
        assert link.receiver.missing("h") == [(2, 8)]  # nothing of a refused batch was stored

    bad = KVBlocks(LAYOUT, 2, kv.data[2:4].copy(), kv.hashes[2:4], kv.checksums[2:4])
    bad.data.reshape(-1)[3] += 1
    rejected("checksum", bad)
    rejected("out_of_range", make_blocks(LAYOUT, 2, start=7))
    rejected("partial_block", make_blocks(LAYOUT, 2, start=2, partial=1))
    rejected("num_tokens", make_blocks(LAYOUT, 1, start=7, partial=2))
    with pytest.raises(KVError):  # another layout is refused before anything is sent
        link.sender().push("h", [make_blocks(KVLayout(2, 2, 4, 4), 2, start=2)])
    link.receiver.expect("hashed", 2, hashes=[1, 2])
    with pytest.raises(RejectedError) as e:
        link.sender().push("hashed", [make_blocks(LAYOUT, 2)])
    assert e.value.code == "hash_mismatch"
    link.sender().push("h", [kv.slice(2, 8)])
    assert_same(link.wait("h").blocks, kv)


def test_release_frees_the_reservation_and_fails_waiters(link: Link) -> None:
    with pytest.raises(CapacityError):
        link.receiver.expect("big", CAPS["max_bytes_per_request"] // LAYOUT.block_bytes + 1)
    kv = make_blocks(LAYOUT, 4)
    link.receiver.expect("a", 4)
    link.receiver.expect("b", 6)
    assert link.receiver.bytes_reserved == 10 * LAYOUT.block_bytes
    link.sender().push("a", [kv])
    link.wait("a")
    assert link.receiver.release("a")
    assert link.receiver.bytes_reserved == 6 * LAYOUT.block_bytes

    async def main() -> None:
        waiter = asyncio.create_task(link.receiver.wait_complete("b", 30))
        await asyncio.sleep(0.05)
        assert link.receiver.release("b")
        with pytest.raises(UnknownRequestError):
            await waiter

    asyncio.run(main())
    assert link.receiver.bytes_reserved == 0


# ---------------------------------------------------------------- the serve code speaks only the seam

SERVE = Path(__file__).resolve().parents[2] / "pdd_serve" / "serve"


def _uses(path: Path, holder: str) -> set[str]:
    """Names used on `self.<holder>` or on a local named `holder` in `path`."""
    def held(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == holder and isinstance(node.value, ast.Name)
                and node.value.id == "self") or (isinstance(node, ast.Name) and node.id == holder)

    tree = ast.parse(path.read_text())
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and held(n.value)}


def test_the_serve_code_uses_only_the_seams_primitives() -> None:
    """MD uses its receiver (`self.flight`) and Prefill its sender (`client`) only through what
    base.py names: a second transport goes behind the same two protocols."""
    md, prefill = _uses(SERVE / "main_decode.py", "flight"), _uses(SERVE / "prefill.py", "client")
    assert {"expect", "wait_complete", "release"} <= md and "push" in prefill  # the scan sees them
    assert md <= transport_members(KVReceiver), md - transport_members(KVReceiver)
    assert prefill <= transport_members(KVSender), prefill - transport_members(KVSender)
