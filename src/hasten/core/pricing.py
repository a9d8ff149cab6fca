"""What a step costs: the step price that cost-aware sizing plans with.

A :class:`StepPrice` prices one generation's steps on this machine: a target forward over k
positions from the calibrated :class:`~hasten.core.cost.CostCurve` (rescaled by the verify times
measured as the generation runs: a longer context, a busier machine), a packed batch's forward
from its :class:`~hasten.core.cost.BatchCost` (every row's positions together, plus what the batch
path costs per row and per cached key a position attends over), and the drafter's proposal
(fixed seconds plus seconds per depth, fitted from the proposals seen). Padded batches and
llama.cpp's batches are priced from the one-row curve at every row's positions.

Where the curves come from is a :class:`StepCosts`: :class:`KnownCosts` holds given ones;
:mod:`hasten.engine.sizing` measures hasten's runtimes on this machine. Nothing here estimates
acceptance (:mod:`hasten.core.estimate`) or picks a depth (:mod:`hasten.core.sizing`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from .cost import BatchCost, CostCurve


class StepCosts:
    """Where a target's cost curves come from."""

    def curve_for(self, target: Any) -> CostCurve:
        """The target's one-row forward cost by block size."""
        raise ValueError("cost-aware sizing needs a cost curve: pass curve=")

    def batch_cost_for(self, target: Any) -> BatchCost | None:
        """What a packed batch costs beyond the one-row curve (None: priced by positions alone)."""
        return None


class KnownCosts(StepCosts):
    """Curves given by the caller (a recording's, vLLM's fitted one, a test's); with no curve,
    asking for one is an error."""

    def __init__(self, curve: CostCurve | None = None, batch_cost: BatchCost | None = None):
        self.curve, self.batch_cost = curve, batch_cost

    def curve_for(self, target: Any) -> CostCurve:
        return self.curve if self.curve is not None else super().curve_for(target)

    def batch_cost_for(self, target: Any) -> BatchCost | None:
        return self.batch_cost


@dataclass
class StepPrice:
    """One generation's step prices (the measured parts decay at ``decay`` per step)."""

    curve: CostCurve
    decay: float = 0.9
    drafting: "DraftingCost | None" = None  # what its proposals cost (None: a fresh one, decaying at ``decay``)
    scale: float | None = None  # observed verify seconds / calibrated forward seconds
    rows: int = 1  # sequences sharing the target's forward (a batch): its cost is split among them
    timed: bool = False  # a step's verify time has been seen (the first is not used: see observe_forward)
    # a batch whose rows are packed along one token dimension (no padding): a forward's cost is
    # batch_forward(rows, positions); else every row is padded to the widest block
    packed: bool = False
    batch_cost: BatchCost | None = None  # what a packed batch costs beyond the one-row curve (None: nothing)
    positions: int | None = None  # tokens the batch's last forward ran (every row's block)
    keys: int | None = None  # cached keys its positions attended over, in all

    def forward_seconds(self, positions: float) -> float:
        """This sequence's share of a forward in which every row runs ``positions``
        positions: a batch of B rows runs B times as many, so a row's extra draft tokens cost
        what B extra positions cost (on a CPU that is far from free; on a GPU, at small
        batches, nearly). The calibrated curve, rescaled by the measured verify times."""
        return self.curve(positions * self.rows) * (self.scale or 1.0) / self.rows

    def batch_forward(self, rows: int, positions: float, keys: float) -> float:
        """Calibrated seconds of a packed batch forward of ``rows`` rows running ``positions``
        tokens in all over ``keys`` cached keys in all (:class:`~hasten.core.cost.BatchCost`)."""
        return self.batch_pricer(rows)(positions, keys)

    def batch_pricer(self, rows: int) -> Callable[[float, float], float]:
        """:meth:`batch_forward` for ``rows`` rows, as a function of (positions, keys)."""
        if self.batch_cost is None:
            curve = self.curve
            return lambda positions, keys: curve(positions)
        return self.batch_cost.pricer(self.curve, rows)

    def batch_ceiling(self, rows: int, tokens: float, positions: float, keys: float, gained: float,
                      per_node: float, added: float, context: float, scale: float,
                      price: Callable[[float, float], float] | None = None) -> float:
        """An upper bound on the tokens per second of any plan that adds up to ``added`` draft
        positions, each attending over at least ``context`` cached keys, to a packed forward of
        ``rows`` rows committing ``tokens`` tokens from ``positions`` positions over ``keys``
        keys, gaining at most ``gained`` expected tokens in all and at most ``per_node`` per
        added position, its forward's seconds times ``scale`` (drafting time left out: it only
        lowers a rate). A plan adding n positions runs at most (tokens + min(per_node n,
        gained)) / forward(positions + n, keys + context n); that forward is piecewise linear in
        n, so the bound's largest value is where n is 0, ``added``, a knot of the curve, where
        the keys' cost starts, or where the gain stops growing. The curve is taken without its
        floor (:meth:`CostCurve.line`: lower, and straight between knots); infinite where
        that leaves no time at all. ``price``: :meth:`batch_pricer`'s for ``rows``, where the
        caller has it."""
        points = {0.0, float(added), *(size - positions for size in self.curve.sizes if 0 < size - positions < added)}
        if per_node > 0 and gained / per_node < added:
            points.add(gained / per_node)
        if self.batch_cost is not None and context != self.batch_cost.context:
            start = (self.batch_cost.context * positions - keys) / (context - self.batch_cost.context)
            if 0 < start < added:
                points.add(start)
        best, price = 0.0, price or self.batch_pricer(rows)
        for n in points:
            at = positions + n
            seconds = price(at, keys + context * n) - self.curve(at) + self.curve.line(at)
            if seconds <= 0:
                return math.inf
            best = max(best, (tokens + min(per_node * n, gained)) / (seconds * scale))
        return best

    def share(self, rows: int, positions: int | None = None, keys: int | None = None) -> None:
        """The next forward is shared by ``rows`` sequences; once their drafts are known,
        ``positions``: the tokens it runs, over ``keys`` cached keys in all."""
        self.rows = rows
        if positions is not None or rows == 1:
            self.positions, self.keys = positions, keys

    def observe_forward(self, block: int, verify_seconds: float) -> None:
        """A step whose own block ran ``block`` positions took ``verify_seconds`` to verify:
        the curve's scale follows. The first step's time is left out: on llama.cpp its block
        reuses the prompt's last position (computed by the prefill), so it runs one position
        short of the curve."""
        if verify_seconds > 0 and self.timed:
            if self.packed and self.rows > 1 and self.positions:
                predicted = self.batch_forward(self.rows, self.positions, self.keys or 0)  # the whole forward
            else:
                predicted = self.curve(block * self.rows)
            ratio = verify_seconds / predicted
            self.scale = ratio if self.scale is None else 0.8 * self.scale + 0.2 * ratio
        self.timed = True

    def __post_init__(self) -> None:
        if self.drafting is None:
            self.drafting = DraftingCost(self.decay)

    def add_drafting(self, depth: int, seconds: float, grade: int | None = None) -> None:
        """A proposal ``depth`` deep, graded ``grade``, took ``seconds``."""
        self.drafting.add(depth, seconds, grade)

    def start_from(self, pool: "DraftingCost") -> None:
        """Begin with what drafting cost in earlier generations (``pool``), worth one proposal per
        grade: the first proposals of a generation are then priced at what they cost before, not
        at nothing (its very first, which may catch up with the whole prompt, is not timed:
        core/sizing.py), and its own proposals soon outweigh the pool's."""
        self.drafting = pool.as_one_proposal(self.decay)

    def draft_cost(self, grade: int | None = None) -> tuple[float, float]:
        return self.drafting.cost(grade)

    def drafting_seconds(self, depth: int, grade: int | None = None) -> float:
        fixed, per_depth = self.draft_cost(grade)
        return fixed + per_depth * depth if depth else 0.0



