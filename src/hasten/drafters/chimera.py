"""Chimera: a lightweight drafter fusing short- and long-range context (Zeng et al. 2024,
"Chimera: A Lossless Decoding Method for Accelerating Large Language Models Inference by
Fusing all Tokens").

Three parts, all small:

* a **trigram encoder** at the bottom: the target's (frozen) embeddings of the last three
  committed tokens, ``x_{r-2}, x_{r-1}, x_r`` (the root included), projected together;
* a **full-context encoder**: one causal transformer layer over the target's last hidden
  states ``f_0 .. f_{r-1}``, with its own KV cache (committed features never change, so it
  only grows);
* **residual decoding heads**: head k (1-based) reads ``f_{r-1}`` plus a correction from
  the two encodings and guesses ``x_{r+k}`` through the target's frozen LM head.

All heads guess at once, so the candidates are a tree of top-k combinations
(:class:`~.candidates.CombinationTree`), chosen from the heads' measured rank accuracies.
Drafts are deterministic (``probs=None``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from ..training.trainer import Batch, option
from .base import Draft, DraftContext, EMPTY_DRAFT, register
from .candidates import CombinationTree, TreeSettings
from .feature_base import (
    KV, Block, CommittedKV, FeatureDrafter, FeatureModule, FeatureTraining, ModuleConfig, WeightsSetting, as_int,
    causal, heads_for, rank_hits,
)

GRAMS = 3  # tokens the short-range encoder reads


# ---- the model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChimeraConfig(ModuleConfig):
    embed_size: int = 0  # the target's input embedding width
    inner_size: int = 0  # width of the two encoders
    heads: int = 1  # attention heads of the context encoder
    num_heads: int = 4  # decoding heads: head k guesses the token k places after the root


class ResidualHead(nn.Module):
    """x + SiLU(Wx + b), zero-initialised (an untrained head changes nothing)."""

    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class ChimeraModel(FeatureModule):
    Config = ChimeraConfig
    name = "chimera"

    def __init__(self, config: ChimeraConfig):
        super().__init__(config)
        H, D = config.hidden_size, config.inner_size
        self.trigram = nn.Linear(GRAMS * config.embed_size, D)
        self.context_in = nn.Linear(H, D)
        self.context = Block(D, config.heads, 2 * D)
        self.fuse = nn.Linear(2 * D, H)  # zero-initialised: untrained, head input = f_{r-1}
        nn.init.zeros_(self.fuse.weight)
        nn.init.zeros_(self.fuse.bias)
        self.heads = nn.ModuleList(ResidualHead(H) for _ in range(config.num_heads))

    @classmethod
    def for_target(cls, target: PreTrainedModel, num_heads: int = 4, inner_ratio: float = 0.5) -> "ChimeraModel":
        sizes = cls.target_sizes(target)
        inner = max(8, int(sizes["hidden_size"] * inner_ratio) // 8 * 8)
        embed = int(target.get_input_embeddings().weight.shape[1])
        return cls(ChimeraConfig(**sizes, embed_size=embed, inner_size=inner, heads=heads_for(inner),
                                 num_heads=num_heads))

    def encode_context(self, features: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None,
                       past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """[B, n, H] features -> [B, n, D] context encodings (and new keys/values)."""
        return self.context(self.context_in(features), positions, visible, past)

    def head_inputs(self, feature: torch.Tensor, grams: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """feature [..., H] f_s; grams [..., 3, E] embeddings of x_{s-1}, x_s, x_{s+1};
        context [..., D] -> [..., H] what every decoding head starts from."""
        short = self.trigram(grams.flatten(-2).to(feature.dtype))
        return feature + self.fuse(F.silu(torch.cat([short, context], dim=-1)))

    def head_logits(self, inputs: torch.Tensor, k: int, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(self.heads[k](inputs))


def trigram_embeddings(embed: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """[B, T] ids -> [B, T, 3, E]: at position s the embeddings of x_{s-1}, x_s, x_{s+1}
    (zeros before the start or past the end)."""
    e = embed(ids)  # [B, T, E]
    zero = torch.zeros_like(e[:, :1])
    before = torch.cat([zero, e[:, :-1]], 1)
    after = torch.cat([e[:, 1:], zero], 1)
    return torch.stack([before, e, after], dim=2)


# ---- training (``hasten train chimera``) ------------------------------------------------------------
@dataclass(frozen=True)
class ChimeraTrainOptions:
    num_heads: int = option(4, "decoding heads: head k guesses the token k places after the root")
    inner_ratio: float = option(0.5, "width of the trigram and context encoders, relative to the hidden size")
    decay: float = option(0.8, "loss weight of head k is decay**(k-1): far heads matter less")

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if not 0 < self.inner_ratio <= 4:
            raise ValueError(f"inner_ratio must be in (0, 4], got {self.inner_ratio}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


class ChimeraTraining(FeatureTraining):
    Options = ChimeraTrainOptions

    def build(self) -> ChimeraModel:
        return ChimeraModel.for_target(self.target, self.options.num_heads, self.options.inner_ratio)

    def measured_levels(self, module: ChimeraModel) -> int:
        return module.config.num_heads

    def loss(self, module: ChimeraModel, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Head k (0-based) at position s (reading f_s and x_{s-1}, x_s, x_{s+1}) against
        x_{s+2+k}, weighted decay**k."""
        lm_head, embed = self.target.get_output_embeddings(), self.target.get_input_embeddings()
        features, ids = batch.hidden, batch.ids  # [B, T, H], [B, T]
        length = ids.shape[1]
        positions = torch.arange(length, device=ids.device).expand(len(ids), -1)
        context, _ = module.encode_context(features, positions, causal(length, device=ids.device))
        grams = trigram_embeddings(embed, ids)  # [B, T, 3, E]
        inputs = module.head_inputs(features, grams, context)  # [B, T, H]
        total, metrics = torch.zeros(()), {}
        for k in range(module.config.num_heads):
            shift = k + 2
            if length <= shift:
                break
            keep = batch.label_mask[:, shift:]
            labels = ids[:, shift:][keep]
            if not len(labels):
                continue
            logits = module.head_logits(inputs[:, :-shift][keep], k, lm_head).float()  # [M, V]
            total = total + self.options.decay**k * F.cross_entropy(logits, labels)
            rank_hits(logits, labels, k + 1, metrics)
        return total, metrics


