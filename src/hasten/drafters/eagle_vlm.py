"""EagleVLM and SpecVLM (Huang et al. 2025, "SpecVLM: Fast Speculative Decoding in
Vision-Language Models"): the EAGLE drafter on a vision-language target, with an elastic
visual compressor for what the drafter reads of the image.

The drafter is :mod:`.eagle`'s layer: its input for the pair ``(f_t, x_{t+1})`` is
``fc(concat(f_t, e_{t+1}))``. At an image placeholder ``e_{t+1}`` is what the target's
language model read there (the projected visual feature, :attr:`ModelAdapter.prompt_embeds`),
not the placeholder token's embedding. When the prompt opens with an image, the first
placeholder's pair gets a zero feature (there is no ``f_{-1}``), so every image contributes
exactly one input per visual token.

Each image's run of inputs then goes through the :class:`~.compress.VisualCompressor`: a
branch chosen once per prompt (``compressor="elastic"``: the gate's choice; or one branch by
name) keeps ``m`` of the run's ``n`` inputs, and the drafter's own positions count what it
reads, so the text after the image sits ``n - m`` positions earlier for the drafter than for
the target. Only the prompt holds images, so after it every committed pair is one drafter
entry (``CommittedRun.shift``). Drafting itself is EAGLE-2's dynamic tree, unchanged.

Training (``hasten train eagle_vlm``): online distillation, as in the paper. Each step draws
scenes, runs the target with its images over prompt and answer (teacher forcing), and
trains on its last-layer features and next-token law computed on the spot: no stored
corpus. Every branch is trained on every batch (so each can run alone); the gate learns by
Gumbel-softmax to pick, per input, the branch whose loss plus ``token_cost`` x (share of
visual inputs kept) is lowest.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from ..core.settings import option
from ..models.vlm import image_token_id
from .base import EMPTY_DRAFT, Draft, DraftContext, register
from .compress import BRANCHES, VisualCompressor
from .eagle import Eagle, EagleConfig, EagleLayer, EagleSettings, EagleTrainOptions, EagleTraining
from .nn import CommittedRun, causal, heads_for
from .trainable import Batch, valid_positions

Run = tuple[int, int]  # [start, end) of one image's inputs, in the drafter's uncompressed input order


def image_runs(is_image: list[bool]) -> list[Run]:
    """Maximal runs of True, as [start, end) pairs."""
    runs, start = [], None
    for i, flag in enumerate(list(is_image) + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


@dataclass(frozen=True)
class EagleVlmConfig(EagleConfig):
    queries: int = 16  # the resampler's outputs per image


class EagleVlmLayer(EagleLayer):
    Config = EagleVlmConfig
    name = "eagle_vlm"

    def __init__(self, config: EagleVlmConfig):
        super().__init__(config)
        self.compressor = VisualCompressor(config.hidden_size, heads_for(config.hidden_size), config.queries)

    def gate(self, x: torch.Tensor, runs: list[Run], text: torch.Tensor) -> torch.Tensor:
        """[B, L, H] inputs, their image runs and [B, t, H] the prompt's text inputs -> [B, branches]."""
        visual = torch.cat([x[:, a:b] for a, b in runs], dim=1)
        return self.compressor.gate_logits(visual, text)

    def compose(self, x: torch.Tensor, runs: list[Run], branch: str) -> torch.Tensor:
        """[B, L, H] inputs -> [B, L', H] with each image run compressed by ``branch``."""
        pieces, done = [], 0
        for a, b in runs:
            pieces += [x[:, done:a], self.compressor.compress(branch, x[:, a:b])]
            done = b
        return torch.cat(pieces + [x[:, done:]], dim=1)


