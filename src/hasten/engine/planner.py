"""The draft planner: how deep every row drafts this step, and what it learns afterwards.

The decode step (:func:`hasten.engine.sequence.step`) calls it twice: :meth:`DraftPlanner.plan`
before any row proposes, which gives each row its depth for this step (a batch is planned
together, one row being a batch of one), and :meth:`DraftPlanner.learn` after every row settled,
with what verification decided and what hindsight saw. Everything a sizing rule measures and
decides goes through these two calls; a :class:`~hasten.engine.sequence.Sequence` holds only its
:class:`RowPlan` handle and reads this step's ``depth`` and ``watch`` from it.

The rule behind the planner (:mod:`hasten.core.sizing`: fixed depths, or the cost-aware search
over an acceptance estimate and a step price) is chosen per request: requests resolved alike share
one rule, which plans all of its rows of a batch at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from ..core.request import Request
from ..core.rows import RowCache
from ..core.tree import TokenTree
from ..drafters.base import Drafter, DraftContext
from .sizing import SizingChoice, SizingRule


@dataclass
class WatchedChain:
    """A chain drafted on a plain step and not verified, still being compared with what gets
    committed: graded ``evidence``, its ``tokens`` would start at ``at`` in the row's tokens, and
    its first ``known`` depths are settled."""

    evidence: int | None
    tokens: tuple[int, ...]
    at: int
    known: int = 0


@dataclass
class RowPlan:
    """One row's handle on the planner: its rule, the rule's state for this generation, and this
    step's decisions (``evidence``: the drafter's grade of its draft; ``depth``: the deepest draft
    node the row may propose, 0 for a plain step; ``watch``: on a plain step, how deep a chain to
    draft for hindsight, unverified)."""

    rule: SizingRule
    state: Any
    evidence: int | None = None
    depth: int = 0
    watch: int = 0
    watched: WatchedChain | None = None


@dataclass
class StepOutcome:
    """What one row's step did, for the planner to learn from: the verified draft (cut to what
    the row could use) and its accepted path's length, the drafting and verification seconds,
    whether the drafter's own draft counts (the row goes on, drafted by its drafter and not forced
    by a grammar), the chain drafted for hindsight on a plain step (empty: none) and where its
    tokens would start, and the tokens committed."""

    tree: TokenTree
    accepted: int
    draft_seconds: float
    verify_seconds: float
    counts: bool
    committed: list[int]
    watched: tuple[int, ...] = ()
    watched_at: int = 0
    watch_seconds: float = 0.0
    block_start: int = 0  # the row's cached tokens when its block ran
    blocks: int = 1  # positions its block ran (root and draft)


class PlannedRow(Protocol):
    """What the planner reads of a row (a :class:`~hasten.engine.sequence.Sequence`)."""

    plan: RowPlan | None
    drafter: Drafter | None
    ctx: DraftContext
    cache: RowCache
    clock: Callable[[], float]
    draft_began: float  # set by the planner: the step's drafting time starts with the drafter's grade
    evidence_seconds: float  # set by the planner: what grading the row's draft took

    @property
    def depth_limit(self) -> int: ...

    @property
    def tokens(self) -> list[int]: ...


class DraftPlanner:
    """Plans every row's draft depth per step from one ``draft_size`` setting (``"auto"``,
    ``"fixed"``, a :class:`SizingRule`, or unset: auto, but fixed for seeded sampling; see
    :func:`~hasten.engine.sizing.default_size`)."""

    def __init__(self, draft_size: str | SizingRule | None = None):
        self.choice = SizingChoice(draft_size)
        self.riding = 0  # prompt tokens the next step's forward runs besides the rows' blocks

    def prompts_ride(self, tokens: int) -> None:
        """The next step's forward also runs ``tokens`` prompt tokens of joining rows (a packed
        batch's deferred or chunked prefill, which the scheduler lays out before the step): its
        time then measures more than the rows' blocks, so :meth:`learn` keeps that step's time
        out of the rules' step price (what the rows' drafts accepted is learnt as ever)."""
        self.riding = tokens

    def open(self, request: Request, cache: RowCache, drafter: Drafter | None) -> RowPlan | None:
        """A new row's handle (None for a row without a drafter: it decodes plainly)."""
        if drafter is None:
            return None
        rule = self.choice.for_request(not request.sampling.greedy, seeded=request.generator is not None)
        return RowPlan(rule, rule.begin(cache, hindsight=drafter.hindsight_from()))

    def plan(self, rows: list[PlannedRow]) -> None:
        """Before the step: grade every row's coming draft, plan each rule's rows together, and
        give each row its depth (and, on a plain step, its hindsight chain's depth)."""
        sized = [row for row in rows if row.plan is not None]
        limits = {id(row): planned_limit(row) for row in sized}
        for row in rows:
            row.draft_began = row.clock()
            plan = row.plan
            if plan is not None:
                asks = plan.rule.uses_evidence and limits[id(row)] > 0
                plan.evidence = row.drafter.evidence(row.ctx) if asks else None
            row.evidence_seconds = row.clock() - row.draft_began
        for row in sized:
            row.plan.rule.share(row.plan.state, len(rows))  # cost-aware sizing prices the shared forward
        if len(rows) > 1:
            for group in by_rule(sized):
                rule = group[0].plan.rule
                others = [row for row in rows if row.plan is None or row.plan.rule is not rule]
                rule.plan([row.plan.state for row in group], [limits[id(row)] for row in group],
                          [row.plan.evidence for row in group], len(others),
                          sum(row.cache.cache_length for row in others), [row.cache.cache_length for row in group])
        for row in sized:
            plan, limit = row.plan, limits[id(row)]
            plan.depth = plan.rule.depth(plan.state, limit, plan.evidence) if limit > 0 else 0
            plan.watch = 0
            # one watched chain at a time, the next where it ends: the drafts a drafter that always
            # drafted would have had verified, each one trial (overlapping chains along one copied
            # stretch would count it many times over)
            if plan.depth == 0 and limit > 0 and plan.watched is None:
                plan.watch = plan.rule.watch(plan.state, limit)

    def learn(self, rows: list[PlannedRow], outcomes: list[StepOutcome]) -> None:
        """After the step: each rule takes what its rows' verification measured, and each row's
        hindsight chain the depths its committed tokens now settle."""
        positions = sum(outcome.blocks for outcome in outcomes)
        keys = sum(outcome.blocks * outcome.block_start for outcome in outcomes)
        timed, self.riding = not self.riding, 0  # a step that ran prompt tokens too is no measure of its blocks
        for row, outcome in zip(rows, outcomes):
            plan = row.plan
            if plan is None:
                continue
            rule, state = plan.rule, plan.state
            if len(rows) > 1:  # what the forward ran, for the rule's reading of its time
                rule.share(state, len(rows), positions, keys)
            if outcome.watched:
                rule.watched(state, plan.evidence, len(outcome.watched), outcome.watch_seconds)
                plan.watched = WatchedChain(plan.evidence, outcome.watched, outcome.watched_at)
            if outcome.counts:
                rule.observe(state, outcome.tree, outcome.accepted, outcome.draft_seconds,
                             outcome.verify_seconds if timed else 0.0)
            if plan.watched is not None:
                settle_watched(plan, row.tokens)


