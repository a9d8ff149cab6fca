"""The noise schedule, training targets and the DDIM sampler shared by the project's two models.

A cosine schedule over ``TRAIN_STEPS`` steps (Nichol & Dhariwal, 2021); the network predicts either
the noise ("epsilon") or the velocity v = sqrt(a) noise - sqrt(1 - a) x0 ("v", Salimans & Ho, 2022),
which keeps the x0 estimate sane at high noise where an epsilon error is amplified by 1/sqrt(a);
deterministic DDIM (eta = 0) sampling on an evenly spaced subset of the steps.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

TRAIN_STEPS = 1000


def alphas_cumprod(steps: int = TRAIN_STEPS) -> torch.Tensor:
    """alpha-bar_t for t = 0..steps-1: [steps], decreasing from ~1 to ~0."""
    s = 0.008
    x = torch.arange(steps + 1, dtype=torch.float64) / steps
    f = torch.cos((x + s) / (1 + s) * math.pi / 2) ** 2
    betas = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    return torch.cumprod(1 - betas, dim=0).float()


ALPHAS = alphas_cumprod()


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """q(x_t | x_0) for a batch: x0, noise [batch, ...]; t [batch] integer steps."""
    a = ALPHAS[t].view(-1, *([1] * (x0.dim() - 1)))
    return a.sqrt() * x0 + (1 - a).sqrt() * noise


def target(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, prediction: str) -> torch.Tensor:
    """What the network learns to output for x_t = add_noise(x0, noise, t)."""
    if prediction == "epsilon":
        return noise
    if prediction == "v":
        a = ALPHAS[t].view(-1, *([1] * (x0.dim() - 1)))
        return a.sqrt() * noise - (1 - a).sqrt() * x0
    raise ValueError(f"prediction must be 'epsilon' or 'v', got {prediction!r}")


def ddim_timesteps(num_steps: int) -> list[int]:
    """Evenly spaced training steps, from the noisiest down to 0."""
    if num_steps < 1 or num_steps > TRAIN_STEPS:
        raise ValueError(f"num_steps must be in 1..{TRAIN_STEPS}, got {num_steps}")
    return [int(round(t)) for t in torch.linspace(TRAIN_STEPS - 1, 0, num_steps).tolist()]


Denoiser = Callable[[torch.Tensor, int], torch.Tensor]  # (x_t [batch, ...], t) -> network output, same shape


@torch.no_grad()
def ddim_sample(denoise: Denoiser, noise: torch.Tensor, num_steps: int, clip: float | None = 1.0,
                prediction: str = "epsilon") -> torch.Tensor:
    """Deterministic DDIM from ``noise`` (x_T); calls ``denoise`` exactly once per step.

    The predicted x_0 is clipped to [-clip, clip] (data live in [-1, 1]) and the noise estimate is
    made consistent with the clipped x_0, as diffusers' DDIMScheduler does.
    """
    x = noise
    steps = ddim_timesteps(num_steps)
    for i, t in enumerate(steps):
        a_t = ALPHAS[t]
        a_prev = ALPHAS[steps[i + 1]] if i + 1 < len(steps) else torch.tensor(1.0)
        out = denoise(x, t)
        if prediction == "v":
            x0 = a_t.sqrt() * x - (1 - a_t).sqrt() * out
            eps = (1 - a_t).sqrt() * x + a_t.sqrt() * out
        else:
            eps = out
            x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        if clip is not None:
            x0 = x0.clamp(-clip, clip)
            eps = (x - a_t.sqrt() * x0) / (1 - a_t).sqrt()
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    return x
