"""hasten's drafters inside vLLM: proposers for vLLM's ``custom_class`` speculative method.

::

    from vllm import LLM
    llm = LLM(model=..., speculative_config={
        "method": "custom_class", "model": "hasten.vllm.PromptLookup", "num_speculative_tokens": 15})

vLLM builds the class with its ``VllmConfig`` and, after every step, asks ``propose`` for each
running request's draft (an empty list: no draft this step); vLLM verifies the drafts with
its own rejection sampler, so its output stays its own plain decoding's. This module stays on
hasten's ground floor (``hasten.core``: no hasten model code, no transformers), so it loads in
vLLM's environment, which pins other versions (``make vllm`` installs hasten there without its
dependencies).

The proposers:

* :class:`PromptLookup`: hasten's ``prompt_lookup`` rule (:mod:`hasten.core.ngram`): the
  longest suffix of 3, 2, then 1 tokens found earlier in the request's tokens (prompt and
  output), its latest occurrence, and what followed it copied (cyclically where the match
  overlaps the suffix).
* :class:`Lookahead`: hasten's ``lookahead`` trie (:mod:`hasten.core.trie`) over the request's
  tokens; vLLM verifies chains, so the draft is the trie's likeliest chain.

Each request's depth is chosen by hasten's cost-aware sizing (:class:`hasten.core.sizing.CostAwareSize`)
from its own history: the acceptance at each depth, apart per grade of the drafter's evidence,
and vLLM's step cost, a line in the positions a step verifies, fitted from the time between
``propose`` calls (:class:`StepCost`). ``num_speculative_tokens`` is the deepest a draft may go;
0 (no draft) is allowed. :class:`FixedPromptLookup` and :class:`FixedLookahead` always draft as
deep as they can, as vLLM's own n-gram proposer does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from .core.cost import CostCurve
from .core.ngram import MAX_NGRAM, MIN_NGRAM, NO_MATCH, Match, NgramIndex, find
from .core.sizing import CostAwareSize, FixedSize, SizingRule, SizingState
from .core.tree import TokenTree
from .core.trie import NgramTrie, best_chain, evidence

# vLLM's step on a CPU (SmolLM2-135M, float32, 1 thread; docs/scale-out.md): each verified
# position adds about this share of a one-position step. The prior of StepCost's fit only:
# measured step times replace it as soon as the positions per step vary.
PRIOR_SLOPE = 0.025
PRIOR_WEIGHT = 2.0  # steps' worth
STEP_DECAY = 0.98  # step times forgotten over about 50 steps


class StepCost:
    """vLLM's step seconds as ``intercept + slope x positions`` (positions: the tokens the step
    verified, each row's sampled one and its draft), fitted by decayed least squares over
    measured steps and a prior: two pseudo-steps of ``PRIOR_WEIGHT`` each, at 1 and 17
    positions, whose times follow ``PRIOR_SLOPE`` scaled to the measured times."""

    def __init__(self, prior_slope: float = PRIOR_SLOPE):
        self.prior_slope = prior_slope
        self.sums = [0.0] * 5  # decayed [weight, sum p, sum p^2, sum t, sum p t]

    def add(self, positions: int, seconds: float) -> None:
        self.sums = [s * STEP_DECAY + v for s, v in
                     zip(self.sums, (1.0, positions, positions * positions, seconds, positions * seconds))]

    def curve(self) -> CostCurve:
        weight, p, pp, t, pt = self.sums
        # the prior's scale: the measured mean time, brought to one position by the prior's slope
        unit = t / (weight + self.prior_slope * (p - weight)) if weight > 0 else 1.0
        for at in (1.0, 17.0):
            time_at = unit * (1.0 + self.prior_slope * (at - 1.0))
            weight, p, pp, t, pt = (weight + PRIOR_WEIGHT, p + PRIOR_WEIGHT * at, pp + PRIOR_WEIGHT * at * at,
                                    t + PRIOR_WEIGHT * time_at, pt + PRIOR_WEIGHT * at * time_at)
        slope = max((weight * pt - p * t) / (weight * pp - p * p), 0.0)
        intercept = max((t - slope * p) / weight, 1e-9)
        return CostCurve((1, 2), (intercept + slope, intercept + 2 * slope))


@dataclass
class Request:
    """One request's state in a batch row."""

    tokens: list[int]  # its tokens at the last ``propose``
    drafter: Any  # the drafter's own state (an n-gram index, a trie)
    sizing: Any  # the sizing rule's state (SizingState for cost-aware sizing)
    proposed: int = 0  # draft tokens proposed at the last step
    draft_seconds: float = 0.0  # what proposing them took
    fresh: bool = True  # its first step: the step before it was its prompt's prefill
    found: tuple | None = None  # (tokens, match) of the drafter's last lookup


