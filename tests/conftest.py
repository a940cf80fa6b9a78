"""Shared fixtures: small real checkpoints built once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Llama (GQA, untied embeddings) for engine tests."""
    from pdd_serve.checkpoints import make_model

    return make_model(tmp_path_factory.mktemp("ckpt") / "llama", arch="llama", layers=2, hidden=64, heads=4,
                      kv_heads=2, intermediate=172, vocab=512, max_pos=512, seed=0)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen2 (qkv bias, tied embeddings, another rope_theta)."""
    from pdd_serve.checkpoints import make_model

    return make_model(tmp_path_factory.mktemp("ckpt") / "qwen2", arch="qwen2", layers=2, hidden=64, heads=4,
                      kv_heads=1, intermediate=160, vocab=512, max_pos=512, seed=1, rope_theta=50000.0,
                      tie_embeddings=True)


from tests.cluster_fixture import ray_two_sites  # noqa: E402,F401  (session fixture: the local two-site cluster)
