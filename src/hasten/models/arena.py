"""One KV store for many sequences: per layer one keys and one values tensor [kv_heads, capacity,
head_dim], in which each sequence owns one contiguous segment.

The batched decoder (``models/packed_batch.py``) writes every row's new keys of a layer with one
``index_copy_`` and attends over every row with one kernel call, each query row reading its own
segment (hasten's attention kernel takes a key list per query row, ``kernels/ops.py``), so nothing
is padded and no row sees another's entries. A segment is sized for what its sequence may hold
and moves to a larger one when a block would overflow it. Space is found first-fit among the free
segments; when none fits, the store grows while it stays within ``keep_bytes`` (room for finished
rows' entries kept for later, ``models/prefix_cache.py``), then kept segments give way (``reclaim``),
then the rows are moved to the front (compaction) if that frees enough, else the store grows. It
never shrinks: its size is the high-water mark of ``keep_bytes`` and what the rows held together,
so memory stays flat under a steady load.
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
                 keep_bytes: int = 0):
        self.shape, self.dtype, self.device = (kv_heads, head_dim), dtype, device
        # the store may grow to this many bytes before what is only kept (reclaim) gives way
        self.entry_bytes = 2 * layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
        self.keep_entries = keep_bytes // self.entry_bytes
        self.keys = [self._empty(0) for _ in range(layers)]  # per layer [kv_heads, capacity, head_dim]
        self.values = [self._empty(0) for _ in range(layers)]
        self.free: list[Segment] = []  # sorted by start, coalesced
        self.owned: dict[int, Segment] = {}  # by id of the owner (a row)
        self.reclaim = lambda: False  # frees some owner's segment that may go (kept prefixes), True if it did

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
        if start is None and self.capacity + size <= self.keep_entries:  # room to grow and keep what is kept
            self._grow(min(max(int(GROWTH * self.capacity), self.capacity + size), self.keep_entries))
            start = self._find(size)
        while start is None and self.reclaim():  # past that, what is only kept for later gives way first
            start = self._find(size)
        if start is None and sum(s.size for s in self.free) >= size:
            self._compact()
            start = self._find(size)
        if start is None:
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

    def _grow(self, capacity: int) -> None:
        """Room for ``capacity`` entries or more; entries keep their places."""
        old = self.capacity
        if capacity <= old:
            return
        for stores in (self.keys, self.values):
            for i, store in enumerate(stores):
                bigger = self._empty(capacity)
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
