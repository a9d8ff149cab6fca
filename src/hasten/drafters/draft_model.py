"""Draft-model speculative decoding: a smaller LM with the target's vocabulary proposes
``num_tokens`` tokens autoregressively (Leviathan et al. 2023; Chen et al. 2023).

The draft keeps its own KV cache across steps. Instead of replaying the verdict, each
proposal first crops the draft cache to the longest prefix it shares with the committed
tokens and feeds the rest, so rejected drafts and the bonus token are handled by one rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..core.sampling import sample
from ..core.settings import Settings
from ..core.stats import holder_kv_bytes
from ..models.adapter import ModelAdapter
from ..models.hf import runtime_of
from .base import Draft, DraftContext, Drafter, EMPTY_DRAFT, StepResult, register


@dataclass(frozen=True)
class DraftModelSettings(Settings):
    num_tokens: int = 5  # draft length (the starting length when adaptive)
    adaptive: bool = False  # grow by 2 after a fully accepted draft, shrink by 1 after a rejection
    max_tokens: int = 16  # ceiling for the adaptive length

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if self.max_tokens < self.num_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= num_tokens ({self.num_tokens})")


@dataclass
class DraftState:
    """One generation's draft cache. It holds the first ``committed`` committed tokens,
    then ``drafted`` (the previous proposal but its last token, which was never fed);
    nothing else is copied: the committed sequence is the loop's."""

    adapter: ModelAdapter
    committed: int
    drafted: list[int]
    length: int  # current draft length (changes when adaptive)


@register
class DraftModel(Drafter):
    name = "draft_model"
    Settings = DraftModelSettings
    needs_draft_model = True

    def __init__(self, model, settings: DraftModelSettings | None = None, **kwargs):
        self.runtime = runtime_of(model)  # a TypeError for anything that is neither a model nor a runtime
        super().__init__(settings, **kwargs)
        self.model = model

    def check_target(self, target: ModelAdapter) -> None:
        super().check_target(target)
        check_same_vocabulary(self.runtime, target)
        if self.runtime.encoder_decoder != target.encoder_decoder:
            raise ValueError("draft model and target must both be causal LMs or both encoder-decoders")

    def begin(self, ctx: DraftContext) -> DraftState:
        adapter = self.runtime.session()
        prompt = torch.tensor([ctx.source if ctx.target.encoder_decoder else ctx.tokens], dtype=torch.long)
        cached = len(adapter.start(prompt)[0]) - 1  # the decoder-side tokens but the root
        return DraftState(adapter, cached, [], self.settings.num_tokens)

    def cache_bytes(self, state: DraftState) -> int | None:
        """KV bytes of the draft model's cache: its adapter's, or the state's own ``cache`` in
        subclasses that keep a bare one (EasySpec); None for a llama.cpp draft that does not say."""
        return holder_kv_bytes(getattr(state, "adapter", state))

    def propose(self, ctx: DraftContext) -> Draft:
        state = ctx.state
        count = min(state.length, ctx.max_depth)
        if count < 1:
            return EMPTY_DRAFT
        tokens = ctx.tokens
        # The cache is valid up to the committed tokens it holds plus the part of the last
        # proposal the target accepted; everything after that is cropped.
        shared = state.committed + _common_prefix(state.drafted, tokens, state.committed, len(tokens) - 1)
        state.adapter.crop(shared)
        block = tokens[shared:]  # at least the root
        drafted, q = draft_chain(lambda block, _: state.adapter.forward(block, tree=None).logits[-1], block, count, ctx)
        state.committed, state.drafted = len(tokens), drafted[:-1]  # the last drafted token was never fed
        return Draft.chain(drafted, q)

    def observe(self, ctx: DraftContext, result: StepResult) -> None:
        state = ctx.state
        if not self.settings.adaptive or result.drafted == 0:
            return
        if result.accepted == result.drafted:
            state.length = min(state.length + 2, self.settings.max_tokens)
        else:
            state.length = max(1, state.length - 1)


def check_same_vocabulary(draft, target: ModelAdapter) -> None:
    """Draft tokens are target tokens: both models (``draft``: a model or a runtime) must
    share one tokenizer."""
    draft = runtime_of(draft)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {draft.label!r} has a vocabulary of {draft.vocab_size} tokens, the target "
                         f"has {target.vocab_size}; they must share one tokenizer")


def draft_chain(forward: Callable[[list[int], int], torch.Tensor], block: list[int], count: int,
                ctx: DraftContext) -> tuple[list[int], torch.Tensor | None]:
    """``count`` tokens drafted one at a time: ``forward(block, i)`` feeds ``block`` (first the
    given one, then each drafted token) and returns the [vocab] logits of draft token ``i``;
    greedy takes the argmax, sampling draws from ``q`` and returns every q ([count, vocab])."""
    drafted, dists = [], []
    for position in range(count):
        logits = forward(block, position)  # [vocab]
        if ctx.sampling.greedy:
            token = int(logits.argmax())
        else:
            q = ctx.sampling.probs(logits)
            token = sample(q, ctx.generator)
            dists.append(q)
        drafted.append(token)
        block = [token]
    return drafted, (torch.stack(dists) if dists else None)


def _common_prefix(drafted: list[int], tokens: list[int], offset: int, limit: int) -> int:
    """How many of ``drafted`` equal ``tokens[offset:]``, stopping at index ``limit``."""
    n = max(0, min(len(drafted), limit - offset))
    for i in range(n):
        if drafted[i] != tokens[offset + i]:
            return i
    return n