# ---- the drafter -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChimeraSettings(TreeSettings, WeightsSetting):
    num_heads: int = 4  # for untrained weights only (trained ones bring their own count)

    def __post_init__(self) -> None:
        TreeSettings.__post_init__(self)
        WeightsSetting.__post_init__(self)
        as_int(self, "num_heads", 1)


@register
class Chimera(FeatureDrafter):
    name = "chimera"
    Settings = ChimeraSettings
    Module = ChimeraModel
    Training = ChimeraTraining  # how `hasten train chimera` builds, trains and saves the model

    def untrained(self, model: PreTrainedModel) -> ChimeraModel:
        return ChimeraModel.for_target(model, self.settings.num_heads)

    def setup(self, model: PreTrainedModel) -> None:
        self._lm_head, self._embed = model.get_output_embeddings(), model.get_input_embeddings()
        config = self.module.config
        self._tree = CombinationTree.choose(self.settings, config.accuracy, config.num_heads)

    def reset(self, ctx: DraftContext) -> None:
        self._committed = CommittedKV()  # the context encoder's keys/values over committed features
        self._context: torch.Tensor | None = None  # [D] encoding at the newest feature

    def draft(self, ctx: DraftContext) -> Draft:
        fed, count = self._committed.length, len(self.record)
        if count == 0:  # no committed feature yet (one-token prompt)
            return EMPTY_DRAFT
        device = self.record.features.device
        if count > fed:  # encode the new committed features
            features = self.record.features[fed:count][None]  # [1, new, H]
            out = self._committed.run(lambda *args: self.module.encode_context(features, *args), count - fed, device)
            self._context = out[0, -1]
        recent = ctx.tokens[-GRAMS:]
        grams = self._embed(torch.tensor(recent, device=device))  # [<=3, E]
        grams = torch.cat([grams.new_zeros(GRAMS - len(recent), grams.shape[-1]), grams])  # zeros before the start
        inputs = self.module.head_inputs(self.record.features[-1], grams, self._context)  # [H]
        logits = torch.stack([self.module.head_logits(inputs, k, self._lm_head) for k in range(self._tree.depth)])
        return Draft(self._tree.tokens(self._tree.ranked(logits)), self._tree.tree)
