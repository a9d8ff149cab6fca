"""Sizing rules: how deep each step's draft may go.

Cutting a draft's depth is always lossless (the loop verifies whatever is left), so the
depth is purely a speed decision. :class:`FixedSize` lets every drafter draft as deep as
it likes (the token budget permitting). :class:`CostAwareSize` is the search: each step, it
picks the depth ``k`` that maximises expected tokens per second::

    (1 + sum_{d<=k} prod_{i<=d} a_i) / (forward(nodes at depth <= k, + 1) + draft(k))

from two separate objects: an acceptance estimate (:mod:`hasten.core.estimate`: ``a_d``, per
depth and per class of the drafter's own evidence, pooled across generations, fed by verified and
watched drafts) and a step price (:mod:`hasten.core.pricing`: the target's forward cost per block
size *on this machine*, a packed batch's cost, the drafter's measured drafting seconds, which a new
generation takes over from the ones before it). ``k = 0`` (a plain step, no proposal at all) is
allowed when drafting does not pay; a small probe now and then re-measures acceptance, less often
after each one that fails, and a new generation keeps the back-off the latest one reached (a drafter
whose drafts did not pay is not tried afresh on every new request): where the generations before found
no depth that pays, a new one starts plain and waits for its probe as they did.

Exploring: a single early failure must not silence a drafter for a whole generation. So among the
depths whose failure costs at most one plain step more than a plain step (on a flat or nearly flat
curve), each step lets its estimates, shifted by a normal draw times their own uncertainty, choose
(Thompson-style: an uncertain estimate is sometimes tried as if better); on a steep curve
(llama.cpp on a CPU) exploring costs more than it finds, and only the probes remain. On a flat
curve a class of evidence graded above every class drafted so far is tried at once (the start of a
copy stretch is worth a probe); on a steep one, where a failed probe costs more than a plain step,
it waits for the probes like any other, and probes may take 1% of the time.

Hindsight: a drafter whose proposal is cheap and changes nothing (``Drafter.hindsight_from``:
prompt lookup at every grade, mixed where it copies alone) is asked for a draft on the steps the
rule keeps plain too, at those grades; the draft is not
verified but compared with the tokens committed next (:meth:`SizingRule.watch`), which is what
verification would have accepted. One such draft at a time, the next where it ends, as a drafter
that always drafted would have been verified. The rule then measures acceptance on every step
without paying for a probe, and makes none.

A batch plans its rows together (:meth:`CostAwareSize.plan`); a single row is sized by
:meth:`CostAwareSize.depth` alone. The replays and runs that chose these rules are in
docs/cpu.md ("The measurements behind the code's choices").

A rule is chosen once per generation (like the acceptance rule); its per-generation state comes
from ``begin`` and is held by the row's :class:`~hasten.engine.planner.RowPlan`. The rule touches
no model (it lives on the ground floor, so :mod:`hasten.vllm` sizes vLLM's drafts with it);
:mod:`hasten.engine.sizing` gives it the calibrated costs of hasten's own runtimes and resolves the
``draft_size`` setting.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cost import CostCurve
from .estimate import AcceptanceCounts, AcceptanceEstimator
from .pricing import DraftingCost, KnownCosts, StepCosts, StepPrice
from .tree import TokenTree

# depths priced before a drafter has drafted (a drafter with no match proposes nothing, so this
# can repeat for many steps: pricing a whole long budget each time would cost more than a step)
FIRST_DEPTHS = 32
# a batch drafts only where its plan beats batched plain decoding by more than this share: the
# batch cost model's error (docs/cpu.md, "The measurements behind the code's choices")
BATCH_MARGIN = 0.10


class SizingRule:
    """Decides each step's deepest usable draft node. ``begin`` returns per-generation state."""

    name: str = "fixed"
    uses_evidence: bool = False  # asks the drafter's evidence (Drafter.evidence) before each step

    def begin(self, target: Any, hindsight: int | None = None) -> Any:
        """``hindsight``: from this grade of evidence up (0: every grade; None: none), the loop
        checks the drafter's unverified drafts against what gets committed (:meth:`watch`), so
        the rule can learn without verifying drafts (``Drafter.hindsight_from``)."""
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
    """One generation's state under cost-aware sizing: its acceptance counts, its step prices,
    and the search's own (probes, exploration, the depth chosen)."""

    counts: AcceptanceCounts
    price: StepPrice
    draws: random.Random = field(default_factory=lambda: random.Random(0))  # exploration (reproducible)
    skipped: int = 0  # plain steps in a row since the last draft
    probe_gap: int = 0  # plain steps before the next probe (at least; doubled after each failed probe)
    probing: bool = False  # this step is a probe
    steep: bool | None = None  # a failed probe costs more than a plain step (set on the first step)
    chosen: int = 0  # the depth chosen for the step under way
    cap: int | None = None  # in a batch: the depth the batch's plan chose for this row
    # the loop checks unverified drafts against the committed tokens (SizingRule.watch): acceptance
    # is measured on plain steps too, so the rule never pays for a probe
    hindsight: int | None = None  # from this grade of evidence up (0: every grade; None: none)
    watch_asked: int = 0  # how deep the watched draft under way was asked for
    # exploration backs off as probes do: a draft that exploration chose and that got nothing
    # accepted doubles the steps before the next one may be chosen (reset by one that got some)
    explored: bool = False  # this step's depth is exploration's choice
    explore_gap: int = 0  # steps between explorations now
    explore_wait: int = 0  # steps before exploration may choose again
    drafted_grades: set[int | None] = field(default_factory=set)  # grades of evidence proposed at so far


