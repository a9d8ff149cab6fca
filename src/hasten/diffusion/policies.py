"""Caching policies: when a unit (block or sub-module) is computed, and what stands in for it otherwise.

Each policy is a frozen settings dataclass validated on construction. ``policy.runtime(units,
num_steps)`` builds the per-trajectory decision object the hooks consult:

* ``should_compute(unit, step, branch) -> bool``: run the unit for real at this denoising step?
* ``observe(unit, step, branch, features)``: called after every real computation (with the cached
  features: the unit's residual for blocks, its output for sub-modules).
* ``order``: the Taylor order used to forecast skipped steps (0 = plain reuse).

Steps count denoising steps from 0; ``branch`` tells apart several model calls within one step
(classifier-free guidance run as two separate calls). The step distance used in the finite
differences is in steps, not in scheduler timesteps.

The feature store itself (``TaylorStore``) is shared by every policy: a policy decides *when*,
the store decides *what*.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .adapters import GRANULARITIES, Unit

Features = list  # list[Tensor | None]: a unit's output (or residual) flattened


def _check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


class TaylorStore:
    """The last fully computed features of one unit and their finite differences up to ``order``.

    ``derivatives[k]`` approximates the k-th derivative in the step index: after full computations
    at steps s_prev and s, derivatives[k] = (derivatives_new[k-1] - derivatives_old[k-1]) / (s - s_prev).
    Tensors are always fresh (never views of what the model holds), so in-place updates by the
    model cannot change them.
    """

    def __init__(self, order: int):
        self.order = order
        self.step: int | None = None
        self.derivatives: list[Features] = []

    def update(self, step: int, features: Features) -> None:
        new = [features]
        if self.step is not None and step > self.step:
            distance = step - self.step
            for k in range(min(self.order, len(self.derivatives))):
                new.append([None if f is None else (f - old) / distance
                            for f, old in zip(new[k], self.derivatives[k])])
        self.derivatives = new
        self.step = step

    def predict(self, step: int) -> Features:
        """Taylor polynomial in the step offset; order 0 returns a copy of the last features."""
        offset = step - self.step
        out = [None if f is None else f.clone() for f in self.derivatives[0]]
        for k in range(1, len(self.derivatives)):
            coef = offset**k / math.factorial(k)
            out = [None if o is None else o.add_(d, alpha=coef) for o, d in zip(out, self.derivatives[k])]
        return out


class TrajectoryDecisions:
    """Decisions for one trajectory. Subclasses override ``should_compute`` (and ``observe``)."""

    order = 0

    def should_compute(self, unit: Unit, step: int, branch: int) -> bool:
        return True

    def observe(self, unit: Unit, step: int, branch: int, features: Features) -> None:
        pass


class _EveryNth(TrajectoryDecisions):
    def __init__(self, interval: int, warmup: int, order: int):
        self.interval, self.warmup, self.order = interval, warmup, order

    def should_compute(self, unit: Unit, step: int, branch: int) -> bool:
        return step < self.warmup or (step - self.warmup) % self.interval == 0


@dataclass(frozen=True)
class TaylorSeer:
    """Full computation at the first ``warmup`` steps and every ``interval`` steps after them;
    in between, each unit's features are forecast by a Taylor polynomial of ``order`` built from
    finite differences of its last full computations (Liu et al., 2025, "From Reusing to
    Forecasting"). ``interval=1`` never forecasts."""

    interval: int = 4
    order: int = 2
    warmup: int = 3
    granularity: str = "block"

    def __post_init__(self):
        if self.interval < 1:
            raise ValueError(f"TaylorSeer: interval must be >= 1, got {self.interval}")
        if self.order < 0:
            raise ValueError(f"TaylorSeer: order must be >= 0, got {self.order}")
        if self.warmup < 0:
            raise ValueError(f"TaylorSeer: warmup must be >= 0, got {self.warmup}")
        _check_granularity(self.granularity)

    def runtime(self, units: list[Unit], num_steps: int | None) -> TrajectoryDecisions:
        return _EveryNth(self.interval, self.warmup, self.order)


@dataclass(frozen=True)
class FixedInterval:
    """Baseline: compute every ``interval`` steps, reuse the last computed features in between
    (for blocks, the last residual is added to the current input)."""

    interval: int = 2
    granularity: str = "block"

    def __post_init__(self):
        if self.interval < 1:
            raise ValueError(f"FixedInterval: interval must be >= 1, got {self.interval}")
        _check_granularity(self.granularity)

    def runtime(self, units: list[Unit], num_steps: int | None) -> TrajectoryDecisions:
        return _EveryNth(self.interval, 0, 0)


class _FirstBlock(TrajectoryDecisions):
    """The first unit always runs; the others run unless its residual barely moved this step."""

    def __init__(self, threshold: float, first: Unit):
        self.threshold, self.first = threshold, first
        self.reference: dict[int, Features] = {}  # branch -> first unit's residual at the last full step
        self.skip_step: dict[int, int] = {}  # branch -> step whose remaining units are skipped

    def should_compute(self, unit: Unit, step: int, branch: int) -> bool:
        return unit.index == self.first.index or self.skip_step.get(branch) != step

    def observe(self, unit: Unit, step: int, branch: int, features: Features) -> None:
        if unit.index != self.first.index:
            return
        reference = self.reference.get(branch)
        if reference is not None and relative_l1(features, reference) < self.threshold:
            self.skip_step[branch] = step
            return  # keep the reference of the last full step, so slow drift still adds up
        self.reference[branch] = features


def relative_l1(features: Features, reference: Features) -> float:
    """mean |a - b| / mean |b| over all tensors of a unit's features."""
    diff = sum(float((a - b).abs().sum()) for a, b in zip(features, reference) if a is not None)
    norm = sum(float(b.abs().sum()) for b in reference if b is not None)
    return diff / max(norm, 1e-12)


@dataclass(frozen=True)
class FirstBlockCache:
    """Baseline (as in ParaAttention's First Block Cache): always run the first block; when its
    residual differs from the one at the last full step by less than ``threshold`` (relative L1),
    skip every other block, each adding its last residual to its input. ``threshold=0`` never skips."""

    threshold: float = 0.1
    granularity: str = "block"

    def __post_init__(self):
        if not self.threshold >= 0:
            raise ValueError(f"FirstBlockCache: threshold must be >= 0, got {self.threshold}")
        if self.granularity != "block":
            raise ValueError("FirstBlockCache works on whole blocks: granularity must be 'block'")

    def runtime(self, units: list[Unit], num_steps: int | None) -> TrajectoryDecisions:
        return _FirstBlock(self.threshold, units[0])


@dataclass(frozen=True)
class NoCache:
    """Computes everything; the reference the others are measured against (hooks still installed)."""

    granularity: str = "block"

    def __post_init__(self):
        _check_granularity(self.granularity)

    def runtime(self, units: list[Unit], num_steps: int | None) -> TrajectoryDecisions:
        return TrajectoryDecisions()


def describe(policy) -> str:
    """Short label, e.g. ``TaylorSeer(interval=4, order=2, warmup=3, granularity=block)``."""
    from dataclasses import fields

    parts = [f"{f.name}={getattr(policy, f.name)}" for f in fields(policy) if f.name != "calibration"]
    return f"{type(policy).__name__}({', '.join(parts)})"
