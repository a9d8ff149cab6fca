"""The one learning-rate schedule and the one optimizer step every trainer in hasten uses
(drafters, zoo models, diffusion models, the diffusion LM)."""
from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, warmup_steps: int, progress: float, final_ratio: float = 0.0) -> float:
    """Multiplier of the peak learning rate: linear warmup over the first ``warmup_steps``
    steps, times a cosine decay from 1 to ``final_ratio`` as ``progress`` goes from 0 to 1
    (progress outside [0, 1] is clamped; a trainer measures it in steps or in wall-clock time)."""
    warmup = min(1.0, (step + 1) / max(1, warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return warmup * (final_ratio + (1.0 - final_ratio) * cosine)


def adamw(groups: list[dict], betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.AdamW:
    """AdamW over parameter ``groups`` (each ``{"params", "lr", "weight_decay"}``), every group
    remembering its peak rate as ``"peak"`` for :func:`optimizer_step`'s schedule."""
    for group in groups:
        group["peak"] = group["lr"]
    return torch.optim.AdamW(groups, betas=betas)


def decay_groups(parameters, lr: float, weight_decay: float) -> list[dict]:
    """Matrices with weight decay, vectors (norm gains, biases) without: :func:`adamw`'s groups."""
    parameters = [p for p in parameters if p.requires_grad]
    return [{"params": [p for p in parameters if p.dim() >= 2], "lr": lr, "weight_decay": weight_decay},
            {"params": [p for p in parameters if p.dim() < 2], "lr": lr, "weight_decay": 0.0}]


def optimizer_step(optimizer, loss, scale: float, clip: float = 1.0) -> None:
    """The one update every trainer in hasten makes: each group's rate at ``scale`` times its
    peak (:func:`warmup_cosine`), gradients of ``loss`` clipped to norm ``clip``, one AdamW step."""
    for group in optimizer.param_groups:
        group["lr"] = group["peak"] * scale
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], clip)
    optimizer.step()
