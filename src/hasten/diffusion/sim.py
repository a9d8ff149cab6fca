"""Planar reaching around an obstacle, simulated in numpy for many episodes at once.

A point agent starts at the bottom of the square [-1, 1]^2 and must reach a goal at the top; a disc
lies across the straight path. Touching the disc fails the episode; coming within ``GOAL_RADIUS``
of the goal succeeds; ``MAX_STEPS`` without either is a time-out. An action is the next
displacement in units of ``MAX_MOVE`` per axis (so actions live in [-1, 1]^2).

The scripted expert goes around the disc along the tangent of a slightly inflated disc, then
straight to the goal. While the agent is near the line through the disc's centre and the goal, the
side is the one drawn at random for the episode (the demonstrations are bimodal, as in Chi et al.'s
Push-T); once it is clearly on one side, it keeps to that side, so the expert's choice can always
be read from the observations. Observation: [agent x, y, goal x, y, disc x, y, disc radius].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

MAX_MOVE = 0.05
GOAL_RADIUS = 0.06
MAX_STEPS = 100
OBS_DIM, ACTION_DIM = 7, 2
SIDE_COMMITTED = 0.1  # lateral offset from the centre-goal line beyond which the expert keeps its side


@dataclass
class Episodes:
    """Batch state: every array's first axis is the episode."""

    pos: np.ndarray  # [n, 2]
    goal: np.ndarray  # [n, 2]
    center: np.ndarray  # [n, 2]
    radius: np.ndarray  # [n]
    side: np.ndarray  # [n], +1 or -1: the expert's way around the disc
    done: np.ndarray  # [n] bool
    success: np.ndarray  # [n] bool
    collided: np.ndarray  # [n] bool
    steps: np.ndarray  # [n] int, steps taken

    def observe(self) -> np.ndarray:
        """[n, OBS_DIM] float32."""
        return np.concatenate([self.pos, self.goal, self.center, self.radius[:, None]], axis=1).astype(np.float32)


def reset(n: int, seed: int) -> Episodes:
    rng = np.random.default_rng(seed)
    start = np.stack([rng.uniform(-0.6, 0.6, n), rng.uniform(-0.9, -0.7, n)], axis=1)
    goal = np.stack([rng.uniform(-0.6, 0.6, n), rng.uniform(0.7, 0.9, n)], axis=1)
    center = (start + goal) / 2 + rng.uniform(-0.08, 0.08, (n, 2))
    radius = rng.uniform(0.2, 0.32, n)
    side = rng.choice([-1.0, 1.0], n)
    false = np.zeros(n, dtype=bool)
    return Episodes(start, goal, center, radius, side, false.copy(), false.copy(), false.copy(), np.zeros(n, int))


def _rotate(v: np.ndarray, angle: np.ndarray) -> np.ndarray:
    c, s = np.cos(angle), np.sin(angle)
    return np.stack([c * v[:, 0] - s * v[:, 1], s * v[:, 0] + c * v[:, 1]], axis=1)


def expert_action(ep: Episodes) -> np.ndarray:
    """[n, 2] in [-1, 1]: straight to the goal when the path is clear, else along the disc's tangent."""
    to_goal = ep.goal - ep.pos
    dist_goal = np.linalg.norm(to_goal, axis=1)
    # is the segment pos -> goal within radius + 0.08 of the centre?
    along = np.clip(np.einsum("nd,nd->n", ep.center - ep.pos, to_goal) / np.maximum(dist_goal**2, 1e-9), 0, 1)
    closest = ep.pos + along[:, None] * to_goal
    blocked = np.linalg.norm(ep.center - closest, axis=1) < ep.radius + 0.08
    to_center = ep.center - ep.pos
    dist_center = np.linalg.norm(to_center, axis=1)
    axis = (ep.goal - ep.center) / np.maximum(np.linalg.norm(ep.goal - ep.center, axis=1), 1e-9)[:, None]
    lateral = axis[:, 0] * (ep.pos - ep.center)[:, 1] - axis[:, 1] * (ep.pos - ep.center)[:, 0]  # signed offset
    side = np.where(np.abs(lateral) > SIDE_COMMITTED, -np.sign(lateral), ep.side)
    inflated = ep.radius + 0.12
    angle = np.arcsin(np.clip(inflated / np.maximum(dist_center, 1e-9), 0, 1)) + 0.05
    tangent = _rotate(to_center / np.maximum(dist_center, 1e-9)[:, None], -side * angle)
    heading = np.where(blocked[:, None], tangent, to_goal / np.maximum(dist_goal, 1e-9)[:, None])
    move = heading * np.minimum(MAX_MOVE, np.where(blocked, MAX_MOVE, dist_goal))[:, None]
    return np.clip(move / MAX_MOVE, -1, 1)


def step(ep: Episodes, action: np.ndarray) -> None:
    """Apply actions [n, 2] to the episodes not done yet (in place)."""
    live = ~ep.done
    move = np.clip(action, -1, 1) * MAX_MOVE
    ep.pos = np.where(live[:, None], np.clip(ep.pos + move, -1, 1), ep.pos)
    ep.steps = ep.steps + live
    hit = live & (np.linalg.norm(ep.pos - ep.center, axis=1) < ep.radius)
    reached = live & ~hit & (np.linalg.norm(ep.pos - ep.goal, axis=1) < GOAL_RADIUS)
    ep.collided |= hit
    ep.success |= reached
    ep.done |= hit | reached | (ep.steps >= MAX_STEPS)


def demonstrations(n: int, seed: int, noise: float = 0.1) -> list[tuple[np.ndarray, np.ndarray]]:
    """Expert episodes: (observations [steps, OBS_DIM], expert actions [steps, 2]) each, successes only.

    The executed action carries Gaussian noise (std ``noise``, action units) while the recorded label
    is the expert's clean action, so the data also show how to recover from small drifts.
    """
    rng = np.random.default_rng(seed + 1)
    ep = reset(n, seed)
    obs, actions, live = [], [], []
    while not ep.done.all():
        live.append(~ep.done)
        obs.append(ep.observe())
        label = expert_action(ep)
        actions.append(label.astype(np.float32))
        step(ep, label + noise * rng.standard_normal(label.shape))
    obs, actions, live = np.stack(obs, 1), np.stack(actions, 1), np.stack(live, 1)  # [n, steps, ...]
    return [(obs[i, live[i]], actions[i, live[i]]) for i in range(n) if ep.success[i]]


Actor = Callable[[np.ndarray], np.ndarray]  # observation history [n, obs_steps, OBS_DIM] -> actions [n, horizon, 2]


def rollout(act: Actor, n: int, seed: int, obs_steps: int = 2, execute: int = 8) -> dict:
    """Closed-loop evaluation of ``n`` episodes at once: the policy is asked for an action sequence,
    the first ``execute`` actions are applied, and so on until every episode is done."""
    ep = reset(n, seed)
    history = [ep.observe()] * obs_steps
    calls = 0
    while not ep.done.all():
        actions = act(np.stack(history[-obs_steps:], axis=1))  # [n, horizon, 2]
        calls += 1
        for k in range(min(execute, actions.shape[1])):
            step(ep, actions[:, k])
            history.append(ep.observe())
            if ep.done.all():
                break
    return {"episodes": n, "success_rate": float(ep.success.mean()), "collision_rate": float(ep.collided.mean()),
            "timeout_rate": float((~ep.success & ~ep.collided).mean()), "mean_steps": float(ep.steps.mean()),
            "policy_calls": calls}
