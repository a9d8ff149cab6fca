"""Buffers that grow by doubling: committed state without O(T^2) copying.

A decode step appends a few rows (the accepted tokens' features, a drafter layer's keys
and values) and sometimes forgets a suffix. Re-joining the whole history with
``torch.cat`` every step copies O(T) per step, O(T^2) per generation. A
:class:`GrowingBuffer` keeps a preallocated tensor and a length: appending writes in
place (the capacity doubles when full, amortised O(1) per row) and rolling back moves
the length, as in gpt-fast's static cache.
"""
from __future__ import annotations

import torch


class GrowingBuffer:
    """Rows along dimension ``dim`` of a tensor allocated on the first write (its other
    dimensions, dtype and device come from that write)."""

    def __init__(self, dim: int = 0, capacity: int = 64):
        self.dim = dim
        self.capacity_hint = capacity
        self.storage: torch.Tensor | None = None
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def view(self, end: int | None = None) -> torch.Tensor | None:
        """Rows [0, end) (default: the committed length) as a view, no copy."""
        if self.storage is None:
            return None
        return self.storage.narrow(self.dim, 0, self.length if end is None else end)

    def write(self, start: int, rows: torch.Tensor) -> torch.Tensor:
        """Write ``rows`` at [start, start + n) without changing the committed length
        (scratch space past it, e.g. a draft tree's keys), and return rows [0, start + n)."""
        if start > self.length:
            raise ValueError(f"GrowingBuffer: write at {start} leaves a gap after length {self.length}")
        end = start + rows.shape[self.dim]
        self._reserve(end, rows, keep=start)
        self.storage.narrow(self.dim, start, end - start).copy_(rows)
        return self.storage.narrow(self.dim, 0, end)

    def extend(self, rows: torch.Tensor) -> torch.Tensor:
        """Append ``rows`` to the committed rows; returns all committed rows."""
        out = self.write(self.length, rows)
        self.length += rows.shape[self.dim]
        return out

    def truncate(self, length: int) -> None:
        """Forget rows at index >= length (a rollback: no copy)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"GrowingBuffer: cannot truncate {self.length} rows to {length}")
        self.length = length

    def _reserve(self, needed: int, like: torch.Tensor, keep: int) -> None:
        # rows [0, keep) stay valid (scratch written earlier past the length included)
        if self.storage is not None and needed <= self.storage.shape[self.dim]:
            return
        capacity = max(self.capacity_hint, needed)
        if self.storage is not None:
            capacity = max(capacity, 2 * self.storage.shape[self.dim])
        shape = list(like.shape)
        shape[self.dim] = capacity
        grown = torch.empty(shape, dtype=like.dtype, device=like.device)
        if self.storage is not None:
            grown.narrow(self.dim, 0, keep).copy_(self.storage.narrow(self.dim, 0, keep))
        self.storage = grown
