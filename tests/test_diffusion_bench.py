"""The benchmark, the recipes and the simulator, end to end on tiny random models (seconds, not minutes)."""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from hasten.diffusion import BlockAdaptive, FirstBlockCache, NoCache, TaylorSeer
from hasten.diffusion import bench, recipes, sim
from hasten.diffusion.cli import COMMANDS
from hasten.diffusion.models import dit as dit_model
from hasten.diffusion.models import policy as policy_model
from hasten.zoo.packing import has_tensors

TINY_DIT = dict(num_layers=2, num_attention_heads=2, attention_head_dim=8, patch_size=8)
TINY_POLICY = policy_model.PolicyConfig(dim=16, layers=2, heads=2)


def few_settings(calibration):
    return [NoCache(), TaylorSeer(interval=2, order=1, warmup=1), FirstBlockCache(0.5),
            BlockAdaptive(calibration, updates=2)]


def test_bench_dit_on_a_tiny_model(tmp_path):
    torch.manual_seed(0)
    model = dit_model.build_dit(**TINY_DIT).eval()
    report = bench.bench_dit(model, tmp_path, steps=4, images=2, repeats=1, progress=False, settings=few_settings)
    rows = {r["policy"]: r for r in report["results"]}
    assert rows["NoCache"]["computed"] == 1.0 and rows["NoCache"]["flop_ratio"] == 1.0
    assert rows["NoCache"]["psnr"] == 99 and rows["NoCache"]["ssim"] == 1.0  # bit-identical
    assert rows["TaylorSeer"]["computed"] == 0.75  # steps 0, 1, 3 of 4 are computed... per block: 0,1,3 -> 3/4
    assert rows["TaylorSeer"]["flop_ratio"] < 1.0
    assert rows["BlockAdaptive"]["computed"] <= 1.0
    assert (tmp_path / report["grid"]).is_file() and (tmp_path / report["calibration"]).is_file()
    table = bench.markdown({"dit": report})
    assert table.count("\n| ") == 2 + len(rows) - 1 and "PSNR" in table


def test_bench_policy_on_a_tiny_model(tmp_path):
    torch.manual_seed(0)
    model = policy_model.TransformerForDiffusion(TINY_POLICY).eval()
    report = bench.bench_policy(model, tmp_path, steps=4, rollouts=3, repeats=1, progress=False,
                                settings=few_settings)
    rows = {r["policy"]: r for r in report["results"]}
    assert rows["NoCache"]["action_rmse"] == 0.0
    assert rows["NoCache"]["success_rate"] == report["full"]["success_rate"]
    assert rows["TaylorSeer"]["computed"] < 1.0
    assert "success" in bench.markdown({"policy": report})


def test_cli_bench_end_to_end(tmp_path, monkeypatch):
    torch.manual_seed(0)
    dit_model.save_dit(dit_model.build_dit(**TINY_DIT), tmp_path / "dit")
    policy_model.save_policy(policy_model.TransformerForDiffusion(TINY_POLICY), tmp_path / "policy")
    name, _, add, run = COMMANDS[0]
    parser = argparse.ArgumentParser()
    add(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["bench", "--out", str(out), "--steps", "3", "--images", "2", "--rollouts", "2",
                              "--repeats", "1", "--no-progress", "--dit-weights", str(tmp_path / "dit"),
                              "--policy-weights", str(tmp_path / "policy")])
    two = lambda cal: [NoCache(), TaylorSeer(interval=2, warmup=1)]  # noqa: E731
    monkeypatch.setattr(bench, "dit_settings", two)
    monkeypatch.setattr(bench, "policy_settings", two)
    assert run(args) == 0
    report = json.loads((out / "results.json").read_text())
    assert name == "diffusion" and {"dit", "policy", "torch", "machine"} <= set(report)
    assert (out / "results.md").is_file() and (out / "dit-grid.png").is_file()


def test_recipes_smoke(tmp_path):
    stats = recipes.train_dit(tmp_path / "dit", steps=2, batch=4, lr=1e-3)
    assert np.isfinite(stats["final_loss"])
    model = dit_model.load_dit(tmp_path / "dit")
    assert dit_model.generate(model, torch.tensor([0, 1]), steps=2).shape == (2, 3, 32, 32)
    stats = recipes.train_policy(tmp_path / "policy", steps=2, batch=8, lr=1e-3, episodes=4, eval_episodes=0)
    assert np.isfinite(stats["final_loss"]) and policy_model.load_policy(tmp_path / "policy")[0].config.dim == 96
    obs, actions = recipes.policy_dataset(3, 0, policy_model.PolicyConfig())
    assert obs.shape[1:] == (2, sim.OBS_DIM) and actions.shape[1:] == (16, sim.ACTION_DIM)
    assert actions.abs().max() <= 1.0


def test_expert_succeeds_and_straight_line_does_not():
    ep = sim.reset(200, 0)
    while not ep.done.all():
        sim.step(ep, sim.expert_action(ep))
    assert ep.success.mean() > 0.97
    straight = sim.rollout(lambda h: np.repeat(np.clip((h[:, -1, 2:4] - h[:, -1, :2]) / sim.MAX_MOVE, -1, 1)[:, None],
                                               8, axis=1), 200, 0)
    assert straight["collision_rate"] > 0.5
    demos = sim.demonstrations(10, 0)
    assert len(demos) >= 9 and all(np.abs(a).max() <= 1 for _, a in demos)


def test_shapes_are_drawn_in_range_and_by_class():
    g = torch.Generator().manual_seed(0)
    images = dit_model.draw_shapes(torch.arange(6), g)
    assert images.shape == (6, 3, 32, 32) and images.min() >= -1 and images.max() <= 1


def test_shipped_models_load_and_never_reuse_is_bit_identical():
    from hasten.diffusion import cached

    # shipped weights are part of the package: a missing file is a packaging bug, so it fails here
    assert has_tensors(dit_model.WEIGHTS / "model.safetensors"), f"shipped DiT weights missing in {dit_model.WEIGHTS}"
    model = dit_model.load_dit()
    labels = torch.tensor([0, 4])
    reference = dit_model.generate(model, labels, seed=1, steps=3)
    with cached(model, TaylorSeer(interval=1)):
        assert torch.equal(dit_model.generate(model, labels, seed=1, steps=3), reference)
    policy, _ = policy_model.load_policy()
    obs = np.zeros((2, 2, sim.OBS_DIM), np.float32)
    reference = policy_model.actor(policy, steps=3)(obs)
    with cached(policy, BlockAdaptive(bench_calibration(policy), updates=3)):
        assert np.array_equal(policy_model.actor(policy, steps=3)(obs), reference)


def bench_calibration(policy):
    from hasten.diffusion import calibrate

    obs = np.zeros((2, 2, sim.OBS_DIM), np.float32)
    return calibrate(policy, lambda: policy_model.actor(policy, steps=3)(obs), num_steps=3)
