"""One KV store for many sequences: per layer one keys and one values tensor [kv_heads, capacity,
head_dim], in which each sequence owns one contiguous segment.

The batched decoder (``models/packed_batch.py``) writes every row's new keys of a layer with one
``index_copy_`` and attends over every row with one kernel call, each query row reading its own
segment (hasten's attention kernel takes a key list per query row, ``kernels/ops.py``), so nothing
is padded and no row sees another's entries. A segment is sized for what its sequence may hold
and moves to a larger one when a block would overflow it. Space is found first-fit among the free
segments; when none fits, segments only kept for later (finished rows' entries,
``models/prefix_cache.py``) give way (``reclaim``), then the rows are moved to the front
(compaction) if that frees enough, and only then does the store grow.

Two sizes. A **fixed** store (``capacity_bytes``, what ``hasten serve --kv-cache-mib`` sets) is
allocated and written once, up front, so a server's memory is what it is from its first request:
the scheduler admits a request only while every running row's segment fits in it
(``PackedBatch.kv_entries``), and kept entries live in whatever room the rows leave. A store of
no set size (a library batch) starts empty and grows to what its rows held together at most, its
high-water mark; it never shrinks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GROWTH = 1.5  # a full store grows to this many times its size, or more (amortised copies)


@dataclass
class Segment:
    start: int  # its first entry in the store
    size: int  # entries it may hold


class KVArena:
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity_bytes: int | None = None):
        self.shape, self.dtype, self.device = (kv_heads, head_dim), dtype, device
        self.entry_bytes = 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        self.keys = [self._empty(0) for _ in range(layers)]  # per layer [kv_heads, capacity, head_dim]
        self.values = [self._empty(0) for _ in range(layers)]
        self.free: list[Segment] = []  # sorted by start, coalesced
        self.owned: dict[int, Segment] = {}  # by id of the owner (a row)
        self.reclaim = lambda: False  # frees some owner's segment that may go (kept prefixes), True if it did
        # a fixed store's entries (None: it grows); past them it grows only if a row outgrows its
        # admitted segment with no room left, which admission makes rare (counted here)
        self.fixed_entries = None if capacity_bytes is None else capacity_bytes // self.entry_bytes
        self.overflows = 0
        if self.fixed_entries:
            self._grow(self.fixed_entries, zeroed=True)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def held_bytes(self) -> int:
        """Bytes the store has allocated (what the KV cache of the batch costs in memory)."""
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    def _empty(self, capacity: int) -> torch.Tensor:
        kv_heads, head_dim = self.shape
        return torch.empty(kv_heads, capacity, head_dim, dtype=self.dtype, device=self.device)

    # ---- segments ---------------------------------------------------------------------------------
    def allocate(self, owner: object, size: int, keep: int = 0) -> Segment:
        """A segment of ``size`` entries for ``owner``; if it had one, its first ``keep`` entries
        move into the new one and the old one is freed."""
        start = self._find(size)
        while start is None and self.reclaim():  # what is only kept for later gives way first
            start = self._find(size)
        if start is None and self.free_entries() >= size:
            self._compact()
            start = self._find(size)
        if start is None:
            self.overflows += self.fixed_entries is not None
            self._grow(max(int(GROWTH * self.capacity), self.capacity + size))
            start = self._find(size)
        self._take(start, size)
        segment = Segment(start, size)
        old = self.owned.get(id(owner))  # after a compaction: where it is now
        if old is not None:
            if keep:
                self._copy(torch.arange(old.start, old.start + keep), torch.arange(start, start + keep))
            self._release(old)
        self.owned[id(owner)] = segment
        return segment

    def free_entries(self) -> int:
        return sum(s.size for s in self.free)

    def release(self, owner: object) -> None:
        segment = self.owned.pop(id(owner), None)
        if segment is not None:
            self._release(segment)

    def segment(self, owner: object) -> Segment:
        return self.owned[id(owner)]

    def hand_over(self, owner: object, heir: object) -> None:
        """``owner``'s segment becomes ``heir``'s."""
        self.owned[id(heir)] = self.owned.pop(id(owner))

    def copy(self, source: object, target: object, count: int) -> None:
        """The first ``count`` entries of ``source``'s segment to the start of ``target``'s."""
        a, b = self.segment(source).start, self.segment(target).start
        self._copy(torch.arange(a, a + count), torch.arange(b, b + count))

    def _find(self, size: int) -> int | None:
        return next((s.start for s in self.free if s.size >= size), None)

    def _take(self, start: int, size: int) -> None:
        for i, s in enumerate(self.free):
            if s.start <= start and start + size <= s.start + s.size:
                pieces = [Segment(s.start, start - s.start), Segment(start + size, s.start + s.size - start - size)]
                self.free[i:i + 1] = [p for p in pieces if p.size > 0]
                return
        raise RuntimeError(f"entries {start}..{start + size} are not free")

    def _release(self, segment: Segment) -> None:
        self.free.append(Segment(segment.start, segment.size))
        self.free.sort(key=lambda s: s.start)
        merged: list[Segment] = []
        for s in self.free:
            if merged and merged[-1].start + merged[-1].size == s.start:
                merged[-1].size += s.size
            else:
                merged.append(Segment(s.start, s.size))
        self.free = merged

    def _grow(self, capacity: int, zeroed: bool = False) -> None:
        """Room for ``capacity`` entries or more; entries keep their places. ``zeroed``: its
        memory written now (a fixed store's pages are resident from the start)."""
        old = self.capacity
        if capacity <= old:
            return
        for stores in (self.keys, self.values):
            for i, store in enumerate(stores):
                bigger = self._empty(capacity)
                if zeroed:
                    bigger.zero_()
                bigger[:, :old].copy_(store)
                stores[i] = bigger
        self._release(Segment(old, capacity - old))

    def _compact(self) -> None:
        """Every owned segment moved to the front, in order: the free space becomes one segment."""
        at = 0
        for segment in sorted(self.owned.values(), key=lambda s: s.start):
            if segment.start != at:
                self._copy(torch.arange(segment.start, segment.start + segment.size),
                           torch.arange(at, at + segment.size))
                segment.start = at
            at += segment.size
        self.free = [Segment(at, self.capacity - at)] if at < self.capacity else []

    # ---- entries ---------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` [N, kv_heads, head_dim] at entries ``slots`` [N] of ``layer``."""
        self.keys[layer].index_copy_(1, slots, keys.transpose(0, 1))
        self.values[layer].index_copy_(1, slots, values.transpose(0, 1))

    def _copy(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Entries ``source`` [n] to ``target`` [n] in every layer (read before any is written)."""
        for stores in (self.keys, self.values):
            for store in stores:
                store.index_copy_(1, target, store.index_select(1, source))

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Entries moved within their segments (a tree's accepted path to its place), every
        row's at once."""
        if source.numel():
            self._copy(source, target)
