"""A generic trainer for a small module on top of a frozen target.

A trained drafter (Medusa heads, an EAGLE-style layer, ...) plugs in by giving its drafter
class a ``Training`` attribute: a :class:`~hasten.drafters.trainable.Trainable` subclass that builds the module for
a target, computes its loss on a :class:`~hasten.drafters.trainable.Batch` of self-distilled data, and saves it in
the layout the drafter loads. ``hasten train NAME`` finds it through the drafter
registry and turns its ``Options`` dataclass into flags; nothing here knows a method.

The trainer owns everything else: AdamW, and the run through hasten's one training loop
(:mod:`hasten.core.training_loop`: linear warmup and cosine decay over the planned steps, clipping,
a progress bar) with held-out evaluation and checkpoints (module weights, AdamW moments, the
run's state, the batch sampler's RNG, in one safetensors file) from which ``resume=True``
continues bit for bit.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, safe_open, save_file
from torch import nn

from ..core.schedule import adamw
from ..core.training_loop import Budget, Checkpoints, RunState, Schedule, TrainingLoop, mean_metrics
from ..core.settings import Settings, option
from ..drafters.trainable import Trainable  # the protocol, re-exported

CHECKPOINT = "checkpoint.safetensors"
FINAL_LR_RATIO = 0.1  # cosine decays to this fraction of the peak learning rate
DEFAULT_STEPS = 1000  # when neither steps nor minutes are given
CLOCKS = {"wall": time.monotonic, "cpu": time.process_time}  # what a budget of minutes counts


@dataclass(frozen=True)
class TrainSettings(Settings):
    steps: int | None = option(None, f"optimiser steps; unset: as many as --minutes allows, else {DEFAULT_STEPS}")
    minutes: float | None = option(None, "budget for training (distillation excluded), in minutes of "
                                         "--budget-clock; stops the run early")
    batch_size: int = option(8, "sequences per step")
    lr: float = option(1e-3, "peak learning rate of AdamW (linear warmup, then cosine decay to 10%)")
    warmup_steps: int = option(50, "steps of linear warmup; 1 means none")
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "clip the gradient norm to this")
    checkpoint_every: int = option(100, "steps between checkpoints (for --resume) and held-out evaluations")
    checkpoint_minutes: float | None = option(None, "also checkpoint and evaluate after this many minutes since the last")
    budget_clock: str = option("wall", "what --minutes and --checkpoint-minutes count: wall (the clock) or cpu (this "
                                       "process's CPU time: on a shared machine, pauses and other jobs' load excluded)")
    seed: int = option(0, "seeds the prompt choice, the initialisation and the batch order")
    init_from: str | None = option(None, "start from this trained module's directory (its config and weights, e.g. "
                                         "an earlier run's output), not from scratch: go on training it on more data")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.steps is None and self.minutes is None:
            object.__setattr__(self, "steps", DEFAULT_STEPS)
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be > 0, got {self.minutes}")
        for name in ("batch_size", "warmup_steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.budget_clock not in CLOCKS:
            raise ValueError(f"budget_clock must be one of {sorted(CLOCKS)}, got {self.budget_clock!r}")
        if self.checkpoint_minutes is not None and self.checkpoint_minutes <= 0:
            raise ValueError(f"checkpoint_minutes must be > 0, got {self.checkpoint_minutes}")

    @property
    def lr_schedule(self) -> Schedule:
        """Linear warmup, then cosine decay to FINAL_LR_RATIO of the peak over the planned steps after
        the warmup (a --minutes-only run plans them while still warming up)."""
        return Schedule(self.warmup_steps, FINAL_LR_RATIO, paced_by_time=False, cosine_after_warmup=True,
                        clip=self.grad_clip)

    @property
    def schedule(self) -> dict:
        """The settings a resumed run must share with the checkpoint to continue bit for bit."""
        run_only = ("minutes", "checkpoint_every", "checkpoint_minutes", "budget_clock")
        return {k: v for k, v in asdict(self).items() if k not in run_only}


@dataclass
class TrainResult:
    module: nn.Module
    report: dict  # steps, minutes, train and eval metrics, settings


# More held-out measurements at each checkpoint: (module, {"step", "tokens", "minutes", "eval": the
# held-out metrics}) -> metrics to record.
ExtraEvaluation = Callable[[nn.Module, dict], dict]


def train(trainable: Trainable, data, settings: TrainSettings, work_dir: Path, *, resume: bool = False,
          device: str = "cpu", progress: bool = True, extra_evaluation: ExtraEvaluation | None = None) -> TrainResult:
    """Train ``trainable``'s module on ``data`` (a :class:`hasten.training.distill.Distilled`, or
    any data with its ``split`` and ``batch``), checkpointing under ``work_dir``; with ``resume``
    continue from the checkpoint there. ``extra_evaluation`` adds its metrics to every
    checkpoint's held-out record. The report counts the label tokens trained on (``tokens``)."""
    target = trainable.target.requires_grad_(False).eval()
    trainable.prepare(data)
    torch.manual_seed(settings.seed)
    module = trainable.build()
    if settings.init_from is not None:
        module = started_from(module, Path(settings.init_from), target)
    module = module.to(device).train()
    optimizer = adamw([{"params": [p for p in module.parameters() if p.requires_grad], "lr": settings.lr,
                        "weight_decay": settings.weight_decay}])
    sampler = torch.Generator().manual_seed(settings.seed)  # which rows form each batch
    train_rows, eval_rows = data.split()
    checkpoint = Path(work_dir) / CHECKPOINT
    seen = {"tokens": 0}  # label tokens of the batches trained on
    state = None
    if resume and checkpoint.is_file():
        state, seen["tokens"] = resumed(checkpoint, module, optimizer, sampler, settings)

    def batch_loss() -> tuple[torch.Tensor, dict]:
        rows = train_rows[torch.randint(len(train_rows), (settings.batch_size,), generator=sampler)]
        batch = data.batch(rows, target, device)
        seen["tokens"] += int(batch.label_mask.sum())
        return trainable.loss(module, batch)

    def held_out(state: RunState) -> dict:
        evaluated = evaluate(trainable, module, data, eval_rows, settings.batch_size, device)
        metrics = {"loss": evaluated.get("loss"), "tokens": seen["tokens"]}
        if extra_evaluation is not None:
            metrics.update(extra_evaluation(module, {"step": state.step, "tokens": seen["tokens"], "eval": evaluated,
                                                     "minutes": round(state.elapsed_s / 60, 2)}))
            module.train()
        return metrics

    def save(state: RunState) -> None:
        save_checkpoint(checkpoint, module, optimizer, sampler,
                        {**asdict(state), "schedule": settings.schedule, "tokens": seen["tokens"]})

    budget = Budget(settings.steps, settings.minutes * 60 if settings.minutes else math.inf)
    every_seconds = settings.checkpoint_minutes * 60 if settings.checkpoint_minutes else None
    checkpoints = Checkpoints(held_out, save, every_steps=settings.checkpoint_every, every_seconds=every_seconds)
    state = TrainingLoop(optimizer, batch_loss, settings.lr_schedule, budget, show_progress=progress,
                         checkpoints=checkpoints, clock=CLOCKS[settings.budget_clock]).run(state)
    module.eval()
    report = {
        "steps": state.step,
        "planned_steps": state.planned_steps,
        "minutes": round(state.elapsed_s / 60, 2),
        "tokens": seen["tokens"],
        "train": state.recent_metrics(),  # over the last steps (core.training_loop.METRIC_WINDOW)
        "eval": evaluate(trainable, module, data, eval_rows, settings.batch_size, device),
        "evals": state.evals,
        "settings": asdict(settings),
    }
    return TrainResult(module, report)


