"""``hasten diffusion bench``: speed against quality of every caching policy on the project's models.

For every policy setting, against full compute of the same seeds on the same machine in the same run:

* ``computed``: fraction of unit (block or sub-module) computations actually run, counted exactly;
* ``flop_ratio``: FLOPs of the cached sampling run / FLOPs of the full one (torch's FlopCounterMode:
  matmuls, convolutions and attention; the forecasts' element-wise arithmetic is not counted);
* ``speedup``: median wall time of full compute / median wall time with the policy, timed in
  interleaved rounds (full, then every setting, ``repeats`` times);
* DiT: PSNR and SSIM of each image against its full-compute twin (mean and worst);
* policy: success rate over ``rollouts`` closed-loop episodes (same episodes, same noise seeds as
  full compute), and the RMS difference of sampled actions against full compute on fixed observations.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from . import sim
from .bac import BlockAdaptive, calibrate
from .hooks import cached
from .metrics import psnr, ssim
from .models import dit as dit_model
from .models import policy as policy_model
from .policies import FirstBlockCache, FixedInterval, NoCache, TaylorSeer, describe


def _count_cpu_attention() -> None:
    """FlopCounterMode knows the CUDA attention kernels; teach it the CPU one too."""
    from torch.utils import flop_counter

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if op not in flop_counter.flop_registry and op.default not in flop_counter.flop_registry:
        flop_counter.register_flop_formula(op, get_raw=True)(flop_counter.sdpa_flop)  # already shape-converting


def dit_settings(calibration: Path) -> list:
    return [
        NoCache(),
        *[TaylorSeer(interval=n, order=o, warmup=3) for n, o in [(2, 1), (3, 1), (3, 2), (4, 1), (4, 2), (5, 2), (6, 2)]],
        *[TaylorSeer(interval=n, order=2, warmup=3, granularity="submodule") for n in (4, 5)],
        *[FixedInterval(n) for n in (2, 3, 4, 5)],
        *[FirstBlockCache(th) for th in (0.05, 0.1, 0.2, 0.3)],
        *[BlockAdaptive(calibration, updates=u) for u in (25, 17, 13, 10)],
    ]


def policy_settings(calibration: Path) -> list:
    return [
        NoCache(),
        *[TaylorSeer(interval=n, order=o, warmup=3) for n, o in [(2, 1), (3, 2), (4, 2), (6, 2)]],
        TaylorSeer(interval=4, order=2, warmup=3, granularity="submodule"),
        *[FixedInterval(n) for n in (2, 3, 5)],
        *[FirstBlockCache(th) for th in (0.05, 0.1, 0.2)],
        *[BlockAdaptive(calibration, updates=u) for u in (25, 20, 17, 13, 10, 8)],
        BlockAdaptive(calibration, updates=17, union_top_k=0),  # without the Bubbling Union
    ]


def _counted(fn: Callable[[], object]) -> tuple[object, int]:
    _count_cpu_attention()
    with FlopCounterMode(display=False) as counter:
        out = fn()
    return out, counter.get_total_flops()


def _cached_run(model, policy, steps: int, fn):
    """``fn`` with ``policy``'s caching hooks on the model, as the timed rounds call it."""
    def run():
        with cached(model, policy, num_steps=steps):
            fn()
    return run


def _timed_rounds(baseline: Callable[[], object], runs: list[Callable[[], object]], repeats: int,
                  progress: bool) -> tuple[list[float], list[list[float]]]:
    """Interleaved: each round times the baseline, then every run once."""
    base, times = [], [[] for _ in runs]
    for _ in tqdm(range(repeats), desc="timing rounds", disable=not progress, leave=False):
        t0 = time.perf_counter()
        baseline()
        base.append(time.perf_counter() - t0)
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - t0)
    return base, times


def _row(policy, stats, flops: int, full_flops: int, base: list[float], times: list[float]) -> dict:
    return {"policy": type(policy).__name__, "setting": describe(policy), "computed": 1 - stats.skipped_fraction,
            "flop_ratio": flops / full_flops, "speedup": statistics.median(base) / statistics.median(times),
            "seconds": statistics.median(times), "counts": stats.to_dict()}


# ---------------------------------------------------------------- DiT


def bench_dit(model, out_dir: Path, steps: int = 50, images: int = 12, repeats: int = 3, seed: int = 0,
              progress: bool = True, settings: Callable[[Path], list] = dit_settings) -> dict:
    classes = model.config.num_embeds_ada_norm
    labels = torch.arange(images) % classes
    sample = lambda: dit_model.generate(model, labels, seed=seed, steps=steps)  # noqa: E731
    reference, full_flops = _counted(sample)  # [images, 3, H, W]
    calibration = out_dir / "dit-calibration.json"
    calib_labels = torch.arange(classes)
    calibrate(model, lambda: dit_model.generate(model, calib_labels, seed=seed + 1000, steps=steps),
              num_steps=steps).save(calibration)
    settings = settings(calibration)
    rows, outputs = [], []
    for policy in tqdm(settings, desc="dit settings", disable=not progress):
        with cached(model, policy, num_steps=steps) as session:
            out, flops = _counted(sample)
        p, s = psnr(out, reference), ssim(out, reference)
        rows.append({"stats": session.stats, "flops": flops, "psnr": float(p.clamp(max=99).mean()),
                     "psnr_min": float(p.clamp(max=99).min()), "ssim": float(s.mean()), "ssim_min": float(s.min())})
        outputs.append(out)

    base, times = _timed_rounds(sample, [_cached_run(model, p, steps, sample) for p in settings], repeats, progress)
    results = []
    for policy, row, t in zip(settings, rows, times):
        entry = _row(policy, row.pop("stats"), row.pop("flops"), full_flops, base, t)
        results.append({**entry, **row})
    grid = out_dir / "dit-grid.png"
    save_grid(reference, outputs, [r["setting"] for r in results], [r["psnr"] for r in results], grid)
    return {"model": "dit-shapes", "steps": steps, "images": images, "seed": seed, "repeats": repeats,
            "full_seconds": statistics.median(base), "full_flops": full_flops, "grid": grid.name,
            "calibration": calibration.name, "results": results}


def save_grid(reference: torch.Tensor, outputs: list[torch.Tensor], labels: list[str], psnrs: list[float],
              path: Path) -> None:
    """Rows: full compute, then each setting; columns: the images. reference [n, 3, H, W] in [-1, 1]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strip = lambda x: ((x.clamp(-1, 1) + 1) / 2).permute(2, 0, 3, 1).reshape(x.shape[2], -1, 3).numpy()  # noqa: E731
    rows = [("full compute", reference)] + [(f"{label}  PSNR {p:.1f} dB", out)
                                           for label, p, out in zip(labels, psnrs, outputs)]
    fig, axes = plt.subplots(len(rows), 1, figsize=(0.55 * reference.shape[0] + 0.5, 0.75 * len(rows)))
    for ax, (title, images) in zip(np.atleast_1d(axes), rows):
        ax.imshow(strip(images), interpolation="nearest")
        ax.set_title(title, fontsize=7, loc="left", pad=2)
        ax.axis("off")
    fig.tight_layout(pad=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- diffusion policy


def _observations(n: int, seed: int, obs_steps: int) -> torch.Tensor:
    """Observation histories from expert demonstrations: [n, obs_steps, obs_dim]."""
    hist = []
    for obs, _ in sim.demonstrations(max(8, n // 20), seed):
        for t in range(len(obs)):
            hist.append(obs[np.clip(np.arange(t - obs_steps + 1, t + 1), 0, None)])
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.stack(hist)[rng.choice(len(hist), n, replace=False)])


def bench_policy(model, out_dir: Path, steps: int = 50, rollouts: int = 100, repeats: int = 3, seed: int = 0,
                 progress: bool = True, settings: Callable[[Path], list] = policy_settings,
                 env_seed: int = 20_000) -> dict:
    c = model.config
    obs = _observations(128, seed + 7, c.obs_steps)  # fixed observations for the action comparison
    noise_seed = seed

    def actions():  # [128, horizon, action_dim] for the fixed observations
        return torch.from_numpy(policy_model.actor(model, steps, noise_seed)(obs.numpy()))

    def roll():
        return sim.rollout(policy_model.actor(model, steps, noise_seed), rollouts, env_seed, c.obs_steps)

    reference, full_flops = _counted(actions)
    full = roll()
    calibration = out_dir / "policy-calibration.json"
    calib_obs = _observations(64, seed + 11, c.obs_steps).numpy()
    calibrate(model, lambda: policy_model.actor(model, steps, seed + 1)(calib_obs), num_steps=steps).save(calibration)
    settings = settings(calibration)
    rows = []
    for policy in tqdm(settings, desc="policy settings", disable=not progress):
        with cached(model, policy, num_steps=steps):
            out, flops = _counted(actions)
        with cached(model, policy, num_steps=steps) as session:
            outcome = roll()
        rmse = float((out - reference).pow(2).mean().sqrt())
        rows.append({"stats": session.stats, "flops": flops, "action_rmse": rmse, **outcome})

    batch = torch.from_numpy(np.repeat(obs.numpy()[:1], rollouts, axis=0))  # one policy call for every episode
    call = lambda: policy_model.actor(model, steps, noise_seed)(batch.numpy())  # noqa: E731

    base, times = _timed_rounds(call, [_cached_run(model, p, steps, call) for p in settings], repeats, progress)
    results = [{**_row(p, row.pop("stats"), row.pop("flops"), full_flops, base, t), **row}
               for p, row, t in zip(settings, rows, times)]
    return {"model": "policy-reach", "steps": steps, "rollouts": rollouts, "env_seed": env_seed, "seed": seed,
            "repeats": repeats, "full_seconds": statistics.median(base), "full_flops": full_flops,
            "full": full, "calibration": calibration.name, "results": results}


# ---------------------------------------------------------------- report


def markdown(report: dict) -> str:
    lines = []
    for key, section in (("dit", report.get("dit")), ("policy", report.get("policy"))):
        if not section:
            continue
        if key == "dit":
            lines += [f"### DiT ({section['images']} images, {section['steps']} DDIM steps, full compute "
                      f"{section['full_seconds']:.2f} s)", "",
                      "| setting | computed | FLOP ratio | speedup | PSNR (dB) | worst PSNR | SSIM |",
                      "|---|---:|---:|---:|---:|---:|---:|"]
            for r in section["results"]:
                lines.append(f"| {r['setting']} | {r['computed']:.0%} | {r['flop_ratio']:.2f} | {r['speedup']:.2f}x "
                             f"| {r['psnr']:.1f} | {r['psnr_min']:.1f} | {r['ssim']:.3f} |")
        else:
            full = section["full"]
            lines += [f"### Diffusion policy ({section['rollouts']} rollouts, {section['steps']} DDIM steps, "
                      f"full compute success {full['success_rate']:.0%}, one call for all episodes "
                      f"{section['full_seconds']:.2f} s)", "",
                      "| setting | computed | FLOP ratio | speedup | success | vs full (points) | collisions "
                      "| action RMSE |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
            for r in section["results"]:
                delta = 100 * (r["success_rate"] - full["success_rate"])
                lines.append(f"| {r['setting']} | {r['computed']:.0%} | {r['flop_ratio']:.2f} | {r['speedup']:.2f}x "
                             f"| {r['success_rate']:.0%} | {delta:+.0f} | {r['collision_rate']:.0%} "
                             f"| {r['action_rmse']:.3f} |")
        lines.append("")
    return "\n".join(lines)
