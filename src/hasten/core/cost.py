"""A target forward's cost by block size: what cost-aware draft sizing prices a step with.

Measured per machine by :mod:`hasten.engine.calibration` (hasten's own runtimes) or fitted from
an engine's step times (:mod:`hasten.vllm`); nothing here touches a model.
"""
from __future__ import annotations

import functools
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class CostCurve:
    """Seconds of one target forward over ``sizes[i]`` positions (after a cached context)."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds) or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"CostCurve needs increasing sizes, one time each: {self.sizes}, {self.seconds}")

    def __call__(self, positions: float | np.ndarray) -> float | np.ndarray:
        """Linear interpolation; linear extrapolation from the last two points past the end (at
        each of an array's sizes: the same arithmetic, element by element)."""
        if isinstance(positions, np.ndarray):
            return self.interpolate_many(positions)
        return _interpolate(self, positions)  # memoised: the sizing rule prices the same sizes every step

    def interpolate_many(self, positions: np.ndarray) -> np.ndarray:
        """:meth:`interpolate` at every element of ``positions``, bit for bit."""
        sizes, seconds = np.array(self.sizes, dtype=float), np.array(self.seconds)
        if len(sizes) == 1:
            return np.full(positions.shape, seconds[0])
        i = np.clip(np.searchsorted(sizes, positions, side="left"), 1, len(sizes) - 1)
        x0, x1, y0, y1 = sizes[i - 1], sizes[i], seconds[i - 1], seconds[i]
        line = np.where(positions <= sizes[0], seconds[0], y0 + (y1 - y0) * (positions - x0) / (x1 - x0))
        return np.maximum(line, seconds[0])

    def interpolate(self, positions: float) -> float:
        return max(self.line(positions), self.seconds[0])

    def line(self, positions: float) -> float:
        """The measured points joined by straight lines (flat before the first, extended past
        the last), without :meth:`interpolate`'s floor at the first point's time: a noisy curve
        can dip below it."""
        sizes, seconds = self.sizes, self.seconds
        if len(sizes) == 1 or positions <= sizes[0]:
            return seconds[0]
        i = min(max(bisect_left(sizes, positions), 1), len(sizes) - 1)
        x0, x1, y0, y1 = sizes[i - 1], sizes[i], seconds[i - 1], seconds[i]
        return y0 + (y1 - y0) * (positions - x0) / (x1 - x0)

    @classmethod
    def flat(cls) -> "CostCurve":
        return cls((1,), (1.0,))


@dataclass(frozen=True)
class BatchCost:
    """What a packed batch forward costs beyond the one-row curve (measured on the batch path):

    * ``rows``: seconds of a step of r rows of one token each, ``context`` cached tokens each
      (running r separate rows costs more than one row running r tokens: each row's own
      attention, its bookkeeping);
    * ``per_key``: seconds per (position, cached key) pair past ``context``: a position on a
      row with a long cache attends over all of it."""

    rows: CostCurve
    per_key: float
    context: int

    def forward(self, curve: CostCurve, rows: int, positions: float, keys: float) -> float:
        """Seconds of a forward of ``rows`` rows running ``positions`` tokens in all, which
        attend over ``keys`` cached keys in all (each position over its row's cache)."""
        return self.pricer(curve, rows)(positions, keys)

    def pricer(self, curve: CostCurve, rows: int) -> Callable[[float, float], float]:
        """:meth:`forward` for ``rows`` rows as a function of (positions, keys), with what
        depends on the rows alone computed once (a batch's plan prices hundreds of candidates)."""
        extra_rows = max(self.rows(rows) - curve(rows), 0.0)
        per_key, context = self.per_key, self.context

        def seconds(positions: float | np.ndarray, keys: float | np.ndarray) -> float | np.ndarray:
            beyond = keys - context * positions
            beyond = np.maximum(beyond, 0.0) if isinstance(beyond, np.ndarray) else max(beyond, 0.0)
            return curve(positions) + extra_rows + per_key * beyond

        return seconds


@functools.lru_cache(maxsize=8192)
def _interpolate(curve: CostCurve, positions: float) -> float:
    return curve.interpolate(positions)
