"""Image quality against a reference: PSNR and SSIM, in torch.

Images are [batch, channels, height, width] with values in [-1, 1] unless ``data_range`` says
otherwise; both metrics return one value per image, [batch].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def psnr(image: torch.Tensor, reference: torch.Tensor, data_range: float = 2.0) -> torch.Tensor:
    """10 log10(range^2 / MSE) per image; +inf where the images are equal."""
    mse = (image.double() - reference.double()).pow(2).flatten(1).mean(dim=1)  # [batch]
    return (10 * torch.log10(data_range**2 / mse)).float()


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-coords**2 / (2 * sigma**2))
    g = g / g.sum()
    return g[:, None] * g[None, :]  # [size, size]


def ssim(image: torch.Tensor, reference: torch.Tensor, data_range: float = 2.0, window: int = 11,
         sigma: float = 1.5, k1: float = 0.01, k2: float = 0.03) -> torch.Tensor:
    """Structural similarity (Wang et al., 2004): Gaussian window 11 / sigma 1.5, K1 = 0.01,
    K2 = 0.03, statistics over valid windows only (no padding), averaged over channels and positions."""
    x, y = image.double(), reference.double()
    channels = x.shape[1]
    w = _gaussian_window(window, sigma).to(x)[None, None].expand(channels, 1, window, window)
    blur = lambda t: F.conv2d(t, w, groups=channels)  # noqa: E731  # [batch, channels, H - window + 1, ...]
    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    s = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    return s.flatten(1).mean(dim=1).float()
