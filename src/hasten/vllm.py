"""hasten's drafters inside vLLM: proposers for vLLM's ``custom_class`` speculative method.

::

    from vllm import LLM
    llm = LLM(model=..., speculative_config={
        "method": "custom_class", "model": "hasten.vllm.Suffix", "num_speculative_tokens": 10})

vLLM builds the class with its ``VllmConfig`` and, after every step, asks ``propose`` for each
running request's draft (an empty list: no draft this step); vLLM verifies the drafts with
its own rejection sampler, so its output stays its own plain decoding's.

Every proposer is one adapter, :class:`Proposer`, around one of hasten's real drafters (the
same class ``hasten generate`` and ``hasten serve`` run, not a copy): it keeps each running
request's :class:`~hasten.drafters.base.DraftContext`, calls the drafter's ``begin``,
``evidence``, ``propose``, ``observe`` and ``end`` as hasten's decode loop does, and hands vLLM
the draft's main chain (vLLM verifies chains). The drafters it wraps need no model, and this
module imports none: the drafters and the ground floor (``hasten.core``) only, never
``hasten.models`` or transformers, so it loads in vLLM's environment, which pins other
versions (``make vllm`` installs hasten there without its dependencies).

* :class:`PromptLookup`: hasten's ``prompt_lookup``;
* :class:`Lookahead`: hasten's ``lookahead`` with its pool, shared by every request the vLLM
  engine runs;
* :class:`Suffix`: hasten's ``suffix``, its global tree shared likewise, drafting paths as
  vLLM's own ``suffix`` method does (the same reference algorithm, the same defaults).

vLLM reuses batch rows: a row's request is recognised by its tokens (those it had, plus
exactly what it sampled since), followed when vLLM moves it to another row, and ended
(``Drafter.end``: a pooled drafter keeps its output once) when it leaves the batch.

Each request's depth is chosen by hasten's cost-aware sizing (:class:`hasten.core.sizing.CostAwareSize`)
from its own history: the acceptance at each depth, apart per grade of the drafter's evidence,
and vLLM's step cost, a line in the positions a step verifies, fitted from the time between
``propose`` calls (:class:`StepCost`). ``num_speculative_tokens`` is the deepest a draft may go;
0 (no draft) is allowed. The ``Fixed*`` proposers always draft as deep as they can, as vLLM's
own n-gram and suffix proposers do.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar

from .core.cost import CostCurve
from .core.sampling import Sampling
from .core.sizing import CostAwareSize, FixedSize, SizingRule, SizingState
from .core.tree import TokenTree
from .drafters.base import DraftContext, Drafter, StepResult, TargetView
from .drafters.lookahead import Lookahead as LookaheadDrafter
from .drafters.prompt_lookup import PromptLookup as PromptLookupDrafter
from .drafters.suffix import Suffix as SuffixDrafter

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


class VllmTarget:
    """What a drafter's :class:`~hasten.drafters.base.TargetView` reads of the target inside
    vLLM: its vocabulary. The drafters wrapped here need nothing more (``needs`` empty)."""

    encoder_decoder = False
    kv_readable = False
    cache_length = 0

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size


@dataclass
class FollowedRequest:
    """A running vLLM request, followed from row to row (:meth:`Proposer.follow`): its drafting
    context (tokens, the drafter's state) and sizing."""

    ctx: DraftContext
    sizing: Any  # the sizing rule's state (SizingState for cost-aware sizing)
    proposed: int = 0  # draft tokens proposed at the last step
    draft_seconds: float = 0.0  # what proposing them took
    fresh: bool = True  # its first step: the step before it was its prompt's prefill

    @property
    def tokens(self) -> list[int]:
        return self.ctx.tokens


class Proposer:
    """vLLM's proposer protocol around one of hasten's drafters (``drafter_class``, built with
    ``settings(depth)``) and a sizing rule (``default_rule``). vLLM builds it with its
    ``VllmConfig``; tests may give ``depth``, ``max_model_len`` and a ``drafter`` instead."""

    drafter_class: ClassVar[type[Drafter]]

    def __init__(self, vllm_config=None, *, depth: int = 0, max_model_len: int = 0, rule: SizingRule | None = None,
                 drafter: Drafter | None = None):
        vocab_size, source = 1 << 31, ""
        if vllm_config is not None:
            depth = int(vllm_config.speculative_config.num_speculative_tokens)
            model_config = vllm_config.model_config
            max_model_len = int(model_config.max_model_len)
            if callable(getattr(model_config, "get_vocab_size", None)):
                vocab_size = int(model_config.get_vocab_size())
            source = str(getattr(model_config, "model", "") or "")
        self.depth, self.max_model_len = depth, max_model_len  # the deepest draft; the context
        self.drafter = drafter or self.drafter_class(**self.settings(depth))
        if self.drafter.needs:
            raise ValueError(f"{self.drafter.name} needs {sorted(map(str, self.drafter.needs))}, which vLLM's "
                             "custom proposers cannot lend")
        self.view = TargetView(VllmTarget(vocab_size), frozenset(), source)
        self.rule = rule or self.default_rule()
        self.cost = StepCost()
        self.rows: dict[int, FollowedRequest] = {}  # batch row -> its request
        self.last_end: float | None = None  # when the last propose returned
        self.clock = time.perf_counter  # seconds (tests give their own)

    def settings(self, depth: int) -> dict:
        """The drafter's settings for drafts at most ``depth`` deep (its own defaults otherwise)."""
        return {}

    def default_rule(self) -> SizingRule:
        """hasten's cost-aware rule without exploration draws: on vLLM's nearly flat step cost
        every depth is cheap enough to explore, and the draws cost more than they found (the
        replays: docs/scale-out.md). ``begin`` needs a curve: StepCost's fit replaces it every step."""
        return CostAwareSize(curve=CostCurve.flat(), explore_scale=0.0)

    # ---- vLLM's protocol ----------------------------------------------------------------------
    def load_model(self, *args, **kwargs) -> None:
        """No model: the drafts come from the requests' own tokens (and the drafter's pool)."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """Each request's draft: ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` are row ``i``'s
        tokens so far (numpy), ``sampled_token_ids[i]`` what row ``i`` sampled this step (the
        accepted draft tokens and one more; empty while it is still prefilling). A row with no
        room left gets no draft."""
        began = self.clock()
        requests = self.follow(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
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
                request.sizing.price.curve = curve
                self.rule.share(request.sizing, len(running))
            ctx = request.ctx
            room = min(self.depth, self.max_model_len - len(ctx.tokens))
            depth = self.rule.depth(request.sizing, room, self.drafter.evidence(ctx)) if room > 0 else 0
            draft: list[int] = []
            if depth > 0:
                ctx.max_depth = depth
                draft = list(self.drafter.propose(ctx).main_chain(depth).tokens)
            request.proposed, request.draft_seconds = len(draft), self.clock() - clock
            drafts.append(draft)
        self.last_end = self.clock()
        return drafts

    # ---- requests in rows -----------------------------------------------------------------------
    def follow(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu) -> list[FollowedRequest | None]:
        """Each row's request (None while it prefills), told what its last draft earned. A row's
        request is the one whose tokens these extend by exactly what it sampled (vLLM may move
        a request to another row); a row with none starts a new request, and a request no row
        holds any more has ended."""
        before, self.rows = self.rows, {}
        unclaimed = {id(request): request for request in before.values()}
        requests: list[FollowedRequest | None] = []
        for row, sampled in enumerate(sampled_token_ids):
            if not sampled:  # prefilling (or not scheduled): it keeps its request, if it had one
                held = before.get(row)
                if held is not None and id(held) in unclaimed:
                    self.rows[row] = unclaimed.pop(id(held))
                requests.append(None)
                continue
            tokens = token_ids_cpu[row, : int(num_tokens_no_spec[row])].tolist()
            request = self.claim(tokens, len(sampled), before.get(row), unclaimed)
            if request is None:
                request = self.start(tokens, len(sampled))
            self.rows[row] = request
            requests.append(request)
        for request in unclaimed.values():
            self.drafter.end(request.ctx)
        return requests

    def claim(self, tokens: list[int], sampled: int, held: FollowedRequest | None,
              unclaimed: dict[int, FollowedRequest]) -> FollowedRequest | None:
        """The running request ``tokens`` continue (the row's own first, then any other), told
        what its last draft earned; None for a new request."""
        candidates = ([held] if held is not None else []) + list(unclaimed.values())
        for request in candidates:
            known = request.tokens
            if id(request) in unclaimed and len(tokens) - len(known) == sampled and tokens[: len(known)] == known:
                del unclaimed[id(request)]
                accepted = min(sampled - 1, request.proposed)
                self.rule.observe(request.sizing, TokenTree.chain(request.proposed), accepted, request.draft_seconds,
                                  0.0)
                request.ctx.tokens = tokens
                self.drafter.observe(request.ctx, StepResult(request.proposed, accepted, request.proposed))
                request.fresh = False
                return request
        return None

    def start(self, tokens: list[int], sampled: int) -> FollowedRequest:
        """A new request: its prompt is what it had before its first sampled tokens."""
        ctx = DraftContext(tokens[: len(tokens) - sampled], 0, Sampling(), None, self.view)
        ctx.state = self.drafter.begin(ctx)
        ctx.tokens = tokens
        return FollowedRequest(ctx, self.rule.begin(None))

    def time_step(self, began: float, requests: list[FollowedRequest | None]) -> None:
        """The step that just ran, into the cost fit: only when every row was decoding (a
        prefill, a row's first step after its prompt, or time between ``generate`` calls
        would be counted as verification)."""
        if self.last_end is None or not requests or any(r is None or r.fresh for r in requests):
            return
        self.cost.add(sum(1 + r.proposed for r in requests), began - self.last_end)


class PromptLookup(Proposer):
    """hasten's ``prompt_lookup``, sized per request (``"hasten.vllm.PromptLookup"``)."""

    drafter_class = PromptLookupDrafter

    def settings(self, depth: int) -> dict:
        return {"num_tokens": max(depth, 1)}


class Lookahead(Proposer):
    """hasten's ``lookahead`` with its pool, shared by every request of the engine, its branches
    as deep as vLLM drafts (``"hasten.vllm.Lookahead"``)."""

    drafter_class = LookaheadDrafter

    def settings(self, depth: int) -> dict:
        return {"branch_length": max(depth, 1)}


class Suffix(Proposer):
    """hasten's ``suffix``, its global tree shared by every request of the engine, drafting the
    likeliest path as vLLM's own suffix method does (``"hasten.vllm.Suffix"``)."""

    drafter_class = SuffixDrafter

    def settings(self, depth: int) -> dict:
        return {"max_spec_tokens": max(depth, 1), "tree_spec": False}


class FixedPromptLookup(PromptLookup):
    """:class:`PromptLookup` drafting as deep as it can every step (``num_speculative_tokens``)."""

    def default_rule(self) -> SizingRule:
        return FixedSize()


class FixedLookahead(Lookahead):
    """:class:`Lookahead` drafting as deep as it can every step."""

    def default_rule(self) -> SizingRule:
        return FixedSize()


class FixedSuffix(Suffix):
    """:class:`Suffix` drafting as deep as its match allows every step, as vLLM's suffix method."""

    def default_rule(self) -> SizingRule:
        return FixedSize()
