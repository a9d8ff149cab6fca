"""Continuous batching: sequences join the running batch at step boundaries and leave when done.

A :class:`Scheduler` holds a queue of :class:`Request`\\ s and a batch of running
sequences over one :class:`~hasten.models.batch.BatchAdapter`. Each :meth:`Scheduler.step`
first applies cancellations, then admits waiting requests (first come, first served) while
the batch has fewer than ``max_batch`` rows, the tokens in flight (every running row's
prompt plus its token budget: the most KV it may hold) stay within ``max_tokens_in_flight``
and this step's prefills stay within ``max_prefill_tokens`` (one row is always admitted, so
a burst of long prompts does not stall the running rows for all of their prefills at once),
then runs one decode step (:func:`hasten.engine.sequence.step`) for every running row.
Each row keeps its own sampling settings, generator, stop rules and statistics, and its
output is exactly what it would be decoded alone.

**Chunked prefill** (``max_num_batched_tokens``, vLLM's name): on a packed batch a joining row's
prompt is not computed at admission but in the step's forward, beside the other rows' blocks
(:class:`~hasten.models.packed_batch.PackedBatch`). With the setting, a step's forward runs at
most that many tokens besides the drafts: one per decoding row (its root), then prompt tokens,
first come first served. A row whose whole remaining prompt fits, with its root, decodes in
that step (its prompt runs first); the first one that does not fit gets what is left as a
chunk and decodes in a later step, once the rest of its prompt fits: until then it has no
block, no draft and no committed token, and the planner does not see it. A long prompt so
joins over several steps while the running rows keep decoding, and since the kernels compute
every position alone, however it is cut its numbers are those of a prefill in one piece. Its
rows' drafts are not counted: the planner sizes them after the step is laid out, pricing the
step's cost. The budget is at least ``max_batch`` (as vLLM asks of ``max_num_seqs``), so a
row in prefill gets at least one token every step: every step makes progress. Other batch
targets (padded, llama.cpp) prefill a row whole as it joins, as before.

``submit`` and ``cancel`` may be called from any thread; ``step`` from one thread only
(the server's decode thread).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core.errors import FieldError
from ..core.request import Request  # the one request object, re-exported here beside the scheduler
from ..core.stats import DecodeStats
from ..drafters.base import Drafter, TargetView
from ..models.hf import runtime_of
from .calibration import load_or_calibrate_batch
from .logprobs import TokenLogprob, token_logprobs
from .planner import DraftPlanner
from .sequence import RowCache, Sequence, open_row, step
from .sizing import SizingRule
from .verify import Acceptance, acceptance_rule

if TYPE_CHECKING:  # type hints only: the engine runs any runtime, Hugging Face's or not
    from transformers import PreTrainedModel


@dataclass
class RowUpdate:
    row_id: int
    tokens: list[int]  # tokens committed this step ([] for a cancel)
    finished: bool
    finish_reason: str | None  # "stop" (EOS or a stop string), "length", "cancelled"
    stats: DecodeStats  # the row's statistics so far
    queued_seconds: float  # from submit to admission
    logprobs: list[TokenLogprob] | None = None  # one per token of ``tokens``, when the request asked
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1 .. T - 1, on the row's first update, when asked
    stop_token: int | None = None  # on the last update: the EOS or stop id that ended the row (its last token)
    speculated: bool = False  # the row drafts (a drafter, and its request did not turn drafting off)


@dataclass
class RowResult:
    tokens: list[int]  # every token the row committed
    stats: DecodeStats
    finish_reason: str | None = None  # "stop", "length" or "cancelled"


@dataclass(frozen=True)
class StepInfo:
    batch_size: int  # rows that ran this step
    admitted: int  # rows that joined before it
    seconds: float  # the whole step, prefills of joining rows included
    draft_seconds: float = 0.0  # every row's proposal
    verify_seconds: float = 0.0  # the shared target forward, acceptance and commits
    prompt_tokens: int = 0  # prompt tokens its forward cached beside the blocks (packed batches: chunks, deferred prompts)


@dataclass
class _Running:
    sequence: Sequence
    row: RowCache  # its row of the batch (a PackedRow, a BatchRow, a llama.cpp sequence)
    queued_seconds: float
    reserved: int  # prompt + budget: what it counts against max_tokens_in_flight
    prompt_scored: list[TokenLogprob] | None = None  # the prompt's log-probabilities, until its first update carries them

    def take_prompt_scored(self) -> list[TokenLogprob] | None:
        scored, self.prompt_scored = self.prompt_scored, None
        return scored


def _count(name: str, value, low: int = 1, optional: bool = True) -> None:
    """ValueError naming ``name`` unless ``value`` is an integer >= ``low`` (or None, where ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}{' or None' if optional else ''}, got {value!r}")


