"""EAGLE: autoregression at the feature level (Li et al. 2024, "EAGLE"; trees from
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees").

One decoder layer runs over the target's features shifted by one token: its input at
position t is ``fc(concat(f_t, embed(x_{t+1})))`` and its output guesses ``f_{t+1}``,
which the target's frozen LM head turns into a guess of ``x_{t+2}``. Knowing the token
that was actually sampled removes the uncertainty a feature alone would have.

The layer keeps its own KV cache (:class:`~.nn.KVCache`, per generation) over the
committed (feature, token) pairs; committed pairs never change, so that part only grows.
Drafting continues from the newest pair ``(f_{r-1}, x_r)`` and feeds the layer its own
predicted features deeper in the tree; the tree's keys and values are scratch written
past the committed ones, level after level, and forgotten at the next step.
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

from ..core.settings import Settings, option
from ..core.stats import allocated_bytes
from .base import Draft, DraftContext, EMPTY_DRAFT, register
from .candidates import GrowingTree, LevelVisibility, dynamic_tree
from .nn import Block, CommittedRun, KVCache, causal, heads_for
from .trainable import Batch, TrainedTraining, valid_positions
from .trained import ModuleConfig, TrainedDrafter, TrainedModule, WeightsSetting, at_least_one


# ---- the layer ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EagleConfig(ModuleConfig):
    embed_size: int = 0  # the target's input embedding width
    heads: int = 1
    mlp_size: int = 0


class EagleLayer(TrainedModule):
    Config = EagleConfig
    name = "eagle"

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        self.fc = nn.Linear(config.hidden_size + config.embed_size, config.hidden_size)
        with torch.no_grad():  # start from "the next feature is this one": fc passes f_t through
            self.fc.weight.zero_()
            self.fc.weight[:, : config.hidden_size].copy_(torch.eye(config.hidden_size))
            self.fc.bias.zero_()
        self.block = Block(config.hidden_size, config.heads, config.mlp_size)

    @classmethod
    def for_target(cls, target: PreTrainedModel, mlp_ratio: int = 2) -> "EagleLayer":
        sizes = cls.target_sizes(target)
        hidden = sizes["hidden_size"]
        embed = target.get_input_embeddings().weight.shape[1]
        return cls(cls.Config(**sizes, embed_size=int(embed), heads=heads_for(hidden), mlp_size=mlp_ratio * hidden))

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor | None, cache: KVCache | None = None, start: int = 0) -> torch.Tensor:
        """features: [B, n, H] f_t; token_embeds: [B, n, E] embed(x_{t+1}) -> guesses of
        f_{t+1} [B, n, H]. With a cache, the n pairs' keys and values go into it at ``start``."""
        return self.block(self.fuse(features, token_embeds), positions, visible, cache, start)

    def fuse(self, features: torch.Tensor, token_embeds: torch.Tensor) -> torch.Tensor:
        """The layer's input: [B, n, H] features and [B, n, E] next-token embeddings -> [B, n, H]."""
        return self.fc(torch.cat([features, token_embeds.to(features.dtype)], dim=-1))


# ---- training (``hasten train eagle``) -------------------------------------------------------------
@dataclass(frozen=True)
class EagleTrainOptions(Settings):
    mlp_ratio: int = option(2, "MLP width of the layer, in multiples of the hidden size")
    ce_weight: float = option(0.1, "weight of the LM-head cross-entropy next to the feature regression")
    noise: float = option(0.2, "uniform noise on input features, relative to their RMS (robustness to drafts)")

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "mlp_ratio")
        if self.ce_weight < 0 or self.noise < 0:
            raise ValueError("ce_weight and noise must be >= 0")


