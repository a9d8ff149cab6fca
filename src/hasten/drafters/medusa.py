"""Medusa: extra heads on the target's last hidden state guess several tokens ahead
(Cai et al. 2024, "Medusa", Medusa-1: heads trained on a frozen target).

Head k (k = 1..K) reads the hidden state at the position just before the root (the one
the target's own LM head turns into the root) and predicts the token k positions after
the root. The candidates form a tree of top-k combinations: the node with path
(i1, i2, ...) holds the i_d-th most likely token of head d. All heads read the same
hidden state, so a node's token does not depend on its ancestors, and siblings are
distinct by construction (top-k of one distribution). The draft is deterministic
(``probs=None``): the verifier's recursive rejection keeps sampling exact.

On disk a set of heads is a directory with ``heads.safetensors`` and ``medusa.json``.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from ..models.adapter import model_name
from ..training.trainer import Batch, Trainable, option
from .base import Draft, DraftContext, Drafter, EMPTY_DRAFT, register, settings_from
from .candidates import CombinationTree, TreeSettings

CONFIG_FILE, WEIGHTS_FILE = "medusa.json", "heads.safetensors"
DEFAULT_DIR = "medusa"  # heads found beside a target: <model dir>/medusa/
RANKS = 4  # ranks per head whose accuracy training measures (the widest default tree)


# ---- the heads ------------------------------------------------------------------------
class ResidualBlock(nn.Module):
    """x + SiLU(Wx + b), as in Medusa-1. Zero-initialised, so an untrained block is the
    identity and an untrained head repeats the target's own next-token prediction."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


@dataclass(frozen=True)
class MedusaConfig:
    """What ``medusa.json`` holds."""

    num_heads: int
    hidden_size: int
    vocab_size: int
    share_lm_head: bool = True  # use the target's frozen LM head (only the blocks are stored)
    target: str = ""  # the model the heads were trained for
    # accuracy[k][r]: how often head k + 1's rank-r token was right on held-out data
    accuracy: list[list[float]] | None = None


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        H, V = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(ResidualBlock(H) for _ in range(config.num_heads))
        # Own LM heads, one per head, when not sharing the target's (Medusa-1 copies the
        # target's head into each; see copy_lm_head).
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(nn.Linear(H, V, bias=False) for _ in range(config.num_heads))

    @classmethod
    def for_target(cls, target: PreTrainedModel, num_heads: int, share_lm_head: bool = True) -> "MedusaHeads":
        """Untrained heads shaped for ``target``."""
        lm_head = target.get_output_embeddings()
        vocab, hidden = lm_head.weight.shape
        heads = cls(MedusaConfig(num_heads, hidden, vocab, share_lm_head, model_name(target)))
        if not share_lm_head:
            for own in heads.lm_heads:
                own.weight.data.copy_(lm_head.weight.data)
        return heads.to(lm_head.weight.device)

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

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().float().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, directory / WEIGHTS_FILE)
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "MedusaHeads":
        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"no Medusa heads in {directory} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
        config = MedusaConfig(**json.loads((directory / CONFIG_FILE).read_text()))
        heads = cls(config)
        heads.load_state_dict(load_file(directory / WEIGHTS_FILE))
        return heads.eval()


# ---- training (``hasten train medusa``) ------------------------------------------------------
@dataclass(frozen=True)
class MedusaTrainOptions:
    num_heads: int = option(4, "heads to train: head k guesses the token k places after the next one")
    share_lm_head: bool = option(True, "reuse the target's frozen LM head (small files); else train one per head")
    decay: float = option(0.8, "loss weight of head k is decay**(k-1): far heads matter less")

    def __post_init__(self) -> None:
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


