"""Held-out acceptance of a drafter, teacher-forced, as greedy speculative decoding accepts it.

At each answer position ``r`` of a held-out row (the root ``x_r`` committed, the target's
features of the positions before it lent as the loop lends them), the drafter proposes exactly
as in the decode loop (``begin``, then ``propose`` at every root in order; a draft's riders are
answered with their logits at the next root's predecessor, as a verification forward would).
The target's greedy continuation after the root is read off one forward over the row: where
the row's next ``depth - 1`` tokens are the target's own greedy tokens (a greedy answer, in the
dtype it was made in), ``greedy[r .. r + depth - 1]`` is exactly what plain greedy decoding
writes, so the draft's accepted length is the one the verifier would give. Positions where the
row leaves the greedy path are skipped (none in a greedy answer made in the same dtype).

Two numbers per root: the accepted length of the draft's main chain (every tree builder puts
its best guess first: the chain a greedy drafter writes) and of the whole draft (its tree, cut
to ``depth``). :func:`summarise` turns them into acceptance per depth (the share of roots whose
accepted path reaches depth d, as ``DecodeStats.accepted_at_depth / steps``) and tau (1 + the
mean accepted length: tokens per target forward).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, fields
from typing import Sequence

import torch

from ..core.sampling import Sampling
from ..core.settings import Settings, option
from ..core.state import GrowingBuffer
from ..drafters.base import Draft, DraftContext, Drafter, StepResult, TargetView
from ..drafters.trained import at_least_one

RIDER_ANCHORS = 128  # anchors whose rider logits one forward computes (each adds its riders to it)


@dataclass(frozen=True)
class ProbeSettings(Settings):
    probe_depth: int = option(5, "draft depth of the held-out acceptance probe (tokens per chain)")
    probe_positions: int = option(1500, "held-out answer positions (roots) each acceptance probe drafts at")

    def __post_init__(self) -> None:
        super().__post_init__()
        at_least_one(self, "probe_depth", "probe_positions")


@dataclass(frozen=True)
class RootResult:
    root: int  # position of the root token in the row
    chain: int  # accepted length of the draft's main chain
    tree: int  # accepted length of the whole draft


class TeacherRow:
    """What a :class:`~hasten.drafters.base.TargetView` lends of a target read teacher-forced:
    its modules, and as cache length the committed tokens but the root (no cache is kept: a
    drafter never reads or writes the loop's)."""

    encoder_decoder = False
    prompt_embeds = None
    encoder_states = None
    kv_readable = False
    cache_length = 0

    def __init__(self, model):
        self.model = model
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])


def accepted_length(draft: Draft, continuation: Sequence[int]) -> int:
    """Greedy verification of ``draft`` against the target's ``continuation``: the longest path
    from the root whose tokens are the continuation's first tokens."""
    node, accepted, children = -1, 0, draft.tree.children
    while accepted < len(continuation):
        matching = [c for c in children[node + 1] if draft.tokens[c] == continuation[accepted]]
        if not matching:
            break
        node, accepted = matching[0], accepted + 1
    return accepted


class RiderLogits:
    """The logits a verification forward would give a draft's riders at each anchor of a row,
    computed RIDER_ANCHORS anchors per forward on first use."""

    def __init__(self, target, ids: torch.Tensor):
        self.target, self.ids, self.done = target, ids, {}  # ids [1, n]

    def at(self, riders, anchor: int) -> torch.Tensor:
        """[count, vocab] the riders' logits after ``anchor``."""
        from ..models.layers import placeholder_logits_batch

        if anchor not in self.done:
            first = anchor - anchor % RIDER_ANCHORS
            anchors = torch.arange(first, min(first + RIDER_ANCHORS, self.ids.shape[1]), device=self.ids.device)
            logits = placeholder_logits_batch(self.target, self.ids, anchors[None], riders.count, riders.layer,
                                              riders.transfer)[0]  # [A, count, V]
            self.done.update({int(a): logits[i].float() for i, a in enumerate(anchors)})
        return self.done[anchor]


