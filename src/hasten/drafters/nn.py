"""Small layers the trained drafters are built from.

* :class:`RMSNorm`, :func:`rotary` and :func:`rotate` (rotary positions), :func:`causal` (a causal mask);
* :class:`Block`: one pre-norm transformer layer over explicit keys and values, with any
  boolean mask, so a drafter can attend over its own cache and over a draft tree without
  any Hugging Face machinery;
* :class:`KVCache`: a drafter layer's keys and values, grown in place by capacity
  doubling (:class:`~hasten.core.state.GrowingBuffer`). Committed positions stay; a draft
  tree's keys and values are scratch written past the committed length and forgotten by
  not committing them, so no step re-joins the history with ``torch.cat``;
  :class:`CommittedRun` keeps such a layer up to date with the committed positions;
* :class:`ResidualBlock`: ``x + SiLU(Wx + b)`` (Medusa's heads, Chimera's heads).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..core.state import GrowingBuffer

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [batch, heads, n, head_dim]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


@lru_cache(maxsize=16)
def _inverse_frequencies(half: int, base: float, device: torch.device) -> torch.Tensor:
    return base ** (-torch.arange(half, device=device, dtype=torch.float32) / half)  # [half]


def rotary(positions: torch.Tensor, head_dim: int, dtype: torch.dtype, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, [batch, 1, n, head_dim / 2] each, for positions [batch, n]."""
    inverse = _inverse_frequencies(head_dim // 2, base, positions.device)  # made once, not per draft level
    angles = positions[:, None, :, None].float() * inverse  # [batch, 1, n, half]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x: [batch, heads, n, head_dim], angles from :func:`rotary`."""
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def causal(n: int, past: int = 0, device=None) -> torch.Tensor:
    """[1, n, past + n] bool: position i sees the past and the block up to itself."""
    block = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(n, past, dtype=torch.bool, device=device), block], 1)[None]


