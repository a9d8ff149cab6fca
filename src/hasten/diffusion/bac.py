"""Block-wise Adaptive Caching (BAC; Ji et al., 2025, "Block-wise Adaptive Caching for Accelerating
Diffusion Policy").

1. Calibration (offline, a few samples): run full compute and record, for every unit, the cosine
   similarity of its features between every pair of steps, S[unit][i, j], averaged over samples,
   and the mean absolute (L1) difference of its features between every pair of steps.
2. Adaptive Caching Scheduler: for each unit, choose ``updates`` steps (step 0 always among them) at
   which it is computed, so that the similarity between each skipped step and the update step whose
   features stand in for it, summed over all steps, is as large as possible (dynamic programming).
3. Bubbling Union, as the reference code (ky-ji/HAS, ``BACInfer``) does it: the ``union_top_k``
   units of any kind (5 in the reference's scripts) whose features change most between steps (the
   mean L1 difference over all pairs of steps) each also update at every step where a feed-forward
   unit of the same or a deeper block updates, so the feed-forward updates downstream of them start
   from fresh features instead of stale ones. As in the reference, the union runs only when at
   least two units are chosen. ``union="ffn_downstream"`` is hasten's earlier, narrower rule (not
   the reference's): feed-forward units only, ranked by 1 - cos under their own schedule, each
   given the steps of the feed-forward units strictly after it.

Calibration results are plain JSON (``Calibration.save`` / ``Calibration.load``); the schedule is a
pure function of the calibration and the settings, so it is not stored.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from .adapters import GRANULARITIES, Unit
from .policies import Features, TrajectoryDecisions


FORMAT = "hasten.bac.calibration/2"


@dataclass
class Calibration:
    unit_names: list[str]
    unit_kinds: list[str]
    unit_blocks: list[int]  # the block (layer) each unit belongs to, in forward order
    granularity: str
    similarity: np.ndarray  # [units, steps, steps], cosine similarity of a unit's features across steps
    change: np.ndarray  # [units, steps, steps], mean |a_i - a_j| over the elements of a unit's features

    @property
    def num_steps(self) -> int:
        return int(self.similarity.shape[1])

    def __repr__(self) -> str:
        return f"Calibration({len(self.unit_names)} {self.granularity} units, {self.num_steps} steps)"

    def save(self, path: str | Path) -> None:
        record = {"format": FORMAT, "granularity": self.granularity, "unit_names": self.unit_names,
                  "unit_kinds": self.unit_kinds, "unit_blocks": self.unit_blocks,
                  "similarity": np.round(self.similarity, 6).tolist(),
                  "change": [[[float(f"{x:.6g}") for x in row] for row in unit] for unit in self.change]}
        Path(path).write_text(json.dumps(record))

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        record = json.loads(Path(path).read_text())
        if record.get("format") == "hasten.bac.calibration/1":
            raise ValueError(f"{path}: a calibration of an earlier hasten, without the L1 change and the block "
                             "indices the Bubbling Union needs; calibrate again")
        if record.get("format") != FORMAT:
            raise ValueError(f"{path}: not a BAC calibration file")
        return cls(record["unit_names"], record["unit_kinds"], record["unit_blocks"], record["granularity"],
                   np.asarray(record["similarity"], dtype=np.float64), np.asarray(record["change"], dtype=np.float64))


class _Recorder(TrajectoryDecisions):
    """Computes everything and keeps each unit's features, one [rows, dim] tensor per step."""

    def __init__(self):
        self.features: dict[str, dict[int, list[torch.Tensor]]] = {}

    def observe(self, unit: Unit, step: int, branch: int, features: Features) -> None:
        rows = torch.cat([f.reshape(f.shape[0], -1).float() for f in features if f is not None], dim=1)
        self.features.setdefault(unit.name, {}).setdefault(step, []).append(rows)  # [batch, dim]


@dataclass(frozen=True)
class _Recording:
    granularity: str
    num_steps: int
    recorder: _Recorder = field(default_factory=_Recorder)

    def runtime(self, units, num_steps):
        return self.recorder


