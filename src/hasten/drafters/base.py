"""The Drafter protocol and the registry of drafters by name.

A drafter proposes only *new* tokens, arranged as a :class:`TokenTree`, and may say
which distribution ``q`` it drew them from. The decode loop never asks what kind of
drafter it holds: methods differ only in what they propose.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from ..engine.sampling import Sampling
from ..engine.tree import TokenTree
from ..models.adapter import ModelAdapter


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]  # one token per tree node
    tree: TokenTree
    probs: torch.Tensor | None = None  # [nodes, vocab] q each node was drawn from; None: deterministic

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.tree):
            raise ValueError(f"Draft: {len(self.tokens)} tokens for a tree of {len(self.tree)} nodes")

    @classmethod
    def chain(cls, tokens, probs: torch.Tensor | None = None) -> "Draft":
        tokens = tuple(int(t) for t in tokens)
        return cls(tokens, TokenTree.chain(len(tokens)), probs)

    def limit_depth(self, max_depth: int) -> "Draft":
        """Drop nodes deeper than ``max_depth`` (so no step can overshoot a token budget)."""
        keep = [i for i, depth in enumerate(self.tree.depths) if depth <= max_depth]
        if len(keep) == len(self):
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        parents = tuple(-1 if self.tree.parents[i] < 0 else new_index[self.tree.parents[i]] for i in keep)
        probs = None if self.probs is None else self.probs[keep]
        return Draft(tuple(self.tokens[i] for i in keep), TokenTree(parents), probs)

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft.chain(())


@dataclass
class DraftContext:
    """What a drafter may look at when proposing."""

    tokens: list[int]  # committed tokens on the decoder side, prompt included; tokens[-1] is the root
    max_depth: int  # deeper draft tokens cannot be used this step
    sampling: Sampling
    generator: torch.Generator | None
    target: ModelAdapter
    source: list[int] | None = None  # encoder input, for encoder-decoder targets
    # [new, hidden_size] the target's last-layer hidden states of the tokens it cached since
    # the previous proposal (the prefilled prompt at first); only for drafters with needs_hidden
    hidden: torch.Tensor | None = None


@dataclass(frozen=True)
class StepResult:
    drafted: int  # draft nodes proposed
    accepted: int  # draft tokens accepted (bonus excluded)
    max_depth: int  # depth of the deepest proposed node


class Drafter:
    """Base class: subclasses set ``name`` and ``Settings`` and implement ``propose``."""

    name: ClassVar[str]
    Settings: ClassVar[type]
    needs_hidden: ClassVar[bool] = False  # ask the target for hidden states (feature-level drafters)
    settings: Any

    def begin(self, ctx: DraftContext) -> None:
        """Reset per-generation state; raise ValueError if the target is incompatible."""

    def propose(self, ctx: DraftContext) -> Draft:
        raise NotImplementedError

    def observe(self, result: StepResult) -> None:
        """Learn from the verdict (adapt draft length, update tables)."""


REGISTRY: dict[str, Callable[..., Drafter]] = {}


def register(cls: type[Drafter]) -> type[Drafter]:
    REGISTRY[cls.name] = cls
    return cls


def create(name: str, **kwargs) -> Drafter:
    """Build a registered drafter by name, e.g. ``create("prompt_lookup", num_tokens=8)``."""
    if name not in REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name](**kwargs)


def settings_from(settings_cls: type, settings: Any, kwargs: dict) -> Any:
    """Accept either a ready settings object or its fields as keyword arguments."""
    if settings is not None:
        if kwargs:
            raise TypeError(f"pass either settings= or keyword settings, not both ({sorted(kwargs)})")
        if not isinstance(settings, settings_cls):
            raise TypeError(f"settings must be a {settings_cls.__name__}, got {type(settings).__name__}")
        return settings
    known = {f.name for f in dataclasses.fields(settings_cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"{settings_cls.__name__} has no setting(s) {unknown}; known: {sorted(known)}")
    return settings_cls(**kwargs)
