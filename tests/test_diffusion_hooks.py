"""Caching hooks on unmodified models: diffusers transformers (tiny, random) and toy modules."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from hasten.diffusion import (BlockAdaptive, Calibration, FirstBlockCache, FixedInterval, NoCache, TaylorSeer, cached,
                              calibrate, disable_cache, enable_cache)

STEPS = 8


def tiny_dit():
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                  num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10).eval()
    labels = torch.tensor([1, 3])

    def call(x, step):  # x [2, 4, 8, 8]
        t = torch.full((2,), 900 - 100 * step, dtype=torch.long)
        return model(x, timestep=t, class_labels=labels).sample

    return model, call, torch.randn(2, 4, 8, 8)


def tiny_pixart():
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(0)
    model = PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
                                     num_layers=2, cross_attention_dim=16, sample_size=8, patch_size=2,
                                     caption_channels=12, use_additional_conditions=False).eval()
    context = torch.randn(2, 5, 12)  # [batch, text tokens, caption_channels]

    def call(x, step):
        t = torch.full((2,), 900 - 100 * step, dtype=torch.long)
        cond = {"resolution": None, "aspect_ratio": None}
        return model(x, encoder_hidden_states=context, timestep=t, added_cond_kwargs=cond).sample

    return model, call, torch.randn(2, 4, 8, 8)


def tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=12,
                                   pooled_projection_dim=8, axes_dims_rope=(4, 4, 8)).eval()
    context, pooled = torch.randn(2, 3, 12), torch.randn(2, 8)  # [batch, text tokens, dim], [batch, dim]
    img_ids, txt_ids = torch.zeros(6, 3), torch.zeros(3, 3)
    img_ids[:, 1] = torch.arange(6)

    def call(x, step):  # x [2, 6 image tokens, 4]
        t = torch.full((2,), 1.0 - step / STEPS)
        return model(hidden_states=x, encoder_hidden_states=context, pooled_projections=pooled, timestep=t,
                     img_ids=img_ids, txt_ids=txt_ids).sample

    return model, call, torch.randn(2, 6, 4)


MODELS = {"dit": tiny_dit, "pixart": tiny_pixart, "flux": tiny_flux}


def sample(call, x, steps=STEPS):
    """A stand-in for a sampling loop: one model call per step."""
    for step in range(steps):
        x = x - 0.1 * call(x, step)
    return x


NEVER_REUSE = [NoCache(), TaylorSeer(interval=1), TaylorSeer(interval=1, granularity="submodule"),
               FixedInterval(1), FixedInterval(1, granularity="submodule"), FirstBlockCache(0.0)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_never_reuse_is_bit_identical(name):
    model, call, x = MODELS[name]()
    reference = sample(call, x.clone())
    for policy in NEVER_REUSE:
        with cached(model, policy) as session:
            out = sample(call, x.clone())
        assert torch.equal(out, reference), policy
        assert session.stats.skipped_fraction == 0.0
        assert session.stats.computed
    assert all("forward" not in m.__dict__ for m in model.modules())  # hooks gone
    assert torch.equal(sample(call, x.clone()), reference)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("granularity", ["block", "submodule"])
def test_taylorseer_counts_and_stays_close(name, granularity):
    model, call, x = MODELS[name]()
    reference = sample(call, x.clone())
    policy = TaylorSeer(interval=3, order=1, warmup=2, granularity=granularity)
    with cached(model, policy) as session:
        out = sample(call, x.clone())
    units = len(session.units)
    # full computations at steps 0, 1 (warm-up), 2 and 5
    assert session.stats.to_dict()["computed"] == 4 * units
    assert session.stats.to_dict()["skipped"] == (STEPS - 4) * units
    assert not torch.equal(out, reference)
    assert torch.isfinite(out).all()
    assert (out - reference).abs().max() < 10 * reference.abs().max()


def test_units_found_for_each_family():
    from hasten.diffusion.adapters import find_units

    kinds = {name: [u.kind for u in find_units(MODELS[name]()[0], "submodule")] for name in MODELS}
    assert kinds["dit"] == ["attn", "ff"] * 2
    assert kinds["pixart"] == ["attn", "attn", "ff"] * 2
    assert kinds["flux"] == ["attn", "ff", "ff"] + ["attn", "ff"] * 2
    names = [u.name for u in find_units(MODELS["flux"]()[0], "block")]
    assert names == ["transformer_blocks.0", "single_transformer_blocks.0", "single_transformer_blocks.1"]


def test_first_block_cache_skips_all_but_first_block():
    model, call, x = tiny_dit()
    with cached(model, FirstBlockCache(threshold=10.0)) as session:  # always similar enough
        sample(call, x.clone())
    stats = session.stats
    assert stats.computed["transformer_blocks.0"] == STEPS
    assert stats.computed["transformer_blocks.1"] == 1  # step 0 sets the reference; later steps match it
    assert stats.skipped["transformer_blocks.1"] == STEPS - 1


def test_guidance_as_two_calls_keeps_a_cache_per_branch():
    model, call, x = tiny_dit()
    policy = FixedInterval(2)

    def two_calls(xc, xu):
        for step in range(STEPS):
            xc, xu = xc - 0.1 * call(xc, step), xu - 0.1 * call(xu, step)
        return xc, xu

    with cached(model, policy, calls_per_step=2):
        cond, uncond = two_calls(x.clone(), 2 * x)
    with cached(model, policy):
        cond_alone = sample(call, x.clone())
    with cached(model, policy):
        uncond_alone = sample(call, 2 * x)
    assert torch.equal(cond, cond_alone) and torch.equal(uncond, uncond_alone)


def test_num_steps_starts_a_new_trajectory():
    model, call, x = tiny_dit()
    policy = TaylorSeer(interval=3, order=2, warmup=1)
    with cached(model, policy) as session:
        first = sample(call, x.clone())
    with cached(model, policy, num_steps=STEPS) as session:
        again = [sample(call, x.clone()) for _ in range(2)]
    assert torch.equal(again[0], first) and torch.equal(again[1], first)
    with cached(model, policy) as session:
        sample(call, x.clone())
        session.reset()
        assert torch.equal(sample(call, x.clone()), first)


def test_manual_step_driving_matches_counting():
    model, call, x = tiny_dit()
    policy = FixedInterval(3)
    with cached(model, policy):
        counted = sample(call, x.clone())
    with cached(model, policy) as session:
        y = x.clone()
        for step in range(STEPS):
            session.set_step(step)
            y = y - 0.1 * call(y, step)
    assert torch.equal(y, counted)


def test_bac_calibrate_save_load_and_schedule(tmp_path):
    model, call, x = tiny_dit()
    reference = sample(call, x.clone())
    calibration = calibrate(model, lambda: sample(call, x.clone()), num_steps=STEPS)
    assert calibration.similarity.shape == calibration.change.shape == (4, STEPS, STEPS)
    assert abs(calibration.similarity[:, 3, 3] - 1).max() < 1e-5
    assert (calibration.change[:, 3, 3] == 0).all() and (calibration.change[:, 0, 1] > 0).all()
    path = tmp_path / "cal.json"
    calibration.save(path)
    loaded = Calibration.load(path)
    assert loaded.unit_blocks == calibration.unit_blocks and loaded.unit_kinds == calibration.unit_kinds
    assert np.allclose(loaded.change, calibration.change, rtol=1e-5)
    old = json.loads(path.read_text()) | {"format": "hasten.bac.calibration/1"}
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="calibrate again"):
        Calibration.load(tmp_path / "old.json")
    with cached(model, BlockAdaptive(str(path), updates=STEPS)) as session:
        assert torch.equal(sample(call, x.clone()), reference)
    policy = BlockAdaptive(path, updates=3, union_top_k=1)
    expected = sum(len(s) for s in policy.schedules().values())
    with cached(model, policy) as session:
        sample(call, x.clone())
    assert session.stats.to_dict()["computed"] == expected < 4 * STEPS
    assert all(0 in steps for steps in policy.schedules().values())


# ---- toy modules: in-place updates, explicit blocks, errors


class InPlaceBlock(nn.Module):
    """Adds ``bias * t`` to its input in place and returns it: the residual is linear in t."""

    def __init__(self, dim: int):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(dim))

    def forward(self, x, t):
        x.add_(self.bias * t)
        return x


class Toy(nn.Module):
    def __init__(self, dim=4, assign=True):
        super().__init__()
        self.layers = nn.ModuleList([InPlaceBlock(dim) for _ in range(3)])
        self.assign = assign

    def forward(self, x, t):
        h = x.clone()
        for layer in self.layers:
            if self.assign:
                h = layer(h, t)
                h.mul_(1.5)  # in place on what the block returned
            else:
                layer(h, t)  # relies on the block updating h in place
        return h


@pytest.mark.parametrize("assign", [True, False])
def test_in_place_blocks_are_forecast_correctly(assign):
    torch.manual_seed(0)
    model = Toy(assign=assign)
    x = torch.randn(2, 4)
    full = [model(x, float(step)) for step in range(STEPS)]
    # residuals linear in the step: a first-order forecast is exact, but only if the stored
    # features were clones, not views of tensors the model later changed in place
    with cached(model, TaylorSeer(interval=3, order=1, warmup=2)) as session:
        out = [model(x, float(step)) for step in range(STEPS)]
    assert session.stats.to_dict()["skipped"] == 3 * (STEPS - 4)
    for a, b in zip(out, full):
        torch.testing.assert_close(a, b)


class FeedForwardByT(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim))

    def forward(self, x, t):
        return self.w * t + 0 * x


class SubBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ff = FeedForwardByT(dim)

    def forward(self, x, t):
        y = self.ff(x, t)
        y.mul_(0.5)  # in place on the feed-forward's output
        return x + y


def test_submodule_outputs_modified_in_place_downstream():
    torch.manual_seed(0)
    model = nn.Sequential()
    blocks = [SubBlock(4) for _ in range(2)]
    x = torch.randn(3, 4)

    def run(step):
        h = x
        for block in blocks:
            h = block(h, float(step))
        return h

    full = [run(step) for step in range(STEPS)]
    session = enable_cache(model, FixedInterval(2, granularity="submodule"), blocks=blocks)
    out = []
    for step in range(STEPS):
        session.set_step(step)
        out.append(run(step))
    stats = disable_cache(model)
    assert stats.to_dict()["by_kind"]["ff"] == {"computed": 8, "skipped": 8}
    for step in range(0, STEPS, 2):  # computed steps are exact, and the reuse is of step - 1
        torch.testing.assert_close(out[step], full[step])
        torch.testing.assert_close(out[step + 1], full[step])


def test_model_without_blocks_says_how_to_pass_them():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match=r"blocks=model\.my_blocks"):
        enable_cache(model, TaylorSeer())
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("make", [
    lambda: TaylorSeer(interval=0), lambda: TaylorSeer(order=-1), lambda: TaylorSeer(warmup=-1),
    lambda: TaylorSeer(granularity="layer"), lambda: FixedInterval(0), lambda: FirstBlockCache(-0.1),
    lambda: FirstBlockCache(0.1, granularity="submodule"),
])
def test_impossible_settings_are_rejected(make):
    with pytest.raises(ValueError):
        make()


def test_enable_twice_is_an_error_and_disable_restores():
    model, call, x = tiny_dit()
    enable_cache(model, NoCache())
    with pytest.raises(ValueError, match="already enabled"):
        enable_cache(model, NoCache())
    disable_cache(model)
    with pytest.raises(ValueError, match="not enabled"):
        disable_cache(model)
