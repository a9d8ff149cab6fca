"""The training side of trained drafters, shared by all of them.

* :class:`Batch` and :class:`Trainable`: the protocol ``hasten train NAME`` drives (a
  drafter class names its recipe in ``Training``; :mod:`hasten.training` runs it). They
  live here, beside the drafters, so that drafters never import the training package;
* :class:`TrainedTraining`: the shared ``save`` (the target's name and the held-out rank
  accuracies go into the module's config, where the drafter's default tree comes from),
  and :class:`LevelTrainOptions` (the per-level loss ``decay``);
* loss helpers: :func:`decayed_cross_entropy` (per-level cross-entropy weighted by
  ``decay ** level``, recording rank accuracies), :func:`valid_positions`, :func:`anchors`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from ..core.settings import Settings, option

RANKS = 4  # ranks per level whose accuracy training measures (the widest default tree)


@dataclass
class Batch:
    ids: torch.Tensor  # [B, T] token ids, zero-padded after each row's length
    # [B, T, H] target's last-layer hidden states; hidden[:, t] predicts ids[:, t + 1]
    # (None where the trainer's data holds no last layer: a method that reads none)
    hidden: torch.Tensor | None
    label_mask: torch.Tensor  # [B, T] bool: ids[:, t] is the target's own token (a label to learn)
    # [B, T, E] what the target's language model read at each position (its projected visual
    # features at image placeholders); only from online sources of image-text targets
    embeds: torch.Tensor | None = None
    # {k: [B, T, H]} the residual stream Hugging Face's hidden_states[k] holds, for the layers
    # Trainable.feature_layers named, where the data stores them (hasten.training.features)
    features: dict[int, torch.Tensor] | None = None
    greedy: torch.Tensor | None = None  # [B, T] the target's greedy next token at each position, where stored


class Trainable:
    """How one drafter's module is trained; subclass and set ``Options``.

    ``Options`` is a frozen settings dataclass of the method's knobs (validated in
    ``__post_init__``); each field becomes a ``hasten train NAME --field-name`` flag, with
    ``metadata={"help": ...}`` as its help text (see :func:`hasten.core.settings.option`).
    """

    Options: ClassVar[type]
    # where batches come from: None, self-distilled text (hasten.training.distill); a name:
    # an online source in hasten.training.online that runs the target on fresh inputs per batch
    data_source: ClassVar[str | None] = None

    def __init__(self, target: PreTrainedModel, options: Any):
        self.target, self.options = target, options

    def prepare(self, data: Any) -> None:
        """Called with the training data before :meth:`build` (e.g. to pick a draft vocabulary
        from the target's own answers); the default needs nothing."""

    def feature_layers(self) -> tuple[int, ...]:
        """The target's hidden states the loss reads, as indices of Hugging Face's
        ``hidden_states`` (the last one, ``num_hidden_layers``, is ``Batch.hidden``): what a
        feature store (:mod:`hasten.training.features`) extracts once for this method."""
        return (self.target.config.get_text_config().num_hidden_layers,)

    def build(self) -> nn.Module:
        """A freshly initialised module for ``self.target`` (the global RNG is seeded)."""
        raise NotImplementedError

    def loss(self, module: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss to minimise, and metrics (floats) to report and average."""
        raise NotImplementedError

    def save(self, module: nn.Module, out_dir: Path, report: dict) -> None:
        """Write the trained module where the drafter loads it from. ``report`` holds
        ``target`` (the model name) and ``eval`` (held-out metrics)."""
        raise NotImplementedError


class TrainedTraining(Trainable):
    """Training of a :class:`~.trained.TrainedModule`: ``save`` records the target and
    the held-out rank accuracies of the ``measured_levels`` levels in its config."""

    def save(self, module: nn.Module, out_dir: Path, report: dict) -> None:
        accuracy = module.config.accuracy
        levels = self.measured_levels(module)
        if levels:
            accuracy = measured_accuracy(report.get("eval", {}), levels)
        module.config = replace(module.config, target=report["target"], accuracy=accuracy)
        module.save(out_dir)

    def measured_levels(self, module: nn.Module) -> int:
        """Levels whose rank accuracies the loss reports (0: none)."""
        return module.levels


@dataclass(frozen=True)
class LevelTrainOptions(Settings):
    """Training options of the drafters that guess several levels at once; their
    ``Options`` extend it."""

    decay: float = option(0.8, "loss weight of level k is decay**(k-1): far guesses matter less")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


def check_inner_ratio(ratio: float) -> None:
    """The width option of drafters with layers of their own (see :func:`.nn.inner_size`)."""
    if not 0 < ratio <= 4:
        raise ValueError(f"inner_ratio must be in (0, 4], got {ratio}")


# ---- loss helpers ----------------------------------------------------------------------------------
Level = tuple[int, torch.Tensor, torch.Tensor]  # level (0-based), logits [M, V], labels [M]


def decayed_cross_entropy(levels: Iterable[Level], decay: float, metrics: dict[str, float]) -> torch.Tensor:
    """Sum over levels of ``decay ** level`` x cross-entropy (far guesses matter less);
    levels without labels are skipped. Records each level's rank accuracies in ``metrics``."""
    total = torch.zeros(())
    for level, logits, labels in levels:
        if not len(labels):
            continue
        logits = logits.float()
        total = total + decay**level * F.cross_entropy(logits, labels)
        rank_hits(logits, labels, level + 1, metrics)
    return total


def rank_hits(logits: torch.Tensor, labels: torch.Tensor, level: int, metrics: dict[str, float]) -> None:
    """Record how often each of the RANKS best guesses of ``logits`` ([M, V]) is the label."""
    hits = logits.topk(min(RANKS, logits.shape[-1]), dim=-1).indices == labels[:, None]  # [M, RANKS]
    for rank, rate in enumerate(hits.float().mean(0).tolist()):
        metrics[f"head{level}_rank{rank}"] = rate


def measured_accuracy(evaluated: dict[str, float], levels: int) -> list[list[float]] | None:
    """accuracy[d][r] of the rank-r guess at depth d + 1, from held-out metrics (None if absent)."""
    keys = [[f"head{k}_rank{r}" for r in range(RANKS)] for k in range(1, levels + 1)]
    if not all(row[0] in evaluated for row in keys):
        return None
    return [[round(evaluated.get(key, 0.0), 4) for key in row] for row in keys]


def valid_positions(batch: Batch) -> torch.Tensor:
    """[B, T] bool: positions holding real tokens (the prompt and the labels), i.e. up to
    the last label of each row; rows without labels count as empty."""
    labels = batch.label_mask.int()
    return labels.flip(1).cummax(1).values.flip(1).bool()


def anchors(mask: torch.Tensor, count: int) -> torch.Tensor:
    """[B, T] bool of allowed positions -> [B, count] positions drawn uniformly (with
    replacement) among them; rows with none get position 0 (their losses are masked)."""
    empty = ~mask.any(1, keepdim=True)  # [B, 1]
    weights = mask.float() + empty.float() * F.one_hot(torch.zeros(len(mask), dtype=torch.long), mask.shape[1])
    return torch.multinomial(weights, count, replacement=True)  # uses the trainer-seeded global RNG