def drafter_inputs(module: EagleVlmLayer, features: torch.Tensor, embeds: torch.Tensor,
                   is_image: list[bool]) -> tuple[torch.Tensor, list[Run]]:
    """Uncompressed drafter inputs of a prompt and where its images are in them.

    features: [B, P, H] f_0 .. f_{P-1}; embeds: [B, P + 1, E] e_0 .. e_P (visual features at
    placeholders); is_image: P + 1 flags. Returns [B, L, H] (L = P, or P + 1 with a zero
    feature before f_0 when position 0 is an image placeholder) and the image runs in it."""
    virtual = int(is_image[0])
    if virtual:
        features = torch.cat([features.new_zeros(features[:, :1].shape), features], dim=1)
    x = module.fuse(features, embeds[:, 1 - virtual:])
    runs = [(a - 1 + virtual, b - 1 + virtual) for a, b in image_runs(is_image)]
    return x, runs


# ---- training (``hasten train eagle_vlm``) ----------------------------------------------------------
@dataclass(frozen=True)
class EagleVlmTrainOptions(EagleTrainOptions):
    token_cost: float = option(0.02, "the gate's price of keeping all of an image's inputs, in loss units")
    gate_temperature: float = option(1.0, "Gumbel-softmax temperature of the gate while training")
    queries: int = option(16, "the resampler's outputs per image")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.token_cost < 0 or self.gate_temperature <= 0 or self.queries < 1:
            raise ValueError("token_cost must be >= 0, gate_temperature > 0 and queries >= 1")


