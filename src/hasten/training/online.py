"""Online data sources for ``hasten train``: the target runs on fresh inputs for every batch,
so no corpus is stored (SpecVLM's online distillation).

A drafter's training names its source in ``Trainable.data_source``; :data:`SOURCES` maps the
name to a class built as ``Source(model, model_dir, settings)``. Each offers what the trainer
asks of distilled data: ``split()`` (training rows, held-out rows) and ``batch(rows, target,
device)``; a row is a seed from which the input is generated.

``scenes``: the procedurally generated scenes of :mod:`hasten.zoo.scenes` (zoo:vlm-tiny's
world), each an image with a one-turn prompt (the description or a question) and its
reference answer, tokenized by the target's own processor exactly as ``hasten generate
--image`` sends a prompt. The target reads image, prompt and answer in one forward
(teacher forcing); its last-layer features and the inputs its language model read
(visual features at the placeholders) come back as the batch. Training seeds are below
:data:`~hasten.zoo.vlm_recipe.HELDOUT_SEEDS`; held-out scenes are the first ones above it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from ..core.settings import Settings, option
from ..drafters.trainable import Batch


@dataclass(frozen=True)
class OnlineSettings(Settings):
    describe_rate: float = option(0.5, "share of scenes prompted for their description (else one question)")
    eval_scenes: int = option(16, "held-out scenes in each evaluation")
    seed: int = option(0, "seeds the initialisation and the order of the training scenes")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.describe_rate <= 1.0:
            raise ValueError(f"describe_rate must be in [0, 1], got {self.describe_rate}")
        if self.eval_scenes < 1:
            raise ValueError(f"eval_scenes must be >= 1, got {self.eval_scenes}")


class SeedRange:
    """Rows 0 .. size - 1 without a tensor of them: indexing by positions gives the seeds."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, positions: torch.Tensor) -> torch.Tensor:
        return positions


class SceneStream:
    """Scenes for an image-text target (LLaVA-style: one image placeholder per visual token)."""

    def __init__(self, model: PreTrainedModel, model_dir: str | Path, settings: OnlineSettings):
        from transformers import AutoProcessor

        from ..zoo import vlm_recipe

        if getattr(model.config, "image_token_id", None) is None:
            raise ValueError("the scenes source needs a vision-language target (one with an image_token_id)")
        self.recipe, self.settings = vlm_recipe, settings
        self.processor = AutoProcessor.from_pretrained(model_dir)
        self.n_image = int(getattr(model.config, "image_seq_length", 0) or vlm_recipe.image_tokens())
        self.turns = vlm_recipe.VlmSettings(max_turns=1, describe_rate=settings.describe_rate)

    def split(self) -> tuple[SeedRange, torch.Tensor]:
        held_out = self.recipe.HELDOUT_SEEDS + torch.arange(self.settings.eval_scenes)
        return SeedRange(self.recipe.HELDOUT_SEEDS), held_out

    @torch.no_grad()
    def batch(self, rows: torch.Tensor, target: PreTrainedModel, device: str = "cpu") -> Batch:
        seeds = rows.tolist()
        rng = np.random.default_rng(seeds)  # the prompts follow from the seeds alone
        inputs = self.recipe.make_batch(self.processor, seeds, rng, self.turns, self.n_image)
        out = target(input_ids=inputs["input_ids"].to(target.device),
                     attention_mask=inputs["attention_mask"].to(target.device),
                     pixel_values=inputs["pixel_values"].to(target.device, target.dtype), output_hidden_states=True)
        hidden = out.hidden_states[-1].float()  # [B, T, H] right padding cannot change earlier positions
        embeds = out.hidden_states[0].float()  # [B, T, E] visual features at the placeholders
        label_mask = inputs["labels"] != -100  # [B, T] the answers
        return Batch(inputs["input_ids"].to(device), hidden.to(device), label_mask.to(device), embeds.to(device))


SOURCES = {"scenes": SceneStream}
