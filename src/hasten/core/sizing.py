"""Sizing rules: how deep each step's draft may go.

Cutting a draft's depth is always lossless (the loop verifies whatever is left), so the
depth is purely a speed decision. :class:`FixedSize` lets every drafter draft as deep as
it likes (the token budget permitting). :class:`CostAwareSize` picks, each step, the depth
``k`` that maximises expected tokens per second::

    (1 + sum_{d<=k} prod_{i<=d} a_i) / (forward(nodes at depth <= k, + 1) + draft(k))

from the target's forward cost per block size *on this machine* (a short calibration,
cached on disk per model, device, dtype, threads and machine; a llama.cpp model times its own
``llama_decode``), the drafter's acceptance
per depth (``a_d``: P(depth d accepted | depth d drafted and depth d - 1 accepted),
measured online per generation, apart for each class of the drafter's own evidence: see
``Drafter.evidence``) and its measured drafting seconds. ``k = 0`` (a plain
step, no proposal at all) is allowed when drafting does not pay; a small probe now and
then re-measures acceptance.

Exploring: a single early failure must not silence a drafter for a whole generation (one
rejected first draft put lookahead's estimate at 0.25 and ~20 plain steps followed where a
fixed size accepted 3 tokens a step). So among the depths whose failure costs at most one
plain step more than a plain step (on a flat or nearly flat curve), each step lets its
estimates, shifted by a normal draw times their own uncertainty, choose (Thompson-style: an
uncertain estimate is sometimes tried as if better); on a steep curve (llama.cpp on a CPU) exploring costs more than it finds, and only
the probes remain. On a flat curve a class of evidence graded above every class drafted so far is
tried at once (the start of a copy stretch is worth a probe); on a steep one, where a failed probe
costs more than a plain step (SmolLM2 Q4_1 under llama.cpp: a block of 4 costs 3 steps), it waits
for the probes like any other, and probes may take 1% of the time: replayed on 35 recorded
Spec-Bench outputs of that model (`hasten replay`), the two took prompt lookup's auto sizing
from 0.98x to 1.00x of plain decoding (conversation 0.98x to 1.00x, QA 0.97x to 0.99x). Replayed on recorded SmolLM2 outputs
(tokens per unit of forward cost; tables in ``docs/benchmarks.md``), this took prompt lookup's auto sizing from
0.96x to 1.06x of its fixed size on PyTorch and from 1.06x to 1.08x of plain decoding on llama.cpp
(replays of November 2026; ``hasten replay`` measures it again).

Hindsight: a drafter whose proposal is cheap and changes nothing (``Drafter.hindsight_ok``:
prompt lookup) is asked for a draft on the steps the rule keeps plain too; the draft is not
verified but compared with the tokens committed next (:meth:`SizingRule.watch`), which is what
verification would have accepted. One such draft at a time, the next where it ends, as a drafter
that always drafted would have been verified. The rule then measures acceptance on every step
without paying for a probe, and makes none: on a steep curve every failed probe cost more than a
plain step (the first one, on the step after a chat prompt, was rejected on all 15 QA, math and
summarisation answers replayed on SmolLM2 Q4_1).

A rule is chosen once per generation (like the acceptance rule); its per-generation
state comes from ``begin`` and lives with the loop.
The rule itself touches no model (it lives on the ground floor, so :mod:`hasten.vllm` sizes
vLLM's drafts with it); :mod:`hasten.engine.sizing` gives it the calibrated curve of
hasten's own runtimes and resolves the ``draft_size`` setting.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Any, Callable

from .cost import BatchCost, CostCurve
from .tree import TokenTree

# depths priced before a drafter has drafted (a drafter with no match proposes nothing, so this
# can repeat for many steps: pricing a whole long budget each time would cost more than a step)
FIRST_DEPTHS = 32
# a batch drafts only where its plan beats batched plain decoding by more than this share: the
# batch cost model's error. Measured (SmolLM2-135M float32, 8 clients, 2-core AMD EPYC VM,
# scripts/serve_profile.py): plans that priced their drafts as paying ran level with batched
# plain decoding (51.2 against 52.2 tok/s; a drafted position cost 4.5 ms, priced at about 4)
BATCH_MARGIN = 0.10


class SizingRule:
    """Decides each step's deepest usable draft node. ``begin`` returns per-generation state."""

    name: str = "fixed"
    uses_evidence: bool = False  # asks the drafter's evidence (Drafter.evidence) before each step

    def begin(self, target: Any, hindsight: bool = False) -> Any:
        """``hindsight``: the loop checks the drafter's unverified drafts against what gets
        committed (:meth:`watch`), so the rule can learn without verifying drafts."""
        return None

    def depth(self, state: Any, limit: int, evidence: int | None = None) -> int:
        """The max draft depth for this step, at most ``limit`` (0: do not draft);
        ``evidence``: the drafter's class for this step's draft, when it grades them."""
        return limit

    def observe(self, state: Any, tree: TokenTree, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """The step's verified (already cut) draft tree, its accepted path length and timings."""

    def watch(self, state: Any, limit: int) -> int:
        """After :meth:`depth` chose a plain step, in a generation begun with ``hindsight``: how
        deep a draft to ask for anyway, not verified but checked against the tokens this step
        and the next ones commit (:meth:`watched`, then :meth:`observe_hindsight`); 0: none."""
        return 0

    def watched(self, state: Any, evidence: int | None, drafted: int, draft_seconds: float) -> None:
        """The draft :meth:`watch` asked for: a chain ``drafted`` deep, graded ``evidence``,
        proposed in ``draft_seconds``."""

    def observe_hindsight(self, state: Any, evidence: int | None, depth: int, accepted: bool) -> None:
        """Depth ``depth`` of the watched chain, whose shallower tokens were all committed,
        now is known: ``accepted`` when its token was committed next. That is what verifying it
        would have decided, for greedy decoding exactly, and for sampling with the same chance
        (a deterministic draft token is accepted with the target's probability of it, the
        chance that sampling draws it)."""

    def share(self, state: Any, rows: int, positions: int | None = None, keys: int | None = None) -> None:
        """The next step's forward is shared by ``rows`` sequences (a batch); once their drafts
        are known, ``positions``: the tokens it runs (every row's block), over ``keys`` cached
        keys in all (each position over its row's cache)."""

    def plan(self, states: list[Any], limits: list[int], evidence: list[int | None], others: int = 0,
             others_keys: int = 0, contexts: list[int] | None = None) -> None:
        """Before a batch's step: choose jointly for its rows (``limits``: each row's deepest
        usable depth; ``evidence``: each row's drafter's class; ``others``: rows of the same
        forward this rule does not size, one position each at least, over ``others_keys``
        cached keys in all; ``contexts``: each row's cached tokens). Fixed sizes need no plan."""


class FixedSize(SizingRule):
    """Today's behaviour: each drafter drafts as deep as its own settings say (budget permitting)."""

    name = "fixed"


# ---- the cost-aware rule ------------------------------------------------------------------------
@dataclass
class SizingState:
    """One generation's measurements (counts decay, so the rule follows drift within a generation)."""

    curve: CostCurve
    # per evidence class (None: the drafter does not grade its drafts), index d - 1: steps that
    # drafted depth d with d - 1 accepted, and of those, the steps that accepted depth d
    trials_by: dict[int | None, list[float]] = field(default_factory=dict)
    hits_by: dict[int | None, list[float]] = field(default_factory=dict)
    evidence: int | None = None  # the class of the step under way
    top_grade: int | None = None  # the highest evidence class drafted so far
    floor: list[float] = field(default_factory=list)  # per depth: the best estimate of a lower class (see depth)
    draws: random.Random = field(default_factory=lambda: random.Random(0))  # exploration (reproducible)
    width: list[float] = field(default_factory=list)  # index d - 1: mean nodes at depth d when drafted
    reach: int | None = None  # deepest depth the drafter has drafted (None: not yet known)
    most_nodes: int = 0  # largest draft seen: drafters with a node budget never exceed it, however deep
    # drafting seconds ~ fixed + per_depth * depth, fitted by decayed least squares over
    # (depth drafted, seconds) of the steps that proposed: [weight, sum k, sum k^2, sum t, sum k t]
    draft_sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    scale: float | None = None  # observed verify seconds / calibrated forward seconds
    skipped: int = 0  # plain steps in a row since the last draft
    probe_gap: int = 0  # plain steps before the next probe (at least; doubled after each failed probe)
    probing: bool = False  # this step is a probe
    steep: bool | None = None  # a failed probe costs more than a plain step (set on the first step)
    chosen: int = 0  # the depth chosen for the step under way
    rows: int = 1  # sequences sharing the target's forward (a batch): its cost is split among them
    cap: int | None = None  # in a batch: the depth the batch's plan chose for this row
    timed: bool = False  # a step's verify time has been seen (the first is not used: see observe)
    # a batch whose rows are packed along one token dimension (no padding): a forward's cost is
    # batch_forward(rows, positions); else every row is padded to the widest block
    packed: bool = False
    batch_cost: BatchCost | None = None  # what a packed batch costs beyond the one-row curve (None: nothing)
    positions: int | None = None  # tokens the batch's last forward ran (every row's block)
    keys: int | None = None  # cached keys its positions attended over, in all
    # per evidence class, per depth: the acceptance the generations before this one measured
    # (the rule's pool when it began), its prior in place of the rule's fixed guess
    prior_by: dict[int | None, list[float]] = field(default_factory=dict)
    # the loop checks unverified drafts against the committed tokens (SizingRule.watch): acceptance
    # is measured on plain steps too, so the rule never pays for a probe
    hindsight: bool = False
    # the deepest watched draft, each asked FIRST_DEPTHS deep: how deep the drafter goes when let
    ceiling: int = 0
    watch_asked: int = 0  # how deep the watched draft under way was asked for

    @property
    def trials(self) -> list[float]:
        """The current evidence class's trials per depth."""
        return self.trials_by.setdefault(self.evidence, [])

    @property
    def hits(self) -> list[float]:
        return self.hits_by.setdefault(self.evidence, [])

    def forward_seconds(self, positions: float) -> float:
        """This sequence's share of a forward in which every row runs ``positions``
        positions: a batch of B rows runs B times as many, so a row's extra draft tokens cost
        what B extra positions cost (on a CPU that is far from free; on a GPU, at small
        batches, nearly). The calibrated curve, rescaled by the measured verify times."""
        return self.curve(positions * self.rows) * (self.scale or 1.0) / self.rows

    def batch_forward(self, rows: int, positions: float, keys: float) -> float:
        """Calibrated seconds of a packed batch forward of ``rows`` rows running ``positions``
        tokens in all over ``keys`` cached keys in all (:class:`~hasten.core.cost.BatchCost`)."""
        return self.batch_pricer(rows)(positions, keys)

    def batch_pricer(self, rows: int) -> Callable[[float, float], float]:
        """:meth:`batch_forward` for ``rows`` rows, as a function of (positions, keys)."""
        if self.batch_cost is None:
            curve = self.curve
            return lambda positions, keys: curve(positions)
        return self.batch_cost.pricer(self.curve, rows)

    def batch_ceiling(self, rows: int, tokens: float, positions: float, keys: float, gained: float,
                      per_node: float, added: float, context: float, scale: float,
                      price: Callable[[float, float], float] | None = None) -> float:
        """An upper bound on the tokens per second of any plan that adds up to ``added`` draft
        positions, each attending over at least ``context`` cached keys, to a packed forward of
        ``rows`` rows committing ``tokens`` tokens from ``positions`` positions over ``keys``
        keys, gaining at most ``gained`` expected tokens in all and at most ``per_node`` per
        added position, its forward's seconds times ``scale`` (drafting time left out: it only
        lowers a rate). A plan adding n positions runs at most (tokens + min(per_node n,
        gained)) / forward(positions + n, keys + context n); that forward is piecewise linear in
        n, so the bound's largest value is where n is 0, ``added``, a knot of the curve, where
        the keys' cost starts, or where the gain stops growing. The curve is taken without its
        floor (:meth:`CostCurve.line`: lower, and straight between knots); infinite where
        that leaves no time at all. ``price``: :meth:`batch_pricer`'s for ``rows``, where the
        caller has it."""
        points = {0.0, float(added), *(size - positions for size in self.curve.sizes if 0 < size - positions < added)}
        if per_node > 0 and gained / per_node < added:
            points.add(gained / per_node)
        if self.batch_cost is not None and context != self.batch_cost.context:
            start = (self.batch_cost.context * positions - keys) / (context - self.batch_cost.context)
            if 0 < start < added:
                points.add(start)
        best, price = 0.0, price or self.batch_pricer(rows)
        for n in points:
            at = positions + n
            seconds = price(at, keys + context * n) - self.curve(at) + self.curve.line(at)
            if seconds <= 0:
                return math.inf
            best = max(best, (tokens + min(per_node * n, gained)) / (seconds * scale))
        return best


class CostAwareSize(SizingRule):
    """Pick each step's depth to maximise expected tokens per second (see the module doc).

    ``curve``: the target's forward cost (None: measured on first use via
    :func:`load_or_calibrate`). For trees, the node count at each depth is estimated from
    recent drafts (a decaying mean of the nodes proposed at that depth, when it was reached),
    capped by the largest draft seen, since tree drafters with a node budget (lookahead,
    eagle) spend it whatever the depth. The measured verify time rescales the calibrated
    curve (a longer context, a busier machine), so forward and drafting seconds stay comparable.
    """

    name = "auto"
    uses_evidence = True

    def __init__(self, curve: CostCurve | None = None, prior: float = 0.5, prior_weight: float = 1.0,
                 decay: float = 0.9, probe_gap: int = 4, max_probe_gap: int = 64, probe_share: float = 0.01,
                 explore_scale: float = 1.0, pool_decay: float = 0.999):
        self.curve, self.prior, self.prior_weight, self.decay = curve, prior, prior_weight, decay
        self.explore_scale = explore_scale  # standard deviation of the exploration draw (0: none)
        self.probe_share = probe_share
        self.first_probe_gap, self.max_probe_gap = probe_gap, max_probe_gap
        # what every generation this rule sized has measured, per evidence class and depth (decayed
        # trials and hits, as a state's): a new generation's prior. A server's rows are short (a
        # hundred tokens) and their own counts start empty; the ones before them have seen the
        # same drafter on the same model.
        self.pool_decay = pool_decay
        self.pool_trials: dict[int | None, list[float]] = {}
        self.pool_hits: dict[int | None, list[float]] = {}

    def begin(self, target: Any, hindsight: bool = False) -> SizingState:
        curve = self.curve if self.curve is not None else self.curve_for(target)
        packed = bool(getattr(target, "packed_rows", False))
        batch_cost = self.batch_cost_for(target) if packed else None
        prior_by = {evidence: self.pooled(evidence) for evidence in self.pool_trials}
        return SizingState(curve, probe_gap=self.first_probe_gap, packed=packed, batch_cost=batch_cost,
                           prior_by=prior_by, hindsight=hindsight)

    def curve_for(self, target: Any) -> CostCurve:
        """The target's cost curve when none was given (:mod:`hasten.engine.sizing` calibrates
        hasten's runtimes on this machine; here there is nothing to measure with)."""
        raise ValueError("CostAwareSize needs a cost curve: pass curve=")

    def batch_cost_for(self, target: Any) -> BatchCost | None:
        """What a packed batch costs beyond the one-row curve (None: priced by positions alone)."""
        return None

    # estimates ----------------------------------------------------------------------------------
    def acceptances(self, state: SizingState, deepest: int, optimism: float = 0.0) -> list[float]:
        """a_1 .. a_deepest, each with a prior worth ``prior_weight`` steps: ``prior`` at depth
        1, deeper the larger of ``prior`` and the estimate one level up (once a draft has
        matched for a while, the next token tends to match as well, so unexplored depths get
        tried). Real counts decay and the prior does not, so a drafter that is never right
        keeps an estimate of ``prior * prior_weight / (prior_weight + 1 / (1 - decay))``
        (0.045 by default). The prior weighs one step (it weighed 3): where only a deep,
        mostly accepted draft pays (llama.cpp on a CPU: a block of 4 costs 3 steps), one
        fully accepted probe must be enough to start drafting, or a copy stretch is over
        before the rule believes in it. ``optimism``: each estimate moves by that many of its
        standard deviations (exploration; see the module doc)."""
        found, prior, floor = [], self.prior, state.floor
        certainty = self.prior_weight
        measured_trials, measured_hits = state.trials, state.hits
        pooled = state.prior_by.get(state.evidence, ())
        for d in range(deepest):
            trials = measured_trials[d] if d < len(measured_trials) else 0.0
            hits = measured_hits[d] if d < len(measured_hits) else 0.0
            weight = trials + self.prior_weight
            if d < len(pooled):  # what earlier generations measured here replaces the guess
                prior = pooled[d]
            if d < len(floor):  # a higher grade is at least as good as a lower one
                prior = max(prior, floor[d])
            estimate = (hits + prior * self.prior_weight) / weight if weight > 0 else prior
            prior = max(estimate, self.prior)
            if trials > 0:
                certainty = weight  # an unmeasured depth is as certain as the measured one above it
            if optimism:  # once per depth: the prior passed down stays the plain estimate
                estimate = min(max(estimate + optimism * math.sqrt(estimate * (1.0 - estimate) / (certainty + 1.0)),
                                   0.0), 1.0)
            found.append(estimate)
        return found

    def pooled(self, evidence: int | None) -> list[float]:
        """Per depth, the acceptance every generation sized by this rule measured for
        ``evidence`` (depths tried at least once in all). A generation takes them as its prior
        when it begins (its own counts never feed its own prior)."""
        trials, hits = self.pool_trials.get(evidence, ()), self.pool_hits.get(evidence, ())
        found = []
        for t, h in zip(trials, hits):
            if t < 1.0:
                break
            found.append((h + self.prior * self.prior_weight) / (t + self.prior_weight))
        return found

    def grade(self, state: SizingState, evidence: int | None) -> None:
        """Make ``evidence`` the current class; its prior at each depth becomes at least the
        best estimate of any lower class measured there (computed once a step)."""
        state.evidence = evidence
        state.floor = []
        if evidence is None:
            return
        for grade, trials in state.trials_by.items():
            if grade is not None and grade < evidence:
                hits = state.hits_by[grade]
                measured = [(h + self.prior * self.prior_weight) / (t + self.prior_weight) if t > 0 else 0.0
                            for t, h in zip(trials, hits)]
                state.floor = [max(a, b) for a, b in zip_longest(state.floor, measured, fillvalue=0.0)]

    def rates(self, state: SizingState, deepest: int, optimism: float = 0.0) -> list[float]:
        """Expected tokens per second when drafting k = 0 .. ``deepest`` deep."""
        tokens, nodes = self.expected(state, deepest, optimism)
        return [t / seconds for t, seconds in zip(tokens, self.seconds_of(state, nodes))]

    def seconds_of(self, state: SizingState, nodes: list[float]) -> list[float]:
        """Seconds of a step drafting k = 0 .. len(nodes) - 1 deep (``nodes[k]`` draft nodes)."""
        fixed, per_depth = self.draft_cost(state)
        return [state.forward_seconds(count + 1) + (fixed + per_depth * d if d else 0.0)
                for d, count in enumerate(nodes)]

    def expected(self, state: SizingState, deepest: int, optimism: float = 0.0) -> tuple[list[float], list[float]]:
        """For k = 0 .. ``deepest``: the expected tokens a step commits drafting k deep, and
        the draft nodes it verifies."""
        tokens, survive, nodes = [1.0], 1.0, [0.0]
        count = 0.0
        for d, accept in enumerate(self.acceptances(state, deepest, optimism), start=1):
            survive *= accept
            tokens.append(tokens[-1] + survive)
            count += state.width[d - 1] if d <= len(state.width) else (state.width[-1] if state.width else 1.0)
            nodes.append(min(count, max(state.most_nodes, d)))
        return tokens, nodes

    def affordable_gap(self, state: SizingState, depth: int) -> int:
        """Plain steps between probes ``depth`` deep such that failed probes cost at most
        ``probe_share`` of the time (a probe whose first token is accepted is no loss, so
        the extra cost is weighed by the estimated chance that it is not)."""
        fixed, per_depth = self.draft_cost(state)
        plain = state.forward_seconds(1)
        nodes = min(sum(state.width[:depth]) + max(depth - len(state.width), 0), max(state.most_nodes, depth))
        extra = state.forward_seconds(nodes + 1) + fixed + per_depth * depth - plain
        miss = 1.0 - self.acceptances(state, 1)[0]
        return min(int(extra * miss / (self.probe_share * plain)), self.max_probe_gap)

    def drafting_seconds(self, state: SizingState, depth: int) -> float:
        fixed, per_depth = self.draft_cost(state)
        return fixed + per_depth * depth if depth else 0.0

    @staticmethod
    def draft_cost(state: SizingState) -> tuple[float, float]:
        """(fixed seconds, seconds per depth) of one proposal. Until depths have varied,
        all of it is charged per depth (a guess that errs towards shallower drafts, which
        then vary the depth and reveal the fixed part)."""
        weight, k, kk, t, kt = state.draft_sums
        if weight <= 0:
            return 0.0, 0.0
        spread = weight * kk - k * k
        if spread > 1e-6 * weight * weight:
            slope = max((weight * kt - k * t) / spread, 0.0)
            fixed = max((t - slope * k) / weight, 0.0)
            return fixed, slope
        return 0.0, t / k

    # the rule ------------------------------------------------------------------------------------
    def plan(self, states: list[SizingState], limits: list[int], evidence: list[int | None], others: int = 0,
             others_keys: int = 0, contexts: list[int] | None = None) -> None:
        """Choose the rows' depths together, for the batch's expected tokens per second.

        Packed rows (no padding): each row its own depth. From no drafts at all (batched plain
        decoding), the rule repeatedly takes the one row's deeper draft that raises the
        batch's rate most, the forward priced at every row's positions together
        (:meth:`SizingState.batch_forward`), until none raises it: an extra draft token pays
        only where its chance of being accepted outweighs what one more position adds to
        every row's step, so under a heavy load drafts shrink to the rows that are nearly
        sure, and to none. Padded rows: one depth for all rows, every row's block padded to
        the widest."""
        for state, grade in zip(states, evidence):
            self.grade(state, grade)
        waits = [0] * len(states)
        if states[0].packed:
            waits = self._plan_packed(states, limits, others, others_keys, contexts or [0] * len(states))
        elif any(state.reach is None for state in states):  # someone has not drafted yet: all draft fully
            for state in states:
                state.cap = None
            return
        else:
            self._plan_padded(states, limits, others)
        for state, limit, wait in zip(states, limits, waits):
            state.probing = False
            if state.cap == 0:  # now and then a probe re-measures acceptance (a failed one doubles the wait)
                state.skipped += 1
                if state.skipped > max(state.probe_gap, wait) and limit > 0 and not state.hindsight:
                    state.cap, state.probing = 1, True

    def _plan_packed(self, states: list[SizingState], limits: list[int], others: int, others_keys: int,
                     contexts: list[int]) -> list[int]:
        """Each row's own depth (see :meth:`plan`); a row's draft positions attend over its own
        cache (``contexts``), so on a long one they cost more. Returns, per row, the plain steps
        between its probes such that failed probes cost at most ``probe_share`` of its share of
        the batch's time (a probe's position priced in this batch's step, as
        :meth:`affordable_gap` prices one alone)."""
        rows = len(states) + others
        scale = sum(state.scale or 1.0 for state in states) / len(states)
        options = [self.expected(state, self.top(state, limit) if state.reach is not None else min(limit, FIRST_DEPTHS))
                   for state, limit in zip(states, limits)]  # a row that has not drafted: its prior's (the pool's)
        chosen = [0] * len(states)
        tokens_total, positions, draft_total = float(rows), float(rows), 0.0
        keys = float(others_keys + sum(contexts))
        first = states[0]

        price = first.batch_pricer(rows)

        def rate(tokens: float, count: float, attended: float, draft: float) -> float:
            return tokens / (price(count, attended) * scale + draft)

        plain_rate = best_rate = rate(tokens_total, positions, keys, draft_total)

        def reach(r: int) -> tuple[float, float, float]:
            """Row r's deeper drafts, from its chosen depth: (most tokens they gain, most
            gained per added position, most positions they add)."""
            (tokens, nodes), d0 = options[r], chosen[r]
            deeper = range(d0 + 1, len(tokens))
            gain = max((tokens[d] - tokens[d0] for d in deeper), default=0.0)
            room = max((nodes[d] - nodes[d0] for d in deeper), default=0.0)
            per_node = max(((tokens[d] - tokens[d0]) / (nodes[d] - nodes[d0]) if nodes[d] > nodes[d0] else math.inf
                            for d in deeper), default=0.0)
            return gain, per_node, room

        def ceiling(gain: float, per_node: float, room: float, context: float) -> float:
            if gain <= 0:
                return 0.0
            if per_node == math.inf:
                return math.inf
            return first.batch_ceiling(rows, tokens_total, positions, keys, gain, per_node, room, context, scale, price)

        # the most any plan could reach (SizingState.batch_ceiling): where even that is within
        # the margin of plain decoding (the common case under a heavy load), the search could
        # only end in plain decoding and is skipped; in the search, a row whose own ceiling is
        # no better than the best rate so far is not priced depth by depth
        reaches = [reach(r) for r in range(len(states))]
        searching = ceiling(sum(g for g, _, _ in reaches), max((e for _, e, _ in reaches), default=0.0),
                            sum(n for _, _, n in reaches), min(contexts)) >= plain_rate * (1 + BATCH_MARGIN)
        drafting = [[self.drafting_seconds(state, d) for d in range(len(tokens))]  # seconds by depth, per row
                    for state, (tokens, _) in zip(states, options)] if searching else []
        while searching:
            best = None  # (rate, row, depth)
            for r, ((tokens, nodes), costs) in enumerate(zip(options, drafting)):
                if ceiling(*reaches[r], contexts[r]) <= best_rate * (1 + 1e-9):
                    continue
                d0, context = chosen[r], contexts[r]
                for d in range(d0 + 1, len(tokens)):
                    added = nodes[d] - nodes[d0]
                    candidate = rate(tokens_total + tokens[d] - tokens[d0], positions + added, keys + added * context,
                                     draft_total + costs[d] - costs[d0])
                    if candidate > best_rate * (1 + 1e-9) and (best is None or candidate > best[0]):
                        best = (candidate, r, d)
            if best is None:
                break
            best_rate, r, d = best
            (tokens, nodes), costs = options[r], drafting[r]
            added = nodes[d] - nodes[chosen[r]]
            tokens_total += tokens[d] - tokens[chosen[r]]
            positions += added
            keys += added * contexts[r]
            draft_total += costs[d] - costs[chosen[r]]
            chosen[r] = d
            reaches[r] = reach(r)
        if best_rate < plain_rate * (1 + BATCH_MARGIN):  # within the model's error of plain decoding: plain
            chosen = [0] * len(states)
            positions, keys = float(rows), float(others_keys + sum(contexts))
        for state, depth in zip(states, chosen):
            state.cap = depth
        step = price(positions, keys) * scale
        waits = [0] * len(states)
        for r, (state, context) in enumerate(zip(states, contexts)):
            if state.cap == 0:  # only a row running plain may probe
                extra = price(positions + 1, keys + context) * scale - step
                miss = 1.0 - self.acceptances(state, 1)[0]
                waits[r] = min(int(extra * miss * rows / (self.probe_share * step)), self.max_probe_gap)
        return waits

    def _plan_padded(self, states: list[SizingState], limits: list[int], others: int) -> None:
        """One depth ``W`` for all rows: the forward runs ``rows x (widest block)`` positions
        and every row drafts up to ``W`` (padding would cost as much)."""
        rows = len(states) + others
        top = max(self.top(state, limit) for state, limit in zip(states, limits))
        per_row = [self.expected(state, self.top(state, limit)) for state, limit in zip(states, limits)]
        scale = sum(state.scale or 1.0 for state in states) / len(states)
        curve = states[0].curve
        best, best_rate = 0, 0.0
        for depth in range(top + 1):
            tokens = others + sum(row_tokens[min(depth, len(row_tokens) - 1)] for row_tokens, _ in per_row)
            widest = max(row_nodes[min(depth, len(row_nodes) - 1)] for _, row_nodes in per_row)
            drafting = sum(self.drafting_seconds(state, depth) for state in states)
            rate = tokens / (curve(rows * (widest + 1)) * scale + drafting)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = depth, rate
        for state in states:
            state.cap = best

    def top(self, state: SizingState, limit: int) -> int:
        """The deepest depth worth pricing: up to twice the deepest drafted so far, so that
        reach can grow past a depth that costs more than the next (llama.cpp's kernels take
        rows four at a time: a block of 5 can cost more than one of 4, which drafting one
        level deeper at a time would never cross)."""
        if state.ceiling >= state.reach:  # watched drafts, asked deeper than it goes, showed the drafter's depth
            return min(limit, state.ceiling)
        return min(limit, 2 * state.reach + 1)

    def probe_depth(self, state: SizingState, limit: int) -> int:
        """The shallowest depth at which a fully accepted draft beats a plain step (drafting
        cost included): a shallower probe could never show that drafting pays (on a flat
        curve that is 1; on SmolLM2 Q4_0 under llama.cpp, 3: a block of 2 costs two steps).
        0 when no depth up to ``limit`` could pay: then there is nothing to probe for."""
        _, nodes = self.expected(state, limit)
        seconds = self.seconds_of(state, nodes)
        return next((depth for depth in range(1, limit + 1) if (depth + 1) / seconds[depth] > 1.0 / seconds[0]), 0)

    def depth(self, state: SizingState, limit: int, evidence: int | None = None) -> int:
        if state.rows > 1 and state.cap is not None:  # a batch: the plan (which graded every row) chose
            state.chosen = min(state.cap, limit)
            if state.chosen:
                state.skipped = 0
            return state.chosen
        state.probing = False
        if evidence == 0:  # the drafter has nothing to propose (Drafter.evidence): a plain step, nothing to price
            state.evidence, state.chosen = evidence, 0
            state.skipped += 1
            return 0
        self.grade(state, evidence)
        if state.reach is None and state.rows > 1:  # a batch plans once every row has drafted: see how deep
            state.chosen = limit
            return limit
        higher = evidence is not None and (state.top_grade is None or evidence > state.top_grade)
        if higher and state.reach is not None and self.is_steep(state, limit):
            state.top_grade, higher = evidence, False  # on a steep curve a better grade waits for a probe
        if state.reach is None or higher:
            # nothing drafted yet (or evidence above any drafted so far): the prior's best, at least a probe's
            first = min(limit, FIRST_DEPTHS)
            rates = self.rates(state, first)
            best = max(range(len(rates)), key=lambda k: (rates[k], -k))
            state.chosen = best if state.hindsight else max(best, self.probe_depth(state, first))
            return state.chosen
        top = self.top(state, limit)
        tokens, nodes = self.expected(state, top)
        seconds = self.seconds_of(state, nodes)
        rates = [t / s for t, s in zip(tokens, seconds)]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        draw, cap = self.exploring(state, seconds)
        if draw:  # the optimistic (or pessimistic) view picks among depths a failure would not cost much
            hoped_tokens, _ = self.expected(state, cap, draw)
            hopes = [t / s for t, s in zip(hoped_tokens, seconds)]
            hoped = max(range(len(hopes)), key=lambda k: (hopes[k], -k))
            best = hoped if best <= cap and hopes[hoped] > hopes[best] else best  # a deeper best stays
        if best == 0:
            state.skipped += 1
            # now and then a probe re-measures acceptance, as shallow as could show a gain
            probe = self.probe_depth(state, top) if top and not state.hindsight else 0
            if probe and state.skipped > max(state.probe_gap, self.affordable_gap(state, probe)):
                best, state.probing = probe, True
        state.chosen = best
        return best

    def is_steep(self, state: SizingState, limit: int) -> bool:
        """Whether a failed probe costs more than a plain step (judged once a generation)."""
        if state.steep is None:
            probe = self.probe_depth(state, min(limit, FIRST_DEPTHS))
            plain = state.forward_seconds(1)
            state.steep = bool(probe) and state.forward_seconds(probe + 1) - plain > plain
        return state.steep

    def exploring(self, state: SizingState, seconds: list[float]) -> tuple[float, int]:
        """This step's exploration draw (normal, ``explore_scale`` wide) and the deepest depth
        it may choose: the depths whose failure costs at most one plain step more than a plain
        step (``seconds[k]``: a step drafting k deep; none on llama.cpp's steep CPU curve:
        then no draw, 0)."""
        if not self.explore_scale:
            return 0.0, 0
        cap = max((k for k in range(1, len(seconds)) if seconds[k] <= 2 * seconds[0]), default=0)
        return (state.draws.gauss(0.0, self.explore_scale), cap) if cap else (0.0, 0)

    def share(self, state: SizingState, rows: int, positions: int | None = None, keys: int | None = None) -> None:
        state.rows = rows
        if positions is not None or rows == 1:
            state.positions, state.keys = positions, keys

    def observe(self, state: SizingState, tree: TokenTree, accepted: int, draft_seconds: float,
                verify_seconds: float) -> None:
        depths = tree.depths
        drafted = max(depths, default=0)
        positions = len(tree) + 1
        # the first step's timing is left out: on llama.cpp its block reuses the prompt's last
        # position (computed by the prefill), so it runs one position short of the curve
        if verify_seconds > 0 and state.timed:
            if state.packed and state.rows > 1 and state.positions:
                predicted = state.batch_forward(state.rows, state.positions, state.keys or 0)  # the whole forward
            else:
                predicted = state.curve(positions * state.rows)
            ratio = verify_seconds / predicted
            state.scale = ratio if state.scale is None else 0.8 * state.scale + 0.2 * ratio
        state.timed = True
        if state.chosen and not drafted:  # no proposal (prompt lookup without a match): a plain step,
            # and the probe waits; but time passes, so old evidence fades as it would over a draft
            state.trials[:] = [trials * self.decay for trials in state.trials]
            state.hits[:] = [hits * self.decay for hits in state.hits]
        if state.chosen == 0 or drafted == 0:
            return
        state.skipped = 0
        if state.probing:  # a failed probe doubles the wait for the next one
            state.probe_gap = self.first_probe_gap if accepted else min(2 * state.probe_gap, self.max_probe_gap)
        counts = [0] * drafted
        for depth in depths:
            counts[depth - 1] += 1
        self.drafted(state, state.evidence, counts, draft_seconds)
        for depth in range(1, min(accepted + 1, drafted) + 1):  # depth d was tried where its parent was accepted
            self.tally(state, state.evidence, depth, accepted >= depth)

    def watch(self, state: SizingState, limit: int) -> int:
        if not state.hindsight or state.chosen or state.evidence == 0:
            return 0
        state.watch_asked = min(limit, FIRST_DEPTHS)
        return state.watch_asked

    def watched(self, state: SizingState, evidence: int | None, drafted: int, draft_seconds: float) -> None:
        if drafted and state.watch_asked == FIRST_DEPTHS:  # asked deeper than it goes: how deep it goes
            state.ceiling = max(state.ceiling, drafted)
        self.drafted(state, evidence, [1] * drafted, draft_seconds)

    def observe_hindsight(self, state: SizingState, evidence: int | None, depth: int, accepted: bool) -> None:
        self.tally(state, evidence, depth, accepted)

    def drafted(self, state: SizingState, evidence: int | None, counts: list[int], draft_seconds: float) -> None:
        """A draft of ``counts[d - 1]`` nodes at depth d, graded ``evidence``, proposed in
        ``draft_seconds`` (verified or watched): how deep and wide the drafter goes, and what
        drafting costs."""
        drafted = len(counts)
        if not drafted:
            return
        first, state.reach = state.reach is None, max(state.reach or 0, drafted)
        if evidence is not None:
            state.top_grade = evidence if state.top_grade is None else max(state.top_grade, evidence)
        state.most_nodes = max(state.most_nodes, sum(counts))
        if not first:  # a drafter's first proposal may catch up with the whole prompt: not a
            sums = state.draft_sums  # step's drafting cost (lookahead's long-prompt loss came from it)
            for i, value in enumerate((1.0, drafted, drafted * drafted, draft_seconds, drafted * draft_seconds)):
                sums[i] = sums[i] * self.decay + value
        for counted in (state.trials_by, state.hits_by, self.pool_trials, self.pool_hits):  # every depth drafted, tried or not
            found = counted.setdefault(evidence, [])
            found.extend([0.0] * (drafted - len(found)))
        for d, count in enumerate(counts, start=1):
            if len(state.width) < d:
                state.width.append(float(count))
            state.width[d - 1] = 0.8 * state.width[d - 1] + 0.2 * count

    def tally(self, state: SizingState, evidence: int | None, depth: int, accepted: bool) -> None:
        """Depth ``depth`` of a draft graded ``evidence`` was tried (its parent accepted) and
        ``accepted`` or not: into the class's trials and hits, and the rule's pool."""
        hit = 1.0 if accepted else 0.0
        for trials, hits, decay in ((state.trials_by.setdefault(evidence, []), state.hits_by.setdefault(evidence, []),
                                     self.decay),
                                    (self.pool_trials.setdefault(evidence, []), self.pool_hits.setdefault(evidence, []),
                                     self.pool_decay)):
            if len(trials) < depth:
                trials.extend([0.0] * (depth - len(trials)))
                hits.extend([0.0] * (depth - len(hits)))
            trials[depth - 1] = trials[depth - 1] * decay + 1.0
            hits[depth - 1] = hits[depth - 1] * decay + hit
