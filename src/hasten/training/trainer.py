"""A generic trainer for a small module on top of a frozen target.

A trained drafter (Medusa heads, an EAGLE-style layer, ...) plugs in by giving its drafter
class a ``Training`` attribute: a :class:`~hasten.drafters.trainable.Trainable` subclass that builds the module for
a target, computes its loss on a :class:`Batch` of self-distilled data, and saves it in
the layout the drafter loads. ``hasten train NAME`` finds it through the drafter
registry and turns its ``Options`` dataclass into flags; nothing here knows a method.

The trainer owns everything else: AdamW with linear warmup and cosine decay, a progress
bar, held-out evaluation, and checkpoints (module weights, AdamW moments, step, the batch
sampler's RNG and the planned step count, in one safetensors file) from which
``resume=True`` continues bit for bit.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file
from torch import nn
from tqdm import tqdm

from ..core.schedule import adamw, optimizer_step, warmup_cosine
from ..core.settings import Settings, option
from ..drafters.trainable import Batch, Trainable  # noqa: F401  (Trainable: the protocol, re-exported)

CHECKPOINT = "checkpoint.safetensors"
FINAL_LR_RATIO = 0.1  # cosine decays to this fraction of the peak learning rate
CALIBRATION_STEPS = 10  # steps timed to plan a --minutes-only run (all inside the warmup)
DEFAULT_STEPS = 1000  # when neither steps nor minutes are given
METRIC_WINDOW = 50  # training metrics are reported as the mean over the last steps


@dataclass(frozen=True)
class TrainSettings(Settings):
    steps: int | None = option(None, f"optimiser steps; unset: as many as --minutes allows, else {DEFAULT_STEPS}")
    minutes: float | None = option(None, "wall-clock budget for training (distillation excluded); stops the run early")
    batch_size: int = option(8, "sequences per step")
    lr: float = option(1e-3, "peak learning rate of AdamW (linear warmup, then cosine decay to 10%)")
    warmup_steps: int = option(50, "steps of linear warmup; 1 means none")
    weight_decay: float = option(0.0, "AdamW weight decay")
    grad_clip: float = option(1.0, "clip the gradient norm to this")
    checkpoint_every: int = option(100, "steps between checkpoints (for --resume)")
    seed: int = option(0, "seeds the prompt choice, the initialisation and the batch order")

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

    @property
    def schedule(self) -> dict:
        """The settings a resumed run must share with the checkpoint to continue bit for bit."""
        return {k: v for k, v in asdict(self).items() if k not in ("minutes", "checkpoint_every")}


def lr_scale(step: int, total_steps: int | None, s: TrainSettings) -> float:
    """Linear warmup, then cosine decay to FINAL_LR_RATIO of the peak at ``total_steps``.
    During the warmup the rate does not depend on ``total_steps`` (unknown while calibrating)."""
    progress = 0.0 if step < s.warmup_steps else (step - s.warmup_steps) / max(1, total_steps - s.warmup_steps)
    return warmup_cosine(step, s.warmup_steps, progress, FINAL_LR_RATIO)


@dataclass
class TrainResult:
    module: nn.Module
    report: dict  # steps, minutes, train and eval metrics, settings


def train(trainable: Trainable, data, settings: TrainSettings, work_dir: Path, *, resume: bool = False,
          device: str = "cpu", progress: bool = True) -> TrainResult:
    """Train ``trainable``'s module on ``data`` (a :class:`hasten.training.distill.Distilled`),
    checkpointing under ``work_dir``; with ``resume`` continue from the checkpoint there."""
    target = trainable.target.requires_grad_(False).eval()
    torch.manual_seed(settings.seed)
    module = trainable.build().to(device).train()
    optimizer = adamw([{"params": [p for p in module.parameters() if p.requires_grad], "lr": settings.lr,
                        "weight_decay": settings.weight_decay}])
    sampler = torch.Generator().manual_seed(settings.seed)  # which rows form each batch
    train_rows, eval_rows = data.split()
    state = {"step": 0, "total_steps": settings.steps, "elapsed_s": 0.0, "schedule": settings.schedule,
             "metrics": [], "evals": []}
    checkpoint = Path(work_dir) / CHECKPOINT
    if resume and checkpoint.is_file():
        state = load_checkpoint(checkpoint, module, optimizer, sampler)
        if state["schedule"] != settings.schedule:
            raise ValueError(f"{checkpoint} was made with other settings ({state['schedule']}); drop --resume to start over")
        state["total_steps"] = state["total_steps"] or settings.steps
    budget_s = settings.minutes * 60 if settings.minutes else math.inf
    start = time.monotonic() - state["elapsed_s"]  # a resumed run continues the same budget
    bar = tqdm(total=state["total_steps"], initial=state["step"], desc="train", disable=not progress,
               file=sys.stderr, mininterval=2)

    def checkpoint_and_evaluate() -> None:
        held_out = evaluate(trainable, module, data, eval_rows, settings.batch_size, device)
        state["evals"].append({"step": state["step"], "loss": held_out.get("loss")})
        bar.write(f"step {state['step']}: held-out loss {held_out.get('loss', float('nan')):.4f}", file=sys.stderr)
        state["elapsed_s"] = time.monotonic() - start
        save_checkpoint(checkpoint, module, optimizer, sampler, state)

    while (state["total_steps"] is None or state["step"] < state["total_steps"]) and time.monotonic() - start < budget_s:
        scale = lr_scale(state["step"], state["total_steps"], settings)
        rows = train_rows[torch.randint(len(train_rows), (settings.batch_size,), generator=sampler)]
        metrics = _step(trainable, module, optimizer, data.batch(rows, target, device), scale, settings.grad_clip)
        state["step"] += 1
        state["metrics"] = (state["metrics"] + [metrics])[-METRIC_WINDOW:]
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
        bar.update(1)
        if state["total_steps"] is None and state["step"] == min(CALIBRATION_STEPS, settings.warmup_steps):
            seconds_per_step = (time.monotonic() - start) / state["step"]
            state["total_steps"] = max(state["step"], int(budget_s / seconds_per_step))
            bar.total = state["total_steps"]
        if state["step"] % settings.checkpoint_every == 0:
            checkpoint_and_evaluate()
    bar.close()
    if not state["evals"] or state["evals"][-1]["step"] != state["step"]:
        checkpoint_and_evaluate()
    module.eval()
    report = {
        "steps": state["step"],
        "planned_steps": state["total_steps"],
        "minutes": round(state["elapsed_s"] / 60, 2),
        "train": _mean(state["metrics"]),  # over the last METRIC_WINDOW steps
        "eval": evaluate(trainable, module, data, eval_rows, settings.batch_size, device),
        "evals": state["evals"],
        "settings": asdict(settings),
    }
    return TrainResult(module, report)


@torch.enable_grad()  # the CLI turns autograd off globally
def _step(trainable: Trainable, module: nn.Module, optimizer, batch: Batch, scale: float, grad_clip: float) -> dict:
    loss, metrics = trainable.loss(module, batch)
    if loss.requires_grad:  # a batch can hold no label at all (targets that stop at once)
        optimizer_step(optimizer, loss, scale, grad_clip)
    return {"loss": loss.item(), **metrics}


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
    return _mean(results)


def _mean(records: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in records for k in r}
    return {k: sum(r[k] for r in records if k in r) / sum(k in r for r in records) for k in sorted(keys)}


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
