"""The project's class-conditional DiT: diffusers' ``DiTTransformer2DModel``, unmodified, trained on
procedurally drawn 32x32 images of coloured shapes (one class per shape) in pixel space.

    model = load_dit()                                    # shipped weights, float32, eval mode
    images = generate(model, labels, seed=0, steps=50)    # [batch, 3, 32, 32] in [-1, 1]
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ...zoo.packing import has_tensors, read_tensors, write_packed
from ..sampling import ddim_sample

CLASSES = ("circle", "square", "triangle", "cross", "ring", "diamond")
IMAGE_SIZE = 32
CONFIG = dict(num_attention_heads=4, attention_head_dim=32, in_channels=3, out_channels=3, num_layers=6,
              sample_size=IMAGE_SIZE, patch_size=4, num_embeds_ada_norm=len(CLASSES))
WEIGHTS = Path(__file__).resolve().parent.parent / "weights" / "dit-shapes"
GUIDANCE = 2.0  # classifier-free guidance scale used by generate() unless told otherwise
PREDICTION = "v"  # what the network outputs (see sampling.py); the recipe trains for it


# ---------------------------------------------------------------- data


def _signed_distance(label: torch.Tensor, dx: torch.Tensor, dy: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Pixels inside the shape are > 0 (in pixels). label [n]; dx, dy [n, H, W] offsets from the centre; r [n, 1, 1]."""
    dist = (dx**2 + dy**2).sqrt()
    ax, ay = dx.abs(), dy.abs()
    bar = 0.35 * r
    shapes = torch.stack([
        r - dist,                                                          # circle
        0.8 * r - torch.maximum(ax, ay),                                   # square
        torch.minimum(0.5 * r - dy, ((dy + r) - math.sqrt(3) * ax) / 2),  # triangle, apex up
        torch.maximum(torch.minimum(r - ax, bar - ay), torch.minimum(bar - ax, r - ay)),  # cross
        0.3 * r - (dist - 0.7 * r).abs(),                                  # ring
        1.1 * r - (ax + ay),                                               # diamond
    ])  # [classes, n, H, W]
    return shapes[label, torch.arange(label.shape[0])]


def draw_shapes(labels: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One image per label: a shape of random colour, size and place on a random two-tone background.

    labels [n] -> images [n, 3, 32, 32] in [-1, 1].
    """
    n = labels.shape[0]
    u = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    r = (5 + 6 * u(n)).view(n, 1, 1)
    cx = (r.view(n) + 1 + (IMAGE_SIZE - 2 * r.view(n) - 2) * u(n)).view(n, 1, 1)
    cy = (r.view(n) + 1 + (IMAGE_SIZE - 2 * r.view(n) - 2) * u(n)).view(n, 1, 1)
    ys, xs = torch.meshgrid(torch.arange(IMAGE_SIZE, dtype=torch.float32) + 0.5,
                            torch.arange(IMAGE_SIZE, dtype=torch.float32) + 0.5, indexing="ij")
    alpha = (_signed_distance(labels, xs - cx, ys - cy, r) + 0.5).clamp(0, 1).unsqueeze(1)  # [n, 1, H, W]
    top, bottom = u(n, 3, 1, 1), u(n, 3, 1, 1)  # background colours at the top and bottom rows
    ramp = (ys / IMAGE_SIZE).view(1, 1, IMAGE_SIZE, IMAGE_SIZE)
    background = 0.15 + 0.5 * (top * (1 - ramp) + bottom * ramp)
    colour = u(n, 3, 1, 1)
    colour = colour / colour.amax(dim=1, keepdim=True).clamp(min=1e-3)  # saturated: brightest channel at 1
    return (background * (1 - alpha) + colour * alpha) * 2 - 1


# ---------------------------------------------------------------- model


def build_dit(**overrides):
    from diffusers import DiTTransformer2DModel

    return DiTTransformer2DModel(**{**CONFIG, **overrides})


def save_dit(model, path: str | Path, extra: dict | None = None) -> None:
    """Packed weights (hasten.zoo.packing) + config.json (the constructor arguments that differ from diffusers' defaults)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_packed(model.state_dict(), path / "model.safetensors")
    config = {k: model.config[k] for k in CONFIG}
    (path / "config.json").write_text(json.dumps(config, indent=1))


def load_dit(path: str | Path = WEIGHTS):
    """The shipped (or a freshly trained) DiT in float32, eval mode."""
    path = Path(path)
    if not has_tensors(path / "model.safetensors"):
        raise FileNotFoundError(f"no DiT weights at {path}; train them with: python -m hasten.diffusion.recipes dit")
    config = json.loads((path / "config.json").read_text())
    model = build_dit(**config)
    model.load_state_dict({k: v.float() for k, v in read_tensors(path / "model.safetensors").items()})
    return model.eval()


def denoiser(model, labels: torch.Tensor, guidance: float = GUIDANCE):
    """Guided network output (x_t, t) -> v, cond and uncond in ONE batch: one model call per step."""
    null = torch.full_like(labels, model.config.num_embeds_ada_norm)  # the label embedding's extra "no class" row
    both = torch.cat([labels, null])  # [2 * batch]

    def eps(x: torch.Tensor, t: int) -> torch.Tensor:  # x [batch, 3, 32, 32]
        timestep = torch.full((2 * x.shape[0],), t, dtype=torch.long)
        out = model(torch.cat([x, x]), timestep=timestep, class_labels=both).sample  # [2 * batch, 3, 32, 32]
        cond, uncond = out.chunk(2)
        return uncond + guidance * (cond - uncond)

    return eps


def initial_noise(batch: int, seed: int) -> torch.Tensor:
    """x_T for a seed: [batch, 3, 32, 32]."""
    return torch.randn(batch, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def generate(model, labels: torch.Tensor, seed: int = 0, steps: int = 50, guidance: float = GUIDANCE) -> torch.Tensor:
    """labels [batch] -> images [batch, 3, 32, 32] in [-1, 1] (DDIM, deterministic for a seed)."""
    return ddim_sample(denoiser(model, labels, guidance), initial_noise(labels.shape[0], seed), steps,
                       prediction=PREDICTION)
