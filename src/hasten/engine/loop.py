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

from ..core.sampling import Sampling
from ..core.state import GrowingBuffer
from ..core.stats import DecodeStats
from ..drafters.base import EMPTY_DRAFT, Draft, DraftContext, Drafter, StepResult
from ..models.adapter import ModelAdapter, decoder_start_token
from .inputs import check_inputs, eos_ids
from .sizing import FixedSize, SizingRule, sizing_rule
from .verify import Acceptance, acceptance_rule


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
    acceptance: Acceptance,
    sizing: SizingRule | None = None,
) -> Iterator[list[int]]:
    """Yield each step's committed tokens. Inputs are assumed validated (see generate).

    This loop owns the committed state: ``tokens`` (host list) and, for drafters that
    read them, the target's features (a doubling buffer). Drafters get read access through
    the :class:`DraftContext` and keep per-generation state in ``ctx.state``. ``sizing``
    (default :class:`FixedSize`) sets each step's deepest usable draft node; 0 skips drafting.
    """
    target = ModelAdapter(model)
    if drafter is not None:
        drafter.check_target(target)
    clock = time.perf_counter()
    want_features = drafter is not None and drafter.needs_features
    tokens, prefilled = target.start(input_ids, hidden=want_features)
    features = GrowingBuffer() if want_features else None
    if prefilled is not None:
        features.extend(prefilled)
    source = input_ids[0].tolist() if target.encoder_decoder else None
    ctx = DraftContext(tokens, 0, sampling, generator, target, source, features)
    fit = Draft.limit_depth if target.trees_ok else Draft.main_chain  # chain-only targets verify a tree's best path
    sizing = sizing or FixedSize()
    if drafter is not None:
        ctx.state = drafter.begin(ctx)
        size_state = sizing.begin(target)
    stats.prefill_seconds += time.perf_counter() - clock

    produced = 0
    while produced < max_new_tokens:
        budget = max_new_tokens - produced
        clock = time.perf_counter()
        draft = EMPTY_DRAFT
        if drafter is not None and budget > 1:
            ctx.max_depth = sizing.depth(size_state, budget - 1)  # the bonus token needs the last slot
            if ctx.max_depth > 0:
                draft = fit(drafter.propose(ctx), ctx.max_depth)
        drafted_at = time.perf_counter()

        start = target.cache_length  # == len(tokens) - 1
        block = [tokens[-1], *draft.tokens]
        out = target.forward(block, draft.tree, want_features, riders=draft.riders)  # logits: [1 + nodes, vocab]
        verdict = acceptance.verify(draft.tree, draft.tokens, out.logits, draft.probs, sampling, generator)
        target.commit(start, draft.tree, verdict.accepted)
        kept_blocks = [0, *(node + 1 for node in verdict.accepted)]  # the root and the accepted path
        if features is not None:
            features.extend(out.hidden[kept_blocks])

        new = [draft.tokens[node] for node in verdict.accepted] + [verdict.next_token]
        new = new[:budget]
        stop = next((i for i, token in enumerate(new) if token in eos_token_ids), None)
        if stop is not None:
            new = new[: stop + 1]
        tokens.extend(new)
        produced += len(new)
        if target.cache_length > len(tokens) - 1:  # a stop rule cut inside the accepted path
            target.crop(len(tokens) - 1)
            if features is not None:
                features.truncate(len(tokens) - 1)
        verified_at = time.perf_counter()
        stats.draft_seconds += drafted_at - clock
        stats.verify_seconds += verified_at - drafted_at
        max_depth = max(draft.tree.depths, default=0)
        stats.record(max_depth, len(draft), len(verdict.accepted), len(new))
        if drafter is not None:
            sizing.observe(size_state, draft.tree, len(verdict.accepted), drafted_at - clock, verified_at - drafted_at)
            riders = None if out.riders is None else out.riders[kept_blocks[-1]]
            drafter.observe(ctx, StepResult(len(draft), len(verdict.accepted), max_depth, riders))
        yield new
        if stop is not None:
            return


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
    lossy_acceptance: Acceptance | None = None,
    draft_size: str | SizingRule = "fixed",
) -> GenerationOutput:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` ([1, T]).

    Greedy (temperature 0) output is token-identical to the plain model's; sampled output
    is distributed exactly as the plain model samples with the same temperature, top-k and
    top-p, whichever drafter is used. ``draft_size`` is ``"fixed"`` (each drafter's own
    depth) or ``"auto"`` (each step's depth chosen from the target's measured forward cost
    and the drafter's measured acceptance; see :mod:`hasten.engine.sizing`). ``lossy_acceptance`` (e.g.
    ``hasten.approx.TypicalAcceptance()``) replaces the exact rule and gives that up.
    """
    sampling = Sampling(temperature, top_k, top_p)
    check_inputs(model, input_ids, drafter, max_new_tokens, generator)
    stats = DecodeStats()
    eos = eos_ids(model, eos_token_id)
    acceptance = acceptance_rule(sampling, lossy_acceptance)
    sizing = sizing_rule(draft_size)
    new: list[int] = []
    for piece in decode(model, input_ids, drafter, max_new_tokens, sampling, eos, generator, stats, acceptance,
                        sizing):
        new.extend(piece)
    head = [decoder_start_token(model)] if model.config.is_encoder_decoder else input_ids[0].tolist()
    return GenerationOutput(torch.tensor([head + new], dtype=torch.long), stats)