class Proposer:
    """vLLM's proposer protocol around one of hasten's drafting rules (subclasses say which:
    ``start``, ``grade``, ``draft``) and a sizing rule (``default_rule``). vLLM builds it with
    its ``VllmConfig``; tests may give ``depth`` and ``max_model_len`` instead."""

    def __init__(self, vllm_config=None, *, depth: int = 0, max_model_len: int = 0, rule: SizingRule | None = None):
        if vllm_config is not None:
            depth = int(vllm_config.speculative_config.num_speculative_tokens)
            max_model_len = int(vllm_config.model_config.max_model_len)
        self.depth, self.max_model_len = depth, max_model_len  # the deepest draft; the context
        self.rule = rule or self.default_rule()
        self.cost = StepCost()
        self.rows: dict[int, Request] = {}  # batch row -> its request
        self.last_end: float | None = None  # when the last propose returned
        self.clock = time.perf_counter  # seconds (tests give their own)

    def default_rule(self) -> SizingRule:
        """hasten's cost-aware rule without exploration draws: on vLLM's nearly flat step cost
        every depth is cheap enough to explore, and the draws cost more than they found
        (replayed on SmolLM2's Spec-Bench outputs at 1 to 5% of a step per position, drafting up
        to 10: 1.49x plain decoding with no draws against 1.46x with them and 1.47x for a fixed
        5; docs/scale-out.md). ``begin`` needs a curve: StepCost's fit replaces it every step."""
        return CostAwareSize(curve=CostCurve.flat(), explore_scale=0.0)

    # the drafting rule ----------------------------------------------------------------------------
    def start(self, tokens: list[int]) -> Any:
        """The drafter's state for a new request."""
        raise NotImplementedError

    def grade(self, request: Request) -> int:
        """The class of this step's evidence (:meth:`hasten.drafters.base.Drafter.evidence`)."""
        raise NotImplementedError

    def draft(self, request: Request, depth: int) -> list[int]:
        """At most ``depth`` tokens to follow ``request.tokens``."""
        raise NotImplementedError

    # vLLM's protocol ------------------------------------------------------------------------------
    def load_model(self, *args, **kwargs) -> None:
        """No model: the drafts come from the request's own tokens."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """Each request's draft: ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` are row ``i``'s
        tokens so far (numpy), ``sampled_token_ids[i]`` what row ``i`` sampled this step (the
        accepted draft tokens and one more; empty while it is still prefilling). A row with no
        room left gets no draft."""
        began = self.clock()
        requests = [self.request(row, sampled, int(num_tokens_no_spec[row]), token_ids_cpu)
                    for row, sampled in enumerate(sampled_token_ids)]
        self.time_step(began, requests)
        running = [r for r in requests if r is not None]
        curve = self.cost.curve()
        drafts = []
        for request in requests:
            if request is None:
                drafts.append([])
                continue
            clock = self.clock()
            if isinstance(request.sizing, SizingState):
                request.sizing.curve = curve
                self.rule.share(request.sizing, len(running))
            room = min(self.depth, self.max_model_len - len(request.tokens))
            depth = self.rule.depth(request.sizing, room, self.grade(request)) if room > 0 else 0
            draft = self.draft(request, depth)[:depth] if depth > 0 else []
            request.proposed, request.draft_seconds = len(draft), self.clock() - clock
            drafts.append(draft)
        self.last_end = self.clock()
        return drafts

    def request(self, row: int, sampled: list[int], length: int, token_ids_cpu) -> Request | None:
        """Row ``row``'s request, told what its last draft earned; None while it prefills.
        Rows move between requests, so a row's state is kept only while its tokens still
        start with the ones it saw."""
        if not sampled:
            self.rows.pop(row, None)
            return None
        tokens = token_ids_cpu[row, :length].tolist()
        known = self.rows.get(row)
        if known is None or len(known.tokens) >= len(tokens) or tokens[: len(known.tokens)] != known.tokens:
            known = self.rows[row] = Request(tokens, self.start(tokens), self.rule.begin(None))
            return known
        accepted = min(len(sampled) - 1, known.proposed)
        self.rule.observe(known.sizing, TokenTree.chain(known.proposed), accepted, known.draft_seconds, 0.0)
        known.tokens, known.fresh = tokens, False
        return known

    def time_step(self, began: float, requests: list[Request | None]) -> None:
        """The step that just ran, into the cost fit: only when every row was decoding (a
        prefill, a row's first step after its prompt, or time between ``generate`` calls
        would be counted as verification)."""
        if self.last_end is None or not requests or any(r is None or r.fresh for r in requests):
            return
        self.cost.add(sum(1 + r.proposed for r in requests), began - self.last_end)


class PromptLookup(Proposer):
    """hasten's prompt lookup as a vLLM proposer, sized per request
    (``speculative_config["model"] = "hasten.vllm.PromptLookup"``)."""

    sizes = range(MAX_NGRAM, MIN_NGRAM - 1, -1)  # longest first

    def start(self, tokens: list[int]) -> NgramIndex:
        return NgramIndex(self.sizes)

    def lookup(self, request: Request) -> Match | None:
        """This step's match (found once a step: ``grade`` and ``draft`` both ask)."""
        if request.found is None or request.found[0] != len(request.tokens):
            request.drafter.extend(request.tokens)
            request.found = (len(request.tokens), find(request.tokens, [(request.drafter, request.tokens)]))
        return request.found[1]

    def grade(self, request: Request) -> int:
        match = self.lookup(request)
        return NO_MATCH if match is None else match.evidence

    def draft(self, request: Request, depth: int) -> list[int]:
        match = self.lookup(request)
        return [] if match is None else match.copy(depth)


class Lookahead(Proposer):
    """hasten's lookahead trie as a vLLM proposer: its likeliest chain, sized per request
    (``"hasten.vllm.Lookahead"``). Windows of ``max_prefix + depth`` tokens of the request."""

    max_prefix, min_prefix = 3, 1  # hasten's LookaheadSettings defaults

    def start(self, tokens: list[int]) -> NgramTrie:
        return NgramTrie(self.max_prefix + self.depth)

    def grade(self, request: Request) -> int:
        return evidence(*request.drafter.anchor(request.tokens, self.max_prefix, self.min_prefix))

    def draft(self, request: Request, depth: int) -> list[int]:
        anchor, _ = request.drafter.anchor(request.tokens, self.max_prefix, self.min_prefix)
        return [] if anchor is None else best_chain(anchor, depth)


class FixedPromptLookup(PromptLookup):
    """:class:`PromptLookup` drafting as deep as it can every step (``num_speculative_tokens``)."""

    def default_rule(self) -> SizingRule:
        return FixedSize()


class FixedLookahead(Lookahead):
    """:class:`Lookahead` drafting as deep as it can every step."""

    def default_rule(self) -> SizingRule:
        return FixedSize()
