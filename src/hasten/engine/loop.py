"""The one decode loop: prefill -> propose -> verify -> commit -> repeat.

Plain autoregressive decoding is this loop with no drafter: every step then verifies an
empty draft and commits the bonus token alone, so the baseline and every method share
one code path and one set of stop rules.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import PreTrainedModel

from ..drafters.base import EMPTY_DRAFT, DraftContext, Drafter, StepResult
from ..models.adapter import ModelAdapter, decoder_start_token, vocab_size
from .sampling import Sampling
from .stats import DecodeStats
from .verify import accept_greedy, accept_sampling


@dataclass
class GenerationOutput:
    sequences: torch.Tensor  # [1, T + n] prompt (decoder start for seq2seq) + new tokens
    stats: DecodeStats


def decode(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    drafter: Drafter | None,
    max_new_tokens: int,
    sampling: Sampling,
    eos_token_ids: frozenset[int],
    generator: torch.Generator | None,
    stats: DecodeStats,
    lossy_acceptance=None,
) -> Iterator[list[int]]:
    """Yield each step's committed tokens. Inputs are assumed validated (see generate)."""
    target = ModelAdapter(model)
    clock = time.perf_counter()
    want_hidden = drafter is not None and drafter.needs_hidden
    tokens, hidden = target.start(input_ids, hidden=want_hidden)
    source = input_ids[0].tolist() if target.encoder_decoder else None
    ctx = DraftContext(tokens, 0, sampling, generator, target, source, hidden)
    if drafter is not None:
        drafter.begin(ctx)
    stats.prefill_seconds += time.perf_counter() - clock

    produced = 0
    while produced < max_new_tokens:
        budget = max_new_tokens - produced
        clock = time.perf_counter()
        draft = EMPTY_DRAFT
        if drafter is not None and budget > 1:
            ctx.max_depth = budget - 1  # the bonus token needs the last slot
            draft = drafter.propose(ctx).limit_depth(budget - 1)
        drafted_at = time.perf_counter()

        start = target.cache_length  # == len(tokens) - 1
        out = target.forward([tokens[-1], *draft.tokens], draft.tree, want_hidden)  # logits: [1 + nodes, vocab]
        if lossy_acceptance is not None:
            verdict = lossy_acceptance.accept(draft.tree, list(draft.tokens), out.logits, sampling, generator)
        elif sampling.greedy:
            verdict = accept_greedy(draft.tree, list(draft.tokens), out.logits.argmax(-1).tolist())
        else:
            verdict = accept_sampling(draft.tree, list(draft.tokens), sampling.probs(out.logits), draft.probs, generator)
        target.commit(start, draft.tree, verdict.accepted)
        if want_hidden:  # the root and the accepted nodes are what the cache gained
            ctx.hidden = out.hidden[[0, *(node + 1 for node in verdict.accepted)]]

        new = [draft.tokens[node] for node in verdict.accepted] + [verdict.next_token]
        new = new[:budget]
        stop = next((i for i, token in enumerate(new) if token in eos_token_ids), None)
        if stop is not None:
            new = new[: stop + 1]
        tokens.extend(new)
        produced += len(new)
        if target.cache_length > len(tokens) - 1:  # a stop rule cut inside the accepted path
            target.crop(len(tokens) - 1)
        stats.draft_seconds += drafted_at - clock
        stats.verify_seconds += time.perf_counter() - drafted_at
        max_depth = max(draft.tree.depths, default=0)
        stats.record(max_depth, len(draft), len(verdict.accepted), len(new))
        if drafter is not None:
            drafter.observe(StepResult(len(draft), len(verdict.accepted), max_depth))
        yield new
        if stop is not None:
            return


def check_inputs(model, input_ids, drafter, max_new_tokens, generator) -> None:
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise TypeError("input_ids must be a torch.LongTensor of shape [1, T]")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must have shape [1, T], got {list(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"input_ids has a batch of {input_ids.shape[0]} rows; hasten decodes one sequence at a time")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    vocab = vocab_size(model)
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids contains token id {bad}, outside the model's vocabulary [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a hasten Drafter or None, got {type(drafter).__name__}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")


def eos_ids(model: PreTrainedModel, eos_token_id) -> frozenset[int]:
    """None means the model's own generation config, as in Hugging Face generate."""
    if eos_token_id is None:
        eos_token_id = getattr(model.generation_config, "eos_token_id", None)
    if eos_token_id is None:
        return frozenset()
    ids = [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
    if not isinstance(ids, (list, tuple, set, frozenset)) or not all(isinstance(t, int) for t in ids):
        raise TypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    return frozenset(ids)


def generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    *,
    drafter: Drafter | None = None,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    lossy_acceptance=None,
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` ([1, T]).

    Greedy (temperature 0) output is token-identical to the plain model's; sampled output
    is distributed exactly as the plain model samples with the same temperature, top-k and
    top-p, whichever drafter is used. ``lossy_acceptance`` (e.g.
    ``hasten.approx.TypicalAcceptance()``) replaces the exact rule and gives that up.
    """
    sampling = Sampling(temperature, top_k, top_p)
    check_inputs(model, input_ids, drafter, max_new_tokens, generator)
    stats = DecodeStats()
    eos = eos_ids(model, eos_token_id)
    new: list[int] = []
    if lossy_acceptance is not None and getattr(lossy_acceptance, "lossless", True):
        raise TypeError("lossy_acceptance must be a lossy rule from hasten.approx, e.g. TypicalAcceptance()")
    if lossy_acceptance is not None and sampling.greedy:
        raise ValueError("lossy_acceptance is a sampling mode (temperature > 0); greedy decoding is already exact")
    for piece in decode(model, input_ids, drafter, max_new_tokens, sampling, eos, generator, stats, lossy_acceptance):
        new.extend(piece)
    head = [decoder_start_token(model)] if model.config.is_encoder_decoder else input_ids[0].tolist()
    return GenerationOutput(torch.tensor([head + new], dtype=torch.long), stats)

