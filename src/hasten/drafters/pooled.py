"""What the drafters that learn across generations (``lookahead``, ``suffix``) share: the pool's
lifecycle, written once.

``shared=True`` keeps one pool on the drafter object: an :class:`~hasten.api.Engine`'s
generations and every row of ``hasten serve`` learn from each other's output (never from each
other's prompts). ``shared=False`` starts every generation on a private pool of its own, as a
drafter that forgets between requests would. A generation that may not read the shared pool
(``DraftContext.reads_pool`` False) drafts from a private pool too; one that may still write to
it (``use_pool`` True) hands its output to the shared pool when it ends (``learn_into``).

A ``corpus`` is learned, as if generated, before the first draft: into the shared pool once
(under a lock, whichever generation comes first), into every private pool as it is made.

A subclass says how its pools are built (:meth:`new_pool`, :meth:`private_pool`) and what
state a generation keeps (:attr:`State`); its pool implements ``start``, ``extend``, ``end``,
``feed`` and ``learn`` (:class:`~hasten.core.pool.Pool`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from ..core.pool import Pool
from .base import DraftContext, Drafter
from .corpus import corpus_ids


@dataclass
class PooledState:
    pool: Pool  # what the generation drafts from
    place: Any  # the generation's place in that pool (what ``pool.start`` returned)
    learn_into: Pool | None = None  # the shared pool its output goes to at the end, when it drafts from its own
    prompt_length: int = 0


class PooledDrafter(Drafter):
    """A drafter whose generations draft from a pool (see the module)."""

    State: ClassVar[type[PooledState]] = PooledState

    def __init__(self, settings=None, **kwargs):
        super().__init__(settings, **kwargs)
        self._shared = self.new_pool() if self.settings.shared else None
        self._corpus_lock = threading.Lock()
        self._corpus_fed = False

    def new_pool(self) -> Pool:
        """A pool as the settings ask (the shared one)."""
        raise NotImplementedError

    def private_pool(self) -> Pool:
        """The pool of a generation that does not read the shared one."""
        return self.new_pool()

    @property
    def pool(self) -> Pool | None:
        return self._shared

    def begin(self, ctx: DraftContext) -> PooledState:
        reads = self._shared is not None and ctx.reads_pool
        pool = self._shared if reads else self.private_pool()
        if self.settings.corpus:
            self._feed_corpus(pool, ctx, once=reads)
        prompt = ctx.source if ctx.source else ctx.tokens  # an encoder-decoder's prompt is its source
        learn_into = self._shared if self._shared is not None and ctx.use_pool and not reads else None
        return self.State(pool, pool.start(list(prompt), fed=len(ctx.tokens)), learn_into, len(ctx.tokens))

    def _feed_corpus(self, pool: Pool, ctx: DraftContext, once: bool) -> None:
        corpus = corpus_ids(self.settings.corpus, ctx.target.source)
        if not once:
            pool.feed(corpus)
            return
        with self._corpus_lock:
            if not self._corpus_fed:
                pool.feed(corpus)
                self._corpus_fed = True

    def end(self, ctx: DraftContext) -> None:
        state: PooledState = ctx.state
        state.pool.extend(state.place, ctx.tokens)  # the last step's tokens, which no draft has read yet
        state.pool.end(state.place)
        if state.learn_into is not None:
            state.learn_into.learn(ctx.tokens[state.prompt_length :])
