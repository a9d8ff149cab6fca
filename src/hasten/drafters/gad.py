"""GAD: Generalized Aggressive Decoding (Ge et al. 2022; Xia et al. 2023, "Speculative
Decoding: Exploiting Speculative Execution for Accelerating Seq2seq Generation").

A small non-autoregressive drafter guesses a whole block of the next ``block`` tokens in
one forward pass: ``block`` mask slots follow a short window of the newest committed
tokens (the target's frozen embeddings, plus the target's newest feature ``f_{r-1}`` at
the root's slot), and a few transformer layers attend bidirectionally over window and
slots. Slot ``i`` guesses ``x_{r+1+i}`` through the target's frozen LM head.

For encoder-decoder targets (the papers' home: grammar correction, translation) every layer
also cross-attends to the target's encoder states of the **whole source**, computed once per
generation (:mod:`.gad_seq2seq`), and window and slots sit at their absolute output positions,
so a slot knows which part of the source it is guessing; ``hasten train gad`` trains it on the
target's own corrections of :mod:`hasten.zoo.gec` sentences. The default draft is a chain (the
block, as in the paper); ``top_k > 1`` drafts a tree of top-k combinations of the slots
instead, which encoder-decoder targets (chains only) cut to its best path. Drafts are
deterministic (``probs=None``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from ..core.settings import option
from ..models.layers import encoder_width
from .base import DraftContext, register
from .candidates import TreeSettings
from .gad_seq2seq import CorrectionPairs, CrossAttention, Seq2SeqBatch, gec_pairs, sinusoid
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
    encoder_size: int = 0  # > 0: cross-attends to the target's encoder states (this wide) of the whole source


class GADModel(TrainedModule):
    Config = GADConfig
    name = "gad"

    def __init__(self, config: GADConfig):
        super().__init__(config)
        H, D = config.hidden_size, config.inner_size
        self.embed_in = nn.Linear(config.embed_size, D)
        self.feature_in = nn.Linear(H, D)
        self.mask = nn.Parameter(torch.randn(config.block, D) * 0.02)  # one learned embedding per slot
        self.source_tag = nn.Parameter(torch.zeros(D))  # the bias of the encoder states' projection
        self.layers = nn.ModuleList(Block(D, config.heads, 2 * D) for _ in range(config.layers))
        self.out = nn.Linear(D, H)
        if config.encoder_size:
            self.encoder_in = nn.Linear(config.encoder_size, D, bias=False)
            self.cross = nn.ModuleList(CrossAttention(D, config.heads) for _ in range(config.layers))

    @classmethod
    def for_target(cls, target: PreTrainedModel, block: int = 4, window: int = 8, layers: int = 2,
                   inner_ratio: float = 0.5) -> "GADModel":
        sizes = cls.target_sizes(target)
        inner = inner_size(sizes["hidden_size"], inner_ratio)
        embed = int(target.get_input_embeddings().weight.shape[1])
        return cls(GADConfig(**sizes, embed_size=embed, inner_size=inner, heads=heads_for(inner), layers=layers,
                             block=block, window=window, encoder_size=encoder_width(target)))

    @property
    def levels(self) -> int:
        return self.config.block

    def forward(self, window: torch.Tensor, present: torch.Tensor, feature: torch.Tensor,
                positions: torch.Tensor | None = None, source: torch.Tensor | list | None = None,
                source_present: torch.Tensor | None = None) -> torch.Tensor:
        """window: [B, w, E] embeddings of the newest tokens, right-aligned (the root last);
        present: [B, w] bool (False: padding before the start); feature: [B, H] f_{r-1}
        (zeros when unknown); positions: [B, w + block] the window's and slots' output
        positions (None: 0 .. w + block - 1, the decoder-only drafter's); source: [B, s, He]
        the target's encoder states (read when the module has ``encoder_size``), or what
        :meth:`read_source` made of them; source_present [B, s] bool. Returns [B, block, H]
        features, one per slot, for the target's LM head."""
        batch, width = present.shape
        x = self.embed_in(window.to(self.mask.dtype))  # [B, w, D]
        x = torch.cat([x[:, :-1], x[:, -1:] + self.feature_in(feature.to(x.dtype))[:, None]], 1)
        x = torch.cat([x, self.mask.expand(batch, -1, -1)], 1)  # [B, n, D]
        seen = torch.cat([present, present.new_ones(batch, self.config.block)], 1)  # [B, n]
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device).expand(batch, -1)
        visible = seen[:, None, :].expand(-1, x.shape[1], -1)  # [B, n, n] bidirectional over what is present
        if self.config.encoder_size and source is not None:
            x = x + sinusoid(positions, x.shape[-1]).to(x.dtype)  # where each position is in the output
            if isinstance(source, torch.Tensor):
                source = self.read_source(source)
        else:
            source = None
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, visible)
            if source is not None:
                x = self.cross[i](x, source[i], source_present)
        return self.out(x[:, -self.config.block:])

    def read_source(self, source: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[B, s, He] encoder states -> each cross-attention layer's keys and values (a
        generation's are made once, in the drafter's ``start``)."""
        memory = self.encoder_in(source.to(self.mask.dtype)) + self.source_tag  # [B, s, D]
        return [cross.keys_values(memory) for cross in self.cross]


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

    @staticmethod
    def seq2seq_data(model: PreTrainedModel, tokenizer, settings, work_dir, resume: bool = False) -> CorrectionPairs:
        """On an encoder-decoder target, ``hasten train gad`` trains on ``settings.samples``
        corrupted :mod:`hasten.zoo.gec` sentences and the target's own greedy corrections
        (at most ``settings.gen_tokens`` tokens), instead of text cut into prompts."""
        return gec_pairs(model, tokenizer, settings.samples, settings.gen_tokens, settings.seed, work_dir,
                         resume=resume)

    def build(self) -> GADModel:
        o = self.options
        return GADModel.for_target(self.target, o.block, o.window, o.layers, o.inner_ratio)

    def loss(self, module: GADModel, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Slot i (0-based) after root position a (window x_{a-w+1} .. x_a, feature f_{a-1})
        against x_{a+1+i}; roots are drawn where the first slot has a label. On an
        encoder-decoder (a :class:`Seq2SeqBatch`) the decoder's start token is a root too (its
        feature zeros, as at a generation's first step), positions are absolute and the
        module reads the source's encoder states."""
        config = module.config
        lm_head, embed = self.target.get_output_embeddings(), self.target.get_input_embeddings()
        ids, labels_ok = batch.ids, batch.label_mask  # [B, T]
        seq2seq = isinstance(batch, Seq2SeqBatch)
        first = 0 if seq2seq else 1  # the first root: a decoder-only root needs a feature f_{a-1}
        length = ids.shape[1]
        if length <= first + 1:
            return torch.zeros(()), {}
        roots = anchors(labels_ok[:, first + 1:], self.options.anchors) + first  # [B, A] with a label at a + 1
        batch_size, count = roots.shape
        rows = torch.arange(batch_size, device=ids.device)[:, None, None]
        offsets = torch.arange(-config.window + 1, 1, device=ids.device)  # [w]
        where = roots[:, :, None] + offsets  # [B, A, w]
        window = embed(ids[rows, where.clamp(min=0)])  # [B, A, w, E]
        present = where >= 0
        feature = batch.hidden[rows[:, :, 0], (roots - 1).clamp(min=0)] * (roots >= 1)[..., None]  # [B, A, H]
        inputs = [window.flatten(0, 1), present.flatten(0, 1), feature.flatten(0, 1)]
        if seq2seq:
            slot_at = roots[:, :, None] + torch.arange(1, config.block + 1, device=ids.device)  # [B, A, block]
            positions = torch.cat([where.clamp(min=0), slot_at], -1).flatten(0, 1)  # [B * A, w + block]
            source = batch.source.repeat_interleave(count, 0)  # [B * A, s, He]
            inputs += [positions, source, batch.source_present.repeat_interleave(count, 0)]
        slots = module(*inputs).view(batch_size, count, config.block, -1)  # [B, A, block, H]

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

    def start(self, ctx: DraftContext) -> list | None:
        """The module's keys and values of the target's encoder states of the whole source,
        once per generation (an encoder-decoder target and a module that reads them), else None."""
        if ctx.source is None or not self.module.config.encoder_size:
            return None
        with torch.no_grad():
            return self.module.read_source(ctx.target.encoder_states)  # the encoder output the target computed

    def level_logits(self, ctx: DraftContext, depth: int) -> torch.Tensor:
        config = self.module.config
        device = self.lm_head.weight.device
        recent = ctx.tokens[-config.window:]
        features = ctx.features
        if features is not None and len(features):
            feature = features[-1][None]  # [1, H]
        else:  # no feature yet (one-token prompt, or an encoder-decoder's first step)
            feature = self.lm_head.weight.new_zeros(1, config.hidden_size)
        if ctx.state is not None:  # seq2seq: the window and slots at their output positions, no padding
            first = len(ctx.tokens) - len(recent)
            positions = torch.arange(first, len(ctx.tokens) + config.block, device=device)[None]  # [1, w + block]
            window = self.embed(torch.tensor(recent, device=device))[None]  # [1, w, E]
            present = torch.ones(1, len(recent), dtype=torch.bool, device=device)
            slots = self.module(window, present, feature, positions, ctx.state)[0]  # [block, H]
        else:
            pad = config.window - len(recent)
            window = self.embed(torch.tensor([0] * pad + recent, device=device))[None]  # [1, w, E]
            present = torch.tensor([[False] * pad + [True] * len(recent)], device=device)
            slots = self.module(window, present, feature)[0]  # [block, H]
        return self.lm_head(slots[:depth]).float()  # [depth, V]