class MedusaTraining(Trainable):
    Options = MedusaTrainOptions

    def build(self) -> MedusaHeads:
        return MedusaHeads.for_target(self.target, self.options.num_heads, self.options.share_lm_head)

    def loss(self, module: MedusaHeads, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Sum over heads of decay**(k-1) x cross-entropy of head k at position t against
        token t + 1 + k (the target's own hidden state at t predicts token t + 1)."""
        lm_head = self.target.get_output_embeddings()
        total, metrics = torch.zeros(()), {}
        for k in range(module.config.num_heads):
            shift = k + 2  # head k (0-based) at position t predicts token t + k + 2
            if batch.ids.shape[1] <= shift:
                break
            keep = batch.label_mask[:, shift:]  # [B, T - shift] labels that are the target's own tokens
            hidden = batch.hidden[:, :-shift][keep]  # [M, H]
            labels = batch.ids[:, shift:][keep]  # [M]
            if not len(labels):
                continue
            logits = module.head_logits(hidden, k, lm_head).float()  # [M, V]
            total = total + self.options.decay**k * F.cross_entropy(logits, labels)
            hits = logits.topk(min(RANKS, logits.shape[-1]), dim=-1).indices == labels[:, None]  # [M, RANKS]
            for rank, rate in enumerate(hits.float().mean(0).tolist()):
                metrics[f"head{k + 1}_rank{rank}"] = rate
        return total, metrics

    def save(self, module: MedusaHeads, out_dir: Path, report: dict) -> None:
        # The held-out rank accuracies shape the drafter's default tree.
        evaluated = report.get("eval", {})
        keys = [[f"head{k}_rank{r}" for r in range(RANKS)] for k in range(1, module.config.num_heads + 1)]
        accuracy = [[round(evaluated[key], 4) for key in row] for row in keys] if keys[-1][0] in evaluated else None
        module.config = replace(module.config, target=report["target"], accuracy=accuracy)
        module.save(out_dir)


# ---- the drafter ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MedusaSettings(TreeSettings):  # tree, top_k, tree_size: the shared candidate-tree knobs
    heads: str | None = None  # heads directory; None: <target model dir>/medusa/, else untrained heads
    num_heads: int = 4  # for untrained heads only (trained heads bring their own count)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_heads < 1:
            raise ValueError(f"num_heads must be >= 1, got {self.num_heads}")


@register
class Medusa(Drafter):
    name = "medusa"
    Settings = MedusaSettings
    Training = MedusaTraining  # how `hasten train medusa` builds, trains and saves heads
    needs_hidden = True

    def __init__(self, settings: MedusaSettings | None = None, **kwargs):
        self.settings = settings_from(MedusaSettings, settings, kwargs)
        self._heads = MedusaHeads.load(self.settings.heads) if self.settings.heads else None
        self._target = None  # the model the current heads are set up for

    def begin(self, ctx: DraftContext) -> None:
        model = ctx.target.model
        if ctx.target.encoder_decoder:
            raise ValueError("medusa drafts trees, which encoder-decoder targets do not support yet")
        if model is not self._target:
            self._setup(model)

    def _setup(self, model: PreTrainedModel) -> None:
        if not self.settings.heads:  # heads live beside each target
            self._heads = self._find_heads(model)
        heads, config = self._heads, self._heads.config
        self._lm_head = model.get_output_embeddings()
        vocab, hidden = self._lm_head.weight.shape
        if (config.hidden_size, config.vocab_size) != (hidden, vocab):
            raise ValueError(
                f"Medusa heads for {config.target!r} (hidden {config.hidden_size}, vocab {config.vocab_size}) do not "
                f"fit {model_name(model)!r} (hidden {hidden}, vocab {vocab})"
            )
        heads.to(self._lm_head.weight.device)
        self._candidates = CombinationTree.choose(self.settings, config.accuracy, config.num_heads)
        self._target = model

    def _find_heads(self, model: PreTrainedModel) -> MedusaHeads:
        source = getattr(model.config, "_name_or_path", "")  # the directory the target was loaded from
        beside = Path(source) / DEFAULT_DIR if source else None
        if beside is not None and (beside / CONFIG_FILE).is_file():
            return MedusaHeads.load(beside)
        warnings.warn(
            f"no Medusa heads found for {model_name(model)!r} (looked in {beside}); using untrained heads, "
            "which rarely guess right: train some with `hasten train medusa`",
            stacklevel=4,
        )
        return MedusaHeads.for_target(model, self.settings.num_heads).eval()

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        if ctx.hidden is None or len(ctx.hidden) == 0:  # nothing cached yet (one-token prompt)
            return EMPTY_DRAFT
        logits = self._heads(ctx.hidden[-1], self._lm_head)  # [K, V]
        return Draft(self._candidates.tokens(self._candidates.ranked(logits)), self._candidates.tree)

