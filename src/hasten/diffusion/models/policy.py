"""A diffusion-policy transformer in the shape of Chi et al.'s ``TransformerForDiffusion`` (2023).

The noisy action sequence is the decoder's input (one token per future action, causal
self-attention); the diffusion step and the last ``obs_steps`` observations, embedded and passed
through a small MLP, are the memory it cross-attends to. Each decoder layer is pre-norm with three
residual branches, ``self_attn``, ``cross_attn`` and ``ff``: the sub-modules BAC caches one by one.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...zoo.packing import has_tensors, read_tensors, write_packed

WEIGHTS = Path(__file__).resolve().parent.parent / "weights" / "policy-reach"


@dataclass(frozen=True)
class PolicyConfig:
    action_dim: int = 2
    obs_dim: int = 7
    horizon: int = 16  # actions predicted per call
    obs_steps: int = 2  # observations conditioned on
    dim: int = 96
    layers: int = 4
    heads: int = 4


class Attention(nn.Module):
    """Pre-norm multi-head attention branch: returns the residual update, not x + update."""

    def __init__(self, dim: int, heads: int, causal: bool):
        super().__init__()
        self.norm, self.heads, self.causal = nn.LayerNorm(dim), heads, causal
        self.q, self.kv, self.out = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape  # [batch, tokens, dim]
        h = self.norm(x)
        source = h if memory is None else memory  # [batch, source tokens, dim]
        split = lambda t: t.view(b, t.shape[1], self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q = split(self.q(h))  # [batch, heads, tokens, head_dim]
        k, v = (split(t) for t in self.kv(source).chunk(2, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, mult * dim), nn.GELU(), nn.Linear(mult * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.self_attn = Attention(dim, heads, causal=True)
        self.cross_attn = Attention(dim, heads, causal=False)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x)
        x = x + self.cross_attn(x, memory)
        return x + self.ff(x)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding: t [batch] -> [batch, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / (half - 1))
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class TransformerForDiffusion(nn.Module):
    def __init__(self, config: PolicyConfig = PolicyConfig()):
        super().__init__()
        c = self.config = config
        self.input_emb = nn.Linear(c.action_dim, c.dim)
        self.pos_emb = nn.Parameter(torch.zeros(1, c.horizon, c.dim))
        self.obs_emb = nn.Linear(c.obs_dim, c.dim)
        self.cond_pos_emb = nn.Parameter(torch.zeros(1, 1 + c.obs_steps, c.dim))
        self.encoder = nn.Sequential(nn.Linear(c.dim, 4 * c.dim), nn.Mish(), nn.Linear(4 * c.dim, c.dim))
        self.layers = nn.ModuleList([DecoderLayer(c.dim, c.heads) for _ in range(c.layers)])
        self.norm_out = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.action_dim)
        nn.init.normal_(self.pos_emb, std=0.02)
        nn.init.normal_(self.cond_pos_emb, std=0.02)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """sample [batch, horizon, action_dim]; timestep [batch]; cond [batch, obs_steps, obs_dim] -> noise, like sample."""
        tokens = torch.cat([timestep_embedding(timestep, self.config.dim)[:, None], self.obs_emb(cond)], dim=1)
        memory = self.encoder(tokens + self.cond_pos_emb)  # [batch, 1 + obs_steps, dim]
        x = self.input_emb(sample) + self.pos_emb  # [batch, horizon, dim]
        for layer in self.layers:
            x = layer(x, memory)
        return self.head(self.norm_out(x))


def save_policy(model: TransformerForDiffusion, path: str | Path, extra: dict | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_packed(model.state_dict(), path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({**asdict(model.config), **(extra or {})}, indent=1))


def load_policy(path: str | Path = WEIGHTS) -> tuple[TransformerForDiffusion, dict]:
    """(model in float32 eval mode, config dict including the normalisation the recipe saved)."""
    path = Path(path)
    if not has_tensors(path / "model.safetensors"):
        raise FileNotFoundError(f"no policy weights at {path}; train them with: python -m hasten.diffusion.recipes policy")
    record = json.loads((path / "config.json").read_text())
    fields = PolicyConfig.__dataclass_fields__
    model = TransformerForDiffusion(PolicyConfig(**{k: v for k, v in record.items() if k in fields}))
    model.load_state_dict({k: v.float() for k, v in read_tensors(path / "model.safetensors").items()})
    return model.eval(), record


EVAL_STEPS = 50  # DDIM steps per action sequence at evaluation


def actor(model: TransformerForDiffusion, steps: int = EVAL_STEPS, seed: int = 0):
    """A closed-loop actor for sim.rollout: observation history [n, obs_steps, obs_dim] (numpy) ->
    actions [n, horizon, action_dim] (numpy). The initial noise of successive calls comes from one
    generator seeded with ``seed``, so a rollout is reproducible."""
    from ..sampling import ddim_sample

    generator = torch.Generator().manual_seed(seed)
    c = model.config

    @torch.no_grad()
    def act(history):
        cond = torch.as_tensor(history, dtype=torch.float32)  # [n, obs_steps, obs_dim]
        noise = torch.randn(cond.shape[0], c.horizon, c.action_dim, generator=generator)

        def eps(x, t):  # x [n, horizon, action_dim]
            return model(x, torch.full((x.shape[0],), t, dtype=torch.long), cond)

        return ddim_sample(eps, noise, steps).numpy()

    return act