@torch.no_grad()
def teacher_forced(drafter: Drafter, target, ids: Sequence[int], first_root: int, depth: int) -> list[RootResult]:
    """The drafter's accepted lengths at every root ``r >= first_root`` of ``ids`` whose greedy
    continuation of ``depth`` tokens the row shows; the drafter walks every position from
    ``first_root - 1`` on (the first one a warm-up: a drafter whose guesses come from the step
    before has some at ``first_root``)."""
    device = target.get_output_embeddings().weight.device
    buffer = GrowingBuffer() if drafter.reads_features() else None
    lent = TeacherRow(target)
    ids, start = list(ids), max(first_root - 1, 0)
    ctx = DraftContext(tokens=ids[: start + 1], max_depth=depth, sampling=Sampling(), generator=None,
                       target=TargetView(lent, drafter.needs), feature_buffer=buffer)
    lent.cache_length = start
    # begun before the target's forward, so that a drafter that watches the target's forwards (EAGLE-3's
    # taps, set up when it first meets the target) sees this one, as it sees the loop's verifications;
    # it sees the committed tokens but not yet their features (no trained drafter reads them there)
    ctx.state = drafter.begin(ctx)
    row = torch.tensor([ids], device=device)  # [1, n]
    out = target(row, output_hidden_states=True)
    features = out.hidden_states[-1][0]  # [n, H] what the loop's verification forwards return
    greedy = out.logits[0].argmax(-1).tolist()  # [n] greedy[t]: the target's next token after x_t
    del out
    riders, pending, results = RiderLogits(target, row), None, []

    def commit(r: int) -> None:  # the loop's state with x_0 .. x_r committed (x_r the root)
        ctx.tokens, lent.cache_length = ids[: r + 1], r
        if buffer is not None and len(buffer) < r:
            buffer.extend(features[len(buffer) : r])

    for r in range(start, len(ids) - depth + 1):
        commit(r)
        if pending is not None:  # what the last draft's riders computed, at this root's predecessor
            drafter.observe(ctx, StepResult(0, 0, 0, riders=riders.at(pending, r - 1)))
        draft = drafter.propose(ctx)
        pending = draft.riders
        if r < first_root or ids[r + 1 : r + depth] != greedy[r : r + depth - 1]:
            continue  # a warm-up, or the row leaves the target's greedy path within the draft's reach
        continuation = greedy[r : r + depth]
        results.append(RootResult(r, accepted_length(draft.main_chain(depth), continuation),
                                  accepted_length(draft.limit_depth(depth), continuation)))
    drafter.end(ctx)
    return results


def summarise(results: list[RootResult], depth: int) -> dict:
    """Acceptance per depth (share of roots whose accepted chain reaches depth d), the same of
    the whole draft, and tau (1 + mean accepted length) of both."""
    n = max(len(results), 1)
    reach = lambda key, d: sum(getattr(r, key) >= d for r in results) / n  # noqa: E731
    return {
        "positions": len(results),
        "acceptance": [round(reach("chain", d), 4) for d in range(1, depth + 1)],
        "tau": round(1 + sum(r.chain for r in results) / n, 4),
        "tree_acceptance": [round(reach("tree", d), 4) for d in range(1, depth + 1)],
        "tree_tau": round(1 + sum(r.tree for r in results) / n, 4),
    }


def probe(drafter_cls: type[Drafter], weights: str, target, rows: list[tuple[Sequence[int], int]],
          settings: ProbeSettings) -> dict:
    """:func:`summarise` over held-out ``rows`` (ids, answer start) of a drafter loaded from
    ``weights`` with its default settings (a chain drafter's depth set to ``probe_depth``),
    walking rows until ``probe_positions`` roots are measured."""
    depth_field = "depth" in {f.name for f in fields(drafter_cls.Settings)}
    drafter = drafter_cls(weights=weights, **({"depth": settings.probe_depth} if depth_field else {}))
    results: list[RootResult] = []
    try:
        for ids, answer_start in rows:
            if len(results) >= settings.probe_positions:
                break
            # the root before the answer's first token is the prompt's last one
            results += teacher_forced(drafter, target, ids, answer_start - 1, settings.probe_depth)
    finally:
        del drafter
        gc.collect()  # a drafter's hooks on the target (EAGLE-3's taps) leave with it
    return summarise(results[: settings.probe_positions], settings.probe_depth)
