"""The engine's public API: `from pdd_serve.engine import Engine, SamplingParams`.

Names load on first use (PEP 562), so importing a light submodule such as
`pdd_serve.engine.radix_cache` (the policy and the simulator do) does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

EXPORTS: dict[str, str] = {
    "Engine": "engine",
    "Sequence": "engine",
    "SamplingParams": "sampling",
    "RequestError": "sampling",
    "EngineWorker": "worker",
    "StepOutput": "worker",
    "RadixCache": "radix_cache",
    "PrefixMatch": "radix_cache",
    "CacheStats": "radix_cache",
    "KVLayout": "kv",
    "KVBlocks": "kv",
    "KVError": "kv",
    "BlockPool": "kv",
    "OutOfBlocksError": "kv",
    "PoolFullError": "kv",
    "ModelArgs": "model",
    "CheckpointError": "model",
}

__all__ = [  # the keys of EXPORTS (a literal, so linters and IDEs see it)
    "BlockPool", "CacheStats", "CheckpointError", "Engine", "EngineWorker", "KVBlocks", "KVError", "KVLayout",
    "ModelArgs", "OutOfBlocksError", "PoolFullError", "PrefixMatch", "RadixCache", "RequestError",
    "SamplingParams", "Sequence", "StepOutput",
]

if TYPE_CHECKING:
    from pdd_serve.engine.engine import Engine, Sequence
    from pdd_serve.engine.kv import BlockPool, KVBlocks, KVError, KVLayout, OutOfBlocksError, PoolFullError
    from pdd_serve.engine.model import CheckpointError, ModelArgs
    from pdd_serve.engine.radix_cache import CacheStats, PrefixMatch, RadixCache
    from pdd_serve.engine.sampling import RequestError, SamplingParams
    from pdd_serve.engine.worker import EngineWorker, StepOutput


def __getattr__(name: str) -> Any:
    mod = EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
