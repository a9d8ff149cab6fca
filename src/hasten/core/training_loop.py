"""The one training loop every trainer in hasten runs: the drafter trainer, the zoo's recipes, the
diffusion recipes and the diffusion LM's.

A trainer brings what is its own: an optimizer over its parameters (:func:`~hasten.core.schedule.adamw`)
and a function that makes a batch and returns its loss. :class:`TrainingLoop` does the rest: steps until
a :class:`Budget` of steps or wall clock is spent, each at the learning rate a :class:`Schedule` gives,
clipped and applied by :func:`~hasten.core.schedule.optimizer_step`; a progress bar; and, through
:class:`Checkpoints`, held-out evaluations and checkpoints at a cadence. Its :class:`RunState` is what a
checkpoint keeps: a loop given back the state continues the run where it stopped.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field, fields
from typing import Callable

import torch
from tqdm import tqdm

from .schedule import optimizer_step, warmup_cosine

CALIBRATION_STEPS = 10  # steps timed to plan a step-paced run whose budget is time alone
METRIC_WINDOW = 50  # a run keeps (and reports) the training metrics of its last steps
BAR_INTERVAL_S = 5.0  # the progress bar redraws at most this often

# A batch's loss, or its loss and more metrics (floats) to keep.
LossFn = Callable[[], torch.Tensor | tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class Budget:
    """A run stops after ``steps`` optimizer steps or ``seconds`` of wall clock, whichever comes first."""
    steps: int | None = None
    seconds: float = math.inf

    def __post_init__(self) -> None:
        if self.steps is None and not math.isfinite(self.seconds):
            raise ValueError("a training budget needs steps or seconds")


@dataclass(frozen=True)
class Schedule:
    """Each step's learning rate as a share of every group's peak: a linear warmup over
    ``warmup_steps`` steps times a cosine from 1 down to ``final_ratio`` as the run progresses;
    and the gradient-norm ``clip`` of every update.

    Progress, with ``paced_by_time``, is the larger of the shares of the time budget and of the step
    budget spent (the steps a time budget buys are unknown in advance); without, it is the share of
    the steps alone, and a budget of time alone is planned in steps once the first steps are timed.
    With ``cosine_after_warmup`` the cosine starts where the warmup ends, else at step 0."""
    warmup_steps: int = 1
    final_ratio: float = 0.0
    paced_by_time: bool = True
    cosine_after_warmup: bool = False
    clip: float = 1.0

    def scale(self, step: int, planned_steps: int | None = None, time_share: float = 0.0) -> float:
        """The multiplier of the peak rates at ``step`` (0-based) of a run of ``planned_steps``
        (None: not known yet) that has spent ``time_share`` of its time budget."""
        return warmup_cosine(step, self.warmup_steps, self.progress(step, planned_steps, time_share), self.final_ratio)

    def progress(self, step: int, planned_steps: int | None, time_share: float) -> float:
        start = self.warmup_steps if self.cosine_after_warmup else 0
        step_share = (step - start) / max(1, planned_steps - start) if planned_steps else 0.0
        return max(step_share, time_share) if self.paced_by_time else step_share


@dataclass
class RunState:
    """How far a run has come: what a checkpoint keeps (``dataclasses.asdict``; :meth:`restored`)."""
    step: int = 0
    elapsed_s: float = 0.0
    planned_steps: int | None = None
    metrics: list[dict[str, float]] = field(default_factory=list)  # loss and metrics of the last steps
    evals: list[dict] = field(default_factory=list)  # {"step", "minutes", held-out metrics...} of each checkpoint

    @classmethod
    def restored(cls, saved: dict) -> RunState:
        """The state in a checkpoint's record (the keys a trainer saved of its own are left out)."""
        return cls(**{f.name: saved[f.name] for f in fields(cls) if f.name in saved})

    def recent_metrics(self) -> dict[str, float]:
        """Each training metric's mean over the last steps."""
        return mean_metrics(self.metrics)


@dataclass(frozen=True)
class Checkpoints:
    """A held-out evaluation, recorded in :attr:`RunState.evals` and logged, then ``save``: every
    ``every_steps`` steps or ``every_seconds`` of wall clock since the last, before the first step
    of a run that has none yet if ``at_start``, and after the last step unless that step had one."""
    evaluate: Callable[[RunState], dict]
    save: Callable[[RunState], None] = lambda state: None
    every_steps: int | None = None
    every_seconds: float | None = None
    at_start: bool = False

    def due(self, step: int, seconds_since_last: float) -> bool:
        return ((self.every_steps is not None and step % self.every_steps == 0)
                or (self.every_seconds is not None and seconds_since_last >= self.every_seconds))


