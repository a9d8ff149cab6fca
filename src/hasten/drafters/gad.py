"""GAD: Generalized Aggressive Decoding (Ge et al. 2022; Xia et al. 2023, "Speculative
Decoding: Exploiting Speculative Execution for Accelerating Seq2seq Generation").

A small non-autoregressive drafter guesses a whole block of the next ``block`` tokens in
one forward pass: ``block`` mask slots follow a short window of the newest committed
tokens (the target's frozen embeddings, plus the target's newest feature ``f_{r-1}`` at
the root's slot), and a few transformer layers attend bidirectionally over window and
slots. Slot ``i`` guesses ``x_{r+1+i}`` through the target's frozen LM head.

For encoder-decoder targets the drafter also reads the encoder input (a window of the
source around the current output position, tagged as source) and drafts a chain, which
is what those adapters verify. For causal LMs the default is a chain too (the block, as
in the paper); ``top_k > 1`` verifies a tree of top-k combinations of the slots instead.
Drafts are deterministic (``probs=None``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from ..training.trainer import Batch, option
from .base import Draft, DraftContext, register
from .candidates import CombinationTree, TreeSettings
from .feature_base import (
    Block, FeatureDrafter, FeatureModule, FeatureTraining, ModuleConfig, WeightsSetting, anchors, as_int, heads_for,
    rank_hits,
)


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


class GADModel(FeatureModule):
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
        inner = max(8, int(sizes["hidden_size"] * inner_ratio) // 8 * 8)
        embed = int(target.get_input_embeddings().weight.shape[1])
        return cls(GADConfig(**sizes, embed_size=embed, inner_size=inner, heads=heads_for(inner), layers=layers,
                             block=block, window=window))

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
            x, _ = layer(x, positions, visible)
        return self.out(x[:, -self.config.block:])


# ---- training (``hasten train gad``) -------------------------------------------------------------------
@dataclass(frozen=True)
class GADTrainOptions:
    block: int = option(4, "mask slots: tokens guessed per forward")
    window: int = option(8, "newest committed tokens the drafter reads")
    layers: int = option(2, "transformer layers of the drafter")
    inner_ratio: float = option(0.5, "width of the drafter's layers, relative to the hidden size")
    anchors: int = option(16, "root positions per sequence trained at once")
    decay: float = option(0.8, "loss weight of slot i is decay**(i-1): far slots matter less")

    def __post_init__(self) -> None:
        for name in ("block", "window", "layers", "anchors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.inner_ratio <= 4:
            raise ValueError(f"inner_ratio must be in (0, 4], got {self.inner_ratio}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


class GADTraining(FeatureTraining):
    Options = GADTrainOptions

    def build(self) -> GADModel:
        o = self.options
        return GADModel.for_target(self.target, o.block, o.window, o.layers, o.inner_ratio)

    def measured_levels(self, module: GADModel) -> int:
        return module.config.block

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
        total, metrics = torch.zeros(()), {}
        for i in range(config.block):
            at = roots + 1 + i
            keep = (at < length) & labels_ok[rows[:, :, 0], at.clamp(max=length - 1)]
            labels = ids[rows[:, :, 0], at.clamp(max=length - 1)][keep]
            if not len(labels):
                continue
            logits = lm_head(slots[:, :, i][keep]).float()  # [M, V]
            total = total + self.options.decay**i * F.cross_entropy(logits, labels)
            rank_hits(logits, labels, i + 1, metrics)
        return total, metrics


# ---- the drafter -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GADSettings(TreeSettings, WeightsSetting):
    top_k: int = 1  # 1: a chain of each slot's best guess; > 1: a tree of top-k combinations (causal targets)
    tree_size: int = 12
    block: int = 4  # mask slots, for untrained weights only (trained ones bring theirs)

    def __post_init__(self) -> None:
        TreeSettings.__post_init__(self)
        WeightsSetting.__post_init__(self)
        as_int(self, "block", 1)


@register
class GAD(FeatureDrafter):
    name = "gad"
    Settings = GADSettings
    Module = GADModel
    Training = GADTraining  # how `hasten train gad` builds, trains and saves the drafter
    seq2seq_chains = True

    def untrained(self, model: PreTrainedModel) -> GADModel:
        return GADModel.for_target(model, self.settings.block)

    def setup(self, model: PreTrainedModel) -> None:
        self._lm_head, self._embed = model.get_output_embeddings(), model.get_input_embeddings()
        config = self.module.config
        chain = tuple((0,) * depth for depth in range(1, config.block + 1))
        self._chain = CombinationTree(chain)
        self._tree = self._chain
        if self.settings.tree is not None or self.settings.top_k > 1:
            self._tree = CombinationTree.choose(self.settings, config.accuracy, config.block)

    def draft(self, ctx: DraftContext) -> Draft:
        config = self.module.config
        device = self._lm_head.weight.device
        recent = ctx.tokens[-config.window:]
        pad = config.window - len(recent)
        window = self._embed(torch.tensor([0] * pad + recent, device=device))[None]  # [1, w, E]
        present = torch.tensor([[False] * pad + [True] * len(recent)], device=device)
        if len(self.record):
            feature = self.record.features[-1][None]
        else:  # no feature yet (one-token prompt, or an encoder-decoder's first step)
            feature = window.new_zeros(1, config.hidden_size)
        source = source_present = None
        if ctx.source is not None:  # the source window around the current output position
            start = max(0, len(ctx.tokens) - 1 - config.source_window // 2)
            part = ctx.source[start : start + config.source_window]
            pad_source = config.source_window - len(part)
            source = self._embed(torch.tensor(part + [0] * pad_source, device=device))[None]
            source_present = torch.tensor([[True] * len(part) + [False] * pad_source], device=device)
        slots = self.module(window, present, feature, source, source_present)[0]  # [block, H]
        tree = self._chain if ctx.target.encoder_decoder else self._tree
        return Draft(tree.tokens(tree.ranked(self._lm_head(slots[: tree.depth]).float())), tree.tree)
