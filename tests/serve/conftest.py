"""Fixtures for the real deployment classes without Ray: Serve's wrapper unwrapped
(`MainDecode.func_or_class(cfg)`), a tiny real engine, and MD's real Flight server on loopback.

A module whose tests build replicas asks for `no_cluster` once:
`pytestmark = pytest.mark.usefixtures("no_cluster")`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdd_serve.config import FlightConfig, ModelConfig, PDDConfig
from tests.serve.replicas import MAC_KEY, TOKEN


@pytest.fixture
def cfg(model_dir: Path) -> PDDConfig:
    return PDDConfig(model=ModelConfig(path=str(model_dir), block_size=16, kv_cache_bytes=4 << 20, max_batch=4),
                     flight=FlightConfig(token=TOKEN, mac_key=MAC_KEY))


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The deployments' constructors ask Ray which node they run on; there is no cluster here.
    Each constructor also sets torch's thread count for its replica: give the process its own back."""
    from pdd_serve.serve import main_decode, prefill, relay

    for mod in (main_decode, prefill, relay):
        monkeypatch.setattr(mod, "placement", lambda: {})
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def md(cfg: PDDConfig):  # noqa: ANN201 - the plain MainDecode class (Serve's deployment wraps it)
    from pdd_serve.serve.main_decode import MainDecode

    replica = MainDecode.func_or_class(cfg)
    yield replica
    replica.flight.close()
    replica.worker._exec.shutdown(wait=True)


@pytest.fixture
def sender(cfg: PDDConfig):  # noqa: ANN201 - the Prefill side's engine: makes the KV MD receives
    from pdd_serve.emulation.clock import Clock
    from pdd_serve.serve.common import load_engine

    return load_engine(cfg.model, enable_prefix_cache=False, clock=Clock(cfg.time_scale))


@pytest.fixture
def crcs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every KV CRC32 computed in this process: `bytes_checksum` is the one function behind
    KVBlocks.verify and the codec's check of a received batch (the codec holds its own name)."""
    from pdd_serve.engine import kv as kv_mod
    from pdd_serve.transport import codec

    real, calls = kv_mod.bytes_checksum, []

    def counting(buf):  # noqa: ANN001, ANN202
        calls.append(len(buf))  # list.append is atomic: Flight verifies on gRPC threads
        return real(buf)

    monkeypatch.setattr(kv_mod, "bytes_checksum", counting)
    monkeypatch.setattr(codec, "bytes_checksum", counting)
    return calls
