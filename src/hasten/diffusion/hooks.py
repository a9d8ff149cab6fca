"""Feature caching on an unmodified model, through hooks.

    session = enable_cache(model, TaylorSeer(interval=4, order=2))
    ...run the sampling loop as usual...
    stats = disable_cache(model)          # or: with cached(model, policy) as session: ...

How it acts on the model (nothing of the model's class or parameters changes):

* a forward pre-hook on the top-level module counts its calls; that count is the step counter;
* each unit (block, or attention / feed-forward module) gets its ``forward`` wrapped on the instance
  (as diffusers' own ``HookRegistry`` does): a plain ``register_forward_hook`` runs after the
  computation and so could never skip it. ``disable_cache`` restores the original ``forward``.

Steps. Call k of the top-level module is step ``k // calls_per_step``, branch ``k % calls_per_step``.
A sampling loop that runs classifier-free guidance as one batch (cond and uncond concatenated) calls
the model once per step: leave ``calls_per_step=1``. A loop that calls it twice per step (cond, then
uncond) passes ``calls_per_step=2``: each branch then keeps its own cache, so cond features never
stand in for uncond ones. With ``num_steps`` set, call ``num_steps * calls_per_step`` starts a new
trajectory (cache cleared); otherwise call ``session.reset()`` between trajectories (the ``cached``
context manager starts fresh). A loop that does not call the top-level module once per step drives
the counter itself with ``session.set_step(step, branch)``.

What is cached. For a whole block whose outputs line up with its inputs (hidden states in, hidden
states out) the cache holds the block's *residual* (output - input) and a skipped block returns its
current input plus the forecast residual, so a change of its input still flows through. Sub-modules
(attention, feed-forward) are residual branches already: their outputs are cached as they are.
Everything stored is a fresh tensor (clones, differences), never a view of what the model holds,
so a model that updates tensors in place cannot corrupt the cache; a unit that returns its own
input updated in place still does so when skipped.

A unit runs for real whenever the policy says so, whenever nothing is cached yet, and whenever the
shapes of its inputs differ from those of its last real call (a new batch size, say).
A policy that never reuses (``TaylorSeer(interval=1)``, ``FixedInterval(1)``, ``NoCache()``) gives
output bit-identical to the model without hooks: computed outputs are returned untouched.
"""
from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import nn

from .adapters import Unit, find_units
from .policies import TaylorStore, TrajectoryDecisions

_SESSIONS: "weakref.WeakKeyDictionary[nn.Module, CacheSession]" = weakref.WeakKeyDictionary()


@dataclass
class CacheStats:
    """Exact counts of real and skipped unit computations."""

    computed: Counter = field(default_factory=Counter)  # unit name -> real computations
    skipped: Counter = field(default_factory=Counter)  # unit name -> forecast / reused
    kinds: dict = field(default_factory=dict)  # unit name -> "block" | "attn" | "ff"

    @property
    def total(self) -> int:
        return sum(self.computed.values()) + sum(self.skipped.values())

    @property
    def skipped_fraction(self) -> float:
        return sum(self.skipped.values()) / self.total if self.total else 0.0

    def to_dict(self) -> dict:
        by_kind: dict = {}
        for name, kind in self.kinds.items():
            entry = by_kind.setdefault(kind, {"computed": 0, "skipped": 0})
            entry["computed"] += self.computed[name]
            entry["skipped"] += self.skipped[name]
        return {"computed": sum(self.computed.values()), "skipped": sum(self.skipped.values()),
                "skipped_fraction": self.skipped_fraction, "by_kind": by_kind}


@dataclass
class _UnitState:
    store: TaylorStore
    signature: tuple
    rebuild: object  # callable: list of tensors -> the unit's output structure
    residual: bool  # features are output - input
    aliased: list  # per output: the unit returned its own input tensor, updated in place


def _flatten(out):
    """Unit output -> (list of tensors or None, rebuild), or (None, None) when not cacheable."""
    if isinstance(out, torch.Tensor):
        return [out], lambda items: items[0]
    if type(out) in (tuple, list) and all(o is None or isinstance(o, torch.Tensor) for o in out):
        kind = type(out)
        return list(out), lambda items: kind(items)
    return None, None


def _signature(args: tuple, kwargs: dict) -> tuple:
    def sig(value):
        return (tuple(value.shape), value.dtype, value.device) if isinstance(value, torch.Tensor) else None

    return tuple(sig(a) for a in args) + tuple((k, sig(v)) for k, v in kwargs.items())


