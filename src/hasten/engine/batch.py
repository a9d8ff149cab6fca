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

``submit`` and ``cancel`` may be called from any thread; ``step`` from one thread only
(the server's decode thread).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..core.errors import FieldError
from ..core.runtime import Capability
from ..core.sampling import Sampling
from ..core.stats import DecodeStats
from ..drafters.base import Drafter, TargetView
from ..models.batch import BatchRow
from ..models.hf import runtime_of
from .inputs import check_positions, eos_ids
from .logprobs import TokenLogprob, token_logprobs
from .sequence import Sequence, step
from .sizing import SizingChoice, SizingRule
from .stops import StopStrings
from .verify import Acceptance, acceptance_rule


@dataclass
class Request:
    input_ids: list[int]  # prompt ids, at least one
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None  # seeds this row's own generator (sampling); ignored when generator is given
    eos_token_ids: frozenset[int] | None = None  # None: the model's generation config
    stop: StopStrings | None = None  # ends the row after the token that completes a stop string
    generator: torch.Generator | None = None  # a generator shared with other rows (hasten.generate's)
    logprobs: int | None = None  # score every generated token, with this many alternatives each (None: no scoring)
    processed_logprobs: bool = False  # score under the request's logit rules and sampling transform (else raw)
    prompt_logprobs: int | None = None  # score the prompt's tokens from the prefill, with this many alternatives
    stop_token_ids: frozenset[int] = frozenset()  # end the row after any of these, as after EOS (vLLM's)
    ignore_eos: bool = False  # EOS does not end the row (it may still be generated; min_tokens holds it back)
    resumed: int = 0  # the last ``resumed`` input ids were generated already (a continuation): penalties count them
    use_pool: bool = True  # a pooled drafter may draft from its shared pool and learn this row's text (False: neither)


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


@dataclass
class _Running:
    sequence: Sequence
    row: BatchRow
    queued_seconds: float
    reserved: int  # prompt + budget: what it counts against max_tokens_in_flight
    prompt_scored: list[TokenLogprob] | None = None  # the prompt's log-probabilities, until its first update carries them

    def take_prompt_scored(self) -> list[TokenLogprob] | None:
        scored, self.prompt_scored = self.prompt_scored, None
        return scored


class Scheduler:
    def __init__(self, model: PreTrainedModel, drafter: Drafter | None = None, *, max_batch: int = 8,
                 max_tokens_in_flight: int | None = None, draft_size: str | SizingRule | None = None,
                 lossy_acceptance: Acceptance | None = None, max_prefill_tokens: int | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if max_tokens_in_flight is not None and (
                isinstance(max_tokens_in_flight, bool) or not isinstance(max_tokens_in_flight, int)
                or max_tokens_in_flight < 1):
            raise ValueError(f"max_tokens_in_flight must be an integer >= 1 or None, got {max_tokens_in_flight!r}")
        if max_prefill_tokens is not None and (
                isinstance(max_prefill_tokens, bool) or not isinstance(max_prefill_tokens, int) or max_prefill_tokens < 1):
            raise ValueError(f"max_prefill_tokens must be an integer >= 1 or None, got {max_prefill_tokens!r}")
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(f"drafter must be a hasten Drafter or None, got {type(drafter).__name__}")
        self.runtime = runtime_of(model)
        if drafter is not None:
            drafter.check_runtime(self.runtime, batched=True)  # before any forward
        self.target = self.runtime.batch(max_batch)
        if drafter is not None:
            drafter.check_target(TargetView(self.target, drafter.needs, self.runtime.source))
        self.model = model
        self.drafter = drafter
        self.max_batch = max_batch
        self.max_tokens_in_flight = max_tokens_in_flight
        self.max_prefill_tokens = max_prefill_tokens
        self.sizing = SizingChoice(draft_size)
        self.lossy_acceptance = lossy_acceptance
        self.last_step: StepInfo | None = None
        self._default_eos = eos_ids(self.runtime, None)
        self._lock = threading.Lock()
        self._waiting: deque[tuple[int, Request, float]] = deque()
        self._cancelled: set[int] = set()
        self._running: dict[int, _Running] = {}  # in admission order
        self._next_id = 0

    # ---- any thread ---------------------------------------------------------------------
    def submit(self, request: Request) -> int:
        """Queue a request; returns its row id. Bad requests raise ValueError/TypeError."""
        self.check(request)
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

    def check(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__}")
        ids = request.input_ids
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise FieldError("input_ids", "invalid_value", "{field} must be a non-empty list of token ids")
        vocab = self.runtime.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError("input_ids", "invalid_value",
                             f"{{field}} contains token id {bad}, outside the model's vocabulary [0, {vocab})")
        budget = request.max_new_tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise FieldError("max_new_tokens", "invalid_value", f"{{field}} must be an integer >= 0, got {budget!r}")
        check_positions(self.runtime, len(ids), budget)
        if not isinstance(request.sampling, Sampling):
            raise TypeError(f"sampling must be a hasten Sampling, got {type(request.sampling).__name__}")
        request.sampling.check_vocab(vocab)
        stop_ids = request.stop_token_ids
        if not isinstance(stop_ids, (set, frozenset, list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_ids):
            raise FieldError("stop_token_ids", "invalid_value",
                             f"{{field}} must be token ids in the model's vocabulary [0, {vocab}), got {stop_ids!r}")
        allowed = request.sampling.allowed_token_ids
        if request.sampling.min_tokens and allowed is not None and set(allowed) <= self._suppressed(request):
            raise FieldError("min_tokens", "invalid_value",
                             "{field} holds back every token allowed_token_ids allows (they all end the row)")
        if not isinstance(request.use_pool, bool):
            raise FieldError("pool", "invalid_value", f"{{field}} must be true or false, got {request.use_pool!r}")
        if request.seed is not None and (isinstance(request.seed, bool) or not isinstance(request.seed, int)):
            raise FieldError("seed", "invalid_value", f"{{field}} must be an integer or None, got {request.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(request, name)
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
                raise FieldError(name, "invalid_value", f"{{field}} must be an integer >= 0 or None, got {count!r}")
        if request.prompt_logprobs is not None and Capability.PROMPT_LOGITS not in self.runtime.capabilities:
            raise FieldError("prompt_logprobs", "unsupported_parameter",
                             "{field} needs the prefill's logits, which this model's runtime does not keep")
        if self.max_tokens_in_flight is not None and len(ids) + budget > self.max_tokens_in_flight:
            raise FieldError("max_new_tokens", "over_capacity",
                             f"the prompt ({len(ids)} tokens) and {{field}} ({budget}) exceed "
                             f"max_tokens_in_flight={self.max_tokens_in_flight}")

    # ---- the decode thread ----------------------------------------------------------------
    def step(self) -> list[RowUpdate]:
        """Apply cancellations, admit waiting rows, run one decode step; every row that
        committed tokens or ended gets an update."""
        began = time.perf_counter()
        updates = self._apply_cancellations()
        admitted = self._admit(updates)
        running = list(self._running.items())
        draft_seconds = verify_seconds = 0.0
        if running:
            sequences = [entry.sequence for _, entry in running]
            news = step(self.target, sequences)
            draft_seconds = sequences[-1].draft_ended - sequences[0].draft_began
            verify_seconds = time.perf_counter() - sequences[-1].draft_ended
            for (row_id, entry), new in zip(running, news):
                sequence = entry.sequence
                scored = None if sequence.logprobs is None else sequence.scored
                updates.append(RowUpdate(row_id, new, sequence.finished, sequence.finish_reason, sequence.stats,
                                         entry.queued_seconds, scored, entry.take_prompt_scored(),
                                         sequence.stop_token))
                if sequence.finished:
                    self._finish(row_id)
        self.last_step = StepInfo(len(running), admitted, time.perf_counter() - began, draft_seconds, verify_seconds)
        return updates

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
                in_flight = sum(entry.reserved for entry in self._running.values())
                if (self.max_tokens_in_flight is not None and self._running
                        and in_flight + need > self.max_tokens_in_flight):
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

    def _start(self, request: Request, queued_seconds: float, reserved: int) -> _Running:
        clock = time.perf_counter()
        stats = DecodeStats()
        want_features = self.drafter is not None and self.drafter.reads_features()
        prompt_scored = None
        if request.prompt_logprobs is None:
            row, prefilled = self.target.add(request.input_ids, hidden=want_features)
        else:  # the prefill keeps its logits, scored here and dropped
            row, prefilled = self.target.add(request.input_ids, hidden=want_features, logits=True)
            prompt_scored = token_logprobs(row.prompt_logits, request.input_ids[1:], request.prompt_logprobs)
            row.prompt_logits = None
        generator = request.generator
        if generator is None and request.seed is not None:
            generator = torch.Generator(self.target.device).manual_seed(request.seed)
        sizing = self.sizing.for_request(not request.sampling.greedy, seeded=generator is not None)
        eos = self._eos(request)
        stops = (frozenset() if request.ignore_eos else eos) | frozenset(request.stop_token_ids)
        sequence = Sequence(
            row, list(request.input_ids), prefilled, self.drafter, request.sampling, generator,
            acceptance_rule(request.sampling, self.lossy_acceptance), stops, request.max_new_tokens, stats,
            sizing, stop=request.stop, model_source=self.runtime.source, logprobs=request.logprobs,
            processed_logprobs=request.processed_logprobs,
            suppressed_ids=self._suppressed(request), resumed=request.resumed, use_pool=request.use_pool,
        )
        stats.prefill_seconds += time.perf_counter() - clock
        return _Running(sequence, row, queued_seconds, reserved, prompt_scored)

    def _eos(self, request: Request) -> frozenset[int]:
        return self._default_eos if request.eos_token_ids is None else frozenset(request.eos_token_ids)

    def _suppressed(self, request: Request) -> frozenset[int]:
        """What min_tokens holds back: EOS (even with ignore_eos, as vLLM) and the stop ids."""
        return self._eos(request) | frozenset(request.stop_token_ids)

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
