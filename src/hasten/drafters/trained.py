"""One base for the trained drafters (Medusa, EAGLE, Chimera, GAD, hidden transfer).

A trained drafter is three things: its module (a :class:`TrainedModule`), its proposal
rule (a :class:`TrainedDrafter` subclass) and its loss (a
:class:`~.trainable.TrainedTraining` subclass). Everything else lives here:

* on disk a module is a directory with ``weights.safetensors`` (float16: small files) and
  ``<name>.json`` (its :class:`ModuleConfig`); on load it is cast to the target's dtype;
* the target's embeddings and LM head are borrowed at run time, never stored;
* weights are found beside the target (``<model dir>/<name>/``), or for a packaged zoo
  model (a GGUF dequantised into the cache) in the zoo (``hasten.zoo.real.shipped_drafter``);
  without them an untrained module is used, with one warning line saying how to train one.

Indexing convention of the feature drafters: the target's feature ``f_t`` (its last-layer
hidden state at position ``t``) is what its LM head turns into token ``x_{t+1}``. With
committed tokens ``x_0 .. x_r`` (``x_r`` the root), ``ctx.features`` holds
``f_0 .. f_{r-1}``: ``f_{r-1}`` is the newest feature, the one that predicted the root.
"""
from __future__ import annotations

import copy
import json
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PreTrainedModel

from .. import zoo
from ..core.errors import HastenWarning
from ..core.runtime import Capability
from ..core.settings import Settings
from ..models import forwards, invariant
from ..models.adapter import model_name
from .base import EMPTY_DRAFT, Draft, DraftContext, Drafter, TargetView
from .candidates import CombinationTree

WEIGHTS_FILE = "weights.safetensors"
LOADED_KEPT = 4  # trained modules kept as read (float32), for the next drafter of the same weights
_LOADED: dict[tuple[type, str], tuple[tuple, "TrainedModule"]] = {}  # (class, directory) -> (files' stamp, module)


@dataclass(frozen=True)
class ModuleConfig:
    """Fields every trained module's JSON config has; modules extend it."""

    hidden_size: int  # the target's
    vocab_size: int  # the target's
    target: str = ""  # the model the module was trained for
    # accuracy[d][r]: how often the rank-r guess for depth d + 1 was right on held-out
    # data (trees of top-k combinations are chosen from it); None: not measured
    accuracy: list[list[float]] | None = None


class TrainedModule(nn.Module):
    """A small trainable module with a JSON config; subclasses set ``Config`` and ``name``
    and implement ``for_target``."""

    Config: ClassVar[type[ModuleConfig]]
    name: ClassVar[str]  # the drafter's name: the config file is <name>.json

    def __init__(self, config: ModuleConfig):
        super().__init__()
        self.config = config

    @classmethod
    def for_target(cls, target: PreTrainedModel, **sizes) -> "TrainedModule":
        """Untrained module shaped for ``target``."""
        raise NotImplementedError

    @property
    def levels(self) -> int:
        """Depths the module guesses at once (training measures their rank accuracies); 0: none."""
        return 0

    @classmethod
    def target_sizes(cls, target: PreTrainedModel) -> dict:
        vocab, hidden = target.get_output_embeddings().weight.shape
        return dict(hidden_size=int(hidden), vocab_size=int(vocab), target=model_name(target))

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # float16 halves the files; the module is cast to the target's dtype when used
        tensors = {name: t.detach().half().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, directory / WEIGHTS_FILE)
        (directory / f"{self.name}.json").write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "TrainedModule":
        """The module saved in ``directory``, in float32 (FileNotFoundError if either file is missing).
        Each call gets its own copy; the files are read once while they do not change (a drafter
        made per request, as the bench makes one per run, took 7-37 ms to read and build them)."""
        directory = Path(directory)
        config_file, weights_file = directory / f"{cls.name}.json", directory / WEIGHTS_FILE
        if not config_file.is_file() or not weights_file.is_file():
            raise FileNotFoundError(
                f"no {cls.name} weights in {directory} (expected {config_file.name} and {WEIGHTS_FILE})"
            )
        stamp = tuple((status.st_mtime_ns, status.st_size) for status in (config_file.stat(), weights_file.stat()))
        key = (cls, str(directory.resolve()))
        cached = _LOADED.get(key)
        if cached is None or cached[0] != stamp:
            known = {f.name for f in fields(cls.Config)}
            config = cls.Config(**{k: v for k, v in json.loads(config_file.read_text()).items() if k in known})
            module = cls(config)
            module.load_state_dict({k: t.float() for k, t in load_file(weights_file).items()})
            cached = _LOADED[key] = (stamp, module.eval())
            while len(_LOADED) > LOADED_KEPT:
                _LOADED.pop(next(iter(_LOADED)))
        return copy.deepcopy(cached[1])

    def check_fits(self, model: PreTrainedModel) -> None:
        vocab, hidden = model.get_output_embeddings().weight.shape
        config = self.config
        if (config.hidden_size, config.vocab_size) != (hidden, vocab):
            raise ValueError(
                f"{self.name} weights for {config.target!r} (hidden {config.hidden_size}, vocab {config.vocab_size}) "
                f"do not fit {model_name(model)!r} (hidden {hidden}, vocab {vocab})"
            )