class EagleTraining(TrainedTraining):
    Options = EagleTrainOptions

    def build(self) -> EagleLayer:
        return EagleLayer.for_target(self.target, self.options.mlp_ratio)

    def loss(self, module: EagleLayer, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        embed = self.target.get_input_embeddings()
        features = batch.hidden  # [B, T, H]
        inputs = self.noisy(module, features[:, :-1])
        length = features.shape[1] - 1
        positions = torch.arange(length, device=features.device).expand(len(features), -1)
        guess = module(inputs, embed(batch.ids[:, 1:]), positions, causal(length, device=features.device))
        keep = valid_positions(batch)[:, 1:]  # guess at t is scored against f_{t+1}
        per_pair, metrics = self.feature_losses(guess[keep], features[:, 1:][keep])
        return (per_pair.mean() if len(per_pair) else torch.zeros(())), metrics

    def noisy(self, module: nn.Module, features: torch.Tensor) -> torch.Tensor:
        """Input features with uniform noise while training (deeper draft levels read predicted features)."""
        if not (module.training and self.options.noise):
            return features
        scale = features.pow(2).mean(-1, keepdim=True).sqrt()
        return features + (torch.rand_like(features) - 0.5) * 2 * self.options.noise * scale

    def feature_losses(self, guess: torch.Tensor, truth: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """guess, truth: [M, H] guessed and true next features -> each pair's loss [M] (smooth-L1
        regression plus ``ce_weight`` x the cross-entropy of the LM head on the guess against
        the target's own next-token law; their mean is the loss) and the batch's metrics."""
        if not len(truth):
            return truth.new_zeros(0), {}
        lm_head = self.target.get_output_embeddings()
        regression = F.smooth_l1_loss(guess, truth, reduction="none").mean(-1)  # [M]
        with torch.no_grad():
            p = lm_head(truth).float().softmax(-1)  # the target's own next-token law  [M, V]
        logits = lm_head(guess).float()
        cross_entropy = -(p * logits.log_softmax(-1)).sum(-1)  # [M]
        accuracy = (logits.argmax(-1) == p.argmax(-1)).float().mean().item()
        metrics = {"regression": regression.mean().item(), "ce": cross_entropy.mean().item(), "top1": accuracy}
        return regression + self.options.ce_weight * cross_entropy, metrics


# ---- the drafter -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EagleSettings(WeightsSetting):
    depth: int = 5  # levels of the draft tree (draft-layer passes per step)
    top_k: int = 4  # children per expanded node, and nodes expanded per level
    total_tokens: int = 16  # nodes kept in the tree (verified per step)

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "depth", "top_k", "total_tokens")


@register
class Eagle(TrainedDrafter):
    name = "eagle"
    Settings = EagleSettings
    Module = EagleLayer
    Training = EagleTraining  # how `hasten train eagle` builds, trains and saves the layer


    def deepest(self) -> int:
        return self.settings.depth

    def start(self, ctx: DraftContext) -> CommittedRun:
        # the layer over the committed pairs; its cache then holds the current tree's nodes
        return CommittedRun()

    def cache_bytes(self, state: CommittedRun) -> int:
        """KV bytes of the layer's cache: its whole preallocated buffers (a view's storage)."""
        return allocated_bytes(state.cache.view())

    def draft(self, ctx: DraftContext) -> Draft:
        state: CommittedRun = ctx.state
        features, device = ctx.features, self.lm_head.weight.device

        def pairs(start: int, end: int, *args) -> torch.Tensor:  # (f_t, x_{t+1}) for t in [start, end)
            embeds = self.embed(torch.tensor(ctx.tokens[start + 1 : end + 1], device=device))[None]  # [1, new, E]
            return self.module(features[start:end][None], embeds, *args)

        newest = state.catch_up(0 if features is None else len(features), pairs, device)  # [H] guess of f_r
        if newest is None:  # no committed feature yet (one-token prompt)
            return EMPTY_DRAFT
        s = self.settings
        lm_head, cache = self.lm_head, state.cache
        committed = cache.length  # == r, the root's position, and the pair index of depth-1 nodes
        # the tree columns each node sees: its ancestors' and its own (the fed nodes' keys and
        # values sit after the committed pairs)
        levels = LevelVisibility()
        # The nodes expanded at one level are children of the nodes expanded at the level
        # before, so their input features are rows of that level's output.
        guesses, row_of = newest[None], {-1: 0}  # [n, H] the layer's guesses of the next features; node -> row

        def expand(nodes: list[int], grown: GrowingTree) -> torch.Tensor:
            nonlocal guesses, row_of
            n, fed = len(nodes), levels.fed
            features = guesses[[row_of[grown.parents[node]] for node in nodes]][None]  # [1, n, H]
            ids = torch.tensor([[grown.tokens[node] for node in nodes],
                                [committed + grown.depths[node] - 1 for node in nodes]], device=device)  # [2, n]
            visible = torch.ones(n, committed + fed + n, dtype=torch.bool, device=device)
            visible[:, committed:] = levels.add_level(nodes, grown).to(device)  # every committed pair, then the path
            # the level's keys/values go after the earlier levels', past the committed pairs
            out = self.module(features, self.embed(ids[0])[None], ids[1:], visible[None], cache, committed + fed)
            guesses, row_of = out[0], {node: row for row, node in enumerate(nodes)}
            return lm_head(out[0]).float().log_softmax(-1)  # [n, V]

        first = lm_head(newest).float().log_softmax(-1)
        depth = min(s.depth, ctx.max_depth)
        tokens, tree = dynamic_tree(first, expand, depth, s.top_k, s.total_tokens)
        return Draft(tokens, tree)
