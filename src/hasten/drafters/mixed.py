"""Copy where the text repeats, predict where it does not: one draft tree holding a retrieval
drafter's copy and a trained drafter's guess, verified in one forward (the idea of SAM-Decoding,
Hu et al. 2024: retrieval where a suffix of the text matches, a trained drafter where none does).

``mixed`` holds two drafters, each with its own per-generation state:

* ``retrieval`` (prompt lookup by default): the text after the latest earlier occurrence of the
  newest tokens, in the prompt or the answer so far;
* ``predictor`` (EAGLE-3 by default; any trained feature drafter): its guess from the target's
  hidden states.

Each step the retrieval grades its match (its evidence). Without a match the draft is the
predictor's alone, graded 1; with a short one (graded below ``guess_below``), the copy is the
tree's first branch and the predictor's guess the second, merged where they agree
(:meth:`Draft.union`); a longer match, whose copy is accepted far more often, is drafted alone,
without the predictor's cost. A step with a copy is graded by the match, one up (2 and up). The draft planner keeps each grade's acceptance apart, so it learns what the predictor's
guesses are worth on their own (math, QA, open conversation) separately from copies (RAG,
summaries, edits), and sizes each step by its grade. Both drafts are deterministic (point
masses), so the verifier's recursive rejection over the tree keeps sampling exact.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from ..core.settings import Settings
from .base import REGISTRY, Draft, DraftContext, Drafter, StepResult, TargetView, register
from .trained import TrainedDrafter

PREDICTOR_ONLY = 1  # the grade of a draft without a copy: the predictor's guess alone


@dataclass(frozen=True)
class MixedSettings(Settings):
    retrieval: str = "prompt_lookup"  # a drafter that copies and needs nothing of the target (prompt_lookup, suffix)
    predictor: str = "eagle3"  # a trained feature drafter (eagle3, eagle, medusa, chimera)
    weights: str | None = None  # the predictor's weights directory (None: beside the target, or shipped in the zoo)
    require_weights: bool = False  # True: a predictor without weights is an error, not an untrained drafter
    # the predictor guesses beside copies the retrieval grades below this (prompt lookup: 0 no match, 1 a
    # short one, 2 medium, 3 long); a copy graded this or higher is drafted alone, where it is surest
    guess_below: int = 2


@dataclass
class MixedState:
    retrieval: Any
    predictor: Any


@register
class Mixed(Drafter):
    name = "mixed"
    Settings = MixedSettings
    needs = TrainedDrafter.needs  # the predictor's: the target's features and its lent LM head
    encoder_decoder_ok = False

    def __init__(self, settings=None, **kwargs):
        super().__init__(settings, **kwargs)
        s = self.settings
        retrieval, predictor = REGISTRY.get(s.retrieval), REGISTRY.get(s.predictor)
        if retrieval is None or retrieval.needs or retrieval.needs_draft_model:
            raise ValueError(f"mixed: retrieval {s.retrieval!r} must be a drafter that copies from the text alone "
                             "(prompt_lookup or suffix), reading neither the target nor a draft model")
        if predictor is None or not issubclass(predictor, TrainedDrafter) or not predictor.needs <= self.needs:
            raise ValueError(f"mixed: predictor {s.predictor!r} must be a trained feature drafter "
                             "(eagle3, eagle, medusa or chimera)")
        self.retrieval: Drafter = retrieval()
        self.predictor: TrainedDrafter = predictor(weights=s.weights, require_weights=s.require_weights)

    def check_target(self, target: TargetView) -> None:
        self.retrieval.check_target(target)
        self.predictor.check_target(target)

    def begin(self, ctx: DraftContext) -> MixedState:
        with acting(ctx, None):
            retrieval = self.retrieval.begin(ctx)
        with acting(ctx, None):
            predictor = self.predictor.begin(ctx)
        return MixedState(retrieval, predictor)

    def evidence(self, ctx: DraftContext) -> int | None:
        with acting(ctx, ctx.state.retrieval):
            grade = self.retrieval.evidence(ctx)
        if grade is None:
            return None
        return PREDICTOR_ONLY if grade == 0 else grade + 1

    def propose(self, ctx: DraftContext) -> Draft:
        return self.propose_rows([ctx])[0]

    def propose_rows(self, ctxs: list[DraftContext]) -> list[Draft]:
        """Each row's copy; the predictor guesses for the rows whose copy is not sure enough alone,
        all of them together (its :meth:`~Drafter.propose_rows`)."""
        copies: list[Draft] = []
        guessing: list[int] = []
        for index, ctx in enumerate(ctxs):
            with acting(ctx, ctx.state.retrieval):
                grade = self.retrieval.evidence(ctx)  # remembered by the retrieval for these tokens: cheap
                copies.append(self.retrieval.propose(ctx))
            if grade is None or grade < self.settings.guess_below or not len(copies[-1]):
                guessing.append(index)
        if guessing:
            with ExitStack() as stack:
                for index in guessing:
                    stack.enter_context(acting(ctxs[index], ctxs[index].state.predictor))
                guesses = self.predictor.propose_rows([ctxs[index] for index in guessing])
            for index, guess in zip(guessing, guesses):
                copies[index] = copies[index].union(guess)
        return copies

    def observe(self, ctx: DraftContext, result: StepResult) -> None:
        state = ctx.state
        with acting(ctx, state.retrieval):
            self.retrieval.observe(ctx, result)
        with acting(ctx, state.predictor):
            self.predictor.observe(ctx, result)

    def end(self, ctx: DraftContext) -> None:
        state = ctx.state
        with acting(ctx, state.retrieval):
            self.retrieval.end(ctx)
        with acting(ctx, state.predictor):
            self.predictor.end(ctx)

    def hindsight_from(self) -> int | None:
        """A copy drafted alone (graded ``guess_below`` + 1 and up) is the retrieval's lookup: cheap;
        below, a proposal runs the predictor."""
        return self.settings.guess_below + 1 if self.retrieval.hindsight_from() == 0 else None

    def drafts_without_prompt_features(self) -> bool:
        return self.predictor.drafts_without_prompt_features()

    def deepest(self) -> int | None:
        depths = (self.retrieval.deepest(), self.predictor.deepest())
        return None if None in depths else max(depths)

    @property
    def pool(self):
        return self.retrieval.pool

    def cache_bytes(self, state: MixedState) -> int | None:
        return self.predictor.cache_bytes(state.predictor)


@contextmanager
def acting(ctx: DraftContext, state: Any) -> Iterator[None]:
    """``ctx`` as one of the two drafters sees it: its own state in ``ctx.state``."""
    mine = ctx.state
    ctx.state = state
    try:
        yield
    finally:
        ctx.state = mine
