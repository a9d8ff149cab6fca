"""What drafts get accepted: the acceptance estimate that cost-aware sizing plans with.

Per generation, an :class:`AcceptanceCounts` holds decayed trials and hits per depth, apart for each
class of the drafter's own evidence (``Drafter.evidence``: prompt lookup grades a draft by the
length of its match), and the shape of the drafts seen (how deep, how many nodes per depth). The
:class:`AcceptanceEstimator` turns counts into ``a_d`` = P(depth d accepted | depth d drafted and
depth d - 1 accepted), each with a prior worth ``prior_weight`` steps, and pools what every
generation it estimated for has measured: a new generation's prior (a server's rows are short,
and the rows before them saw the same drafter on the same model). Verified drafts and watched ones
(hindsight: drafted on a plain step, compared with what gets committed) count alike.

Nothing here prices a step (:mod:`hasten.core.pricing`) or picks a depth (:mod:`hasten.core.sizing`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import zip_longest


@dataclass
class AcceptanceCounts:
    """One generation's measurements (counts decay, so the estimate follows drift within a generation)."""

    # per evidence class (None: the drafter does not grade its drafts), index d - 1: steps that
    # drafted depth d with d - 1 accepted, and of those, the steps that accepted depth d
    trials_by: dict[int | None, list[float]] = field(default_factory=dict)
    hits_by: dict[int | None, list[float]] = field(default_factory=dict)
    evidence: int | None = None  # the class of the step under way
    top_grade: int | None = None  # the highest evidence class drafted so far
    floor: list[float] = field(default_factory=list)  # per depth: the best estimate of a lower class (see grade)
    width: list[float] = field(default_factory=list)  # index d - 1: mean nodes at depth d when drafted
    reach: int | None = None  # deepest depth the drafter has drafted (None: not yet known)
    most_nodes: int = 0  # largest draft seen: drafters with a node budget never exceed it, however deep
    # per evidence class, per depth: the acceptance the generations before this one measured
    # (the estimator's pool when it began), its prior in place of the fixed guess
    prior_by: dict[int | None, list[float]] = field(default_factory=dict)
    ceiling: int = 0  # the deepest watched draft asked deeper than the drafter goes: how deep it goes

    @property
    def trials(self) -> list[float]:
        """The current evidence class's trials per depth."""
        return self.trials_by.setdefault(self.evidence, [])

    @property
    def hits(self) -> list[float]:
        return self.hits_by.setdefault(self.evidence, [])


