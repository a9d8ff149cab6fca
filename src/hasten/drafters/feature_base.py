"""Shared pieces of the feature-level drafters (EAGLE, Chimera, hidden transfer, GAD).

* :class:`FeatureRecord`: the running list of committed (feature, token) pairs, kept in
  step with the decode loop from ``ctx.hidden``;
* :class:`Block`: one small pre-norm transformer layer over explicit keys and values
  (rotary positions, any boolean mask), so drafters can attend over their own caches and
  over draft trees without any Hugging Face machinery;
* :class:`FeatureModule`: a small ``nn.Module`` with a JSON config, saved as float16
  safetensors (the target's embeddings and LM head are borrowed at run time, never stored);
* :class:`FeatureDrafter`: finding weights beside the target (``<model dir>/<name>/``),
  falling back to an untrained module with a warning, shape checks;
* :class:`FeatureTraining`: the parts of ``hasten train NAME`` these drafters share.

Indexing convention, used by every drafter here: the target's feature ``f_t`` (its
last-layer hidden state at position ``t``) is what its LM head turns into token
``x_{t+1}``. With committed tokens ``x_0 .. x_r`` (``x_r`` the root), the record holds
``f_0 .. f_{r-1}``: ``f_{r-1}`` is the newest feature, the one that predicted the root.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from ..models.adapter import model_name
from ..training.trainer import Batch, Trainable
from .base import Draft, DraftContext, Drafter, EMPTY_DRAFT, settings_from

WEIGHTS_FILE = "weights.safetensors"
RANKS = 4  # ranks per level whose accuracy training measures (the widest default tree)


# ---- the record of committed features --------------------------------------------------------
class FeatureRecord:
    """Committed features ``f_0 .. f_{n-1}`` with ``n = len(tokens) - 1`` (every committed
    token but the root has one). ``sync`` appends what the target cached since the last
    proposal: the prompt minus its last token after prefill, then the root and the
    accepted nodes after each step."""

    def __init__(self) -> None:
        self.features: torch.Tensor | None = None  # [n, hidden]
        self._seen: torch.Tensor | None = None  # the ctx.hidden already appended

    def __len__(self) -> int:
        return 0 if self.features is None else len(self.features)

    def sync(self, ctx: DraftContext) -> None:
        if ctx.hidden is not None and ctx.hidden is not self._seen and len(ctx.hidden):
            new = ctx.hidden.detach()
            self.features = new if self.features is None else torch.cat([self.features, new])
            self._seen = ctx.hidden
        expected = len(ctx.tokens) - 1
        if len(self) < expected:
            raise RuntimeError(f"feature record out of step: {len(self)} features for {expected} cached tokens")
        if len(self) > expected:  # a stop rule cut inside the accepted path
            self.features = self.features[:expected]


# ---- a small transformer layer -------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding. x: [batch, heads, n, head_dim]; positions: [batch, n]."""
    half = x.shape[-1] // 2
    inverse = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)  # [half]
    angles = positions[:, None, :, None].float() * inverse  # [batch, 1, n, half]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [batch, heads, n, head_dim]


class Block(nn.Module):
    """Pre-norm attention + MLP. The output projections start at zero, so an untrained
    block is the identity (training starts from "change nothing")."""

    def __init__(self, size: int, heads: int, mlp_size: int):
        super().__init__()
        if size % heads or (size // heads) % 2:
            raise ValueError(f"Block: size {size} must split into {heads} heads of even size")
        self.heads = heads
        self.attn_norm, self.mlp_norm = RMSNorm(size), RMSNorm(size)
        self.qkv = nn.Linear(size, 3 * size, bias=False)
        self.proj = nn.Linear(size, size, bias=False)
        self.up, self.down = nn.Linear(size, mlp_size), nn.Linear(mlp_size, size)
        for zero in (self.proj.weight, self.down.weight, self.down.bias):
            nn.init.zeros_(zero)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None,
                past: KV | None = None) -> tuple[torch.Tensor, KV]:
        """x: [batch, n, size]; positions: [batch, n]; visible: [batch, n, past + n] bool
        (None: everything); past: cached keys and values. Returns the output and the
        keys and values of the n new positions."""
        batch, n, size = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, n, 3, self.heads, size // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, positions), rotate(k, positions)  # [batch, heads, n, head_dim]
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2))
        mask = None if visible is None else visible[:, None]  # [batch, 1, n, past + n]
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [batch, heads, n, head_dim]
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, n, size))
        x = x + self.down(F.gelu(self.up(self.mlp_norm(x))))
        return x, (k, v)


