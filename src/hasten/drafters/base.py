"""The Drafter protocol and the registry of drafters by name.

A drafter proposes only *new* tokens, arranged as a :class:`TokenTree`, and may say
which distribution ``q`` it drew them from. The decode loop never asks what kind of
drafter it holds: methods differ only in what they propose and in what they declare they
need (a draft model, the target's features, tree attention).

State has one owner. The loop owns the committed tokens and the target's features
(:class:`DraftContext`); drafters read them and never keep a copy. A :class:`Drafter`
object holds configuration and weights only and can serve any number of generations at
once: whatever one generation needs to remember (n-gram tables, a draft model's cache, a
drafter layer's keys and values) lives in the object ``begin`` returns, which the loop
keeps in ``ctx.state``.
"""
from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Any, ClassVar

import torch

from ..core import settings as settings_io
from ..core.errors import FieldError
from ..core.rows import Riders
from ..core.runtime import Capability, MissingCapability, Runtime
from ..core.sampling import Sampling
from ..core.state import GrowingBuffer
from ..core.tree import TokenTree


@dataclass(frozen=True)
class Draft:
    tokens: tuple[int, ...]  # one token per tree node
    tree: TokenTree
    probs: torch.Tensor | None = None  # [nodes, vocab] q each node was drawn from; None: deterministic
    # extra positions riding on this draft's verification forward (hidden transfer's
    # placeholders); their logits come back in StepResult.riders
    riders: Riders | None = None

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.tree):
            raise ValueError(f"Draft: {len(self.tokens)} tokens for a tree of {len(self.tree)} nodes")

    @classmethod
    def chain(cls, tokens, probs: torch.Tensor | None = None, riders: Riders | None = None) -> "Draft":
        tokens = tuple(int(t) for t in tokens)
        return cls(tokens, TokenTree.chain(len(tokens)), probs, riders)

    def _subset(self, keep: list[int]) -> "Draft":
        if len(keep) == len(self):
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        parents = tuple(-1 if self.tree.parents[i] < 0 else new_index[self.tree.parents[i]] for i in keep)
        probs = None if self.probs is None else self.probs[keep]
        return Draft(tuple(self.tokens[i] for i in keep), TokenTree(parents), probs, self.riders)

    def limit_depth(self, max_depth: int) -> "Draft":
        """Drop nodes deeper than ``max_depth`` (so no step can overshoot a token budget)."""
        return self._subset([i for i, depth in enumerate(self.tree.depths) if depth <= max_depth])

    def within_vocab(self, vocab_size: int) -> "Draft":
        """Drop nodes (with their subtrees) whose token the target does not have: a pool saved
        or warmed with another model's tokens may hold some."""
        keep, dropped = [], set()
        for i, (token, parent) in enumerate(zip(self.tokens, self.tree.parents)):
            if token >= vocab_size or token < 0 or parent in dropped:
                dropped.add(i)
            else:
                keep.append(i)
        return self._subset(keep)

    def main_chain(self, max_depth: int) -> "Draft":
        """The path that follows each node's first child (every tree builder puts its best
        guess first), at most ``max_depth`` long: what a target without tree attention verifies."""
        path, node = [], -1
        while len(path) < max_depth and self.tree.children[node + 1]:
            node = self.tree.children[node + 1][0]
            path.append(node)
        return self._subset(path)

    def union(self, other: "Draft") -> "Draft":
        """This draft's tree with ``other``'s paths added after it, one node per distinct path
        (where the two agree they share nodes): both deterministic, as copies and trained
        drafters' guesses are. A drafted distribution cannot be merged: then this draft, or
        ``other`` where this one is empty."""
        if not len(other) or not len(self) or self.probs is not None or other.probs is not None \
                or self.riders is not None or other.riders is not None:
            return self if len(self) else other
        tokens, parents = list(self.tokens), list(self.tree.parents)
        children = {(parent, token): i for i, (parent, token) in enumerate(zip(parents, tokens))}
        placed: list[int] = []  # other's node -> its node here
        for token, parent in zip(other.tokens, other.tree.parents):
            under = -1 if parent < 0 else placed[parent]
            node = children.get((under, token))
            if node is None:
                node = len(tokens)
                tokens.append(token)
                parents.append(under)
                children[(under, token)] = node
            placed.append(node)
        return Draft(tuple(tokens), TokenTree(tuple(parents)))

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_DRAFT = Draft.chain(())