def heads_for(size: int) -> int:
    """Attention heads of width 32 (at least one)."""
    return max(1, size // 32)


def inner_size(hidden_size: int, ratio: float) -> int:
    """Width of a drafter's own layers: ``ratio`` x the target's, a multiple of 8 (at least 8)."""
    return max(8, int(hidden_size * ratio) // 8 * 8)


class KVCache:
    """One drafter layer's keys and values over positions ``0 .. end``.

    The first ``length`` positions are committed; rows past them (a draft tree's) are
    scratch, valid until something is written before them. :meth:`write` puts new rows at
    any ``start`` up to the end of what is valid and returns every row before their end,
    as views of one preallocated buffer (capacity doubles when full)."""

    def __init__(self, capacity: int = 64):
        # The buffers' own length marks the end of the valid rows, scratch included.
        self._keys = GrowingBuffer(dim=-2, capacity=capacity)
        self._values = GrowingBuffer(dim=-2, capacity=capacity)
        self.length = 0  # committed positions

    @property
    def end(self) -> int:
        """Positions holding valid keys and values (committed and scratch)."""
        return len(self._keys)

    def view(self) -> KV:
        """The committed keys and values, [batch, heads, length, head_dim] each (views)."""
        return self._keys.view(self.length), self._values.view(self.length)

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> KV:
        """keys, values: [batch, heads, n, head_dim] for positions start .. start + n ->
        all keys and values [batch, heads, start + n, head_dim] (views, no copy of the past).
        Rows at ``start`` and after are overwritten and forgotten."""
        if not self.length <= start <= self.end:
            raise ValueError(f"KVCache: write at {start} outside [{self.length}, {self.end}] (committed, valid)")
        self._keys.truncate(start)
        self._values.truncate(start)
        return self._keys.extend(keys), self._values.extend(values)

    def commit(self, length: int) -> None:
        """Positions before ``length`` are committed (they must be valid)."""
        if not 0 <= length <= self.end:
            raise ValueError(f"KVCache: cannot commit {length} positions of {self.end} valid ones")
        self.length = length

    def truncate(self, length: int) -> None:
        """Forget the positions from ``length`` on, committed ones included (a rollback)."""
        self.commit(length)
        self._keys.truncate(length)
        self._values.truncate(length)


class CommittedRun:
    """A drafter layer kept up to date with the committed positions, one generation's
    worth: its KV cache and its output at the newest committed position (where drafting
    continues from). Committed positions never change, so each is run once.

    ``shift``: committed positions minus cache entries, for a layer whose cache holds the
    prompt in fewer entries than positions (eagle_vlm's compressed images); positions past
    the prompt map one to one onto entries."""

    def __init__(self) -> None:
        self.cache = KVCache()
        self.newest: torch.Tensor | None = None  # [size] the layer's output at the newest position
        self.shift = 0

    def catch_up(self, count: int, layer: Callable[..., torch.Tensor], device) -> torch.Tensor | None:
        """Run ``layer(start, end, positions, visible, cache, entry)`` -> [1, end - start, size]
        over the positions [start, end) of the first ``count`` that it has not seen (their
        keys and values go into the cache from entry ``entry``; ``positions`` are the layer's
        own, entry indices), and return the output at position count - 1 (None while there is none)."""
        start = self.pending(count)
        if start is not None:
            entry = self.cache.length
            positions = torch.arange(entry, count - self.shift, device=device)[None]  # [1, new]
            out = layer(start, count, positions, causal(count - start, entry, device), self.cache, entry)  # [1, new, size]
            self.ran(count, out[0, -1])
        return self.newest

    def pending(self, count: int) -> int | None:
        """Where the first ``count`` committed positions the layer has not run start (their cache
        entries from ``cache.length``), after forgetting what the loop cut; None: it ran them all."""
        cache = self.cache
        if cache.length + self.shift > count:  # the loop cut inside the accepted path: redo the newest position
            cache.truncate(max(count - 1 - self.shift, 0))
            self.newest = None
        start = cache.length + self.shift
        return start if count > start else None

    def ran(self, count: int, newest: torch.Tensor) -> None:
        """The layer ran the :meth:`pending` positions up to ``count``; ``newest``: [size] its output at the last."""
        self.cache.commit(count - self.shift)
        self.newest = newest


class Block(nn.Module):
    """Pre-norm attention + MLP. The output projections start at zero, so an untrained
    block is the identity (training starts from "change nothing")."""

    def __init__(self, size: int, heads: int, mlp_size: int):
        super().__init__()
        if size % heads or (size // heads) % 2:
            raise ValueError(f"Block: size {size} must split into {heads} heads of even size")
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(size), RMSNorm(size)
        self.qkv = nn.Linear(size, 3 * size, bias=False)
        self.proj = nn.Linear(size, size, bias=False)
        self.up, self.down = nn.Linear(size, mlp_size), nn.Linear(mlp_size, size)
        for zero in (self.proj.weight, self.down.weight, self.down.bias):
            nn.init.zeros_(zero)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None,
                cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        """x: [batch, n, size] at ``positions`` [batch, n]. Without a cache the n positions
        attend to each other; with one, their keys and values are written into it at
        ``start`` and they attend to every cached position before them too. visible:
        [batch, n, start + n] bool (None: everything)."""
        batch, n, size = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, n, 3, self.heads, size // self.heads).permute(2, 0, 3, 1, 4)
        cos, sin = rotary(positions, size // self.heads, x.dtype)  # one set of angles for queries and keys
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # [batch, heads, n, head_dim]
        if cache is not None:
            k, v = cache.write(start, k, v)  # [batch, heads, start + n, head_dim]
        mask = None if visible is None else visible[:, None]  # [batch, 1, n, start + n]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [batch, heads, n, head_dim]
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, n, size))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class ResidualBlock(nn.Module):
    """x + SiLU(Wx + b), as in Medusa-1. Zero-initialised, so an untrained block is the
    identity (an untrained Medusa head repeats the target's own next-token guess)."""

    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))
