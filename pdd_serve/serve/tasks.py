"""The asyncio tasks the orchestrator starts: each one's exception is always retrieved, and one
poll loop per live replica follows the replica set as it scales.

Separate so that the relay reader spawns its reads the way the orchestrator does, without
importing the orchestrator.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


def follow_replicas(tasks: dict[Hashable, asyncio.Task], live: list[Hashable], start: Callable[[Hashable], Any]) -> None:
    """One task per live replica: new replicas get one, removed ones' are cancelled."""
    for i in [i for i in tasks if i not in live]:
        tasks.pop(i).cancel()
    for i in live:
        if i not in tasks:
            tasks[i] = spawn(start(i))


def spawn(aw: Awaitable[T]) -> asyncio.Future[T]:
    """A task whose exception is always retrieved (a cancelled relay read may fail after the cut)."""
    fut = asyncio.ensure_future(aw)
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut
