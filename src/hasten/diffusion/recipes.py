"""Train the two models the diffusion benchmark measures on, offline, on one CPU thread.

    python -m hasten.diffusion.recipes all --threads 1          # dit, then policy

* ``dit``: the class-conditional DiT (models/dit.py) on procedurally drawn shapes, v-prediction,
  label dropout 0.1 for classifier-free guidance;
* ``policy``: the diffusion-policy transformer (models/policy.py) on noisy-executed expert
  demonstrations of the reaching task (sim.py), then a short rollout check of its success rate.

Both use AdamW with warm-up and cosine decay and keep an exponential moving average of the weights,
which is what gets saved (packed weights: hasten.zoo.packing; config.json; training.json) under --out-root.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..core.schedule import adamw
from ..core.training_loop import Budget, Schedule, TrainingLoop
from . import sim
from .models import dit as dit_model
from .models import policy as policy_model
from .sampling import TRAIN_STEPS, add_noise, target

DEFAULT_OUT = Path(__file__).resolve().parent / "weights"
DEFAULTS = {  # the shipped weights were trained with these, one thread, on a 2-core AMD EPYC VM
    "dit": dict(steps=1500, batch=64, lr=6e-4),
    "policy": dict(steps=2500, batch=256, lr=1e-3),
}


def train(model: torch.nn.Module, loss_fn: Callable[[torch.nn.Module, torch.Generator], torch.Tensor],
          steps: int, lr: float, seed: int, label: str) -> tuple[torch.nn.Module, dict]:
    """``steps`` steps of ``loss_fn`` through the training loop; returns (EMA copy of the model, stats)."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    optimizer = adamw([{"params": list(model.parameters()), "lr": lr, "weight_decay": 0.01}])
    model.train()
    state = TrainingLoop(optimizer, lambda: loss_fn(model, generator), Schedule(warmup_steps=max(1, steps // 20)),
                         Budget(steps=steps), after_step=lambda state: update_ema(ema, model, state.step),
                         label=label, window=100).run()
    stats = {"steps": steps, "lr": lr, "seed": seed, "minutes": round(state.elapsed_s / 60, 2),
             "final_loss": state.recent_metrics()["loss"], "threads": torch.get_num_threads(),
             "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    return ema, stats


@torch.no_grad()
def update_ema(ema: torch.nn.Module, model: torch.nn.Module, steps_done: int) -> None:
    """Move the moving average toward the weights, its decay growing with the steps to 0.999."""
    decay = min(0.999, steps_done / (9 + steps_done))
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p, 1 - decay)


# ---------------------------------------------------------------- DiT


def dit_loss(batch: int, label_dropout: float = 0.1):
    classes = len(dit_model.CLASSES)

    def loss_fn(model, generator):
        labels = torch.randint(0, classes, (batch,), generator=generator)
        x0 = dit_model.draw_shapes(labels, generator)  # [batch, 3, 32, 32]
        dropped = torch.rand(batch, generator=generator) < label_dropout
        labels = torch.where(dropped, classes, labels)  # the "no class" row, for classifier-free guidance
        noise = torch.randn(x0.shape, generator=generator)
        t = torch.randint(0, TRAIN_STEPS, (batch,), generator=generator)
        pred = model(add_noise(x0, noise, t), timestep=t, class_labels=labels).sample
        return torch.nn.functional.mse_loss(pred, target(x0, noise, t, dit_model.PREDICTION))

    return loss_fn


def train_dit(out: Path, steps: int, batch: int, lr: float, seed: int = 0) -> dict:
    model = dit_model.build_dit()
    # diffusers' LabelEmbedding would drop labels by itself in train mode, independently in each of
    # the blocks' embeddings; we drop them once per sample instead (dit_loss), for every block alike
    for module in model.modules():
        if hasattr(module, "dropout_prob") and hasattr(module, "embedding_table"):
            module.dropout_prob = 0.0
    ema, stats = train(model, dit_loss(batch), steps, lr, seed, "dit")
    dit_model.save_dit(ema, out)
    stats.update(batch=batch, params=sum(p.numel() for p in ema.parameters()))
    (out / "training.json").write_text(json.dumps(stats, indent=1))
    return stats


# ---------------------------------------------------------------- policy


def policy_dataset(episodes: int, seed: int, config: policy_model.PolicyConfig):
    """(observation histories [m, obs_steps, obs_dim], action chunks [m, horizon, 2]) from expert demos."""
    hist, chunks = [], []
    for obs, actions in sim.demonstrations(episodes, seed):
        steps = len(obs)
        for t in range(steps):
            idx = np.clip(np.arange(t - config.obs_steps + 1, t + 1), 0, None)  # repeat the first observation
            hist.append(obs[idx])
            chunk = np.zeros((config.horizon, sim.ACTION_DIM), np.float32)  # after the goal: stay
            tail = actions[t:t + config.horizon]
            chunk[:len(tail)] = tail
            chunks.append(chunk)
    return torch.from_numpy(np.stack(hist)), torch.from_numpy(np.stack(chunks))


def policy_loss(obs: torch.Tensor, actions: torch.Tensor, batch: int):
    def loss_fn(model, generator):
        idx = torch.randint(0, obs.shape[0], (batch,), generator=generator)
        x0, cond = actions[idx], obs[idx]  # [batch, horizon, 2], [batch, obs_steps, obs_dim]
        noise = torch.randn(x0.shape, generator=generator)
        t = torch.randint(0, TRAIN_STEPS, (batch,), generator=generator)
        return torch.nn.functional.mse_loss(model(add_noise(x0, noise, t), t, cond), noise)

    return loss_fn


def train_policy(out: Path, steps: int, batch: int, lr: float, seed: int = 0, episodes: int = 2000,
                 eval_episodes: int = 100) -> dict:
    config = policy_model.PolicyConfig()
    obs, actions = policy_dataset(episodes, seed, config)
    model = policy_model.TransformerForDiffusion(config)
    ema, stats = train(model, policy_loss(obs, actions, batch), steps, lr, seed, "policy")
    stats.update(batch=batch, episodes=episodes, samples=int(obs.shape[0]),
                 params=sum(p.numel() for p in ema.parameters()))
    if eval_episodes:
        act = policy_model.actor(ema, steps=policy_model.EVAL_STEPS, seed=seed)
        stats["check_rollouts"] = sim.rollout(act, eval_episodes, seed=10_000, obs_steps=config.obs_steps)
    policy_model.save_policy(ema, out)
    (out / "training.json").write_text(json.dumps(stats, indent=1))
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["dit", "policy", "all"])
    parser.add_argument("--out-root", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, help="optimizer steps (default per stage)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--episodes", type=int, default=2000, help="policy: expert demonstrations")
    parser.add_argument("--eval-episodes", type=int, default=100, help="policy: rollouts of the check (0: none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for stage in (["dit", "policy"] if args.stage == "all" else [args.stage]):
        d = DEFAULTS[stage]
        steps, batch = args.steps or d["steps"], args.batch or d["batch"]
        if stage == "dit":
            stats = train_dit(args.out_root / "dit-shapes", steps, batch, d["lr"], args.seed)
        else:
            stats = train_policy(args.out_root / "policy-reach", steps, batch, d["lr"], args.seed,
                                 args.episodes, args.eval_episodes)
        print(json.dumps({stage: stats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