def watches(state: SizingState) -> bool:
    """Whether the rule learns this step's grade by hindsight (SizingState.hindsight), not probes."""
    evidence = state.counts.evidence
    if state.hindsight is None:
        return False
    return state.hindsight == 0 if evidence is None else evidence >= state.hindsight


class CostAwareSize(SizingRule):
    """Pick each step's depth to maximise expected tokens per second (see the module doc).

    ``curve``: the target's forward cost; or ``costs``, where the curves come from
    (:class:`~hasten.engine.sizing.CalibratedCosts` measures hasten's runtimes). For trees, the node count at each depth is estimated from
    recent drafts (a decaying mean of the nodes proposed at that depth, when it was reached),
    capped by the largest draft seen, since tree drafters with a node budget (lookahead,
    eagle) spend it whatever the depth. The measured verify time rescales the calibrated
    curve (a longer context, a busier machine), so forward and drafting seconds stay comparable.
    """

    name = "auto"
    uses_evidence = True

    def __init__(self, curve: CostCurve | None = None, prior: float = 0.5, prior_weight: float = 1.0,
                 decay: float = 0.9, probe_gap: int = 4, max_probe_gap: int = 64, probe_share: float = 0.01,
                 explore_scale: float = 1.0, pool_decay: float = 0.999, costs: StepCosts | None = None):
        if curve is not None and costs is not None:
            raise ValueError("give CostAwareSize a curve or costs, not both")
        self.costs = costs if costs is not None else KnownCosts(curve)
        # what drafts get accepted; it pools what every generation this rule sized measured (a
        # server's rows are short, and the ones before them saw the same drafter on the same model)
        self.estimator = AcceptanceEstimator(prior, prior_weight, decay, pool_decay)
        # what drafting cost in those generations: a new one starts from it (StepPrice.start_from)
        self.drafting = DraftingCost(decay)
        self.decay = decay  # how fast a generation's measured drafting seconds fade
        self.explore_scale = explore_scale  # standard deviation of the exploration draw (0: none)
        self.probe_share = probe_share
        self.first_probe_gap, self.max_probe_gap = probe_gap, max_probe_gap
        # the back-off of probes and explorations where the latest generation left it: a drafter whose
        # drafts did not pay in the generations before is not tried afresh at every new one
        self.gaps = (probe_gap, 0)  # (probe_gap, explore_gap)

    def begin(self, target: Any, hindsight: int | None = None) -> SizingState:
        packed = bool(getattr(target, "packed_rows", False))
        price = StepPrice(self.costs.curve_for(target), self.decay, packed=packed,
                          batch_cost=self.costs.batch_cost_for(target) if packed else None)
        price.start_from(self.drafting)
        probe_gap, explore_gap = self.gaps
        return SizingState(self.estimator.begin(), price, probe_gap=probe_gap, hindsight=hindsight,
                           explore_gap=explore_gap, explore_wait=explore_gap)

    def rates(self, state: SizingState, deepest: int, optimism: float = 0.0) -> list[float]:
        """Expected tokens per second when drafting k = 0 .. ``deepest`` deep."""
        tokens, nodes = self.estimator.expected(state.counts, deepest, optimism)
        return [t / seconds for t, seconds in zip(tokens, self.seconds_of(state, nodes))]

    def seconds_of(self, state: SizingState, nodes: list[float]) -> list[float]:
        """Seconds of a step drafting k = 0 .. len(nodes) - 1 deep (``nodes[k]`` draft nodes)."""
        fixed, per_depth = state.price.draft_cost(state.counts.evidence)
        return [state.price.forward_seconds(count + 1) + (fixed + per_depth * d if d else 0.0)
                for d, count in enumerate(nodes)]

    def affordable_gap(self, state: SizingState, depth: int) -> int:
        """Plain steps between probes ``depth`` deep such that failed probes cost at most
        ``probe_share`` of the time (a probe whose first token is accepted is no loss, so
        the extra cost is weighed by the estimated chance that it is not)."""
        fixed, per_depth = state.price.draft_cost(state.counts.evidence)
        plain = state.price.forward_seconds(1)
        nodes = min(sum(state.counts.width[:depth]) + max(depth - len(state.counts.width), 0), max(state.counts.most_nodes, depth))
        extra = state.price.forward_seconds(nodes + 1) + fixed + per_depth * depth - plain
        miss = 1.0 - self.estimator.acceptances(state.counts, 1)[0]
        return min(int(extra * miss / (self.probe_share * plain)), self.max_probe_gap)

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
            self.estimator.grade(state.counts, grade)
        waits = [0] * len(states)
        if states[0].price.packed:
            waits = self._plan_packed(states, limits, others, others_keys, contexts or [0] * len(states))
        elif any(state.counts.reach is None for state in states):  # someone has not drafted yet: all draft fully
            for state in states:
                state.cap = None
            return
        else:
            self._plan_padded(states, limits, others)
        for state, limit, wait in zip(states, limits, waits):
            state.probing = False
            if state.cap == 0:  # now and then a probe re-measures acceptance (a failed one doubles the wait)
                state.skipped += 1
                if state.skipped > max(state.probe_gap, wait) and limit > 0 and not watches(state):
                    state.cap, state.probing = 1, True

    def _plan_packed(self, states: list[SizingState], limits: list[int], others: int, others_keys: int,
                     contexts: list[int]) -> list[int]:
        """Each row's own depth (see :meth:`plan`); a row's draft positions attend over its own
        cache (``contexts``), so on a long one they cost more. Returns, per row, the plain steps
        between its probes such that failed probes cost at most ``probe_share`` of its share of
        the batch's time (a probe's position priced in this batch's step, as
        :meth:`affordable_gap` prices one alone)."""
        rows = len(states) + others
        scale = sum(state.price.scale or 1.0 for state in states) / len(states)
        options = [self.estimator.expected(state.counts, self.top(state, limit) if state.counts.reach is not None else min(limit, FIRST_DEPTHS))
                   for state, limit in zip(states, limits)]  # a row that has not drafted: its prior's (the pool's)
        chosen = [0] * len(states)
        tokens_total, positions, draft_total = float(rows), float(rows), 0.0
        keys = float(others_keys + sum(contexts))
        first = states[0]

        price = first.price.batch_pricer(rows)

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
            return first.price.batch_ceiling(rows, tokens_total, positions, keys, gain, per_node, room, context, scale, price)

        # the most any plan could reach (SizingState.batch_ceiling): where even that is within
        # the margin of plain decoding (the common case under a heavy load), the search could
        # only end in plain decoding and is skipped
        reaches = [reach(r) for r in range(len(states))]
        searching = ceiling(sum(g for g, _, _ in reaches), max((e for _, e, _ in reaches), default=0.0),
                            sum(n for _, _, n in reaches), min(contexts)) >= plain_rate * (1 + BATCH_MARGIN)
        if searching:
            # every row's options by depth, padded to the deepest: [rows, depths]; the search
            # prices all of them at once per round (a Python loop over 32 rows x 20 depths per
            # round cost 4% of a 32-row step)
            depths = max(len(tokens) for tokens, _ in options)
            valid = np.zeros((len(states), depths), dtype=bool)  # [rows, depths]
            by_depth = np.zeros((3, len(states), depths))  # tokens, nodes, drafting seconds: [3, rows, depths]
            for r, (state, (tokens, nodes)) in enumerate(zip(states, options)):
                valid[r, :len(tokens)] = True
                by_depth[:, r, :len(tokens)] = (tokens, nodes, [state.price.drafting_seconds(d, state.counts.evidence)
                                                          for d in range(len(tokens))])
            row_tokens, row_nodes, row_costs = by_depth
            row_contexts = np.array(contexts, dtype=float)[:, None]  # [rows, 1]
            deeper = np.arange(depths)[None, :]  # [1, depths]
            picked = np.arange(len(states))
        while searching:
            at = np.array(chosen)
            added = row_nodes - row_nodes[picked, at][:, None]  # [rows, depths]
            candidates = ((tokens_total + row_tokens - row_tokens[picked, at][:, None])
                          / (price(positions + added, keys + added * row_contexts) * scale
                             + (draft_total + row_costs - row_costs[picked, at][:, None])))
            candidates[~valid | (deeper <= at[:, None])] = -np.inf
            best = int(np.argmax(candidates))  # the first of the best, rows then depths in order
            r, d = divmod(best, depths)
            if not candidates[r, d] > best_rate * (1 + 1e-9):
                break
            best_rate = float(candidates[r, d])
            (tokens, nodes) = options[r]
            added_here = nodes[d] - nodes[chosen[r]]
            tokens_total += tokens[d] - tokens[chosen[r]]
            positions += added_here
            keys += added_here * contexts[r]
            draft_total += float(row_costs[r, d] - row_costs[r, chosen[r]])
            chosen[r] = d
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
                miss = 1.0 - self.estimator.acceptances(state.counts, 1)[0]
                waits[r] = min(int(extra * miss * rows / (self.probe_share * step)), self.max_probe_gap)
        return waits

    def _plan_padded(self, states: list[SizingState], limits: list[int], others: int) -> None:
        """One depth ``W`` for all rows: the forward runs ``rows x (widest block)`` positions
        and every row drafts up to ``W`` (padding would cost as much)."""
        rows = len(states) + others
        top = max(self.top(state, limit) for state, limit in zip(states, limits))
        per_row = [self.estimator.expected(state.counts, self.top(state, limit)) for state, limit in zip(states, limits)]
        scale = sum(state.price.scale or 1.0 for state in states) / len(states)
        curve = states[0].price.curve
        best, best_rate = 0, 0.0
        for depth in range(top + 1):
            tokens = others + sum(row_tokens[min(depth, len(row_tokens) - 1)] for row_tokens, _ in per_row)
            widest = max(row_nodes[min(depth, len(row_nodes) - 1)] for _, row_nodes in per_row)
            drafting = sum(state.price.drafting_seconds(depth, state.counts.evidence) for state in states)
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
        if state.counts.ceiling >= state.counts.reach:  # watched drafts, asked deeper than it goes, showed the drafter's depth
            return min(limit, state.counts.ceiling)
        return min(limit, 2 * state.counts.reach + 1)

    def probe_depth(self, state: SizingState, limit: int) -> int:
        """The shallowest depth at which a fully accepted draft beats a plain step (drafting
        cost included): a shallower probe could never show that drafting pays (on a flat
        curve that is 1; on SmolLM2 Q4_0 under llama.cpp, 3: a block of 2 costs two steps).
        0 when no depth up to ``limit`` could pay: then there is nothing to probe for."""
        _, nodes = self.estimator.expected(state.counts, limit)
        seconds = self.seconds_of(state, nodes)
        return next((depth for depth in range(1, limit + 1) if (depth + 1) / seconds[depth] > 1.0 / seconds[0]), 0)

    def depth(self, state: SizingState, limit: int, evidence: int | None = None) -> int:
        if state.price.rows > 1 and state.cap is not None:  # a batch: the plan (which graded every row) chose
            state.chosen = min(state.cap, limit)
            if state.chosen:
                state.skipped = 0
            return state.chosen
        state.probing = False
        if evidence == 0:  # the drafter has nothing to propose (Drafter.evidence): a plain step, nothing to price
            state.counts.evidence, state.chosen = evidence, 0
            state.skipped += 1
            return 0
        self.estimator.grade(state.counts, evidence)
        if state.counts.reach is None and state.price.rows > 1:  # a batch plans once every row has drafted: see how deep
            state.chosen = limit
            return limit
        higher = evidence is not None and (state.counts.top_grade is None or evidence > state.counts.top_grade)
        if higher and state.counts.reach is not None and self.is_steep(state, limit):
            state.counts.top_grade, higher = evidence, False  # on a steep curve a better grade waits for a probe
        if state.counts.reach is None or higher:
            # nothing drafted yet (or evidence above any drafted so far): the prior's best, at least a probe's
            first = min(limit, FIRST_DEPTHS)
            rates = self.rates(state, first)
            best = max(range(len(rates)), key=lambda k: (rates[k], -k))
            if watches(state):
                state.chosen = best
            elif best or higher or state.probe_gap <= self.first_probe_gap:
                state.chosen = max(best, self.probe_depth(state, first))
            else:  # the generations before found no draft that pays and backed their probes off: so does this one
                state.skipped += 1
                probe = self.probe_depth(state, first) if state.skipped > state.probe_gap else 0
                state.chosen, state.probing = probe, bool(probe)
            return state.chosen
        top = self.top(state, limit)
        tokens, nodes = self.estimator.expected(state.counts, top)
        seconds = self.seconds_of(state, nodes)
        rates = [t / s for t, s in zip(tokens, seconds)]
        best = max(range(len(rates)), key=lambda k: (rates[k], -k))
        draw, cap = self.exploring(state, seconds)
        state.explored = False
        if draw:  # the optimistic (or pessimistic) view picks among depths a failure would not cost much
            hoped_tokens, _ = self.estimator.expected(state.counts, cap, draw)
            hopes = [t / s for t, s in zip(hoped_tokens, seconds)]
            hoped = max(range(len(hopes)), key=lambda k: (hopes[k], -k))
            if best <= cap and hopes[hoped] > hopes[best]:  # a deeper best stays
                state.explored, best = hoped > best, hoped
        if best == 0:
            state.skipped += 1
            # now and then a probe re-measures acceptance, as shallow as could show a gain
            probe = self.probe_depth(state, top) if top and not watches(state) else 0
            if probe and state.skipped > max(state.probe_gap, self.affordable_gap(state, probe)):
                best, state.probing = probe, True
        state.chosen = best
        return best

    def is_steep(self, state: SizingState, limit: int) -> bool:
        """Whether a failed probe costs more than a plain step (judged once a generation)."""
        if state.steep is None:
            probe = self.probe_depth(state, min(limit, FIRST_DEPTHS))
            plain = state.price.forward_seconds(1)
            state.steep = bool(probe) and state.price.forward_seconds(probe + 1) - plain > plain
        return state.steep

    def exploring(self, state: SizingState, seconds: list[float]) -> tuple[float, int]:
        """This step's exploration draw (normal, ``explore_scale`` wide) and the deepest depth
        it may choose: the depths whose failure costs at most one plain step more than a plain
        step (``seconds[k]``: a step drafting k deep; none on llama.cpp's steep CPU curve:
        then no draw, 0). No draw either while the state backs off after explorations that got
        nothing accepted (``SizingState.explore_wait``, counted down here)."""
        if not self.explore_scale:
            return 0.0, 0
        if state.explore_wait:  # backing off after explorations that got nothing
            state.explore_wait -= 1
            return 0.0, 0
        cap = max((k for k in range(1, len(seconds)) if seconds[k] <= 2 * seconds[0]), default=0)
        return (state.draws.gauss(0.0, self.explore_scale), cap) if cap else (0.0, 0)

    def observe(self, state: SizingState, tree: TokenTree, accepted: int, draft_seconds: float,
                verify_seconds: float) -> None:
        depths = tree.depths
        drafted = max(depths, default=0)
        state.price.observe_forward(len(tree) + 1, verify_seconds)
        if state.chosen and not drafted:  # no proposal (prompt lookup without a match): a plain step,
            # and the probe waits; but time passes, so old evidence fades as it would over a draft
            self.estimator.fade(state.counts)
        if state.explored:  # exploration's draft: nothing accepted doubles the wait for the next one
            state.explored = False
            state.explore_gap = 0 if accepted else min(max(2 * state.explore_gap, 1), self.max_probe_gap)
            state.explore_wait = state.explore_gap
            self.gaps = (self.gaps[0], state.explore_gap)
        if state.chosen == 0 or drafted == 0:
            return
        state.skipped = 0
        if state.probing:  # a failed probe doubles the wait for the next one
            state.probe_gap = self.first_probe_gap if accepted else min(2 * state.probe_gap, self.max_probe_gap)
            self.gaps = (state.probe_gap, self.gaps[1])
        nodes = [0] * drafted
        for depth in depths:
            nodes[depth - 1] += 1
        self.drafted(state, state.counts.evidence, nodes, draft_seconds)
        for depth in range(1, min(accepted + 1, drafted) + 1):  # depth d was tried where its parent was accepted
            self.estimator.tally(state.counts, state.counts.evidence, depth, accepted >= depth)

    def watch(self, state: SizingState, limit: int) -> int:
        if not watches(state) or state.chosen or state.counts.evidence == 0:
            return 0
        state.watch_asked = min(limit, FIRST_DEPTHS)
        return state.watch_asked

    def watched(self, state: SizingState, evidence: int | None, drafted: int, draft_seconds: float) -> None:
        if drafted and state.watch_asked == FIRST_DEPTHS:  # asked deeper than it goes: how deep it goes
            state.counts.ceiling = max(state.counts.ceiling, drafted)
        self.drafted(state, evidence, [1] * drafted, draft_seconds)

    def observe_hindsight(self, state: SizingState, evidence: int | None, depth: int, accepted: bool) -> None:
        self.estimator.tally(state.counts, evidence, depth, accepted)

    def share(self, state: SizingState, rows: int, positions: int | None = None, keys: int | None = None) -> None:
        state.price.share(rows, positions, keys)

    def drafted(self, state: SizingState, evidence: int | None, nodes: list[int], draft_seconds: float) -> None:
        """A draft of ``nodes[d - 1]`` nodes at depth d, graded ``evidence``, proposed in
        ``draft_seconds`` (verified or watched): how deep and wide the drafter goes, and what
        drafting costs."""
        if not nodes:
            return
        # a drafter's first proposal at a grade may catch up with the whole prompt (mixed's predictor
        # first runs at its grade): not a step's drafting cost
        first = evidence not in state.drafted_grades
        state.drafted_grades.add(evidence)
        self.estimator.drafted(state.counts, evidence, nodes)
        if not first:
            state.price.add_drafting(len(nodes), draft_seconds, evidence)
            self.drafting.add(len(nodes), draft_seconds, evidence)
