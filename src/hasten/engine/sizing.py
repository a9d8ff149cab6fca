"""Draft sizing for hasten's own loop: the cost-aware rule (:mod:`hasten.core.sizing`) priced with
the target's forward cost calibrated on this machine (:class:`CalibratedCosts`), and what the
``draft_size`` setting means.
"""
from __future__ import annotations

import weakref

from ..core.cost import BatchCost, CostCurve
from ..core.pricing import StepCosts
from ..core.sizing import FIRST_DEPTHS, CostAwareSize, FixedSize, SizingRule, SizingState
from .calibration import load_or_calibrate, load_or_calibrate_batch

__all__ = ["FIRST_DEPTHS", "CalibratedCosts", "CostAwareSize", "FixedSize", "SizingRule", "SizingState", "SIZES",
           "default_size", "SizingChoice", "sizing_rule"]


class CalibratedCosts(StepCosts):
    """The target's forward cost measured on this machine (:func:`load_or_calibrate`, cached on
    disk), read once per model: a server begins a generation per request."""

    def __init__(self):
        self._read: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {what: cost}

    def _once(self, model, what: str, measure):
        try:
            known = self._read.setdefault(model, {})
        except TypeError:  # a model object that cannot be weakly referenced or hashed: read each time
            return measure(model)
        if what not in known:
            known[what] = measure(model)
        return known[what]

    def curve_for(self, target) -> CostCurve:
        return self._once(target.model, "curve", load_or_calibrate)

    def batch_cost_for(self, target) -> BatchCost:
        return self._once(target.model, "batch", load_or_calibrate_batch)


SIZES = ("auto", "fixed")


def default_size(draft_size: str | SizingRule | None, sampled: bool, seeded: bool) -> str | SizingRule:
    """What an unset ``draft_size`` (None) means: ``"auto"``, except for sampling with a seed,
    where it is ``"fixed"``: auto's depths follow measured times, and a different depth draws
    different random numbers, so a seed would no longer give the same text on every run (the
    text's law is exact either way)."""
    if draft_size is not None:
        return draft_size
    return "fixed" if sampled and seeded else "auto"


class SizingChoice:
    """One ``draft_size`` setting, resolved for each request as :func:`default_size` says
    (unset: auto, but fixed for seeded sampling), so a seeded request gives the same text
    alone, in a batch or through the server. Requests resolved alike share one rule object,
    which plans for all of its rows of a batch at once."""

    def __init__(self, draft_size: str | SizingRule | None):
        sizing_rule(draft_size)  # a bad value fails here, not at the first request
        self.draft_size = draft_size
        self._rules: dict[object, SizingRule] = {}

    def for_request(self, sampled: bool, seeded: bool) -> SizingRule:
        chosen = default_size(self.draft_size, sampled, seeded)
        key = chosen if isinstance(chosen, str) else id(chosen)
        if key not in self._rules:
            self._rules[key] = sizing_rule(chosen)
        return self._rules[key]


def sizing_rule(draft_size: str | SizingRule | None) -> SizingRule:
    """``"auto"`` (:class:`CostAwareSize` on :class:`CalibratedCosts`; also None, unset),
    ``"fixed"`` (:class:`FixedSize`) or a rule object."""
    if isinstance(draft_size, SizingRule):
        return draft_size
    if draft_size in ("auto", None):
        return CostAwareSize(costs=CalibratedCosts())
    if draft_size == "fixed":
        return FixedSize()
    raise ValueError(f"draft_size must be 'auto' or 'fixed' (or a SizingRule), got {draft_size!r}")
