"""Draft-model speculative decoding: a smaller LM with the target's vocabulary proposes
``num_tokens`` tokens autoregressively (Leviathan et al. 2023; Chen et al. 2023).

The draft keeps its own KV cache across steps. Instead of replaying the verdict, each
proposal first crops the draft cache to the longest prefix it shares with the committed
tokens and feeds the rest, so rejected drafts and the bonus token are handled by one rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..engine.sampling import sample
from ..models.adapter import ModelAdapter, model_name, vocab_size
from .base import Draft, DraftContext, Drafter, EMPTY_DRAFT, StepResult, register, settings_from


@dataclass(frozen=True)
class DraftModelSettings:
    num_tokens: int = 5  # draft length (the starting length when adaptive)
    adaptive: bool = False  # grow by 2 after a fully accepted draft, shrink by 1 after a rejection
    max_tokens: int = 16  # ceiling for the adaptive length

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")
        if self.max_tokens < self.num_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= num_tokens ({self.num_tokens})")


@register
class DraftModel(Drafter):
    name = "draft_model"
    Settings = DraftModelSettings

    def __init__(self, model: PreTrainedModel, settings: DraftModelSettings | None = None, **kwargs):
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"DraftModel needs a transformers PreTrainedModel, got {type(model).__name__}")
        self.model = model
        self.settings = settings_from(DraftModelSettings, settings, kwargs)
        self.length = self.settings.num_tokens

    def begin(self, ctx: DraftContext) -> None:
        target = ctx.target
        if vocab_size(self.model) != target.vocab_size:
            raise ValueError(
                f"draft model {model_name(self.model)!r} has a vocabulary of {vocab_size(self.model)} tokens, "
                f"the target {model_name(target.model)!r} has {target.vocab_size}; they must share one tokenizer"
            )
        if bool(self.model.config.is_encoder_decoder) != target.encoder_decoder:
            raise ValueError("draft model and target must both be causal LMs or both encoder-decoders")
        self.length = self.settings.num_tokens
        self._draft = ModelAdapter(self.model)
        prompt = torch.tensor([ctx.source if target.encoder_decoder else ctx.tokens], dtype=torch.long)
        self._cached = self._draft.start(prompt)[0][:-1]  # tokens whose KV the draft cache holds

    def propose(self, ctx: DraftContext) -> Draft:
        count = min(self.length, ctx.max_depth)
        if count < 1:
            return EMPTY_DRAFT
        tokens = ctx.tokens
        shared = _common_prefix(self._cached, tokens, limit=len(tokens) - 1)
        self._draft.crop(shared)
        block = tokens[shared:]  # at least the root
        drafted, dists = [], []
        for _ in range(count):
            logits = self._draft.forward(block, tree=None).logits[-1]  # [vocab]
            if ctx.sampling.greedy:
                token = int(logits.argmax())
            else:
                q = ctx.sampling.probs(logits)
                token = sample(q, ctx.generator)
                dists.append(q)
            drafted.append(token)
            block = [token]
        # The last drafted token was never fed, so the cache ends one short of the draft.
        self._cached = tokens + drafted[:-1]
        return Draft.chain(drafted, torch.stack(dists) if dists else None)

    def observe(self, result: StepResult) -> None:
        if not self.settings.adaptive or result.drafted == 0:
            return
        if result.accepted == result.drafted:
            self.length = min(self.length + 2, self.settings.max_tokens)
        else:
            self.length = max(1, self.length - 1)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
