"""GAD: Generalized Aggressive Decoding (Ge et al. 2022; Xia et al. 2023, "Speculative
Decoding: Exploiting Speculative Execution for Accelerating Seq2seq Generation").

A small non-autoregressive drafter guesses a whole block of the next ``block`` tokens in
one forward pass: ``block`` mask slots follow a short window of the newest committed
tokens (the target's frozen embeddings, plus the target's newest feature ``f_{r-1}`` at
the root's slot), and a few transformer layers attend bidirectionally over window and
slots. Slot ``i`` guesses ``x_{r+1+i}`` through the target's frozen LM head.

For encoder-decoder targets the drafter also reads the encoder input (a window of the
source around the current output position, tagged as source). The default draft is a
chain (the block, as in the paper); ``top_k > 1`` drafts a tree of top-k combinations of
the slots instead, which encoder-decoder targets (chains only) cut to its best path.
Drafts are deterministic (``probs=None``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from ..core.settings import option
from .base import DraftContext, register
from .candidates import TreeSettings
from .nn import Block, heads_for, inner_size
from .trainable import Batch, LevelTrainOptions, TrainedTraining, anchors, check_inner_ratio, decayed_cross_entropy
from .trained import ModuleConfig, TopKTreeDrafter, TrainedModule, WeightsSetting, at_least_one


# ---- the model ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GADConfig(ModuleConfig):
    embed_size: int = 0  # the target's input embedding width
    inner_size: int = 0  # width of the drafter's layers
    heads: int = 1
    layers: int = 2
    block: int = 4  # mask slots: tokens guessed per forward
    window: int = 8  # newest committed tokens read (the root included)
    source_window: int = 16  # encoder-input tokens read, for encoder-decoder targets


class GADModel(TrainedModule):
    Config = GADConfig
    name = "gad"

    def __init__(self, config: GADConfig):
        super().__init__(config)
        H, D = config.hidden_size, config.inner_size
        self.embed_in = nn.Linear(config.embed_size, D)
        self.feature_in = nn.Linear(H, D)
        self.mask = nn.Parameter(torch.randn(config.block, D) * 0.02)  # one learned embedding per slot
        self.source_tag = nn.Parameter(torch.zeros(D))
        self.layers = nn.ModuleList(Block(D, config.heads, 2 * D) for _ in range(config.layers))
        self.out = nn.Linear(D, H)

    @classmethod
    def for_target(cls, target: PreTrainedModel, block: int = 4, window: int = 8, layers: int = 2,
                   inner_ratio: float = 0.5) -> "GADModel":
        sizes = cls.target_sizes(target)
        inner = inner_size(sizes["hidden_size"], inner_ratio)
        embed = int(target.get_input_embeddings().weight.shape[1])
        return cls(GADConfig(**sizes, embed_size=embed, inner_size=inner, heads=heads_for(inner), layers=layers,
                             block=block, window=window))

    @property
    def levels(self) -> int:
        return self.config.block

    def forward(self, window: torch.Tensor, present: torch.Tensor, feature: torch.Tensor,
                source: torch.Tensor | None = None, source_present: torch.Tensor | None = None) -> torch.Tensor:
        """window: [B, w, E] embeddings of the newest tokens, right-aligned (the root last);
        present: [B, w] bool (False: padding before the start); feature: [B, H] f_{r-1}
        (zeros when unknown); source: [B, s, E] encoder-input embeddings or None.
        Returns [B, block, H] features, one per slot, for the target's LM head."""
        batch, width = present.shape
        x = self.embed_in(window.to(self.mask.dtype))  # [B, w, D]
        x = torch.cat([x[:, :-1], x[:, -1:] + self.feature_in(feature.to(x.dtype))[:, None]], 1)
        parts, seen = [x, self.mask.expand(batch, -1, -1)], [present, present.new_ones(batch, self.config.block)]
        if source is not None:
            parts.insert(0, self.embed_in(source.to(x.dtype)) + self.source_tag)
            seen.insert(0, source_present)
        x, seen = torch.cat(parts, 1), torch.cat(seen, 1)  # [B, n, D], [B, n]
        positions = torch.arange(x.shape[1], device=x.device).expand(batch, -1)
        visible = seen[:, None, :].expand(-1, x.shape[1], -1)  # bidirectional over everything present
        for layer in self.layers:
            x = layer(x, positions, visible)
        return self.out(x[:, -self.config.block:])


