"""Block-granular radix prefix cache.

One node per full KV block, keyed by the block's chain hash (which already encodes the whole
prefix before it, so the trie is a dict plus parent/child links). Each node carries an opaque
`value` (the engine stores the pool block id) and a lock count: a node locked by a running
request is never evicted. Eviction is LRU over unlocked leaves until the byte budget holds.
The same class is Prefill's prefix cache and Main decode's decode-side cache (DRC).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from pdd_serve.engine.kv import ROOT_HASH, block_hashes


@dataclass
class _Node:
    hash: int
    parent: int
    value: int
    children: set[int] = field(default_factory=set)
    lock: int = 0
    last_access: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a token sequence."""

    hashes: list[int]  # chain hashes of the matched blocks, in order
    values: list[int]  # the values stored for them (pool block ids)
    num_tokens: int  # matched tokens = len(hashes) * block_size


@dataclass
class CacheStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class RadixCache:
    hit_unit = 1  # any number of whole blocks can hit
    def __init__(self, block_size: int, block_bytes: int, capacity_bytes: int,
                 on_evict: Callable[[int], None] | None = None) -> None:
        if block_size <= 0 or block_bytes <= 0 or capacity_bytes < 0:
            raise ValueError("RadixCache needs block_size > 0, block_bytes > 0, capacity_bytes >= 0")
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self.on_evict = on_evict
        self.nodes: dict[int, _Node] = {}
        self.root_children: set[int] = set()
        self.stats = CacheStats()
        self._clock = itertools.count(1)

    # ------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        return len(self.nodes)

    def refresh(self, wait: bool = True) -> None:
        """Always current (the engine thread changes it directly); `CacheView` asks every view."""

    @property
    def used_bytes(self) -> int:
        return len(self.nodes) * self.block_bytes

    def match(self, token_ids: list[int], record: bool = True) -> PrefixMatch:
        """Longest cached prefix of `token_ids`; touches LRU and (if `record`) the hit stats."""
        return self.match_hashes(block_hashes(token_ids, self.block_size), len(token_ids), record)

    def match_hashes(self, hashes: list[int], query_tokens: int | None = None,
                     record: bool = True) -> PrefixMatch:
        now = next(self._clock)
        matched: list[int] = []
        values: list[int] = []
        for h in hashes:
            node = self.nodes.get(h)
            if node is None:
                break
            node.last_access = now
            matched.append(h)
            values.append(node.value)
        n = len(matched) * self.block_size
        if record:
            self.stats.queries += 1
            self.stats.query_tokens += len(hashes) * self.block_size if query_tokens is None else query_tokens
            self.stats.hit_tokens += n
        return PrefixMatch(matched, values, n)

    def peek(self, hashes: list[int]) -> int:
        """Number of leading blocks cached; no side effects (the router's hit estimate)."""
        n = 0
        for h in hashes:
            if h not in self.nodes:
                break
            n += 1
        return n

    def evictable(self, keep: list[int] = ()) -> int:
        """Blocks eviction could free now: nodes neither locked nor above a locked node, not
        counting `keep` (a prefix about to be locked by a new request) and its ancestors.
        Reads a snapshot, so an admission check on the event loop may call it while the engine
        thread inserts (list() of a dict is one step under the GIL)."""
        nodes = dict(list(self.nodes.items()))
        pinned: set[int] = set()
        for h in [h for h, n in nodes.items() if n.lock > 0] + [h for h in keep if h in nodes]:
            while h in nodes and h not in pinned:
                pinned.add(h)
                h = nodes[h].parent
        return len(nodes) - len(pinned)

    # ------------------------------------------------------------ updates

    def insert(self, hashes: list[int], values: list[int]) -> list[bool]:
        """Insert a chain of blocks. Returns, per block, whether the cache adopted `values[i]`
        (False: the block was already cached and the caller keeps ownership of its value).
        A block whose parent is absent (evicted meanwhile) is not inserted.

        The budget is restored by evicting other blocks, never the chain just inserted: the caller
        takes its references to the adopted values after this returns, and evicting one before
        that would hand `on_evict` a value the cache never owned (the engine's pool would free a
        block a running request still holds). Over budget, the chain stays until the next
        eviction finds it unlocked."""
        assert len(hashes) == len(values)
        now = next(self._clock)
        adopted: list[bool] = []
        parent = ROOT_HASH
        for h, v in zip(hashes, values):
            node = self.nodes.get(h)
            if node is not None:
                node.last_access = now
                adopted.append(False)
            elif parent != ROOT_HASH and parent not in self.nodes:
                adopted.append(False)
            else:
                self.nodes[h] = _Node(h, parent, v, last_access=now)
                (self.root_children if parent == ROOT_HASH else self.nodes[parent].children).add(h)
                self.stats.inserted_blocks += 1
                adopted.append(True)
            parent = h
        self.evict_to_budget(keep=frozenset(hashes))
        return adopted

    def lock(self, hashes: list[int]) -> None:
        """Pin blocks in use by a request (a locked node and its ancestors are never evicted)."""
        for h in hashes:
            self.nodes[h].lock += 1

    def unlock(self, hashes: list[int]) -> None:
        for h in hashes:
            node = self.nodes[h]
            assert node.lock > 0, f"unlock of an unlocked block {h:#x}"
            node.lock -= 1

    def evict_to_budget(self, keep: frozenset[int] = frozenset()) -> int:
        over = self.used_bytes - self.capacity_bytes
        return self.evict(over, keep) if over > 0 else 0

    def evict(self, nbytes: int, keep: frozenset[int] = frozenset()) -> int:
        """Evict LRU unlocked leaves (not in `keep`) until `nbytes` are freed or nothing evictable
        is left."""
        heap = [(n.last_access, h) for h, n in self.nodes.items() if not n.children and n.lock == 0 and h not in keep]
        heapq.heapify(heap)
        freed = 0
        while freed < nbytes and heap:
            _, h = heapq.heappop(heap)
            node = self.nodes.pop(h)
            siblings = self.root_children if node.parent == ROOT_HASH else self.nodes[node.parent].children
            siblings.discard(h)
            if node.parent != ROOT_HASH:
                parent = self.nodes[node.parent]
                if not parent.children and parent.lock == 0 and parent.hash not in keep:
                    heapq.heappush(heap, (parent.last_access, parent.hash))
            if self.on_evict is not None:
                self.on_evict(node.value)
            self.stats.evicted_blocks += 1
            freed += self.block_bytes
        return freed

    def discard(self, h: int) -> int:
        """Drop block `h` and every block cached under it (a block found not to hold the KV it is
        named by: nothing may hit it again). Left in place while any of them is locked. Returns
        the blocks dropped."""
        if h not in self.nodes:
            return 0
        order, stack = [], [h]
        while stack:
            n = self.nodes[stack.pop()]
            if n.lock:
                return 0
            order.append(n)
            stack.extend(n.children)
        for n in reversed(order):  # children first: each is a leaf when it goes
            del self.nodes[n.hash]
            (self.root_children if n.parent == ROOT_HASH else self.nodes[n.parent].children).discard(n.hash)
            if self.on_evict is not None:
                self.on_evict(n.value)
            self.stats.evicted_blocks += 1
        return len(order)

    def clear(self) -> None:
        self.evict(self.used_bytes)