def calibrate(model: nn.Module, run: Callable[[], object], num_steps: int, *, granularity: str = "submodule",
              blocks: Sequence[nn.Module] | None = None, calls_per_step: int = 1) -> Calibration:
    """Record feature similarities while ``run()`` samples (full compute) ``num_steps`` steps per trajectory."""
    from .hooks import cached

    recording = _Recording(granularity, num_steps)
    with cached(model, recording, blocks=blocks, calls_per_step=calls_per_step) as session:
        with torch.no_grad():
            run()
        units = session.units
    similarity = np.zeros((len(units), num_steps, num_steps))
    change = np.zeros((len(units), num_steps, num_steps))
    for u, unit in enumerate(units):
        per_step = recording.recorder.features.get(unit.name, {})
        if sorted(per_step) != list(range(num_steps)):
            raise ValueError(f"calibration saw steps {sorted(per_step)[:5]}... of {unit.name}, expected 0..{num_steps - 1}")
        feats = torch.stack([torch.cat(per_step[t]) for t in range(num_steps)])  # [steps, rows, dim]
        similarity[u], change[u] = step_similarity(feats), step_change(feats)
    return Calibration([u.name for u in units], [u.kind for u in units], [u.block for u in units], granularity,
                       similarity, change)


def step_similarity(feats: torch.Tensor) -> np.ndarray:
    """[steps, rows, dim] -> [steps, steps]: the cosine of each row's features, averaged over rows."""
    feats = torch.nn.functional.normalize(feats, dim=-1)
    return (torch.einsum("ird,jrd->ij", feats, feats) / feats.shape[1]).double().numpy()


def step_change(feats: torch.Tensor) -> np.ndarray:
    """[steps, rows, dim] -> [steps, steps]: mean |a_i - a_j| over all elements (the reference's L1 error)."""
    flat = feats.flatten(1)  # [steps, rows * dim]
    return np.stack([(flat - flat[i]).abs().mean(1).double().numpy() for i in range(flat.shape[0])])


def adaptive_schedule(similarity: np.ndarray, updates: int) -> list[int]:
    """Update steps (step 0 first) maximising sum_t S[c(t), t], c(t) the last update at or before t."""
    steps = similarity.shape[0]
    if updates >= steps:
        return list(range(steps))
    # seg[i, j] = sum_{t=i}^{j-1} S[i, t]: score of computing at i and reusing until j (exclusive)
    cumulative = np.concatenate([np.zeros((steps, 1)), np.cumsum(similarity, axis=1)], axis=1)  # [steps, steps+1]
    seg = np.full((steps, steps + 1), -np.inf)
    for i in range(steps):
        seg[i, i + 1:] = cumulative[i, i + 1:] - cumulative[i, i]
    best = np.full((updates + 1, steps + 1), -np.inf)  # best[m, j]: m updates cover steps [0, j)
    parent = np.zeros((updates + 1, steps + 1), dtype=int)
    best[1] = seg[0]
    for m in range(2, updates + 1):
        for j in range(m, steps + 1):
            candidates = best[m - 1, :j] + seg[:j, j]  # previous update segment ends at i, next starts at i
            parent[m, j] = int(np.argmax(candidates))
            best[m, j] = candidates[parent[m, j]]
    chosen, j = [], steps
    for m in range(updates, 1, -1):
        j = parent[m, j]
        chosen.append(j)
    return [0] + sorted(int(step) for step in chosen)


def caching_error(similarity: np.ndarray, update_steps: Sequence[int]) -> float:
    """Mean over steps of 1 - S[c(t), t] under a schedule."""
    update_set, last, total = set(update_steps), 0, 0.0
    for t in range(similarity.shape[0]):
        last = t if t in update_set else last
        total += 1.0 - similarity[last, t]
    return total / similarity.shape[0]


def mean_change(change: np.ndarray) -> float:
    """Mean over all pairs of steps i < j of a unit's L1 change ([steps, steps])."""
    upper = np.triu_indices(change.shape[0], k=1)
    return float(change[upper].mean()) if upper[0].size else 0.0


