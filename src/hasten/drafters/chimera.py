"""Chimera: a lightweight drafter fusing short- and long-range context (Zeng et al. 2024,
"Chimera: A Lossless Decoding Method for Accelerating Large Language Models Inference by
Fusing all Tokens").

Three parts, all small:

* a **trigram encoder** at the bottom: the target's (frozen) embeddings of the last three
  committed tokens, ``x_{r-2}, x_{r-1}, x_r`` (the root included), projected together;
* a **full-context encoder**: one causal transformer layer over the target's last hidden
  states ``f_0 .. f_{r-1}``, with its own KV cache per generation (committed features
  never change, so it only grows);
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

from ..core.settings import option
from .base import DraftContext, register
from .candidates import TreeSettings
from .nn import Block, CommittedRun, KVCache, ResidualBlock, causal, heads_for, inner_size
from .trainable import Batch, LevelTrainOptions, TrainedTraining, check_inner_ratio, decayed_cross_entropy
from .trained import ModuleConfig, TopKTreeDrafter, TrainedModule, WeightsSetting, at_least_one

GRAMS = 3  # tokens the short-range encoder reads


# ---- the model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChimeraConfig(ModuleConfig):
    embed_size: int = 0  # the target's input embedding width
    inner_size: int = 0  # width of the two encoders
    heads: int = 1  # attention heads of the context encoder
    num_heads: int = 4  # decoding heads: head k guesses the token k places after the root


class ChimeraModel(TrainedModule):
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
        self.heads = nn.ModuleList(ResidualBlock(H) for _ in range(config.num_heads))

    @classmethod
    def for_target(cls, target: PreTrainedModel, num_heads: int = 4, inner_ratio: float = 0.5) -> "ChimeraModel":
        sizes = cls.target_sizes(target)
        inner = inner_size(sizes["hidden_size"], inner_ratio)
        embed = int(target.get_input_embeddings().weight.shape[1])
        return cls(ChimeraConfig(**sizes, embed_size=embed, inner_size=inner, heads=heads_for(inner),
                                 num_heads=num_heads))

    @property
    def levels(self) -> int:
        return self.config.num_heads

    def encode_context(self, features: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None,
                       cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        """[B, n, H] features -> [B, n, D] context encodings (keys/values into ``cache`` at ``start``)."""
        return self.context(self.context_in(features), positions, visible, cache, start)

    def head_inputs(self, feature: torch.Tensor, grams: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """feature [..., H] f_s; grams [..., 3, E] embeddings of x_{s-1}, x_s, x_{s+1};
        context [..., D] -> [..., H] what every decoding head starts from."""
        short = self.trigram(grams.flatten(-2).to(feature.dtype))
        return feature + self.fuse(F.silu(torch.cat([short, context], dim=-1)))

    def head_logits(self, inputs: torch.Tensor, k: int, lm_head: nn.Module) -> torch.Tensor:
        return lm_head(self.heads[k](inputs))

    def all_logits(self, inputs: torch.Tensor, depth: int, lm_head: nn.Module) -> torch.Tensor:
        """[H] -> [depth, V] logits of the first ``depth`` heads, in one LM-head product
        (the vocabulary projection is most of the cost)."""
        return lm_head(torch.stack([self.heads[k](inputs) for k in range(depth)]))


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
class ChimeraTrainOptions(LevelTrainOptions):  # decay: far heads matter less
    num_heads: int = option(4, "decoding heads: head k guesses the token k places after the root")
    inner_ratio: float = option(0.5, "width of the trigram and context encoders, relative to the hidden size")

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "num_heads")
        check_inner_ratio(self.inner_ratio)


class ChimeraTraining(TrainedTraining):
    Options = ChimeraTrainOptions

    def build(self) -> ChimeraModel:
        return ChimeraModel.for_target(self.target, self.options.num_heads, self.options.inner_ratio)

    def loss(self, module: ChimeraModel, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Head k (0-based) at position s (reading f_s and x_{s-1}, x_s, x_{s+1}) against
        x_{s+2+k}, weighted decay**k."""
        lm_head, embed = self.target.get_output_embeddings(), self.target.get_input_embeddings()
        features, ids = batch.hidden, batch.ids  # [B, T, H], [B, T]
        length = ids.shape[1]
        positions = torch.arange(length, device=ids.device).expand(len(ids), -1)
        context = module.encode_context(features, positions, causal(length, device=ids.device))
        inputs = module.head_inputs(features, trigram_embeddings(embed, ids), context)  # [B, T, H]

        def levels():
            for k in range(min(module.config.num_heads, length - 2)):
                shift = k + 2
                keep = batch.label_mask[:, shift:]
                yield k, module.head_logits(inputs[:, :-shift][keep], k, lm_head), ids[:, shift:][keep]

        metrics: dict[str, float] = {}
        return decayed_cross_entropy(levels(), self.options.decay, metrics), metrics


# ---- the drafter -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChimeraSettings(TreeSettings, WeightsSetting):
    num_heads: int = 4  # for untrained weights only (trained ones bring their own count)

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "num_heads")


@register
class Chimera(TopKTreeDrafter):
    name = "chimera"
    Settings = ChimeraSettings
    Module = ChimeraModel
    Training = ChimeraTraining  # how `hasten train chimera` builds, trains and saves the model

    untrained_sizes = ("num_heads",)

    def start(self, ctx: DraftContext) -> CommittedRun:
        return CommittedRun()  # the context encoder over the committed features

    def level_logits(self, ctx: DraftContext, depth: int) -> torch.Tensor | None:
        features = ctx.features
        if features is None or not len(features):  # no committed feature yet (one-token prompt)
            return None

        def encode(start: int, end: int, *args) -> torch.Tensor:
            return self.module.encode_context(features[start:end][None], *args)

        context = ctx.state.catch_up(len(features), encode, features.device)  # [D] at the newest feature
        recent = ctx.tokens[-GRAMS:]
        grams = self.embed(torch.tensor(recent, device=features.device))  # [<=3, E]
        grams = torch.cat([grams.new_zeros(GRAMS - len(recent), grams.shape[-1]), grams])  # zeros before the start
        inputs = self.module.head_inputs(features[-1], grams, context)  # [H]
        return self.module.all_logits(inputs, depth, self.lm_head)  # [depth, V]
