"""Quality metrics on known inputs, and the BAC scheduler against brute force."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from hasten.diffusion.bac import adaptive_schedule, bubbling_union, caching_error
from hasten.diffusion.metrics import psnr, ssim


def test_psnr_known_values():
    ref = torch.zeros(2, 3, 8, 8)
    img = ref.clone()
    img[0] += 0.1  # MSE 0.01 over a range of 2
    out = psnr(img, ref)
    assert math.isinf(out[1])
    assert out[0].item() == pytest.approx(10 * math.log10(4 / 0.01), abs=1e-4)


def test_ssim_of_constant_images_is_the_luminance_term():
    a, b = 0.3, -0.2
    c1 = (0.01 * 2) ** 2
    out = ssim(torch.full((1, 3, 16, 16), a), torch.full((1, 3, 16, 16), b))
    assert out.item() == pytest.approx((2 * a * b + c1) / (a * a + b * b + c1), rel=1e-5)


def test_ssim_identity_symmetry_and_order():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 32, 32, generator=g) * 2 - 1
    noise = torch.randn(x.shape, generator=g)
    assert torch.allclose(ssim(x, x), torch.ones(2))
    assert torch.allclose(ssim(x, x + 0.1 * noise), ssim(x + 0.1 * noise, x))
    assert (ssim(x, x + 0.05 * noise) > ssim(x, x + 0.3 * noise)).all()
    unrelated = torch.rand(x.shape, generator=g) * 2 - 1
    assert (ssim(x, unrelated).abs() < 0.1).all()


def test_ssim_matches_a_direct_window_by_window_computation():
    g = torch.Generator().manual_seed(1)
    x, y = torch.rand(1, 1, 13, 12, generator=g), torch.rand(1, 1, 13, 12, generator=g)
    coords = np.arange(11) - 5
    w = np.exp(-(coords[:, None] ** 2 + coords[None, :] ** 2) / (2 * 1.5**2))
    w /= w.sum()
    c1, c2 = (0.01 * 1) ** 2, (0.03 * 1) ** 2
    values = []
    for i in range(13 - 10):
        for j in range(12 - 10):
            px, py = x[0, 0, i:i + 11, j:j + 11].double().numpy(), y[0, 0, i:i + 11, j:j + 11].double().numpy()
            mx, my = (w * px).sum(), (w * py).sum()
            vx, vy = (w * (px - mx) ** 2).sum(), (w * (py - my) ** 2).sum()
            cov = (w * (px - mx) * (py - my)).sum()
            values.append((2 * mx * my + c1) * (2 * cov + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2)))
    assert ssim(x, y, data_range=1.0).item() == pytest.approx(float(np.mean(values)), rel=1e-5)


def _score(similarity, updates):
    return -caching_error(similarity, updates)


@pytest.mark.parametrize("seed", range(4))
def test_adaptive_schedule_is_optimal(seed):
    rng = np.random.default_rng(seed)
    steps, budget = 9, 4
    sim = rng.uniform(0, 1, (steps, steps))
    best = max(([0, *rest] for rest in itertools.combinations(range(1, steps), budget - 1)),
               key=lambda s: _score(sim, s))
    chosen = adaptive_schedule(sim, budget)
    assert len(chosen) == budget and chosen[0] == 0
    assert _score(sim, chosen) == pytest.approx(_score(sim, best))
    assert adaptive_schedule(sim, steps + 3) == list(range(steps))
    assert adaptive_schedule(sim, 1) == [0]


def test_bubbling_union_adds_downstream_ffn_steps_to_worst_upstream_ffn():
    schedules = [[0, 4], [0, 2], [0, 6], [0, 3], [0, 5]]
    kinds = ["attn", "ff", "attn", "ff", "ff"]
    errors = [0.9, 0.5, 0.9, 0.1, 0.2]
    out = bubbling_union(schedules, kinds, errors, top_k=1)  # unit 1 is the worst feed-forward
    assert out == [[0, 4], [0, 2, 3, 5], [0, 6], [0, 3], [0, 5]]
    assert bubbling_union(schedules, kinds, errors, top_k=0) == schedules