def causal(n: int, past: int = 0, device=None) -> torch.Tensor:
    """[1, n, past + n] bool: position i sees the past and the block up to itself."""
    block = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(n, past, dtype=torch.bool, device=device), block], 1)[None]


def joined(parts: list[KV]) -> KV:
    """Keys and values of several runs, in order: [batch, heads, sum of n, head_dim] each."""
    return torch.cat([k for k, _ in parts], 2), torch.cat([v for _, v in parts], 2)


class CommittedKV:
    """A drafter layer's keys and values over the committed positions. Committed features
    and tokens never change, so this cache only grows: no rollback is ever needed."""

    def __init__(self) -> None:
        self.kv: KV | None = None
        self.length = 0

    def run(self, layer, new: int, device) -> torch.Tensor:
        """``layer(positions, visible, past) -> (out, new keys/values)`` over the ``new``
        next committed positions, in causal order after the cached ones. Returns ``out``."""
        positions = torch.arange(self.length, self.length + new, device=device)[None]  # [1, new]
        out, kv = layer(positions, causal(new, self.length, device), self.kv)
        self.kv = kv if self.kv is None else joined([self.kv, kv])
        self.length += new
        return out


def heads_for(size: int) -> int:
    """Attention heads of width 32 (at least one)."""
    return max(1, size // 32)


# ---- modules on disk ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModuleConfig:
    """Fields every feature module's JSON config has; modules extend it."""

    hidden_size: int  # the target's
    vocab_size: int  # the target's
    target: str = ""  # the model the module was trained for
    # accuracy[d][r]: how often the rank-r guess for depth d + 1 was right on held-out
    # data (trees of top-k combinations are chosen from it); None: not measured
    accuracy: list[list[float]] | None = None


class FeatureModule(nn.Module):
    """A small trainable module with a JSON config; subclasses set ``Config`` and ``name``."""

    Config: ClassVar[type[ModuleConfig]]
    name: ClassVar[str]  # the drafter's name: the config file is <name>.json

    def __init__(self, config: ModuleConfig):
        super().__init__()
        self.config = config

    @classmethod
    def for_target(cls, target: PreTrainedModel, **sizes) -> "FeatureModule":
        """Untrained module shaped for ``target``."""
        raise NotImplementedError

    @classmethod
    def target_sizes(cls, target: PreTrainedModel) -> dict:
        vocab, hidden = target.get_output_embeddings().weight.shape
        return dict(hidden_size=int(hidden), vocab_size=int(vocab), target=model_name(target))

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # float16 halves the files; the module is cast back to the target's dtype on load
        tensors = {name: t.detach().half().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, directory / WEIGHTS_FILE)
        (directory / f"{self.name}.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "FeatureModule":
        directory = Path(directory)
        config_file = directory / f"{cls.name}.json"
        if not config_file.is_file() or not (directory / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(
                f"no {cls.name} weights in {directory} (expected {config_file.name} and {WEIGHTS_FILE})"
            )
        known = {f.name for f in fields(cls.Config)}
        config = cls.Config(**{k: v for k, v in json.loads(config_file.read_text()).items() if k in known})
        module = cls(config)
        module.load_state_dict({k: t.float() for k, t in load_file(directory / WEIGHTS_FILE).items()})
        return module.eval()

    def check_fits(self, model: PreTrainedModel) -> None:
        vocab, hidden = model.get_output_embeddings().weight.shape
        config = self.config
        if (config.hidden_size, config.vocab_size) != (hidden, vocab):
            raise ValueError(
                f"{self.name} weights for {config.target!r} (hidden {config.hidden_size}, vocab {config.vocab_size}) "
                f"do not fit {model_name(model)!r} (hidden {hidden}, vocab {vocab})"
            )


# ---- the drafter side ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightsSetting:
    """Mixed into every feature drafter's settings."""

    weights: str | None = None  # module directory; None: <target model dir>/<name>/, else untrained

    def __post_init__(self) -> None:
        if self.weights is not None and not isinstance(self.weights, (str, Path)):
            raise ValueError(f"weights must be a directory path or None, got {self.weights!r}")


def as_int(settings: Any, name: str, minimum: int, optional: bool = False) -> None:
    """Validate an integer setting in place (strings from ``--method-arg`` are converted)."""
    value = getattr(settings, name)
    if value is None and optional:
        return
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
        object.__setattr__(settings, name, value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class FeatureDrafter(Drafter):
    """Base of the feature-level drafters: subclasses set ``name``, ``Settings``,
    ``Module`` and implement ``untrained``, ``setup`` and ``draft``."""

    Module: ClassVar[type[FeatureModule]]
    needs_hidden = True
    seq2seq_chains: ClassVar[bool] = False  # can draft chains for encoder-decoder targets

    def __init__(self, settings=None, **kwargs):
        self.settings = settings_from(self.Settings, settings, kwargs)
        self.module = self.Module.load(self.settings.weights) if self.settings.weights else None
        self._target: PreTrainedModel | None = None  # the model the module is set up for

    # ---- subclass hooks ------------------------------------------------------------
    def untrained(self, model: PreTrainedModel) -> FeatureModule:
        raise NotImplementedError

    def setup(self, model: PreTrainedModel) -> None:
        """Per-target preparation (trees, borrowed embeddings); self.module is ready."""

    def reset(self, ctx: DraftContext) -> None:
        """Per-generation state."""

    def draft(self, ctx: DraftContext) -> Draft:
        raise NotImplementedError

    # ---- the protocol ------------------------------------------------------------------
    def begin(self, ctx: DraftContext) -> None:
        model = ctx.target.model
        if ctx.target.encoder_decoder and not self.seq2seq_chains:
            raise ValueError(
                f"{self.name} drafts trees over a causal LM's features; encoder-decoder targets are not supported"
            )
        if model is not self._target:
            if not self.settings.weights:  # weights live beside each target
                self.module = self._find(model)
            self.module.check_fits(model)
            self.module.to(device=model.get_output_embeddings().weight.device, dtype=model.dtype).eval()
            self.setup(model)
            self._target = model
        self.record = FeatureRecord()
        self.reset(ctx)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        if self.needs_hidden:
            self.record.sync(ctx)
        if ctx.max_depth < 1:
            return EMPTY_DRAFT
        return self.draft(ctx)

    def _find(self, model: PreTrainedModel) -> FeatureModule:
        source = getattr(model.config, "_name_or_path", "")  # the directory the target was loaded from
        beside = Path(source) / self.name if source else None
        if beside is not None and (beside / f"{self.name}.json").is_file():
            return self.Module.load(beside)
        warnings.warn(
            f"no {self.name} weights found for {model_name(model)!r} (looked in {beside}); using an untrained "
            f"{self.name} drafter, which rarely guesses right: train one with `hasten train {self.name}`",
            stacklevel=5,
        )
        return self.untrained(model).eval()


# ---- the training side --------------------------------------------------------------------------------
def valid_positions(batch: Batch) -> torch.Tensor:
    """[B, T] bool: positions holding real tokens (the prompt and the labels), i.e. up to
    the last label of each row; rows without labels count as empty."""
    labels = batch.label_mask.int()
    return labels.flip(1).cummax(1).values.flip(1).bool()


def rank_hits(logits: torch.Tensor, labels: torch.Tensor, level: int, metrics: dict[str, float]) -> None:
    """Record how often each of the RANKS best guesses of ``logits`` ([M, V]) is the label."""
    hits = logits.topk(min(RANKS, logits.shape[-1]), dim=-1).indices == labels[:, None]  # [M, RANKS]
    for rank, rate in enumerate(hits.float().mean(0).tolist()):
        metrics[f"head{level}_rank{rank}"] = rate


def measured_accuracy(evaluated: dict[str, float], levels: int) -> list[list[float]] | None:
    keys = [[f"head{k}_rank{r}" for r in range(RANKS)] for k in range(1, levels + 1)]
    if not all(row[0] in evaluated for row in keys):
        return None
    return [[round(evaluated.get(key, 0.0), 4) for key in row] for row in keys]


def anchors(mask: torch.Tensor, count: int) -> torch.Tensor:
    """[B, T] bool of allowed positions -> [B, count] positions drawn uniformly (with
    replacement) among them; rows with none get position 0 (their losses are masked)."""
    empty = ~mask.any(1, keepdim=True)  # [B, 1]
    weights = mask.float() + empty.float() * F.one_hot(torch.zeros(len(mask), dtype=torch.long), mask.shape[1])
    return torch.multinomial(weights, count, replacement=True)  # uses the trainer-seeded global RNG


class FeatureTraining(Trainable):
    """Shared ``save``: record the target and the held-out rank accuracies in the config."""

    def save(self, module: FeatureModule, out_dir: Path, report: dict) -> None:
        accuracy = module.config.accuracy
        levels = self.measured_levels(module)
        if levels:
            accuracy = measured_accuracy(report.get("eval", {}), levels)
        module.config = replace(module.config, target=report["target"], accuracy=accuracy)
        module.save(out_dir)

    def measured_levels(self, module: FeatureModule) -> int:
        """Levels whose rank accuracies the loss reports (0: none)."""
        return 0
