"""EAGLE: autoregression at the feature level (Li et al. 2024, "EAGLE"; trees from
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees").

One decoder layer runs over the target's features shifted by one token: its input at
position t is ``fc(concat(f_t, embed(x_{t+1})))`` and its output guesses ``f_{t+1}``,
which the target's frozen LM head turns into a guess of ``x_{t+2}``. Knowing the token
that was actually sampled removes the uncertainty a feature alone would have.

The layer keeps its own KV cache over the committed (feature, token) pairs; committed
pairs never change, so that cache only grows. Drafting continues from the newest pair
``(f_{r-1}, x_r)`` and feeds the layer its own predicted features deeper in the tree.
The tree is EAGLE-2's dynamic tree (:func:`~.candidates.dynamic_tree`): ``depth``
levels, expanding the ``top_k`` most confident nodes of each level, then the
``total_tokens`` nodes of highest cumulative draft probability. Drafts are
deterministic (``probs=None``), so the verifier keeps sampling exact.

Training (EAGLE-1): on self-distilled data, smooth-L1 regression of the next feature
plus cross-entropy of the LM head on the predicted feature against the target's own
next-token distribution; inputs get uniform noise, as deeper draft levels see predicted
features, not real ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from ..training.trainer import Batch, option
from .base import Draft, DraftContext, EMPTY_DRAFT, register
from .candidates import GrowingTree, dynamic_tree
from .feature_base import (
    KV, Block, CommittedKV, FeatureDrafter, FeatureModule, FeatureTraining, ModuleConfig, WeightsSetting, as_int,
    causal, heads_for, joined, valid_positions,
)


# ---- the layer ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EagleConfig(ModuleConfig):
    embed_size: int = 0  # the target's input embedding width
    heads: int = 1
    mlp_size: int = 0


class EagleLayer(FeatureModule):
    Config = EagleConfig
    name = "eagle"

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        H = config.hidden_size
        self.fc = nn.Linear(H + config.embed_size, H)
        with torch.no_grad():  # start from "the next feature is this one": fc passes f_t through
            self.fc.weight.zero_()
            self.fc.weight[:, :H].copy_(torch.eye(H))
            self.fc.bias.zero_()
        self.block = Block(H, config.heads, config.mlp_size)

    @classmethod
    def for_target(cls, target: PreTrainedModel, mlp_ratio: int = 2) -> "EagleLayer":
        sizes = cls.target_sizes(target)
        hidden = sizes["hidden_size"]
        embed = target.get_input_embeddings().weight.shape[1]
        return cls(EagleConfig(**sizes, embed_size=int(embed), heads=heads_for(hidden), mlp_size=mlp_ratio * hidden))

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor | None, past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """features: [B, n, H] f_t; token_embeds: [B, n, E] embed(x_{t+1}) -> guesses of
        f_{t+1} [B, n, H] and the new keys/values."""
        x = self.fc(torch.cat([features, token_embeds.to(features.dtype)], dim=-1))
        return self.block(x, positions, visible, past)


# ---- training (``hasten train eagle``) -------------------------------------------------------------
@dataclass(frozen=True)
class EagleTrainOptions:
    mlp_ratio: int = option(2, "MLP width of the layer, in multiples of the hidden size")
    ce_weight: float = option(0.1, "weight of the LM-head cross-entropy next to the feature regression")
    noise: float = option(0.2, "uniform noise on input features, relative to their RMS (robustness to drafts)")

    def __post_init__(self) -> None:
        if self.mlp_ratio < 1:
            raise ValueError(f"mlp_ratio must be >= 1, got {self.mlp_ratio}")
        if self.ce_weight < 0 or self.noise < 0:
            raise ValueError("ce_weight and noise must be >= 0")


class EagleTraining(FeatureTraining):
    Options = EagleTrainOptions

    def build(self) -> EagleLayer:
        return EagleLayer.for_target(self.target, self.options.mlp_ratio)

    def loss(self, module: EagleLayer, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        lm_head, embed = self.target.get_output_embeddings(), self.target.get_input_embeddings()
        features = batch.hidden  # [B, T, H]
        inputs = features[:, :-1]
        if module.training and self.options.noise:
            scale = inputs.pow(2).mean(-1, keepdim=True).sqrt()
            inputs = inputs + (torch.rand_like(inputs) - 0.5) * 2 * self.options.noise * scale
        length = features.shape[1] - 1
        positions = torch.arange(length, device=features.device).expand(len(features), -1)
        guess, _ = module(inputs, embed(batch.ids[:, 1:]), positions, causal(length, device=features.device))
        keep = valid_positions(batch)[:, 1:]  # guess at t is scored against f_{t+1}
        guess, truth = guess[keep], features[:, 1:][keep]  # [M, H]
        if not len(truth):
            return torch.zeros(()), {}
        regression = F.smooth_l1_loss(guess, truth)
        with torch.no_grad():
            p = lm_head(truth).float().softmax(-1)  # the target's own next-token law  [M, V]
        logits = lm_head(guess).float()
        cross_entropy = -(p * logits.log_softmax(-1)).sum(-1).mean()
        accuracy = (logits.argmax(-1) == p.argmax(-1)).float().mean().item()
        loss = regression + self.options.ce_weight * cross_entropy
        return loss, {"regression": regression.item(), "ce": cross_entropy.item(), "top1": accuracy}


# ---- the drafter -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EagleSettings(WeightsSetting):
    depth: int = 5  # levels of the draft tree (draft-layer passes per step)
    top_k: int = 4  # children per expanded node, and nodes expanded per level
    total_tokens: int = 16  # nodes kept in the tree (verified per step)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("depth", "top_k", "total_tokens"):
            as_int(self, name, 1)


@register
class Eagle(FeatureDrafter):
    name = "eagle"
    Settings = EagleSettings
    Module = EagleLayer
    Training = EagleTraining  # how `hasten train eagle` builds, trains and saves the layer

    def untrained(self, model: PreTrainedModel) -> EagleLayer:
        return EagleLayer.for_target(model)

    def setup(self, model: PreTrainedModel) -> None:
        self._lm_head, self._embed = model.get_output_embeddings(), model.get_input_embeddings()

    def reset(self, ctx: DraftContext) -> None:
        self._committed = CommittedKV()  # the layer's keys/values over the committed pairs
        self._newest: torch.Tensor | None = None  # [H] the layer's guess of f_r

    def _feed_committed(self, tokens: list[int]) -> None:
        """Run the layer over the committed pairs (f_t, x_{t+1}) it has not seen yet."""
        fed, count = self._committed.length, len(self.record)
        if count == fed:
            return
        device = self.record.features.device
        features = self.record.features[fed:count][None]  # [1, new, H]
        embeds = self._embed(torch.tensor(tokens[fed + 1 : count + 1], device=device))[None]  # [1, new, E]
        out = self._committed.run(lambda *args: self.module(features, embeds, *args), count - fed, device)
        self._newest = out[0, -1]

    def draft(self, ctx: DraftContext) -> Draft:
        self._feed_committed(ctx.tokens)
        if self._newest is None:  # no committed feature yet (one-token prompt)
            return EMPTY_DRAFT
        s = self.settings
        lm_head = self._lm_head
        root_position = len(self.record)  # position r of the root; pair index of depth-1 nodes
        committed = self._committed.length
        tree_kv: list[KV] = []  # keys/values of the nodes fed so far, in feeding order
        column: dict[int, int] = {}  # node -> its index in the fed columns
        guesses: dict[int, torch.Tensor] = {-1: self._newest}  # node -> the layer's guess of the next feature

        def expand(nodes: list[int], grown: GrowingTree) -> torch.Tensor:
            device = self._newest.device
            features = torch.stack([guesses[grown.parents[n]] for n in nodes])[None]  # [1, n, H]
            embeds = self._embed(torch.tensor([grown.tokens[n] for n in nodes], device=device))[None]
            positions = torch.tensor([[root_position + grown.depths[n] - 1 for n in nodes]], device=device)
            fed = len(column)
            visible = torch.zeros(len(nodes), committed + fed + len(nodes), dtype=torch.bool, device=device)
            visible[:, :committed] = True  # every committed pair
            for row, node in enumerate(nodes):
                ancestor = grown.parents[node]
                while ancestor >= 0:  # the node's ancestors were all fed at earlier levels
                    visible[row, committed + column[ancestor]] = True
                    ancestor = grown.parents[ancestor]
                visible[row, committed + fed + row] = True
            past = joined([self._committed.kv, *tree_kv])
            out, new_kv = self.module(features, embeds, positions, visible[None], past)  # [1, n, H]
            tree_kv.append(new_kv)
            for row, node in enumerate(nodes):
                column[node] = fed + row
                guesses[node] = out[0, row]
            return lm_head(out[0]).float().log_softmax(-1)  # [n, V]

        first = lm_head(self._newest).float().log_softmax(-1)
        depth = min(s.depth, ctx.max_depth)
        tokens, tree = dynamic_tree(first, expand, depth, s.top_k, s.total_tokens)
        return Draft(tokens, tree)