class Scheduler:
    def __init__(self, model: PreTrainedModel, drafter: Drafter | None = None, *, max_batch: int = 8,
                 max_tokens_in_flight: int | None = None, draft_size: str | SizingRule | None = None,
                 lossy_acceptance: Acceptance | None = None, max_prefill_tokens: int | None = None,
                 kv_cache_bytes: int | None = None, max_num_batched_tokens: int | None = None):
        """``max_num_batched_tokens``: the most tokens a step's forward runs besides drafts (a
        decoding row's root and prompt tokens; the module's docstring), at least ``max_batch``;
        None: a joining row's prompt runs whole in its first step."""
        _count("max_batch", max_batch, optional=False)
        _count("max_tokens_in_flight", max_tokens_in_flight)
        _count("max_prefill_tokens", max_prefill_tokens)
        _count("max_num_batched_tokens", max_num_batched_tokens)
        if max_num_batched_tokens is not None and max_num_batched_tokens < max_batch:
            raise ValueError(f"max_num_batched_tokens must be >= max_batch ({max_batch}): every decoding row's root "
                             f"counts, and a row in prefill needs a token of the step, got {max_num_batched_tokens}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be a hasten Drafter or None, got {type(drafter).__name__}")
        self.runtime = runtime_of(model)
        if drafter is not None:
            drafter.check_runtime(self.runtime, batched=True)  # before any forward
        _count("kv_cache_bytes", kv_cache_bytes)
        self.target = self.runtime.batch(max_batch, drafter.needs if drafter is not None else frozenset(),
                                         kv_cache_bytes)
        if drafter is not None:
            drafter.check_target(TargetView(self.target, drafter.needs, self.runtime.source))
        self.model = model
        self.drafter = drafter
        self.max_batch = max_batch
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_prefill_tokens = max_prefill_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        self.planner = DraftPlanner(draft_size)
        if drafter is not None and draft_size in ("auto", None) and self.target.packed_rows:
            load_or_calibrate_batch(model)  # a packed batch's cost, measured now rather than inside the first step
        self.lossy_acceptance = lossy_acceptance
        self.last_step: StepInfo | None = None
        self._lock = threading.Lock()
        self._waiting: deque[tuple[int, Request, float]] = deque()
        self._cancelled: set[int] = set()
        self._running: dict[int, _Running] = {}  # in admission order
        self._next_id = 0

    # ---- any thread ---------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Admit a request (checked once, here) and queue it; returns its row id. Bad requests
        raise FieldError (a ValueError) or TypeError."""
        request = self.check(request)
        acceptance_rule(request.sampling, self.lossy_acceptance)  # a lossy rule with greedy sampling fails here
        with self._lock:
            row_id = self._next_id
            self._next_id += 1
            self._waiting.append((row_id, request, time.perf_counter()))
        return row_id

    def cancel(self, row_id: int) -> None:
        """End a row at the next step boundary (waiting or running; unknown ids are ignored)."""
        with self._lock:
            self._cancelled.add(row_id)

    def row_generator(self, row_id: int) -> torch.Generator | None:
        """The generator a running row draws from (seeded at admission), or None for a row
        that is not running or does not sample."""
        entry = self._running.get(row_id)
        return None if entry is None else entry.sequence.ctx.generator

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._cancelled)

    def check(self, request: Request) -> Request:
        """The request admitted (:meth:`Request.admit`: checked against the model, its defaults
        filled in), within this scheduler's capacity."""
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__}")
        admitted = request.admit(self.runtime)
        budget = request.max_new_tokens
        if self.max_tokens_in_flight is not None and len(request.input_ids) + budget > self.max_tokens_in_flight:
            raise FieldError("max_new_tokens", "over_capacity",
                             f"the prompt ({len(request.input_ids)} tokens) and {{field}} ({budget}) exceed "
                             f"max_tokens_in_flight={self.max_tokens_in_flight}")
        entries = self.target.kv_entries
        if entries is not None and self.target.entries_for(len(request.input_ids) + budget) > entries:
            raise FieldError("max_new_tokens", "over_capacity",
                             f"the prompt ({len(request.input_ids)} tokens) and {{field}} ({budget}) need more KV "
                             f"entries than the KV cache holds ({entries}; a server sets it with --kv-cache-mib)")
        return admitted

    # ---- the decode thread ----------------------------------------------------------------
    def step(self) -> list[RowUpdate]:
        """Apply cancellations, admit waiting rows, run one decode step; every row that
        committed tokens or ended gets an update."""
        began = time.perf_counter()
        updates = self._apply_cancellations()
        admitted = self._admit(updates)
        running, prompt_tokens = self._lay_out()
        draft_seconds = verify_seconds = 0.0
        if running:
            sequences = [entry.sequence for _, entry in running]
            self.planner.prompts_ride(prompt_tokens)
            news = step(self.target, sequences, self.planner)
            draft_seconds = sequences[-1].draft_ended - sequences[0].draft_began
            verify_seconds = time.perf_counter() - sequences[-1].draft_ended
            for (row_id, entry), new in zip(running, news):
                sequence = entry.sequence
                scored = None if sequence.logprobs is None else sequence.scored
                updates.append(RowUpdate(row_id, new, sequence.finished, sequence.finish_reason, sequence.stats,
                                         entry.queued_seconds, scored, entry.take_prompt_scored(),
                                         sequence.stop_token, sequence.drafter is not None))
                if sequence.finished:
                    self._finish(row_id)
        elif prompt_tokens:  # no row decodes yet: the forward runs the prompt chunks alone
            self.target.forward_rows([], [], [], False)
        self.last_step = StepInfo(len(running), admitted, time.perf_counter() - began, draft_seconds, verify_seconds,
                                  prompt_tokens)
        return updates

    def _lay_out(self) -> tuple[list[tuple[int, _Running]], int]:
        """The rows that decode this step, in admission order, and the prompt tokens its forward
        runs besides their blocks. On a packed batch a row whose prompt is not all cached yet
        decodes once the rest of it fits in the step with its root; with
        ``max_num_batched_tokens``, the first row it does not fit is fed what the step has
        left (a chunk), and later ones wait (chunked prefill, the module's docstring). Without
        it every row decodes, the rest of its prompt first. Other targets prefilled every row
        as it joined."""
        running = list(self._running.items())
        if not self.target.packed_rows:
            return running, 0
        if self.max_num_batched_tokens is None:
            return running, sum(entry.row.prompt_due for _, entry in running)
        left = self.max_num_batched_tokens - sum(1 for _, entry in running if not entry.row.prompt_due)
        decoding, prompt_tokens = [], 0
        for row_id, entry in running:
            due = entry.row.prompt_due
            if not due:  # decoding (its root is counted above)
                decoding.append((row_id, entry))
            elif due + 1 <= left:  # the rest of its prompt and its root fit: it decodes, its prompt first
                decoding.append((row_id, entry))
                left -= due + 1
                prompt_tokens += due
            elif left > 0:  # >= 1 for the first such row: max_num_batched_tokens >= max_batch
                self.target.feed(entry.row, left)
                prompt_tokens += left
                left = 0
        return decoding, prompt_tokens

    def _apply_cancellations(self) -> list[RowUpdate]:
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            gone = [(row_id, request) for row_id, request, _ in self._waiting if row_id in cancelled]
            self._waiting = deque(item for item in self._waiting if item[0] not in cancelled)
        updates = [RowUpdate(row_id, [], True, "cancelled", DecodeStats(), 0.0) for row_id, _ in gone]
        for row_id in cancelled & self._running.keys():
            entry = self._running[row_id]
            entry.sequence.cancel()
            updates.append(RowUpdate(row_id, [], True, "cancelled", entry.sequence.stats, entry.queued_seconds))
            self._finish(row_id)
        return updates

    def _admit(self, updates: list[RowUpdate]) -> int:
        admitted = prefilled = 0
        while len(self._running) < self.max_batch:
            with self._lock:
                if not self._waiting:
                    break
                row_id, request, submitted = self._waiting[0]
                if (self.max_prefill_tokens is not None and admitted
                        and prefilled + len(request.input_ids) > self.max_prefill_tokens):
                    break  # the rows already running decode a step before the next prefill
                need = len(request.input_ids) + request.max_new_tokens
                if not self._fits(need):
                    break
                self._waiting.popleft()
            entry = self._start(request, time.perf_counter() - submitted, need)
            admitted += 1
            prefilled += len(request.input_ids)
            if entry.sequence.finished:  # nothing to generate (max_new_tokens=0)
                updates.append(RowUpdate(row_id, [], True, entry.sequence.finish_reason, entry.sequence.stats,
                                         entry.queued_seconds, None if request.logprobs is None else [],
                                         entry.take_prompt_scored()))
                entry.sequence.close()
                self.target.remove(entry.row)
            else:
                self._running[row_id] = entry
        return admitted

    def _fits(self, need: int) -> bool:
        """Whether a request that may hold ``need`` tokens joins the running rows within
        ``max_tokens_in_flight`` and a fixed KV store (the first always joins the first bound;
        :meth:`check` refused one the store cannot hold alone)."""
        reserved = [entry.reserved for entry in self._running.values()]
        if self.max_tokens_in_flight is not None and reserved and sum(reserved) + need > self.max_tokens_in_flight:
            return False
        entries = self.target.kv_entries
        return entries is None or sum(map(self.target.entries_for, reserved + [need])) <= entries

    def _start(self, request: Request, queued_seconds: float, reserved: int) -> _Running:
        clock = time.perf_counter()
        stats = DecodeStats()
        keep_logits = request.prompt_logprobs is not None  # else a packed batch prefills in the row's first step

        def prefill(features: bool):
            # a drafter that drafts without the prompt's states lets a packed batch's prompt reuse a cached prefix
            # and run in the steps (the states of what the steps run are reported to the row, models/packed_batch.py)
            features = features and not (self.target.defers_prompts and self.drafter.drafts_without_prompt_features())
            row, prefilled = self.target.add(request.input_ids, hidden=features, room=reserved,
                                             **({"logits": True} if keep_logits else {"defer": True}))
            return row, list(request.input_ids), prefilled

        sequence = open_row(request, self.drafter, prefill, self.planner,
                            acceptance_rule(request.sampling, self.lossy_acceptance), stats, self.runtime.source)
        prompt_scored = None
        if keep_logits:  # the prefill kept its logits, scored here and dropped
            row = sequence.cache
            prompt_scored = token_logprobs(row.prompt_logits, request.input_ids[1:], request.prompt_logprobs)
            row.prompt_logits = None
        # a deferred prompt (a packed batch's) is computed in the steps that follow: its time counts there
        stats.prefill_seconds += time.perf_counter() - clock
        return _Running(sequence, sequence.cache, queued_seconds, reserved, prompt_scored)

    def abandon(self) -> None:
        """Tell the drafter that every running row's generation is over, without an update: a
        server replacing this scheduler after a failed step goes on with its rows elsewhere (as
        continuations), so a pooled drafter forgets their prompts here and keeps what they wrote."""
        for entry in self._running.values():
            entry.sequence.close()

    def _finish(self, row_id: int) -> None:
        entry = self._running.pop(row_id)
        entry.sequence.close()
        self.target.remove(entry.row)

    def run(self) -> dict[int, "RowResult"]:
        """Step until every submitted row has ended: each row's new tokens, statistics and why
        it ended, by row id. The one loop that drives a scheduler to the end (``hasten.generate``'s
        batches and ``Engine.generate_batch``; the server steps it from its decode thread)."""
        results: dict[int, RowResult] = {}
        while self.has_work():
            for update in self.step():
                result = results.setdefault(update.row_id, RowResult([], update.stats))
                result.tokens.extend(update.tokens)
                result.stats = update.stats
                if update.finished:
                    result.finish_reason = update.finish_reason
        return results
