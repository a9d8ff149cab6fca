"""Medusa: extra heads on the target's last hidden state guess several tokens ahead
(Cai et al. 2024, "Medusa", Medusa-1: heads trained on a frozen target).

Head k (k = 1..K) reads the hidden state at the position just before the root (the one
the target's own LM head turns into the root) and predicts the token k positions after
the root. The candidates form a tree of top-k combinations: the node with path
(i1, i2, ...) holds the i_d-th most likely token of head d. All heads read the same
hidden state, so a node's token does not depend on its ancestors, and siblings are
distinct by construction (top-k of one distribution). The draft is deterministic
(``probs=None``): the verifier's recursive rejection keeps sampling exact.

On disk a set of heads is a directory with ``weights.safetensors`` and ``medusa.json``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from ..core.settings import option
from .base import DraftContext, register
from .candidates import TreeSettings
from .nn import ResidualBlock
from .trainable import Batch, LevelTrainOptions, TrainedTraining, decayed_cross_entropy
from .trained import ModuleConfig, TopKTreeDrafter, TrainedModule, WeightsSetting, at_least_one


# ---- the heads ------------------------------------------------------------------------
@dataclass(frozen=True)
class MedusaConfig(ModuleConfig):
    num_heads: int = 4
    share_lm_head: bool = True  # use the target's frozen LM head (only the blocks are stored)


class MedusaHeads(TrainedModule):
    Config = MedusaConfig
    name = "medusa"

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(H) for _ in range(config.num_heads))
        # Own LM heads, one per head, when not sharing the target's (Medusa-1 copies the
        # target's head into each; see for_target).
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(config.num_heads))

    @classmethod
    def for_target(cls, target: PreTrainedModel, num_heads: int = 5, share_lm_head: bool = True) -> "MedusaHeads":
        """Untrained heads shaped for ``target``."""
        lm_head = target.get_output_embeddings()
        heads = cls(MedusaConfig(**cls.target_sizes(target), num_heads=num_heads, share_lm_head=share_lm_head))
        if not share_lm_head:
            for own in heads.lm_heads:
                own.weight.data.copy_(lm_head.weight.data)
        return heads.to(lm_head.weight.device)

    @property
    def levels(self) -> int:
        return self.config.num_heads

    def head_logits(self, hidden: torch.Tensor, k: int, lm_head: nn.Module) -> torch.Tensor:
        """[..., H] hidden states -> [..., V] logits of head k (0-based). ``lm_head`` is the
        target's, used when the heads share it."""
        features = self.blocks[k](hidden.to(self.blocks[k].linear.weight.dtype))
        head = lm_head if self.lm_heads is None else self.lm_heads[k]
        return head(features.to(head.weight.dtype))

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """[..., H] -> [K, ..., V]"""
        if self.lm_heads is not None:
            return torch.stack([self.head_logits(hidden, k, lm_head) for k in range(len(self.blocks))])
        # One LM-head product for all heads: the vocabulary projection is most of the cost.
        features = torch.stack([block(hidden.to(block.linear.weight.dtype)) for block in self.blocks])  # [K, ..., H]
        return lm_head(features.to(lm_head.weight.dtype))


# ---- training (``hasten train medusa``) ------------------------------------------------------
@dataclass(frozen=True)
class MedusaTrainOptions(LevelTrainOptions):  # decay: far heads matter less
    num_heads: int = option(5, "heads to train: head k guesses the token k places after the next one "
                               "(5: Medusa's medusa_num_heads)")
    share_lm_head: bool = option(True, "reuse the target's frozen LM head (small files); else train one per head")

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "num_heads")


class MedusaTraining(TrainedTraining):
    Options = MedusaTrainOptions

    def build(self) -> MedusaHeads:
        return MedusaHeads.for_target(self.target, self.options.num_heads, self.options.share_lm_head)

    def loss(self, module: MedusaHeads, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Sum over heads of decay**(k-1) x cross-entropy of head k at position t against
        token t + 1 + k (the target's own hidden state at t predicts token t + 1)."""
        lm_head = self.target.get_output_embeddings()

        def levels():
            for k in range(min(module.config.num_heads, batch.ids.shape[1] - 2)):
                shift = k + 2  # head k (0-based) at position t predicts token t + k + 2
                keep = batch.label_mask[:, shift:]  # [B, T - shift] labels that are the target's own tokens
                yield k, module.head_logits(batch.hidden[:, :-shift][keep], k, lm_head), batch.ids[:, shift:][keep]

        metrics: dict[str, float] = {}
        return decayed_cross_entropy(levels(), self.options.decay, metrics), metrics


# ---- the drafter ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MedusaSettings(TreeSettings, WeightsSetting):  # tree, top_k, tree_size: the shared candidate-tree knobs
    num_heads: int = 5  # for untrained heads only (trained heads bring their own count); 5 as Medusa's code

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "num_heads")


@register
class Medusa(TopKTreeDrafter):
    name = "medusa"
    Settings = MedusaSettings
    Module = MedusaHeads
    Training = MedusaTraining  # how `hasten train medusa` builds, trains and saves heads

    untrained_sizes = ("num_heads",)

    def level_logits(self, ctx: DraftContext, depth: int) -> torch.Tensor | None:
        features = ctx.features
        if features is None or not len(features):  # nothing cached yet (one-token prompt)
            return None
        return self.module(features[-1], self.lm_head)[:depth]  # [depth, V]
