"""Hidden transfer: pseudo hidden states for future positions, refined by the target's own
upper layers (Wu et al. 2024, "Parallel Decoding via Hidden Transfer for Lossless Large
Language Model Acceleration").

At an intermediate layer ``L`` of the target, a trained linear transfer maps a token's
hidden state ``h_a`` to pseudo hidden states for ``num_tokens`` placeholder positions
``a + 1 .. a + num_tokens``, ``h_a + W_j h_a + b_j`` (zero-initialised ``W_j, b_j``). The
target's layers above ``L`` run on them as on real tokens, attending to ``a``'s context
and to each other in causal order, and the LM head reads placeholder ``j``'s guess of
``x_{a+2+j}`` (``x_{a+1}`` being the target's own next token after ``a``).

Drafting costs no forward of its own: the placeholders *ride* on the verification
forward (:class:`~hasten.core.rows.Riders`), ``num_tokens`` of them after every
block position, hidden from the real tokens by the tree mask. The loop hands back the
rider logits at the accepted path's end ``e``; the next root is the bonus token at
``e + 1``, so placeholder ``j`` guesses exactly depth ``j + 1`` of the next draft. The
next draft is a tree of top-k combinations of those guesses (the first step, with no
guesses yet, verifies the root alone and carries riders). One target forward per step;
``tau`` counts everything.

Verification cost: a draft of ``n`` nodes runs ``(n + 1) * (num_tokens + 1)`` positions,
so the default tree is small (``tree_size`` 6); the riders skip the decoder layers below
``L``, where whatever they held would be replaced anyway.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn
from transformers import PreTrainedModel

from ..core.rows import Riders
from ..core.runtime import Capability
from ..core.settings import Settings, option
from ..models.layers import num_layers, placeholder_logits_batch
from .base import Draft, DraftContext, StepResult, register
from .candidates import TreeSettings
from .trainable import Batch, TrainedTraining, anchors, decayed_cross_entropy
from .trained import ModuleConfig, TopKTreeDrafter, TrainedModule, WeightsSetting


# ---- the transfer ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class HiddenTransferConfig(ModuleConfig):
    layer: int = 1  # the decoder layer whose input is replaced at the placeholders
    num_tokens: int = 3  # placeholders: pseudo hidden states for positions a + 1 .. a + num_tokens


class Transfer(TrainedModule):
    Config = HiddenTransferConfig
    name = "hidden_transfer"

    def __init__(self, config: HiddenTransferConfig):
        super().__init__(config)
        H = config.hidden_size
        self.maps = nn.ModuleList(nn.Linear(H, H) for _ in range(config.num_tokens))
        for linear in self.maps:  # untrained: every pseudo state is a copy of h_a
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)

    @classmethod
    def for_target(cls, target: PreTrainedModel, num_tokens: int = 3, layer: int | None = None) -> "Transfer":
        depth = num_layers(target)
        layer = depth // 2 if layer is None else layer
        if not 0 <= layer < depth:
            raise ValueError(f"layer must be in [0, {depth}) for this target, got {layer}")
        return cls(HiddenTransferConfig(**cls.target_sizes(target), layer=layer, num_tokens=num_tokens))

    def forward(self, hidden: torch.Tensor, count: int | None = None) -> torch.Tensor:
        """[..., H] an anchor's input to layer L -> [..., count, H] pseudo states for its
        first ``count`` placeholders (None: all ``num_tokens``)."""
        hidden = hidden.to(self.maps[0].weight.dtype)
        return torch.stack([hidden + linear(hidden) for linear in self.maps[:count]], dim=-2)


# ---- training (``hasten train hidden_transfer``) --------------------------------------------------------
@dataclass(frozen=True)
class HiddenTransferTrainOptions(Settings):
    num_tokens: int = option(3, "placeholders per step: pseudo hidden states for the next positions")
    layer: int = option(-1, "decoder layer whose input is replaced (-1: the middle one)")
    anchors: int = option(16, "anchor positions per sequence trained at once (one forward, a block mask)")
    decay: float = option(0.8, "loss weight of placeholder j is decay**(j-1): far ones matter less")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_tokens < 1 or self.anchors < 1:
            raise ValueError("num_tokens and anchors must be >= 1")
        if self.layer < -1:
            raise ValueError(f"layer must be >= 0, or -1 for the middle layer, got {self.layer}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


class HiddenTransferTraining(TrainedTraining):
    Options = HiddenTransferTrainOptions

    def build(self) -> Transfer:
        layer = None if self.options.layer < 0 else self.options.layer
        return Transfer.for_target(self.target, self.options.num_tokens, layer)

    def measured_levels(self, module: Transfer) -> int:
        return module.config.num_tokens

    def feature_layers(self) -> tuple[int, ...]:
        return ()  # the placeholders run through the target's own upper layers at every step

    def loss(self, module: Transfer, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Placeholder j (0-based) after anchor a, against x_{a+2+j}: the same layout as
        the riders of a verification forward. Anchors are drawn where at least the first
        placeholder has a label."""
        k = module.config.num_tokens
        ids, labels_ok = batch.ids, batch.label_mask  # [B, T]
        length = ids.shape[1]
        if length <= 2:
            return torch.zeros(()), {}
        roots = anchors(labels_ok[:, 2:], self.options.anchors)  # [B, A] positions a with a label at a + 2
        logits = placeholder_logits_batch(self.target, ids, roots, k, module.config.layer, module)  # [B, A, k, V]
        rows = torch.arange(len(ids), device=ids.device)[:, None]

        def levels():
            for j in range(k):
                guessed = roots + 2 + j  # [B, A] the position placeholder j guesses
                where = guessed.clamp(max=length - 1)
                keep = labels_ok[rows, where] & (guessed < length)  # [B, A]
                yield j, logits[:, :, j][keep], ids[rows, where][keep]

        metrics: dict[str, float] = {}
        return decayed_cross_entropy(levels(), self.options.decay, metrics), metrics