def planned_limit(row: PlannedRow) -> int:
    """The deepest draft the planner prices for ``row`` this step: what its budget leaves, and no
    deeper than its drafter can go (priced deeper, a step would hope for tokens it never drafts)."""
    deepest = row.drafter.deepest()
    return row.depth_limit if deepest is None else min(row.depth_limit, deepest)


def settle_watched(plan: RowPlan, tokens: list[int]) -> None:
    """Tell the rule each depth of the watched chain that the committed ``tokens`` now decide; the
    chain ends at its first token that was not committed, or its last. That is what verifying it
    would have decided: for greedy decoding exactly, for sampling with the same chance (a fixed
    draft token is accepted with the target's probability of it)."""
    chain = plan.watched
    committed = tokens[chain.at + chain.known : chain.at + len(chain.tokens)]
    for depth, token in enumerate(committed, start=chain.known + 1):
        accepted = token == chain.tokens[depth - 1]
        plan.rule.observe_hindsight(plan.state, chain.evidence, depth, accepted)
        if not accepted or depth == len(chain.tokens):
            plan.watched = None
            return
    chain.known += len(committed)


def by_rule(rows: list[PlannedRow]) -> list[list[PlannedRow]]:
    """Rows grouped by the rule that sizes them, in order of first appearance."""
    groups: dict[int, list[PlannedRow]] = {}
    for row in rows:
        groups.setdefault(id(row.plan.rule), []).append(row)
    return list(groups.values())