def started_from(built: nn.Module, directory: Path, target) -> nn.Module:
    """The trained module in ``directory``, in float32, in place of the freshly built ``built``:
    the same class, fitting ``target`` (``TrainedModule.check_fits``), its own settings kept
    (EAGLE-3's draft vocabulary included, which the loss reads from the module); ValueError when
    it cannot stand in."""
    load = getattr(type(built), "load", None)
    if load is None:
        raise ValueError(f"init_from: a {type(built).__name__} cannot be loaded from a directory")
    try:
        module = load(directory)  # float32
    except FileNotFoundError as err:
        raise ValueError(f"init_from {directory}: no trained {type(built).__name__} there ({err})") from None
    module.check_fits(target)
    return module


def resumed(checkpoint: Path, module: nn.Module, optimizer, sampler: torch.Generator,
            settings: TrainSettings) -> tuple[RunState, int]:
    """The run saved in ``checkpoint`` and the label tokens it had trained on, its weights, moments
    and sampler loaded; refused if other settings made it."""
    saved = load_checkpoint(checkpoint, module, optimizer, sampler)
    if saved["schedule"] != settings.schedule:
        raise ValueError(f"{checkpoint} was made with other settings ({saved['schedule']}); drop --resume to start over")
    return RunState.restored(saved), int(saved.get("tokens", 0))


@torch.no_grad()
def evaluate(trainable: Trainable, module: nn.Module, data, rows: torch.Tensor, batch_size: int, device: str) -> dict:
    """Mean loss and metrics over held-out rows."""
    training = module.training
    module.eval()
    results = []
    for chunk in rows.split(batch_size) if len(rows) else ():
        loss, metrics = trainable.loss(module, data.batch(chunk, trainable.target, device))
        results.append({"loss": float(loss), **metrics})
    module.train(training)
    return mean_metrics(results)


# ---- checkpoints -----------------------------------------------------------------------------
def save_checkpoint(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer,
                    sampler: torch.Generator, state: dict) -> None:
    """One safetensors file; written under a temporary name first so an interrupted save
    never clobbers the previous checkpoint."""
    tensors = {f"module.{name}": t.detach().contiguous().cpu() for name, t in module.state_dict().items()}
    for index, moments in optimizer.state_dict()["state"].items():
        tensors.update({f"optimizer.{index}.{key}": t.contiguous().cpu() for key, t in moments.items()})
    tensors["sampler"] = sampler.get_state()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    save_file(tensors, temporary, metadata={"state": json.dumps(state)})
    os.replace(temporary, path)


def load_checkpoint(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer, sampler: torch.Generator) -> dict:
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        state = json.loads(f.metadata()["state"])
    module.load_state_dict({k[len("module."):]: t for k, t in tensors.items() if k.startswith("module.")})
    moments: dict[int, dict] = {}
    for key, t in tensors.items():
        if key.startswith("optimizer."):
            _, index, name = key.split(".", 2)
            moments.setdefault(int(index), {})[name] = t
    optimizer.load_state_dict({**optimizer.state_dict(), "state": moments})
    sampler.set_state(tensors["sampler"])
    return state