def at_least_one(settings: Any, *names: str) -> None:
    """Raise ValueError naming the first of the counts ``names`` (heads, slots, ...) below 1."""
    for name in names:
        if getattr(settings, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(settings, name)}")


@dataclass(frozen=True)
class WeightsSetting(Settings):
    """Mixed into every trained drafter's settings."""

    weights: str | None = None  # module directory; None: <target model dir>/<name>/, else untrained
    require_weights: bool = False  # True: no weights found is an error (MissingWeights), not an untrained drafter


class MissingWeights(ValueError):
    """A trained drafter found no weights for its target and was told not to run untrained."""


class TrainedDrafter(Drafter):
    """Base of the trained drafters: subclasses set ``name``, ``Settings`` (with a
    ``weights`` field), ``Module`` and ``Training`` and implement ``draft``; ``setup``
    (per target) and ``start`` (per generation) are optional."""

    Module: ClassVar[type[TrainedModule]]
    # settings handed to Module.for_target to shape an untrained module (trained ones bring their own)
    untrained_sizes: ClassVar[tuple[str, ...]] = ()
    needs = frozenset({Capability.FEATURES, Capability.MODULES})
    encoder_decoder_ok = False

    def __init__(self, settings=None, **kwargs):
        super().__init__(settings, **kwargs)
        self.module: TrainedModule | None = self.Module.load(self.settings.weights) if self.settings.weights else None
        self.lm_head: nn.Module | None = None  # the target's, borrowed
        self.embed: nn.Module | None = None  # the target's input embeddings, borrowed
        self._target: PreTrainedModel | None = None  # the model the module is set up for

    # ---- subclass hooks ------------------------------------------------------------
    def untrained(self, model: PreTrainedModel) -> TrainedModule:
        """The module to use when no weights were given or found beside ``model``."""
        return self.Module.for_target(model, **{name: getattr(self.settings, name) for name in self.untrained_sizes})

    def setup(self, model: PreTrainedModel) -> None:
        """Per-target preparation (e.g. the candidate tree); self.module is ready."""

    def start(self, ctx: DraftContext) -> Any:
        """A new generation's state (kept in ``ctx.state``); None: the drafter needs none."""
        return None

    def draft(self, ctx: DraftContext) -> Draft:
        raise NotImplementedError

    # ---- the protocol ------------------------------------------------------------------
    def check_target(self, target: TargetView) -> None:
        """Meet the target before its prompt is prefilled: the module is found (or its absence
        refused, under ``require_weights``) and set up now, so a drafter that taps the target's
        forwards (EAGLE-3) records the prefill too, and a fresh drafter per prompt does not run
        the target over the prompt a second time."""
        super().check_target(target)
        model = target.modules
        if model is not self._target:
            self._prepare(model)

    def begin(self, ctx: DraftContext) -> Any:
        model = ctx.target.modules
        if model is not self._target:
            self._prepare(model)
        return self.start(ctx)

    def propose(self, ctx: DraftContext) -> Draft:
        return self.propose_rows([ctx])[0]

    def propose_rows(self, ctxs: list[DraftContext]) -> list[Draft]:
        with torch.no_grad(), forwards.active():  # the module's and the lent LM head's products on hasten's kernels
            return self.draft_rows(ctxs)

    def draft_rows(self, ctxs: list[DraftContext]) -> list[Draft]:
        """Each row's :meth:`draft` (one by one here; a module that runs rows together overrides it)."""
        return [self.draft(ctx) for ctx in ctxs]

    def _prepare(self, model: PreTrainedModel) -> None:
        if not self.settings.weights:  # weights live beside each target
            self.module = self.find_module(model)
        self.module.check_fits(model)
        self.lm_head, self.embed = model.get_output_embeddings(), model.get_input_embeddings()
        self.module.to(device=self.lm_head.weight.device, dtype=self.lm_head.weight.dtype).eval()
        if invariant.is_prepared(model) and self.lm_head.weight.device.type == "cpu":
            invariant.use_kernels(self.module)  # a target on hasten's kernels: its drafter's products too
        self.setup(model)
        self._target = model

    @classmethod
    def weights_dir(cls, model: PreTrainedModel) -> Path | None:
        """The directory of this drafter's trained module for ``model``: beside it
        (``<model dir>/<name>/``), or shipped in the zoo for a packaged model; None: none found."""
        source = model.config._name_or_path  # the directory the target was loaded from
        if not source:
            return None
        beside = Path(source) / cls.name
        if not (beside / f"{cls.name}.json").is_file():
            # a packaged zoo model (a GGUF dequantised into the cache) has its modules in the zoo
            beside = zoo.real.shipped_drafter(source, cls.name)
        return beside

    def find_module(self, model: PreTrainedModel) -> TrainedModule:
        """The trained module for ``model`` (:meth:`weights_dir`); without one, MissingWeights
        under ``require_weights``, else an untrained module and a warning."""
        found = self.weights_dir(model)
        if found is not None:
            return self.Module.load(found)  # raises if the weights file next to the config is missing
        source = model.config._name_or_path
        where = f"looked in {Path(source) / self.name}" if source else "the model was not loaded from a directory"
        missing = f"no {self.name} weights found for {model_name(model)!r} ({where})"
        train = f"train one with `hasten train {self.name}`"
        if self.settings.require_weights:
            raise MissingWeights(f"{missing}: {train}")
        warnings.warn(f"{missing}; using an untrained {self.name} drafter, which rarely guesses right: {train}",
                      HastenWarning, stacklevel=2)
        return self.untrained(model).eval()


class TopKTreeDrafter(TrainedDrafter):
    """Trained drafters that guess every level at once (Medusa, Chimera, GAD): their draft
    is a tree of top-k combinations (:class:`~.candidates.CombinationTree`) chosen once per
    target from the settings' tree knobs and the module's measured rank accuracies.
    Subclasses implement ``level_logits``."""

    tree: CombinationTree

    def levels(self) -> int:
        """Levels the tree may use."""
        return self.module.levels

    def level_logits(self, ctx: DraftContext, depth: int) -> torch.Tensor | None:
        """[depth, vocab] scores of the guesses for depths 1 .. depth; None: no guess yet."""
        raise NotImplementedError

    def setup(self, model: PreTrainedModel) -> None:
        self.tree = CombinationTree.choose(self.settings, self.module.config.accuracy, self.levels())

    def deepest(self) -> int | None:
        """The tree's depth, once chosen for a target (before: no bound yet)."""
        tree = getattr(self, "tree", None)
        return None if tree is None else tree.depth

    def draft(self, ctx: DraftContext) -> Draft:
        logits = self.level_logits(ctx, self.tree.depth)
        if logits is None:
            return EMPTY_DRAFT
        return Draft(self.tree.tokens(self.tree.ranked(logits)), self.tree.tree)