def bubbling_union(schedules: list[list[int]], kinds: list[str], blocks: list[int], changes: list[float],
                   top_k: int) -> list[list[int]]:
    """The reference's Bubbling Union: the ``top_k`` units of any kind with the largest ``changes``
    (ties: the earlier unit) each also update wherever a feed-forward unit of the same or a deeper
    block does; nothing changes unless at least two units are chosen."""
    chosen = sorted(range(len(schedules)), key=lambda u: -changes[u])[:top_k]
    out = [set(s) for s in schedules]
    if len(chosen) >= 2:
        ffn = [u for u, kind in enumerate(kinds) if kind == "ff"]
        for u in chosen:
            for f in ffn:
                if blocks[f] >= blocks[u]:
                    out[u] |= set(schedules[f])
    return [sorted(s) for s in out]


def ffn_downstream_union(schedules: list[list[int]], kinds: list[str], errors: list[float],
                         top_k: int) -> list[list[int]]:
    """hasten's earlier, narrower rule (not the reference's): the top_k feed-forward units by
    caching error also update wherever a feed-forward unit after them does."""
    ffn = [u for u, kind in enumerate(kinds) if kind == "ff"]
    upstream = sorted(sorted(ffn, key=lambda u: -errors[u])[:top_k])
    out = [set(s) for s in schedules]
    for u in upstream:
        for downstream in ffn:
            if downstream > u:
                out[u] |= set(schedules[downstream])
    return [sorted(s) for s in out]


UNIONS = ("reference", "ffn_downstream")


class _Scheduled(TrajectoryDecisions):
    def __init__(self, schedules: dict[str, frozenset], num_steps: int):
        self.schedules, self.num_steps = schedules, num_steps

    def should_compute(self, unit: Unit, step: int, branch: int) -> bool:
        return step in self.schedules[unit.name] or step >= self.num_steps  # beyond the calibration: compute


@dataclass(frozen=True)
class BlockAdaptive:
    """BAC: per-unit update steps chosen offline from a calibration (a ``Calibration`` or the path
    of its JSON file). ``updates`` is the number of real computations per unit per trajectory
    before the Bubbling Union (which only adds steps). ``union_top_k``: how many units the union
    picks (the reference's ``num_bu_blocks``, 5 in its scripts; fewer than 2 turns the reference's
    union off, 0 turns either off). ``union``: ``"reference"`` (the reference code's rule) or
    ``"ffn_downstream"`` (hasten's earlier, narrower rule; its old default was ``union_top_k=2``)."""

    calibration: Calibration | str | Path
    updates: int = 10
    union_top_k: int = 5
    union: str = "reference"

    def __post_init__(self):
        if not isinstance(self.calibration, Calibration):
            object.__setattr__(self, "calibration", Calibration.load(self.calibration))
        if self.updates < 1:
            raise ValueError(f"BlockAdaptive: updates must be >= 1, got {self.updates}")
        if self.union_top_k < 0:
            raise ValueError(f"BlockAdaptive: union_top_k must be >= 0, got {self.union_top_k}")
        if self.union not in UNIONS:
            raise ValueError(f"BlockAdaptive: union must be one of {UNIONS}, got {self.union!r}")
        if self.calibration.granularity not in GRANULARITIES:
            raise ValueError(f"BlockAdaptive: calibration has unknown granularity {self.calibration.granularity!r}")

    @property
    def granularity(self) -> str:
        return self.calibration.granularity

    @property
    def num_steps(self) -> int:
        return self.calibration.num_steps

    def schedules(self) -> dict[str, list[int]]:
        cal = self.calibration
        acs = [adaptive_schedule(s, self.updates) for s in cal.similarity]
        if self.union == "reference":
            changes = [mean_change(c) for c in cal.change]
            final = bubbling_union(acs, cal.unit_kinds, cal.unit_blocks, changes, self.union_top_k)
        else:
            errors = [caching_error(s, steps) for s, steps in zip(cal.similarity, acs)]
            final = ffn_downstream_union(acs, cal.unit_kinds, errors, self.union_top_k)
        return dict(zip(cal.unit_names, final))

    def runtime(self, units: list[Unit], num_steps: int | None) -> TrajectoryDecisions:
        names = [u.name for u in units]
        if names != self.calibration.unit_names:
            raise ValueError("BlockAdaptive: the calibration was made on other units "
                             f"({self.calibration.unit_names[:3]}...) than this model's ({names[:3]}...)")
        schedules = {name: frozenset(steps) for name, steps in self.schedules().items()}
        return _Scheduled(schedules, self.calibration.num_steps)