class AcceptanceEstimator:
    """Acceptance per depth from counts, a prior, and the pool of every generation before.

    ``prior``: the guess at depth 1 before anything is measured; ``prior_weight``: how many steps
    it weighs; ``decay``: how fast a generation's counts fade; ``pool_decay``: how fast the pool's."""

    def __init__(self, prior: float = 0.5, prior_weight: float = 1.0, decay: float = 0.9, pool_decay: float = 0.999):
        self.prior, self.prior_weight, self.decay, self.pool_decay = prior, prior_weight, decay, pool_decay
        self.pool_trials: dict[int | None, list[float]] = {}
        self.pool_hits: dict[int | None, list[float]] = {}

    def begin(self) -> AcceptanceCounts:
        """A new generation's counts, whose prior is what the pool measured so far."""
        return AcceptanceCounts(prior_by={evidence: self.pooled(evidence) for evidence in self.pool_trials})

    def acceptances(self, counts: AcceptanceCounts, deepest: int, optimism: float = 0.0) -> list[float]:
        """a_1 .. a_deepest, each with a prior worth ``prior_weight`` steps: ``prior`` at depth
        1, deeper the larger of ``prior`` and the estimate one level up (once a draft has
        matched for a while, the next token tends to match as well, so unexplored depths get
        tried). Real counts decay and the prior does not, so a drafter that is never right
        keeps an estimate of ``prior * prior_weight / (prior_weight + 1 / (1 - decay))``
        (0.045 by default). The prior weighs one step: where only a deep, mostly accepted draft
        pays (a steep cost curve), one fully accepted draft must be enough to start drafting, or
        a copy stretch is over before the rule believes in it. ``optimism``: each estimate moves
        by that many of its standard deviations (exploration)."""
        found, prior, floor = [], self.prior, counts.floor
        certainty = self.prior_weight
        measured_trials, measured_hits = counts.trials, counts.hits
        pooled = counts.prior_by.get(counts.evidence, ())
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
        """Per depth, the acceptance every generation measured for ``evidence`` (depths tried at
        least once in all). A generation takes them as its prior when it begins (its own counts
        never feed its own prior)."""
        trials, hits = self.pool_trials.get(evidence, ()), self.pool_hits.get(evidence, ())
        found = []
        for t, h in zip(trials, hits):
            if t < 1.0:
                break
            found.append((h + self.prior * self.prior_weight) / (t + self.prior_weight))
        return found

    def grade(self, counts: AcceptanceCounts, evidence: int | None) -> None:
        """Make ``evidence`` the current class; its prior at each depth becomes at least the
        best estimate of any lower class measured there (computed once a step)."""
        counts.evidence = evidence
        counts.floor = []
        if evidence is None:
            return
        for grade, trials in counts.trials_by.items():
            if grade is not None and grade < evidence:
                hits = counts.hits_by[grade]
                measured = [(h + self.prior * self.prior_weight) / (t + self.prior_weight) if t > 0 else 0.0
                            for t, h in zip(trials, hits)]
                counts.floor = [max(a, b) for a, b in zip_longest(counts.floor, measured, fillvalue=0.0)]

    def expected(self, counts: AcceptanceCounts, deepest: int, optimism: float = 0.0) -> tuple[list[float], list[float]]:
        """For k = 0 .. ``deepest``: the expected tokens a step commits drafting k deep, and
        the draft nodes it verifies (for trees, the nodes at each depth are a decaying mean of
        the drafts seen, capped by the largest draft: drafters with a node budget spend it
        whatever the depth)."""
        tokens, survive, nodes = [1.0], 1.0, [0.0]
        count = 0.0
        for d, accept in enumerate(self.acceptances(counts, deepest, optimism), start=1):
            survive *= accept
            tokens.append(tokens[-1] + survive)
            count += counts.width[d - 1] if d <= len(counts.width) else (counts.width[-1] if counts.width else 1.0)
            nodes.append(min(count, max(counts.most_nodes, d)))
        return tokens, nodes

    def drafted(self, counts: AcceptanceCounts, evidence: int | None, nodes: list[int]) -> None:
        """A draft of ``nodes[d - 1]`` nodes at depth d, graded ``evidence`` (verified or
        watched): how deep and wide the drafter goes; every depth drafted is counted, tried or not."""
        drafted = len(nodes)
        counts.reach = max(counts.reach or 0, drafted)
        if evidence is not None:
            counts.top_grade = evidence if counts.top_grade is None else max(counts.top_grade, evidence)
        counts.most_nodes = max(counts.most_nodes, sum(nodes))
        for counted in (counts.trials_by, counts.hits_by, self.pool_trials, self.pool_hits):
            found = counted.setdefault(evidence, [])
            found.extend([0.0] * (drafted - len(found)))
        for d, count in enumerate(nodes, start=1):
            if len(counts.width) < d:
                counts.width.append(float(count))
            counts.width[d - 1] = 0.8 * counts.width[d - 1] + 0.2 * count

    def tally(self, counts: AcceptanceCounts, evidence: int | None, depth: int, accepted: bool) -> None:
        """Depth ``depth`` of a draft graded ``evidence`` was tried (its parent accepted) and
        ``accepted`` or not: into the class's trials and hits, and the pool."""
        hit = 1.0 if accepted else 0.0
        for trials, hits, decay in ((counts.trials_by.setdefault(evidence, []), counts.hits_by.setdefault(evidence, []),
                                     self.decay),
                                    (self.pool_trials.setdefault(evidence, []), self.pool_hits.setdefault(evidence, []),
                                     self.pool_decay)):
            if len(trials) < depth:
                trials.extend([0.0] * (depth - len(trials)))
                hits.extend([0.0] * (depth - len(hits)))
            trials[depth - 1] = trials[depth - 1] * decay + 1.0
            hits[depth - 1] = hits[depth - 1] * decay + hit

    def fade(self, counts: AcceptanceCounts) -> None:
        """A step that meant to draft but got no proposal: time passes, so the current class's
        evidence fades as it would over a draft."""
        counts.trials[:] = [trials * self.decay for trials in counts.trials]
        counts.hits[:] = [hits * self.decay for hits in counts.hits]
