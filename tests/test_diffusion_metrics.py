"""Quality metrics on known inputs, and the BAC scheduler against brute force."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from hasten.diffusion.bac import (BlockAdaptive, Calibration, adaptive_schedule, bubbling_union, caching_error,
                                  ffn_downstream_union, mean_change, step_change)
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


# Bubbling Union, hand-worked: two blocks of (self-attention, cross-attention, feed-forward).
KINDS = ["attn", "attn", "ff", "attn", "attn", "ff"]
BLOCKS = [0, 0, 0, 1, 1, 1]
SLOPES = [3.0, 1.0, 0.5, 2.0, 0.0, 4.0]  # unit u's features at step t: SLOPES[u] * t in every element


def _traces(steps):
    return [torch.arange(steps, dtype=torch.float32).view(steps, 1, 1).expand(steps, 2, 3) * c for c in SLOPES]


def test_step_change_is_the_mean_l1_difference_between_steps():
    change = step_change(_traces(3)[0])  # |3i - 3j|
    assert change.tolist() == [[0, 3, 6], [3, 0, 3], [6, 3, 0]]
    assert mean_change(change) == pytest.approx(4.0)  # pairs (0,1) (0,2) (1,2): (3 + 6 + 3) / 3


def test_bubbling_union_picks_any_kind_by_l1_change_and_gives_same_or_deeper_ffn_steps():
    changes = [mean_change(step_change(t)) for t in _traces(3)]  # ranks units 5, 0, 3, 1, 2, 4
    schedules = [[0, 5], [0, 6], [0, 2, 7], [0, 4], [0, 8], [0, 3, 9]]
    out = bubbling_union(schedules, KINDS, BLOCKS, changes, top_k=3)  # chosen: 5 (ff), 0 (attn), 3 (attn)
    assert out == [[0, 2, 3, 5, 7, 9],  # layer 0's attention: its own layer's ff (2) and the deeper one (5)
                   [0, 6], [0, 2, 7],  # not chosen: unchanged, though a deeper ff updates elsewhere
                   [0, 3, 4, 9],  # layer 1's attention: layer 1's ff only
                   [0, 8], [0, 3, 9]]  # the chosen ff of the last layer: nothing deeper
    two = bubbling_union(schedules, KINDS, BLOCKS, changes, top_k=2)
    assert two == [[0, 2, 3, 5, 7, 9], *schedules[1:]]
    assert bubbling_union(schedules, KINDS, BLOCKS, changes, top_k=1) == schedules  # one block: no union
    assert bubbling_union(schedules, KINDS, BLOCKS, changes, top_k=0) == schedules
    assert bubbling_union(schedules, KINDS, BLOCKS, [1.0] * 6, top_k=2)[:2] == [[0, 2, 3, 5, 7, 9], [0, 2, 3, 6, 7, 9]]


def _phase_similarity(steps, switch):
    """Similarity 1 within [0, switch) and within [switch, steps), 0 across: the scheduler's only
    best 2-update schedule is [0, switch]."""
    phase = np.arange(steps) >= switch
    return (phase[:, None] == phase[None, :]).astype(float)


def test_block_adaptive_schedules_with_the_reference_union_and_hasten_narrowed_one():
    steps, switches = 6, [5, 4, 2, 3, 1, 4]
    traces = _traces(steps)
    calibration = Calibration([f"u{u}" for u in range(6)], KINDS, BLOCKS, "submodule",
                              np.stack([_phase_similarity(steps, k) for k in switches]),
                              np.stack([step_change(t) for t in traces]))
    assert BlockAdaptive(calibration, updates=2, union_top_k=0).schedules() == {
        f"u{u}": [0, k] for u, k in enumerate(switches)}
    assert BlockAdaptive(calibration, updates=2, union_top_k=3).schedules() == {
        "u0": [0, 2, 4, 5], "u1": [0, 4], "u2": [0, 2], "u3": [0, 3, 4], "u4": [0, 1], "u5": [0, 4]}
    # hasten's narrowed rule: the worst feed-forward unit (a tie at 0 error: the first) takes later ones' steps
    narrowed = BlockAdaptive(calibration, updates=2, union_top_k=1, union="ffn_downstream").schedules()
    assert narrowed == {"u0": [0, 5], "u1": [0, 4], "u2": [0, 2, 4], "u3": [0, 3], "u4": [0, 1], "u5": [0, 4]}
    with pytest.raises(ValueError, match="union"):
        BlockAdaptive(calibration, union="ffn")


def test_ffn_downstream_union_adds_later_ffn_steps_to_worst_earlier_ffn():
    schedules = [[0, 4], [0, 2], [0, 6], [0, 3], [0, 5]]
    kinds = ["attn", "ff", "attn", "ff", "ff"]
    errors = [0.9, 0.5, 0.9, 0.1, 0.2]
    out = ffn_downstream_union(schedules, kinds, errors, top_k=1)  # unit 1 is the worst feed-forward
    assert out == [[0, 4], [0, 2, 3, 5], [0, 6], [0, 3], [0, 5]]
    assert ffn_downstream_union(schedules, kinds, errors, top_k=0) == schedules