@dataclass
class TrainingLoop:
    """Steps of ``loss`` at ``schedule``'s rates until ``budget`` is spent. ``after_step`` runs after
    every update (an exponential moving average of the weights, say); ``window``: how many steps'
    metrics the state keeps; ``clock``: seconds (a test's own clock times the budget)."""
    optimizer: torch.optim.Optimizer
    loss: LossFn
    schedule: Schedule
    budget: Budget
    checkpoints: Checkpoints | None = None
    after_step: Callable[[RunState], None] | None = None
    label: str = "train"
    show_progress: bool = True
    window: int = METRIC_WINDOW
    clock: Callable[[], float] = time.monotonic
    _started: float = field(default=0.0, init=False, repr=False)  # the clock's reading at elapsed 0
    _last_checkpoint: float = field(default=0.0, init=False, repr=False)

    def run(self, state: RunState | None = None) -> RunState:
        """Train on from ``state`` (a new run without one) until the budget is spent; returns the state."""
        state = state or RunState()
        state.planned_steps = self.budget.steps or state.planned_steps
        self._started = self.clock() - state.elapsed_s  # a resumed run continues the same budget
        if self.checkpoints and self.checkpoints.at_start and not state.evals:
            self._checkpoint(state)
        self._last_checkpoint = self.clock()
        bar = ProgressBar(self, state)
        while self._continues(state, elapsed := self._elapsed()):
            self._step(state, elapsed)
            bar.advance(state, self._elapsed())
            if self.checkpoints and self.checkpoints.due(state.step, self.clock() - self._last_checkpoint):
                self._checkpoint(state)
        bar.close()
        state.elapsed_s = self._elapsed()
        if self.checkpoints and (not state.evals or state.evals[-1]["step"] != state.step):
            self._checkpoint(state)
        return state

    def _elapsed(self) -> float:
        return self.clock() - self._started

    def _continues(self, state: RunState, elapsed: float) -> bool:
        return elapsed < self.budget.seconds and (state.planned_steps is None or state.step < state.planned_steps)

    def _step(self, state: RunState, elapsed: float) -> None:
        scale = self.schedule.scale(state.step, state.planned_steps, elapsed / self.budget.seconds)
        with torch.enable_grad():  # callers (the CLI, tests) may have turned autograd off
            loss, metrics = _loss_and_metrics(self.loss())
            if loss.requires_grad:  # a batch can hold nothing to learn (a drafter's rows that stop at once)
                optimizer_step(self.optimizer, loss, scale, self.schedule.clip)
        state.step += 1
        state.metrics = (state.metrics + [{"loss": loss.item(), **metrics}])[-self.window:]
        if self.after_step:
            self.after_step(state)
        if state.planned_steps is None and not self.schedule.paced_by_time:
            self._plan(state)

    def _plan(self, state: RunState) -> None:
        """A step-paced run on a time budget: once the first steps are timed, the steps the budget buys.
        (They are inside the warmup, whose rates do not depend on the plan.)"""
        if state.step >= min(CALIBRATION_STEPS, self.schedule.warmup_steps):
            seconds_per_step = self._elapsed() / state.step
            state.planned_steps = max(state.step, int(self.budget.seconds / seconds_per_step))

    def _checkpoint(self, state: RunState) -> None:
        state.elapsed_s = self._elapsed()
        held_out = self.checkpoints.evaluate(state)
        state.evals.append({"step": state.step, "minutes": round(state.elapsed_s / 60, 2), **held_out})
        tqdm.write(f"{self.label}: step {state.step}, " + ", ".join(f"{k} {_shown(v)}" for k, v in held_out.items()),
                   file=sys.stderr)
        self.checkpoints.save(state)
        self._last_checkpoint = self.clock()


class ProgressBar:
    """A tqdm bar over what paces the run: its seconds when paced by a time budget, else its steps."""

    def __init__(self, loop: TrainingLoop, state: RunState):
        self.in_seconds = loop.schedule.paced_by_time and math.isfinite(loop.budget.seconds)
        total, initial = ((round(loop.budget.seconds), round(state.elapsed_s)) if self.in_seconds
                          else (state.planned_steps, state.step))
        self.bar = tqdm(total=total, initial=initial, unit="s" if self.in_seconds else "step", desc=loop.label,
                        disable=not loop.show_progress, file=sys.stderr, mininterval=BAR_INTERVAL_S)

    def advance(self, state: RunState, elapsed: float) -> None:
        self.bar.set_postfix(step=state.step, loss=f"{state.recent_metrics()['loss']:.3f}", refresh=False)
        if self.in_seconds:
            self.bar.update(round(elapsed) - self.bar.n)
        else:
            self.bar.total = state.planned_steps
            self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def mean_metrics(records: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the records that hold it."""
    keys = {k for r in records for k in r}
    return {k: sum(r[k] for r in records if k in r) / sum(k in r for r in records) for k in sorted(keys)}


def _loss_and_metrics(outcome) -> tuple[torch.Tensor, dict[str, float]]:
    return outcome if isinstance(outcome, tuple) else (outcome, {})


def _shown(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