class CacheSession:
    """The live state of caching on one model: step counter, per-unit stores, statistics."""

    def __init__(self, model: nn.Module, policy, units: list[Unit], calls_per_step: int, num_steps: int | None):
        if calls_per_step < 1:
            raise ValueError(f"calls_per_step must be >= 1, got {calls_per_step}")
        if num_steps is not None and num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self.model, self.policy, self.units = model, policy, units
        self.calls_per_step, self.num_steps = calls_per_step, num_steps
        self.stats = CacheStats(kinds={u.name: u.kind for u in units})
        self._originals: dict[int, object] = {}
        self._handle = None
        self.reset()

    # ---- step counter
    def reset(self) -> None:
        """Start a new trajectory: forget cached features and restart the step count at 0."""
        self.runtime: TrajectoryDecisions = self.policy.runtime(self.units, self.num_steps)
        self._states: dict[tuple[int, int], _UnitState] = {}
        self._calls = 0
        self._manual = False
        self.step, self.branch = 0, 0

    def set_step(self, step: int, branch: int = 0) -> None:
        """Drive the counter explicitly (the top-level call count is ignored from now on)."""
        self._manual = True
        self.step, self.branch = step, branch

    def _on_model_call(self, module, args):
        if self._manual:
            return
        step, branch = divmod(self._calls, self.calls_per_step)
        if self.num_steps is not None and step >= self.num_steps:
            self.reset()
            step, branch = 0, 0
        self.step, self.branch = step, branch
        self._calls += 1

    # ---- install / remove
    def install(self) -> None:
        for unit in self.units:
            module = unit.module
            self._originals[unit.index] = module.__dict__.get("forward")  # an instance-level forward, if any
            module.forward = self._wrap(unit, module.forward)
        self._handle = self.model.register_forward_pre_hook(self._on_model_call)

    def remove(self) -> None:
        for unit in self.units:
            previous = self._originals.get(unit.index)
            if previous is None:
                unit.module.__dict__.pop("forward", None)
            else:
                unit.module.forward = previous
        if self._handle is not None:
            self._handle.remove()

    def _wrap(self, unit: Unit, original):
        def forward(*args, **kwargs):
            return self._call(unit, original, args, kwargs)

        forward.__wrapped__ = original
        return forward

    # ---- one unit call
    def _call(self, unit: Unit, original, args: tuple, kwargs: dict):
        step, branch = self.step, self.branch
        state = self._states.get((unit.index, branch))
        signature = _signature(args, kwargs)
        if (state is not None and state.signature == signature and state.store.step <= step
                and not self.runtime.should_compute(unit, step, branch)):
            self.stats.skipped[unit.name] += 1
            return self._forecast(unit, state, step, args, kwargs)

        raw_inputs = unit.inputs(args, kwargs) if unit.inputs is not None else None
        # cloned before the call: the unit may update its inputs in place
        inputs = [x.detach().clone() if isinstance(x, torch.Tensor) else None for x in raw_inputs or ()]
        out = original(*args, **kwargs)
        self.stats.computed[unit.name] += 1
        outputs, rebuild = _flatten(out)
        if outputs is None:
            return out  # not a tensor or a tuple of tensors: never cached
        residual = len(inputs) == len(outputs) and all(
            o is None or (x is not None and x.shape == o.shape) for o, x in zip(outputs, inputs))
        features = [None if o is None else (o.detach() - x if residual else o.detach().clone())
                    for o, x in zip(outputs, inputs if residual else outputs)]
        aliased = [residual and o is not None and o is x for o, x in zip(outputs, raw_inputs or ())]
        if state is None or state.signature != signature or state.store.step > step:
            state = _UnitState(TaylorStore(self.runtime.order), signature, rebuild, residual, aliased)
            self._states[(unit.index, branch)] = state
        state.store.update(step, features)
        self.runtime.observe(unit, step, branch, features)
        return out

    def _forecast(self, unit: Unit, state: _UnitState, step: int, args: tuple, kwargs: dict):
        predicted = state.store.predict(step)  # fresh tensors
        if not state.residual:
            return state.rebuild(predicted)
        outputs = []
        for residual, x, aliased in zip(predicted, unit.inputs(args, kwargs), state.aliased):
            if residual is None:
                outputs.append(None)
            elif aliased:
                outputs.append(x.add_(residual))  # as the unit itself would have done
            else:
                outputs.append(residual.add_(x))
        return state.rebuild(outputs)


def enable_cache(model: nn.Module, policy, *, blocks: Sequence[nn.Module] | None = None,
                 calls_per_step: int = 1, num_steps: int | None = None) -> CacheSession:
    """Install ``policy`` on ``model``'s blocks (found automatically unless ``blocks`` is given)."""
    if model in _SESSIONS:
        raise ValueError("caching is already enabled on this model; call disable_cache(model) first")
    if num_steps is None:
        num_steps = getattr(policy, "num_steps", None)
    units = find_units(model, policy.granularity, blocks)
    if len({id(u.module) for u in units}) != len(units):
        raise ValueError("the same module appears twice among the blocks; each can be cached once")
    session = CacheSession(model, policy, units, calls_per_step, num_steps)
    session.install()
    _SESSIONS[model] = session
    return session


def disable_cache(model: nn.Module) -> CacheStats:
    """Remove the hooks and restore every wrapped forward; returns the session's statistics."""
    session = _SESSIONS.pop(model, None)
    if session is None:
        raise ValueError("caching is not enabled on this model")
    session.remove()
    return session.stats


@contextlib.contextmanager
def cached(model: nn.Module, policy, **options) -> Iterator[CacheSession]:
    """``with cached(model, TaylorSeer()) as session: ...``; hooks removed on exit, even on error."""
    session = enable_cache(model, policy, **options)
    try:
        yield session
    finally:
        disable_cache(model)
