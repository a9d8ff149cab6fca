"""One sequence in flight, and the one decode step every sequence goes through.

A :class:`Sequence` owns what one generation commits (its tokens, the target's features
for drafters that read them, the drafter's per-generation state, its stop rules and
stats). :func:`step` is the loop's body: every sequence proposes, one target forward
verifies all their blocks, every sequence settles its own verdict. One sequence through a
:class:`~hasten.models.adapter.ModelAdapter` is ``hasten.generate``; many through a
:class:`~hasten.models.batch.BatchAdapter` are the batched decoder and the server's
scheduler. The step is the same code either way.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..core.request import Request
from ..core.rows import ForwardOutput, RowCache, Target
from ..core.sampling import LogitRules
from ..core.state import GrowingBuffer
from ..core.stats import DecodeStats, holder_kv_bytes
from ..core.tree import TokenTree
from ..drafters.base import EMPTY_DRAFT, Draft, DraftContext, Drafter, StepResult, TargetView
from .constraint import RowConstraint
from .logprobs import TokenLogprob, token_logprobs
from .planner import DraftPlanner, RowPlan, StepOutcome
from .stops import StopStrings
from .verify import Acceptance, RowCheck, Verdict, verify_all


class Sequence:
    """Cache invariant: the target caches every committed token but the newest (the root).

    ``clock`` times drafting and verification for the stats and the sizing rule (a replay,
    :mod:`hasten.bench.replay`, gives one whose forwards take the recorded cost curve's time)."""

    clock = staticmethod(time.perf_counter)

    def __init__(
        self,
        cache: RowCache,
        tokens: list[int],  # committed tokens to decode after: the prompt (a seq2seq decoder's start token)
        prefilled: torch.Tensor | None,  # [len(tokens) - 1, hidden] features of the prefilled tokens
        drafter: Drafter | None,  # None: plain decoding (open_row reads the request's drafting switch)
        request: Request,  # admitted (Request.admit): its EOS ids and generator resolved
        acceptance: Acceptance,
        stats: DecodeStats,
        plan: RowPlan | None = None,  # the row's handle on the draft planner (None: no drafter)
        source: list[int] | None = None,
        model_source: str = "",  # where the target was loaded from (a drafter's corpus may need its tokenizer)
    ):
        sampling, max_new_tokens, resumed, stop = request.sampling, request.max_new_tokens, request.resumed, request.stop
        self.request = request
        self.cache = cache
        self.drafter = drafter
        self.acceptance = acceptance
        self.eos_token_ids = request.ending_ids()  # what ends the row: EOS (unless ignored), stop ids
        self.max_new_tokens = max_new_tokens
        self.stats = stats
        self.stop = stop if stop else None
        if self.stop is not None and sampling.min_tokens > resumed:  # no stop string ends it before min_tokens
            self.stop = StopStrings(stop.tokenizer, stop.strings, sampling.min_tokens - resumed)
        self.generated: list[int] = []
        self.logprobs = request.logprobs
        self.processed_logprobs = request.processed_logprobs
        self.scored: list[TokenLogprob] = []  # the last settle's committed tokens, scored (when logprobs is set)
        self.finish_reason: str | None = "length" if max_new_tokens == 0 else None
        self.stop_token: int | None = None  # the EOS or stop id that ended the sequence
        self.suppressed_ids = request.suppressed_ids()  # what min_tokens holds back
        self.resumed = resumed
        generator = request.generator
        self.ruled = sampling.has_logit_rules  # asked once: a request without rules does no extra work per step
        self.rules: LogitRules | None = None  # the request's logit rules, from the first step
        self.want_features = drafter is not None and drafter.reads_features()
        features = None
        self.unfeatured = 0  # prompt rows whose features the first step fills in (_features_of_prompt)
        if self.want_features:
            features = GrowingBuffer()
            if prefilled is not None:
                features.extend(prefilled)
            else:  # a prompt prefilled without its states (Drafter.drafts_without_prompt_features)
                self.unfeatured = len(tokens) - 1
        view = TargetView(cache, drafter.needs if drafter else frozenset(), model_source)
        self.ctx = DraftContext(tokens, 0, sampling, generator, view, source, features, acceptance=acceptance,
                                use_pool=request.pool)
        self._ended = drafter is None
        self.fit = Draft.limit_depth if cache.trees_ok else Draft.main_chain  # chain-only targets verify a tree's best path
        if drafter is not None and plan is None:
            raise ValueError("a row with a drafter needs its plan (DraftPlanner.open)")
        self.plan = plan
        self.watching: tuple[tuple[int, ...], int, float] = ((), 0, 0.0)  # this step's hindsight chain, where, seconds
        if drafter is not None:
            self.ctx.state = drafter.begin(self.ctx)
        # the constraint's one hook: it fits each draft to the grammar, masks the verified logits, follows commits
        self.constraint = None if request.constraint is None else RowConstraint(
            request.constraint, self.eos_token_ids, tokens[len(tokens) - resumed:])
        self.draft_began = self.draft_ended = 0.0  # the step's drafting phase (for the scheduler's split of a step)
        self.evidence_seconds = 0.0  # this step's grading of its draft (set by the planner)
        self.draft_seconds = 0.0  # this row's part of the step's drafting: its grading and its share of the proposals
        self._start = 0

    @property
    def tokens(self) -> list[int]:
        return self.ctx.tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def depth_limit(self) -> int:
        """The deepest draft token this step could use (the bonus token needs the last slot)."""
        return max(self.max_new_tokens - len(self.generated) - 1, 0)

    def ask(self) -> int:
        """How deep this step's proposal goes (0: none): the planner's depth, or on a plain step the
        depth of a chain to watch, drafted but not verified (see :mod:`hasten.engine.planner`).
        Sets ``ctx.max_depth``, which the drafter reads."""
        self.watching = ((), 0, 0.0)
        plan = self.plan
        if plan is None:
            return 0
        if plan.depth > 0 or plan.watch > 0:
            self.ctx.max_depth = plan.depth or plan.watch
            return self.ctx.max_depth
        if self.depth_limit > 0:
            self.ctx.max_depth = 0
        return 0

    def take(self, proposal: Draft | None, seconds: float = 0.0) -> Draft:
        """This step's draft from the drafter's ``proposal`` for :meth:`ask`'s depth (None where it
        asked for none), proposed in ``seconds``: cut to the planner's depth, or on a plain step
        kept as the chain the tokens committed next are compared with (the planner's hindsight),
        and the step's draft is empty; then fitted to the row's grammar."""
        draft, plan = EMPTY_DRAFT, self.plan
        if proposal is not None and plan.depth > 0:
            draft = self.fit(proposal, plan.depth)
        elif proposal is not None:
            chain = proposal if proposal.tree.is_chain else proposal.main_chain(plan.watch)
            self.watching = (tuple(chain.tokens[: plan.watch]), len(self.tokens), seconds)
            self.ctx.max_depth = 0
        if self.constraint is not None:  # forced text only where a method drafts: plain decoding stays plain
            draft = self.constraint.fit(draft, self.depth_limit if self.drafter is not None else 0, self.tokens,
                                        self.cache.trees_ok)
        self.draft_seconds = self.evidence_seconds + seconds
        self.draft_ended = self.clock()
        self._start = self.cache.cache_length  # == len(tokens) - 1, before the forward caches the block
        return draft

    def _scoring_rows(self, raw: torch.Tensor, ruled: torch.Tensor, blocks: list[int]) -> torch.Tensor:
        """[len(blocks), vocab] what a committed token's log-probability is read from: the raw
        logits, or (processed) the law it was drawn from: the logit rules, then the sampling
        transform (temperature, top-k, top-p, min-p; greedy: the rules alone)."""
        if not self.processed_logprobs:
            return raw[blocks]
        rows = ruled[blocks]
        return rows if self.ctx.sampling.greedy else self.ctx.sampling.probs(rows).log()

    def block(self, draft: Draft) -> list[int]:
        return [self.tokens[-1], *draft.tokens]

    def check(self, draft: Draft, out: ForwardOutput) -> RowCheck:
        """What the verifier reads of this sequence's part of the forward: the target's logits
        under the request's logit rules (the same rules plain decoding applies, each row after
        its own path)."""
        ctx = self.ctx
        logits = out.logits  # [n + 1, vocab] the target's, at each block index
        if self.ruled:
            if self.rules is None:
                split = len(self.tokens) - self.resumed
                self.rules = LogitRules(ctx.sampling, logits.shape[-1], logits.device, self.tokens[:split],
                                        self.tokens[split:], self.suppressed_ids)
            logits = self.rules.apply(logits, draft.tree, draft.tokens)
        if self.constraint is not None:  # after the logit rules, before the verification pass
            logits = self.constraint.mask(logits, self.ruled)
        return RowCheck(draft.tree, tuple(draft.tokens), logits, draft.probs, ctx.sampling, ctx.generator)

    def _features_of_prompt(self, out: ForwardOutput) -> None:
        """The prompt's rows of the features, at the row's first step: the target's states at the
        prompt tokens that step ran (a deferred prefill), zeros where it ran none (entries reused
        from a cached prefix, chunks fed in earlier steps): rows no drafter finds, which one that
        drafts without them skips."""
        ran = out.prompt_hidden  # [n, hidden] the prompt's last n, or None
        count = 0 if ran is None else min(len(ran), self.unfeatured)
        if self.unfeatured > count:
            self.ctx.feature_buffer.extend(out.hidden.new_zeros(self.unfeatured - count, out.hidden.shape[-1]))
        if count:
            self.ctx.feature_buffer.extend(ran[len(ran) - count:])
        self.unfeatured = 0

    def settle(self, draft: Draft, out: ForwardOutput, check: RowCheck, verdict: Verdict) -> StepOutcome:
        """Commit this sequence's verdict and apply the stop rules; returns what the step did
        (its ``committed`` tokens, and what the planner learns from)."""
        ctx, cache, stats = self.ctx, self.cache, self.stats
        start = self._start
        if self.constraint is not None:  # a verdict ending where no token was allowed fails the row
            self.constraint.check_end(verdict.accepted, len(self.generated), ctx.sampling)
        cache.commit(start, draft.tree, verdict.accepted)
        kept_blocks = [0, *(node + 1 for node in verdict.accepted)]  # the root and the accepted path
        if ctx.feature_buffer is not None:
            if self.unfeatured:
                self._features_of_prompt(out)
            ctx.feature_buffer.extend(out.hidden[kept_blocks])

        new = [draft.tokens[node] for node in verdict.accepted] + [verdict.next_token]
        new = self._apply_stop_rules(new)
        if self.rules is not None:
            self.rules.commit(new)
        forced = self.constraint is not None and self.constraint.forced_nodes > 0
        if self.constraint is not None:
            self.constraint.commit(new)
            stats.forced_tokens += min(self.constraint.forced_accepted(verdict.accepted), len(new))
        if self.logprobs is not None:  # each committed token was scored at its block index (kept_blocks)
            self.scored = token_logprobs(self._scoring_rows(out.logits, check.logits, kept_blocks[: len(new)]), new,
                                         self.logprobs)
        self.tokens.extend(new)
        if cache.cache_length > len(self.tokens) - 1:  # a stop rule cut inside the accepted path
            cache.crop(len(self.tokens) - 1)
            if ctx.feature_buffer is not None:
                ctx.feature_buffer.truncate(len(self.tokens) - 1)
        verified_at = self.clock()
        stats.draft_seconds += self.draft_seconds
        stats.verify_seconds += verified_at - self.draft_ended
        max_depth = max(draft.tree.depths, default=0)
        stats.record(max_depth, len(draft), len(verdict.accepted), len(new))
        counts = self.drafter is not None and not self.finished and not forced  # the method learns from its own drafts
        if counts:
            riders = None if out.riders is None else out.riders[kept_blocks[-1]]
            self.drafter.observe(ctx, StepResult(len(draft), len(verdict.accepted), max_depth, riders))
        watched, watched_at, watch_seconds = self.watching
        return StepOutcome(draft.tree, len(verdict.accepted), self.draft_seconds,
                           verified_at - self.draft_ended, counts, new, watched, watched_at, watch_seconds, start,
                           len(draft) + 1)

    def _apply_stop_rules(self, new: list[int]) -> list[int]:
        """Cut ``new`` at the budget, the first EOS token or the token completing a stop
        string, whichever comes first, and record why the sequence ends."""
        budget = self.max_new_tokens - len(self.generated)
        reason = None
        if len(new) >= budget:
            new, reason = new[:budget], "length"
        eos = next((i for i, token in enumerate(new) if token in self.eos_token_ids), None)
        if eos is not None:
            new, reason = new[: eos + 1], "stop"
            self.stop_token = new[-1]
        if self.stop is not None:
            checked = len(self.generated)
            at = self.stop.stop_index(self.generated + new, checked)
            if at is not None:
                new, reason = new[: at + 1 - checked], "stop"
                self.stop_token = None
        self.generated.extend(new)
        self.finish_reason = reason
        return new

    def cancel(self) -> None:
        self.finish_reason = "cancelled"

    def close(self) -> None:
        """Tell the drafter the generation is over (finished, cancelled or abandoned), once:
        a pooled drafter keeps its output and forgets its prompt."""
        if not self._ended:
            self._ended = True
            self.drafter.end(self.ctx)

    def record_kv_bytes(self) -> None:
        """Put the target's and the drafter's KV bytes in the stats. Once, at the end of a
        generation (caches only grow): it walks every cache layer, too much for every step."""
        self.stats.target_kv_bytes = holder_kv_bytes(self.cache)  # None for a batch row: the batch holds the cache
        self.stats.drafter_kv_bytes = None if self.drafter is None else self.drafter.cache_bytes(self.ctx.state)


def open_row(request: Request, drafter: Drafter | None,
             prefill: Callable[[bool], tuple[RowCache, list[int], torch.Tensor | None]], planner: DraftPlanner,
             acceptance: Acceptance, stats: DecodeStats, model_source: str = "") -> Sequence:
    """The one way a row begins, alone (:func:`~hasten.engine.loop.decode`) or joining a batch
    (the scheduler): the request's drafting switch is read here and nowhere else (a row that does
    not speculate decodes plainly, in any batch), ``prefill(features)`` caches the prompt (with
    the target's features of it, when the drafter reads them) and answers the row's cache, its
    committed tokens and those features, and the planner opens the row's handle."""
    drafter = drafter if request.speculate else None
    cache, tokens, prefilled = prefill(drafter is not None and drafter.reads_features())
    source = list(request.input_ids) if cache.encoder_decoder else None  # what a seq2seq drafter reads
    return Sequence(cache, tokens, prefilled, drafter, request, acceptance, stats,
                    planner.open(request, cache, drafter), source, model_source)


def step(target: Target, sequences: list[Sequence], planner: DraftPlanner) -> list[list[int]]:
    """One decode step for every sequence: the planner gives each its depth, every sequence
    proposes, one verification forward, one verification pass over every row
    (:func:`~hasten.engine.verify.verify_all`), every sequence settles, the planner learns.
    Returns each sequence's newly committed tokens."""
    planner.plan(sequences)
    drafts = propose(sequences)
    riders = [draft.riders for draft in drafts]
    outs = target.forward_rows(
        [sequence.cache for sequence in sequences],
        [sequence.block(draft) for sequence, draft in zip(sequences, drafts)],
        [draft.tree for draft in drafts],
        any(sequence.want_features for sequence in sequences),
        **({"riders": riders} if any(r is not None for r in riders) else {}),  # only a riders-capable target
    )
    checks = [sequence.check(draft, out) for sequence, draft, out in zip(sequences, drafts, outs)]
    verdicts = verify_all([sequence.acceptance for sequence in sequences], checks)
    outcomes = [sequence.settle(draft, out, check, verdict)
                for sequence, draft, out, check, verdict in zip(sequences, drafts, outs, checks, verdicts)]
    planner.learn(sequences, outcomes)
    return [outcome.committed for outcome in outcomes]


def propose(sequences: list[Sequence]) -> list[Draft]:
    """Every sequence's draft for this step (:meth:`Sequence.ask`, :meth:`Sequence.take`). The rows
    one drafter proposes for are proposed together (:meth:`Drafter.propose_rows`: a trained drafter
    runs its layer once for all of them), each charged an equal share of the call's seconds."""
    depths = [sequence.ask() for sequence in sequences]
    proposals: list[tuple[Draft | None, float]] = [(None, 0.0)] * len(sequences)  # (proposal, its seconds)
    groups: dict[int, list[int]] = {}
    for index, (sequence, depth) in enumerate(zip(sequences, depths)):
        if depth:
            groups.setdefault(id(sequence.drafter), []).append(index)
    for members in groups.values():
        first = sequences[members[0]]
        began = first.clock()
        drafts = first.drafter.propose_rows([sequences[index].ctx for index in members])
        share = (first.clock() - began) / len(members)
        for index, draft in zip(members, drafts):
            proposals[index] = (draft, share)
    return [sequence.take(*proposal) for sequence, proposal in zip(sequences, proposals)]