# ---- training (``hasten train gad``) -------------------------------------------------------------------
@dataclass(frozen=True)
class GADTrainOptions(LevelTrainOptions):  # decay: far slots matter less
    block: int = option(4, "mask slots: tokens guessed per forward")
    window: int = option(8, "newest committed tokens the drafter reads")
    layers: int = option(2, "transformer layers of the drafter")
    inner_ratio: float = option(0.5, "width of the drafter's layers, relative to the hidden size")
    anchors: int = option(16, "root positions per sequence trained at once")

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "block", "window", "layers", "anchors")
        check_inner_ratio(self.inner_ratio)


class GADTraining(TrainedTraining):
    Options = GADTrainOptions

    def build(self) -> GADModel:
        o = self.options
        return GADModel.for_target(self.target, o.block, o.window, o.layers, o.inner_ratio)

    def loss(self, module: GADModel, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Slot i (0-based) after root position a (window x_{a-w+1} .. x_a, feature f_{a-1})
        against x_{a+1+i}; roots are drawn where the first slot has a label."""
        config = module.config
        lm_head, embed = self.target.get_output_embeddings(), self.target.get_input_embeddings()
        ids, labels_ok = batch.ids, batch.label_mask  # [B, T]
        length = ids.shape[1]
        if length <= 2:
            return torch.zeros(()), {}
        roots = anchors(labels_ok[:, 2:], self.options.anchors) + 1  # [B, A]: a >= 1 with a label at a + 1
        batch_size, count = roots.shape
        rows = torch.arange(batch_size, device=ids.device)[:, None, None]
        offsets = torch.arange(-config.window + 1, 1, device=ids.device)  # [w]
        where = roots[:, :, None] + offsets  # [B, A, w]
        window = embed(ids[rows, where.clamp(min=0)])  # [B, A, w, E]
        present = where >= 0
        feature = batch.hidden[rows[:, :, 0], roots - 1]  # [B, A, H]
        slots = module(window.flatten(0, 1), present.flatten(0, 1), feature.flatten(0, 1))  # [B * A, block, H]
        slots = slots.view(batch_size, count, config.block, -1)

        def levels():
            for i in range(config.block):
                at = roots + 1 + i
                keep = (at < length) & labels_ok[rows[:, :, 0], at.clamp(max=length - 1)]  # [B, A]
                yield i, lm_head(slots[:, :, i][keep]), ids[rows[:, :, 0], at.clamp(max=length - 1)][keep]

        metrics: dict[str, float] = {}
        return decayed_cross_entropy(levels(), self.options.decay, metrics), metrics


# ---- the drafter -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GADSettings(TreeSettings, WeightsSetting):
    top_k: int = 1  # 1: a chain of each slot's best guess; > 1: a tree of top-k combinations
    tree_size: int = 12
    block: int = 4  # mask slots, for untrained weights only (trained ones bring theirs)

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "block")


@register
class GAD(TopKTreeDrafter):
    name = "gad"
    Settings = GADSettings
    Module = GADModel
    Training = GADTraining  # how `hasten train gad` builds, trains and saves the drafter
    encoder_decoder_ok = True  # it reads the source too; the loop verifies the tree's best path there

    untrained_sizes = ("block",)

    def level_logits(self, ctx: DraftContext, depth: int) -> torch.Tensor:
        config = self.module.config
        device = self.lm_head.weight.device
        recent = ctx.tokens[-config.window:]
        pad = config.window - len(recent)
        window = self.embed(torch.tensor([0] * pad + recent, device=device))[None]  # [1, w, E]
        present = torch.tensor([[False] * pad + [True] * len(recent)], device=device)
        features = ctx.features
        if features is not None and len(features):
            feature = features[-1][None]  # [1, H]
        else:  # no feature yet (one-token prompt, or an encoder-decoder's first step)
            feature = window.new_zeros(1, config.hidden_size)
        source = source_present = None
        if ctx.source is not None:  # the source window around the current output position
            start = max(0, len(ctx.tokens) - 1 - config.source_window // 2)
            part = ctx.source[start : start + config.source_window]
            pad_source = config.source_window - len(part)
            source = self.embed(torch.tensor(part + [0] * pad_source, device=device))[None]
            source_present = torch.tensor([[True] * len(part) + [False] * pad_source], device=device)
        slots = self.module(window, present, feature, source, source_present)[0]  # [block, H]
        return self.lm_head(slots[:depth]).float()  # [depth, V]
