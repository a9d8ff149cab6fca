"""Hidden transfer: pseudo hidden states for future positions, refined by the target's own
upper layers (Wu et al. 2024, "Parallel Decoding via Hidden Transfer for Lossless Large
Language Model Acceleration").

At an intermediate layer ``L`` of the target, a trained linear transfer maps the root's
hidden state ``h_r`` to pseudo hidden states for the next ``num_tokens`` positions,
``h_r + W_j h_r + b_j`` (zero-initialised ``W_j, b_j``). The target's layers above ``L`` then
run on them as on real tokens: they attend to the real context (the cache) and to each
other in causal order, and the LM head reads off a guess of ``x_{r+1+j}`` at placeholder
``j``. The same forward also runs the root, whose logits are the target's exact next-token
distribution, so depth 1 of the draft is the target's own top choices (its argmax alone
when greedy) and depths 2 .. num_tokens + 1 come from the placeholders.

The forward with replaced hidden states lives in :mod:`hasten.models.layers` (any causal
LM whose decoder layers form one list); the target's cache is cropped back afterwards.
Candidates are a tree of top-k combinations verified with tree attention. The drafting
forward is a second target forward per step (the paper folds it into verification);
``tau`` counts verification forwards only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from ..models.layers import num_layers, placeholder_logits, placeholder_logits_batch
from ..training.trainer import Batch, option
from .base import Draft, DraftContext, register
from .candidates import CombinationTree, TreeSettings, guessed_accuracy
from .feature_base import (
    RANKS, FeatureDrafter, FeatureModule, FeatureTraining, ModuleConfig, WeightsSetting, anchors, as_int, rank_hits,
)

# Depth 1 comes from the target itself: under sampling its rank-r token is accepted about
# as often as the target samples it; this prior (not a measurement) shapes the default tree.
ROOT_PRIOR = [0.8, 0.1, 0.05, 0.02]


# ---- the transfer ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HiddenTransferConfig(ModuleConfig):
    layer: int = 1  # the decoder layer whose input is replaced at the placeholders
    num_tokens: int = 3  # placeholders: pseudo hidden states for positions r + 1 .. r + num_tokens


class Transfer(FeatureModule):
    Config = HiddenTransferConfig
    name = "hidden_transfer"

    def __init__(self, config: HiddenTransferConfig):
        super().__init__(config)
        H = config.hidden_size
        self.maps = nn.ModuleList(nn.Linear(H, H) for _ in range(config.num_tokens))
        for linear in self.maps:  # untrained: every pseudo state is a copy of h_r
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    @classmethod
    def for_target(cls, target: PreTrainedModel, num_tokens: int = 3, layer: int | None = None) -> "Transfer":
        depth = num_layers(target)
        layer = depth // 2 if layer is None else layer
        if not 0 <= layer < depth:
            raise ValueError(f"layer must be in [0, {depth}) for this target, got {layer}")
        return cls(HiddenTransferConfig(**cls.target_sizes(target), layer=layer, num_tokens=num_tokens))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] the root's input to layer L -> [..., num_tokens, H] pseudo states."""
        hidden = hidden.to(self.maps[0].weight.dtype)
        return torch.stack([hidden + linear(hidden) for linear in self.maps], dim=-2)


# ---- training (``hasten train hidden_transfer``) --------------------------------------------------------
@dataclass(frozen=True)
class HiddenTransferTrainOptions:
    num_tokens: int = option(3, "placeholders per step: pseudo hidden states for the next positions")
    layer: int = option(-1, "decoder layer whose input is replaced (-1: the middle one)")
    anchors: int = option(16, "root positions per sequence trained at once (one forward, a block mask)")
    decay: float = option(0.8, "loss weight of placeholder j is decay**(j-1): far ones matter less")

    def __post_init__(self) -> None:
        if self.num_tokens < 1 or self.anchors < 1:
            raise ValueError("num_tokens and anchors must be >= 1")
        if self.layer < -1:
            raise ValueError(f"layer must be >= 0, or -1 for the middle layer, got {self.layer}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


class HiddenTransferTraining(FeatureTraining):
    Options = HiddenTransferTrainOptions

    def build(self) -> Transfer:
        layer = None if self.options.layer < 0 else self.options.layer
        return Transfer.for_target(self.target, self.options.num_tokens, layer)

    def measured_levels(self, module: Transfer) -> int:
        return module.config.num_tokens

    def loss(self, module: Transfer, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Placeholder j (0-based) after root position a, against x_{a+2+j}. Roots are drawn
        where at least the first placeholder has a label."""
        k = module.config.num_tokens
        ids, labels_ok = batch.ids, batch.label_mask  # [B, T]
        length = ids.shape[1]
        if length <= 2:
            return torch.zeros(()), {}
        roots = anchors(labels_ok[:, 2:], self.options.anchors)  # [B, A] positions a with a label at a + 2
        logits = placeholder_logits_batch(self.target, ids, roots, k, module.config.layer, module)  # [B, A, k, V]
        total, metrics = torch.zeros(()), {}
        rows = torch.arange(len(ids), device=ids.device)[:, None]
        for j in range(k):
            where = (roots + 2 + j).clamp(max=length - 1)
            keep = labels_ok[rows, where] & (roots + 2 + j < length)  # [B, A]
            labels = ids[rows, where][keep]
            if not len(labels):
                continue
            scores = logits[:, :, j][keep].float()  # [M, V]
            total = total + self.options.decay**j * F.cross_entropy(scores, labels)
            rank_hits(scores, labels, j + 1, metrics)
        return total, metrics


# ---- the drafter -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HiddenTransferSettings(TreeSettings, WeightsSetting):
    num_tokens: int = 3  # placeholders, for untrained weights only (trained ones bring theirs)
    layer: int | None = None  # replaced layer, for untrained weights only; None: the middle one

    def __post_init__(self) -> None:
        TreeSettings.__post_init__(self)
        WeightsSetting.__post_init__(self)
        as_int(self, "num_tokens", 1)
        as_int(self, "layer", 0, optional=True)


@register
class HiddenTransfer(FeatureDrafter):
    name = "hidden_transfer"
    Settings = HiddenTransferSettings
    Module = Transfer
    Training = HiddenTransferTraining  # how `hasten train hidden_transfer` trains and saves the transfer
    needs_hidden = False  # it runs the target itself

    def untrained(self, model: PreTrainedModel) -> Transfer:
        return Transfer.for_target(model, self.settings.num_tokens, self.settings.layer)

    def setup(self, model: PreTrainedModel) -> None:
        config = self.module.config
        if config.layer >= num_layers(model):  # also raises for architectures the runner cannot handle
            raise ValueError(f"hidden_transfer weights replace layer {config.layer}, "
                             f"but the target has {num_layers(model)} layers")
        levels = config.num_tokens + 1
        measured = config.accuracy or guessed_accuracy(config.num_tokens, RANKS)
        # greedy: depth 1 is the target's argmax, certain; sampling: its top choices by prior
        self._trees = {
            greedy: CombinationTree.choose(self.settings, [[1.0] if greedy else ROOT_PRIOR, *measured], levels)
            for greedy in (True, False)
        }

    def draft(self, ctx: DraftContext) -> Draft:
        config = self.module.config
        tree = self._trees[ctx.sampling.greedy]
        target = ctx.target
        logits = placeholder_logits(target.model, target.cache, [ctx.tokens[-1]], config.num_tokens, config.layer,
                                    self.module)  # [1 + num_tokens, V]: the root, then the placeholders
        return Draft(tree.tokens(tree.ranked(logits[: tree.depth])), tree.tree)