class UndeclaredNeed(RuntimeError):
    """A drafter read what it did not declare in ``needs``: a bug in the drafter, not in the request."""


class TargetView:
    """What a drafter may read of the target it drafts for (``ctx.target``), lent by the
    capabilities its ``needs`` declare and nothing else. It holds no way to run a forward on
    the loop's cache, commit to it or crop it: the loop owns the target's state.

    Always lent: ``vocab_size``, ``encoder_decoder``, ``source`` (where the model was loaded
    from) and ``cache_length`` (the committed tokens the target has cached: all but the root).
    ``Capability.MODULES``: ``modules``, the target's own torch model (LM head, embeddings, rotary, layers).
    ``Capability.FEATURES``: ``prompt_embeds``, what an image prefill fed the language model, and
    ``encoder_states``, an encoder-decoder's encoder output over the source.
    ``Capability.KV_READ``: ``read_kv`` and ``read_all_kv``, where ``kv_readable``.
    ``Capability.QUERY_CAPTURE``: ``probe_queries``, which the target runs and undoes itself.
    Reading anything else raises :class:`UndeclaredNeed`."""

    def __init__(self, row, needs: frozenset[Capability], source: str = ""):
        self._row, self._needs = row, frozenset(needs)
        self.vocab_size: int = row.vocab_size
        self.encoder_decoder: bool = row.encoder_decoder
        self.source = source
        # whether this row answers read_kv and probe_queries: one sequence's full cache
        # (batch rows share a padded cache; llama.cpp does not expose its cells)
        self.kv_readable: bool = bool(self._needs & {Capability.KV_READ, Capability.QUERY_CAPTURE}) and row.kv_readable

    def _lend(self, capability: Capability):
        if capability not in self._needs:
            raise UndeclaredNeed(f"a drafter read the target's {capability} without declaring "
                                 f"Capability.{capability.name} in its needs")
        return self._row

    @property
    def modules(self):
        """The target's torch model (borrow its LM head, embeddings, rotary, layers; never its cache)."""
        return self._lend(Capability.MODULES).model

    @property
    def prompt_embeds(self) -> torch.Tensor | None:
        """[T - 1, embed] what an image prefill fed the language model; None after a text prefill."""
        return self._lend(Capability.FEATURES).prompt_embeds

    @property
    def encoder_states(self) -> torch.Tensor | None:
        """[1, s, He] the target's encoder output over the source, as its decoder reads it; None for a causal LM."""
        return self._lend(Capability.FEATURES).encoder_states

    @property
    def cache_length(self) -> int:
        return self._row.cache_length

    def read_kv(self, layer: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s cached keys and values, [1, kv_heads, entries, head_dim] views to read."""
        return self._lend(Capability.KV_READ).read_kv(layer)

    def read_all_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._lend(Capability.KV_READ).read_all_kv()

    def probe_queries(self, token: int) -> dict[int, torch.Tensor]:
        """Each layer's query of ``token`` fed after the cache, ``{layer: [heads, 1, head_dim]}``;
        the target restores its cache afterwards."""
        return self._lend(Capability.QUERY_CAPTURE).probe_queries(token)


@dataclass
class DraftContext:
    """What a drafter may look at when proposing; made by the loop for one generation."""

    tokens: list[int]  # committed decoder-side tokens, prompt included; tokens[-1] is the root. Read only.
    max_depth: int  # deeper draft tokens cannot be used this step
    sampling: Sampling
    generator: torch.Generator | None
    target: TargetView  # what the drafter may read of the target, by its declared needs
    source: list[int] | None = None  # encoder input, for encoder-decoder targets
    # committed target features, for drafters whose needs hold Capability.FEATURES: row t is the target's
    # last-layer hidden state at position t (its LM head turns it into tokens[t + 1]), so
    # there are len(tokens) - 1 rows. Owned by the loop.
    feature_buffer: GrowingBuffer | None = None
    state: Any = None  # what the drafter's begin() returned: its per-generation state
    # the generation's acceptance rule (an engine.verify.Acceptance), for drafters that verify a
    # draft of their own before proposing (TriForce's middle level): the one verifier, reused
    acceptance: Any = None
    # whether this generation may read and write its drafter's shared pool (Drafter.pool): False,
    # a pooled drafter drafts from a private pool that ends with the generation (the server's "pool": false)
    use_pool: bool = True

    @property
    def reads_pool(self) -> bool:
        """Whether a pooled drafter may draft from its shared pool in this generation: not when
        it opted out, nor when it samples with its own generator (a seed must give the same
        text every run, which a draft read from what other generations wrote would not: the
        verifier's draws follow the draft). Such a generation still adds its text, unless it
        opted out."""
        return self.use_pool and (self.generator is None or self.sampling.greedy)

    @property
    def features(self) -> torch.Tensor | None:
        """[len(tokens) - 1, hidden] a view of the committed features (no copy)."""
        return None if self.feature_buffer is None else self.feature_buffer.view()


@dataclass(frozen=True)
class StepResult:
    drafted: int  # draft nodes proposed
    accepted: int  # draft tokens accepted (bonus excluded)
    max_depth: int  # depth of the deepest proposed node
    riders: torch.Tensor | None = None  # [count, vocab] rider logits at the accepted path's end, if the draft had riders


class Drafter:
    """Base class: subclasses set ``name`` and ``Settings`` and implement ``propose``.

    Declarations the loop and the API answer (never a drafter's name):

    * ``needs``: the runtime capabilities it uses (:class:`~hasten.core.runtime.Capability`),
      matched against the target's runtime before any forward (:meth:`check_runtime`);
      ``Capability.FEATURES`` in it means it reads ``ctx.features`` (the target's last-layer
      hidden states), which the loop then collects;
    * ``needs_draft_model``: built with a second model, ``Drafter(model, ...)``;
    * ``encoder_decoder_ok``: can serve encoder-decoder targets (which verify chains only:
      a tree draft is cut to its :meth:`Draft.main_chain` there);
    * ``Training``: a :class:`~hasten.drafters.trainable.Trainable`, for ``hasten train NAME``;
    * ``hindsight_ok``: ``propose`` is cheap and changes nothing but what it looked up for
      these very tokens, so cost-aware sizing may ask for a draft on a step it keeps plain and
      learn from what gets committed instead of verifying it (no probes: see
      :meth:`~hasten.core.sizing.SizingRule.watch`).
    """

    name: ClassVar[str]
    Settings: ClassVar[type]
    needs: ClassVar[frozenset[Capability]] = frozenset()
    needs_draft_model: ClassVar[bool] = False
    encoder_decoder_ok: ClassVar[bool] = True
    Training: ClassVar[type | None] = None
    hindsight_ok: ClassVar[bool] = False
    settings: Any

    def __init__(self, settings=None, **kwargs):
        self.settings = settings_io.build(self.Settings, settings, **kwargs)

    @classmethod
    def check_runtime(cls, runtime: Runtime | type[Runtime], batched: bool = False) -> None:
        """Refuse, before any forward, a runtime (or its batches) that lacks what this drafter
        needs (:class:`~hasten.core.runtime.MissingCapability`, naming each missing capability).
        A runtime class whose declarations are class attributes (llama.cpp's) will do too."""
        if runtime.encoder_decoder and not cls.encoder_decoder_ok:  # the plainer reason, where both hold
            raise FieldError("method", "unsupported_method",
                             f"{cls.name} does not support encoder-decoder targets; use a chain drafter such as "
                             "prompt_lookup, draft_model or gad")
        capabilities = runtime.capabilities - runtime.unbatched if batched else runtime.capabilities
        missing = frozenset(cls.needs) - capabilities
        if missing:
            raise MissingCapability(cls.name, runtime.name, missing, batched)

    def hindsight_from(self) -> int | None:
        """The lowest grade of evidence (:meth:`evidence`) at which ``propose`` is a cheap
        lookup that changes nothing (``hindsight_ok`` for every grade: 0), so cost-aware sizing
        may learn that grade's acceptance from unverified drafts; None: at none."""
        return 0 if self.hindsight_ok else None

    @classmethod
    def reads_features(cls) -> bool:
        """Whether the loop must collect the target's hidden states for this drafter."""
        return Capability.FEATURES in cls.needs

    def drafts_without_prompt_features(self) -> bool:
        """Whether this drafter (one that reads features) still drafts when some of a prompt's
        rows of ``ctx.features`` are rows of zeros, the target's states there unknown, and while
        ``ctx.features`` is None before the row's first step: then a server reuses a cached prefix
        of the prompt and prefills the rest in its steps beside the other rows (the states of
        what a step runs are reported). False (the default): the prompt is prefilled alone, with
        its states at every position."""
        return False

    def check_target(self, target: TargetView) -> None:
        """Raise ValueError if this drafter cannot serve this particular ``target`` (a
        vocabulary or an architecture it cannot read); what the runtime can do at all is
        :meth:`check_runtime`'s."""

    def begin(self, ctx: DraftContext) -> Any:
        """Start a generation: return its per-generation state (kept in ``ctx.state``)."""
        return None

    def propose(self, ctx: DraftContext) -> Draft:
        raise NotImplementedError

    def propose_rows(self, ctxs: list[DraftContext]) -> list[Draft]:
        """The proposals of a batch step's rows that this drafter drafts for, each row's as
        :meth:`propose` would make it alone (one by one here; a drafter whose model can run the
        rows together overrides it)."""
        return [self.propose(ctx) for ctx in ctxs]

    def deepest(self) -> int | None:
        """The deepest draft token this drafter can ever propose (its chain length or tree depth
        setting): the planner prices no deeper. None: no fixed bound (a copy runs as long as its
        match)."""
        return None

    def evidence(self, ctx: DraftContext) -> int | None:
        """How much this step's draft deserves trust, as a small class number, before
        proposing it (asked by cost-aware sizing, which keeps each class's acceptance apart:
        prompt lookup's copies after a long match are accepted far more often than after a
        short one). 0: it has nothing to propose this step (the sizing rule then prices
        nothing). None: this drafter does not grade its drafts. Must be cheap; a drafter may
        keep what it looked up in ``ctx.state`` for the ``propose`` that follows."""
        return None

    def observe(self, ctx: DraftContext, result: StepResult) -> None:
        """Learn from the verdict (adapt draft length, keep rider logits) in ``ctx.state``."""

    def end(self, ctx: DraftContext) -> None:
        """The generation ended (finished, cancelled or abandoned): called once, after its last
        step. A pooled drafter keeps the generation's output and forgets its prompt here."""

    @property
    def pool(self):
        """The :class:`~hasten.core.pool.Pool` every generation of this drafter shares (what
        ``--pool FILE`` saves and loads, ``/metrics`` reports), or None: this drafter forgets
        everything when a generation ends."""
        return None

    def cache_bytes(self, state: Any) -> int | None:
        """Bytes the drafter's own per-generation caches hold (allocated, not the target's):
        the bench's "drafter KV" column. None: the drafter keeps no cache of its own."""
        return None


# the modules of hasten's own drafters, imported by the registry the first time it is read: importing one
# drafter (hasten.vllm imports those that need no model) then never imports the others and their model code
BUILT_IN = ("chimera", "draft_model", "eagle", "eagle3", "eagle_vlm", "easyspec", "gad", "hidden_transfer", "iad",
            "lookahead", "longspec", "medusa", "mixed", "prompt_lookup", "suffix", "triforce")


class Registry(dict):
    """Drafter classes by name: hasten's own (:data:`BUILT_IN`, imported on the first read) and
    whatever :func:`register` adds."""

    _complete = False

    def _load(self) -> None:
        if not self._complete:
            self._complete = True  # first: a drafter module that reads the registry while importing must not recurse
            for module in BUILT_IN:
                import_module(f"{__package__}.{module}")

    def __getitem__(self, name):
        self._load()
        return super().__getitem__(name)

    def __contains__(self, name) -> bool:
        self._load()
        return super().__contains__(name)

    def __iter__(self):
        self._load()
        return super().__iter__()

    def __len__(self) -> int:
        self._load()
        return super().__len__()

    def get(self, name, default=None):
        self._load()
        return super().get(name, default)

    def keys(self):
        self._load()
        return super().keys()

    def values(self):
        self._load()
        return super().values()

    def items(self):
        self._load()
        return super().items()


REGISTRY: Registry = Registry()


def register(cls: type[Drafter]) -> type[Drafter]:
    dict.__setitem__(REGISTRY, cls.name, cls)
    return cls


def create(name: str, **kwargs) -> Drafter:
    """Build a registered drafter by name, e.g. ``create("prompt_lookup", num_tokens=8)``."""
    if name not in REGISTRY:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name](**kwargs)