# ---- the drafter -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HiddenTransferSettings(TreeSettings, WeightsSetting):
    # every node brings num_tokens riders: a draft of n nodes runs (n + 1) * (num_tokens + 1)
    # positions, so a small tree pays best (6: 28 positions for 3 placeholders)
    tree_size: int = 6
    num_tokens: int = 3  # placeholders, for untrained weights only (trained ones bring theirs)
    layer: int | None = None  # replaced layer, for untrained weights only; None: the middle one

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if self.layer is not None and self.layer < 0:
            raise ValueError(f"layer must be >= 0 (or None for the middle one), got {self.layer}")


@dataclass
class PendingGuesses:
    """One generation's state: the rider logits the last verification left at its
    accepted path's end; row j guesses depth j + 1 of the next draft."""

    logits: torch.Tensor | None = None  # [tree depth, vocab]; None before the first step


@register
class HiddenTransfer(TopKTreeDrafter):
    name = "hidden_transfer"
    Settings = HiddenTransferSettings
    Module = Transfer
    Training = HiddenTransferTraining  # how `hasten train hidden_transfer` trains and saves the transfer
    needs = frozenset({Capability.MODULES, Capability.RIDERS})  # it reads its riders' logits, not features
    riders: Riders

    def untrained(self, model: PreTrainedModel) -> Transfer:
        return Transfer.for_target(model, self.settings.num_tokens, self.settings.layer)

    def levels(self) -> int:
        return self.module.config.num_tokens

    def setup(self, model: PreTrainedModel) -> None:
        config = self.module.config
        if config.layer >= num_layers(model):  # also raises for architectures whose layers cannot be found
            raise ValueError(f"hidden_transfer weights replace layer {config.layer}, "
                             f"but the target has {num_layers(model)} layers")
        super().setup(model)  # the tree, from the measured accuracy of each placeholder
        # a shallower tree needs fewer placeholders; placeholder j sees only 0 .. j, so
        # dropping the later ones changes nothing
        depth = self.tree.depth
        self.riders = Riders(depth, config.layer, partial(self.module, count=depth))

    def start(self, ctx: DraftContext) -> PendingGuesses:
        return PendingGuesses()

    def level_logits(self, ctx: DraftContext, depth: int) -> torch.Tensor | None:
        pending = ctx.state.logits
        return None if pending is None else pending[:depth]

    def draft(self, ctx: DraftContext) -> Draft:
        return replace(super().draft(ctx), riders=self.riders)  # the first step: no guesses, riders only

    def observe(self, ctx: DraftContext, result: StepResult) -> None:
        ctx.state.logits = result.riders