@dataclass
class DraftingCost:
    """Drafting seconds ~ fixed + per_depth * depth, fitted by decayed least squares over (depth
    drafted, seconds) of the proposals seen: one generation's (:class:`StepPrice`), or a sizing
    rule's over all its generations (the same drafter on the same model). ``sums``: [weight, sum k,
    sum k^2, sum t, sum k t]; ``graded``: the same for each grade of evidence alone (a mixed drafter
    copies at some grades, in well under a millisecond, and runs a trained predictor at others)."""

    decay: float = 0.9
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    graded: dict[int | None, list[float]] = field(default_factory=dict)

    def add(self, depth: int, seconds: float, grade: int | None = None) -> None:
        """A proposal ``depth`` deep, graded ``grade``, took ``seconds``."""
        for sums in (self.sums, self.graded.setdefault(grade, [0.0] * 5)):
            for i, value in enumerate((1.0, depth, depth * depth, seconds, depth * seconds)):
                sums[i] = sums[i] * self.decay + value

    def cost(self, grade: int | None = None) -> tuple[float, float]:
        """(fixed seconds, seconds per depth) of one proposal graded ``grade`` (its own
        proposals' fit once it has one, else every grade's). Until depths have varied, all of
        it is charged per depth (a guess that errs towards shallower drafts, which then vary
        the depth and reveal the fixed part)."""
        sums = self.graded.get(grade)
        weight, k, kk, t, kt = sums if sums is not None and sums[0] > 0 else self.sums
        if weight <= 0:
            return 0.0, 0.0
        spread = weight * kk - k * k
        if spread > 1e-6 * weight * weight:
            slope = max((weight * kt - k * t) / spread, 0.0)
            fixed = max((t - slope * k) / weight, 0.0)
            return fixed, slope
        return 0.0, t / k

    def as_one_proposal(self, decay: float) -> "DraftingCost":
        """The same fits, each as sure as one proposal (weight one), decaying at ``decay``."""
        def one(sums: list[float]) -> list[float]:
            return [value / sums[0] for value in sums] if sums[0] > 0 else [0.0] * 5

        return DraftingCost(decay, one(self.sums), {grade: one(sums) for grade, sums in self.graded.items()})
