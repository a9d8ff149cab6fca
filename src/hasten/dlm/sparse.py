"""SparseD (Wang et al. 2025): head-specific block-sparse attention for diffusion LMs.

Full attention for the first ``skip`` fraction of the steps (early denoising steps shape the
output most); at the first step after them every head of every layer picks, for each block of
``block`` queries, the ``select`` fraction of key blocks that took most of its attention
probability; every later step reuses those patterns, which barely change across steps.

The sparse attention is gather-based (it runs on CPU): each query block attends to the keys of its
own selected key blocks, gathered into one dense tile, so its cost is ``select`` of full attention.
It reaches the model through ``transformers.AttentionInterface`` as ``"hasten_sparsed"``; the
per-generation state travels in the forward's keyword arguments, not on the model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..core.settings import Settings
from .forward import full_forward
from .policies import Layout, Runtime, StepView

ATTENTION_NAME = "hasten_sparsed"


@dataclass
class SparseState:
    """One generation's attention mode and per-layer patterns."""

    block: int
    select: float
    mode: str = "full"  # full | select (full attention that also picks the patterns) | sparse
    patterns: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, query blocks, kept] key blocks


def pick_patterns(probs: torch.Tensor, block: int, select: float) -> torch.Tensor:
    """probs [heads, length, length] -> per head and query block, the key blocks holding most of the
    attention mass, sorted: [heads, blocks, kept] with kept = ceil(select * blocks)."""
    heads, length, _ = probs.shape
    blocks = math.ceil(length / block)
    pad = blocks * block - length
    padded = F.pad(probs, (0, pad, 0, pad))  # [heads, padded, padded]
    mass = padded.view(heads, blocks, block, blocks, block).sum((2, 4))  # [heads, query blocks, key blocks]
    kept = max(1, math.ceil(select * blocks))
    return mass.topk(kept, dim=-1).indices.sort(-1).values


def block_sparse_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pattern: torch.Tensor,
                           block: int, scaling: float) -> torch.Tensor:
    """query [heads, length, dim], key/value [kv_heads, length, dim], pattern [heads, blocks, kept]
    -> [heads, length, dim]: each query block attends only to the keys of its kept key blocks."""
    heads, length, dim = query.shape
    kv_heads = key.shape[0]
    blocks, kept = pattern.shape[1:]
    pad = blocks * block - length
    query_blocks = F.pad(query, (0, 0, 0, pad)).reshape(heads, blocks, block, dim)
    key_blocks = F.pad(key, (0, 0, 0, pad)).reshape(kv_heads * blocks, block * dim)
    value_blocks = F.pad(value, (0, 0, 0, pad)).reshape(kv_heads * blocks, block * dim)
    # One flat index_select per tensor: much faster on CPU than advanced indexing with broadcast indices.
    kv_head = torch.arange(heads, device=query.device) // (heads // kv_heads)  # [heads]
    flat = (kv_head[:, None, None] * blocks + pattern).reshape(-1)  # [heads * blocks * kept]
    gathered_keys = key_blocks.index_select(0, flat).view(heads, blocks, kept * block, dim)
    gathered_values = value_blocks.index_select(0, flat).view(heads, blocks, kept * block, dim)
    padding = None
    if pad:  # padded keys never count
        key_position = (pattern[..., None] * block + torch.arange(block, device=query.device)).view(heads, blocks, -1)
        padding = torch.zeros(key_position.shape, dtype=query.dtype, device=query.device)
        padding = padding.masked_fill_(key_position >= length, float("-inf"))[:, :, None]
    out = F.scaled_dot_product_attention(query_blocks, gathered_keys, gathered_values, attn_mask=padding,
                                         scale=scaling)  # [heads, blocks, block, dim]
    return out.reshape(heads, blocks * block, dim)[:, :length]


def _full_with_probs(query, key, value, scaling, groups):
    """Plain attention that also returns its probabilities. query [heads, L, d] -> ([heads, L, d], [heads, L, L])"""
    key = key.repeat_interleave(groups, dim=0)
    value = value.repeat_interleave(groups, dim=0)
    probs = torch.softmax((query @ key.transpose(-1, -2)) * scaling, dim=-1)
    return probs @ value, probs


def sparsed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      sparsed: SparseState | None = None, **kwargs):
    """The attention function registered as ``hasten_sparsed``: sdpa unless ``sparsed`` says otherwise.
    query [1, heads, L, d], key/value [1, kv_heads, L, d] -> ([1, L, heads, d], None)."""
    if sparsed is None or sparsed.mode == "full" or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if sparsed.mode == "select":
        out, probs = _full_with_probs(query[0], key[0], value[0], scaling, query.shape[1] // key.shape[1])
        sparsed.patterns[module.layer_idx] = pick_patterns(probs, sparsed.block, sparsed.select)
    else:
        out = block_sparse_attention(query[0], key[0], value[0], sparsed.patterns[module.layer_idx], sparsed.block,
                                     scaling)
    return out.transpose(0, 1)[None].contiguous(), None


AttentionInterface.register(ATTENTION_NAME, sparsed_attention)


class _SparseRuntime(Runtime):
    def __init__(self, model, layout: Layout, settings: "SparseD"):
        super().__init__(model, layout)
        self.full_steps = math.ceil(settings.skip * layout.num_steps)
        self.state = SparseState(settings.block, settings.select)
        blocks = math.ceil(layout.length / settings.block)
        self.kept = max(1, math.ceil(settings.select * blocks)) / blocks
        self.previous = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)

    def logits(self, tokens: torch.Tensor, view: StepView) -> torch.Tensor:
        kept = 1.0
        if view.step >= self.full_steps:
            self.state.mode = "sparse" if self.state.patterns else "select"
            kept = self.kept if self.state.mode == "sparse" else 1.0
        return full_forward(self.model, tokens, view.rows, self.counts, self.per_pair, kept=kept, sparsed=self.state)

    def close(self) -> None:
        self.model.set_attn_implementation(self.previous)


@dataclass(frozen=True)
class SparseD(Settings):
    """Full attention for the first ``skip`` fraction of steps, then per-head block-sparse attention
    keeping ``select`` of the key blocks (chosen once, reused); ``select=1.0`` is full attention."""

    skip: float = 0.2
    select: float = 0.3
    block: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.skip <= 1:
            raise ValueError(f"SparseD: skip must be in [0, 1], got {self.skip}")
        if not 0 < self.select <= 1:
            raise ValueError(f"SparseD: select must be in (0, 1], got {self.select}")
        if self.block < 1:
            raise ValueError(f"SparseD: block must be >= 1, got {self.block}")

    def start(self, model, layout: Layout) -> Runtime:
        return _SparseRuntime(model, layout, self)