class EagleVlmTraining(EagleTraining):
    """Batches carry ``embeds`` (what the target read at every position) and come from an
    online source (``data_source``): the target runs on fresh scenes every step."""

    Options = EagleVlmTrainOptions
    data_source: ClassVar[str] = "scenes"

    def build(self) -> EagleVlmLayer:
        layer = EagleVlmLayer.for_target(self.target, self.options.mlp_ratio)
        return EagleVlmLayer(replace(layer.config, queries=self.options.queries))

    def loss(self, module: EagleVlmLayer, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        placeholder = self.target.config.image_token_id
        is_image = (batch.ids[0] == placeholder).tolist()
        if not torch.equal(batch.ids == placeholder, (batch.ids[:1] == placeholder).expand_as(batch.ids)):
            raise ValueError("eagle_vlm training batches must hold their images at the same positions")
        features = self.noisy(module, batch.hidden[:, :-1])  # [B, P, H]
        x, runs = drafter_inputs(module, features, batch.embeds, is_image)  # [B, L, H]
        virtual, last = int(is_image[0]), runs[-1][1]
        # pairs scored: after the last image, up to each row's last label; pair j guesses f_{j - virtual + 1}
        truth_all = F.pad(batch.hidden, (0, 0, virtual, 0))[:, 1:]  # [B, L, H] aligned with x
        keep = F.pad(valid_positions(batch), (virtual, 0))[:, 1:].clone()  # [B, L]
        keep[:, :last] = False
        text = x[:, last:][:, : self._prompt_text(batch, last - virtual + 1)]
        gate_logits = module.gate(x, runs, text)  # [B, branches]
        rows = keep.nonzero()[:, 0]  # [M] the row of each scored pair
        losses, row_costs, metrics = [], [], {}
        for branch in BRANCHES:
            composed = module.compose(x, runs, branch)  # [B, L', H]
            length = composed.shape[1]
            positions = torch.arange(length, device=x.device).expand(len(x), -1)
            out = module.block(composed, positions, causal(length, device=x.device))
            guess = out[:, length - (x.shape[1] - last):]  # [B, L - last, H] the text pairs' guesses
            per_pair, branch_metrics = self.feature_losses(guess[keep[:, last:]], truth_all[keep])  # [M]
            losses.append(per_pair.mean() if len(per_pair) else torch.zeros(()))
            per_row = torch.zeros(len(x)).index_add_(0, rows, per_pair.detach()) / keep.sum(1).clamp(min=1)
            kept = sum(module.compressor.kept(branch, b - a) for a, b in runs) / max(1, sum(b - a for a, b in runs))
            row_costs.append(per_row + self.options.token_cost * kept)
            metrics.update({f"{branch}_{k}": v for k, v in branch_metrics.items()})
        weights = module.compressor.gate_weights(gate_logits, self.options.gate_temperature)  # [B, branches]
        gate_loss = (weights * torch.stack(row_costs, dim=1)).sum(1).mean()
        chosen = gate_logits.argmax(-1)
        for i, branch in enumerate(BRANCHES):
            metrics[f"gate_{branch}"] = (chosen == i).float().mean().item()
        metrics["top1"] = metrics.get("full_top1", 0.0)
        return torch.stack(losses).mean() + gate_loss, metrics

    def _prompt_text(self, batch: Batch, first_text: int) -> int:
        """How many text positions follow the images before the first answer token (the
        prompt's text, which the gate reads), the fewest over the batch."""
        labels = batch.label_mask[:, first_text:].int()
        first_label = torch.where(labels.any(1), labels.argmax(1), torch.full_like(labels[:, 0], labels.shape[1]))
        return int(first_label.min())


# ---- the drafter -------------------------------------------------------------------------------------
COMPRESSORS = ("elastic",) + BRANCHES


@dataclass(frozen=True)
class EagleVlmSettings(EagleSettings):
    compressor: str = "elastic"  # "elastic" (the gate picks per prompt) or one of compress.BRANCHES

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {', '.join(COMPRESSORS)}, got {self.compressor!r}")


class VlmRun(CommittedRun):
    """eagle_vlm's per-generation state: the committed run, and what its prompt step chose."""

    def __init__(self) -> None:
        super().__init__()
        self.branch: str | None = None  # the compressor branch used for the prompt's images
        self.visual_tokens = 0  # image placeholders in the prompt
        self.visual_inputs = 0  # drafter inputs the compressed images kept of them
        self.prompt_seconds = 0.0  # the drafter's own prefill: reading the prompt once


@register
class EagleVlm(Eagle):
    name = "eagle_vlm"
    Settings = EagleVlmSettings
    Module = EagleVlmLayer
    Training = EagleVlmTraining

    def start(self, ctx: DraftContext) -> VlmRun:
        return VlmRun()

    def draft(self, ctx: DraftContext) -> Draft:
        state: VlmRun = ctx.state
        if state.branch is None:
            if ctx.features is None or not len(ctx.features):
                return EMPTY_DRAFT
            self._read_prompt(ctx, state)
        return super().draft(ctx)

    def choose(self, x: torch.Tensor, runs: list[Run]) -> str:
        """The branch for one prompt: the setting, or the gate's choice."""
        if self.settings.compressor != "elastic":
            return self.settings.compressor
        text = x[:, runs[-1][1]:]
        return BRANCHES[int(self.module.gate(x, runs, text).argmax(-1))]

    def _read_prompt(self, ctx: DraftContext, state: VlmRun) -> None:
        """Run the layer over the prompt's pairs once, its images compressed; later pairs
        go through Eagle's catch-up (``state.shift`` maps them to entries)."""
        clock = time.perf_counter()
        features = ctx.features  # [P, H]
        count, device = len(features), features.device
        tokens = torch.tensor(ctx.tokens[: count + 1], device=device)  # [P + 1] the pairs' next tokens included
        placeholder = image_token_id(ctx.target.modules)
        is_image = (tokens == placeholder).tolist() if placeholder is not None else [False] * (count + 1)
        prompt_embeds = ctx.target.prompt_embeds  # [T - 1, E] from an image prefill, else None
        if not any(is_image) or prompt_embeds is None:
            state.branch = "full"  # a text prompt: plain EAGLE
            return
        embeds = self.embed(tokens)  # [P + 1, E]
        image = torch.tensor(is_image, device=device)
        embeds[image] = prompt_embeds[image[: len(prompt_embeds)]].to(embeds.dtype)
        x, runs = drafter_inputs(self.module, features[None], embeds[None], is_image)  # [1, L, H]
        state.branch = self.choose(x, runs)
        composed = self.module.compose(x, runs, state.branch)  # [1, L', H]
        length = composed.shape[1]
        out = self.module.block(composed, torch.arange(length, device=device)[None], causal(length, device=device),
                                state.cache, 0)
        state.cache.commit(length)
        state.newest = out[0, -1]
        state.shift = count - length
        state.visual_tokens = sum(b - a for a, b in runs)
        state.visual_inputs = sum(self.module.compressor.kept(state.branch, b - a) for a, b in runs)
        state.prompt_seconds = time.perf_counter() - clock
