"""The decode thread: it runs ``Scheduler.step()`` while rows are running or waiting, and hands
each row's updates to the asyncio queue of the HTTP request that asked for it.

The scheduler's ``step`` is called from this one thread only; ``submit`` and ``cancel`` are
thread-safe and come from the event loop.

A step that raises fails only the rows that cause it. The worker starts a fresh scheduler (so
no batch or cache is left half-updated), tries every row's next step alone on a scratch
scheduler (its generator cloned, so the probe draws nothing from it), fails the rows that
raise there, and resubmits the others as continuations: their prompt plus the tokens their
clients already have, the rest of their budget, the same generator. A greedy row's text is
then exactly what it would have been; a sampled row keeps drawing from its own stream.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..core.errors import FieldError
from .metrics import Metrics

log = logging.getLogger("hasten.serve")
IDLE_WAIT_SECONDS = 0.5  # an idle worker wakes at least this often to see whether it must stop


@dataclass(frozen=True)
class RowError:
    """Put on a row's queue instead of an update when the step decoding it failed."""

    message: str
    # a refusal of the request's own fields (e.g. a constraint that leaves no token min_tokens allows),
    # which the client hears as a 400 naming the field
    refusal: FieldError | None = None


class Sink:
    """A row's asyncio queue, filled from the decode thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down, nobody listens
            pass


@dataclass
class _Row:
    """A request the worker serves: what was asked, where its updates go, what was sent."""

    request: object  # the scheduler's Request, as submitted
    sink: Sink
    scheduler_id: int  # its row id in the current scheduler (a continuation gets a new one)
    sent: list[int] = field(default_factory=list)  # tokens its client has been given


class Worker:
    """Owns a scheduler and the thread that steps it. Row ids it hands out stay the same when
    a failed step makes it move rows to a fresh scheduler."""

    def __init__(self, make_scheduler: Callable[[], object], metrics: Metrics | None = None):
        self.make_scheduler = make_scheduler
        self.scheduler = make_scheduler()
        self.metrics = metrics
        self._rows: dict[int, _Row] = {}  # by the worker's row id
        self._by_scheduler_id: dict[int, int] = {}  # the current scheduler's row id -> the worker's
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards the row tables and swapping the scheduler
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._reused = 0  # the prefix cache's reused tokens counted so far (the scheduler's batch counts them)

    # ---- called from the event loop ------------------------------------------------------------
    def start(self) -> None:
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="hasten-decode", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, request, sink: Sink) -> int:
        """Queue ``request``; its updates go to ``sink``. ValueError (naming the field) if refused."""
        with self._lock:  # registered before the decode thread can report on the row
            scheduler_id = self.scheduler.submit(request)
            row_id = next(self._ids)
            self._rows[row_id] = _Row(request, sink, scheduler_id)
            self._by_scheduler_id[scheduler_id] = row_id
        self._wake.set()
        if self.metrics:
            self.metrics.queue_depth(self.scheduler.running, self.scheduler.waiting)
        return row_id

    def cancel(self, row_id: int) -> None:
        """End a row at the next step boundary (its client left, or its text hit a stop string)."""
        with self._lock:
            if row_id in self._rows:
                self.scheduler.cancel(self._rows[row_id].scheduler_id)
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the decode thread -----------------------------------------------------------------------
    def _run(self) -> None:
        # Grad mode is per thread: the server's main thread turning it off does not reach this one.
        with torch.no_grad():
            while not self._stopping.is_set():
                self._wake.clear()  # before looking, so a submit after the look wakes the wait below
                if not self.scheduler.has_work():
                    self._wake.wait(IDLE_WAIT_SECONDS)
                    continue
                try:
                    updates = self.scheduler.step()
                except Exception as err:  # noqa: BLE001 - any failure must reach the clients, not kill the thread
                    self._recover(err)
                    continue
                self._record_step()
                self._dispatch(updates)

    def _dispatch(self, updates) -> None:
        for update in updates:
            with self._lock:
                row_id = self._by_scheduler_id.get(update.row_id)
                row = self._rows.get(row_id)
                if row is not None:
                    row.sent.extend(update.tokens)
                    if update.finished:
                        del self._rows[row_id], self._by_scheduler_id[update.row_id]
            if update.finished and self.metrics:
                self.metrics.row_finished(update.finish_reason or "stop", update.stats, update.queued_seconds,
                                          update.speculated)
            if row is not None:
                row.sink.put(update)

    def _record_step(self) -> None:
        info = getattr(self.scheduler, "last_step", None)
        if self.metrics and info is not None:
            self.metrics.step(info, self.scheduler.running, self.scheduler.waiting)
            target = self.scheduler.target
            held = getattr(target, "held_bytes", None)
            if callable(held):
                self.metrics.kv_bytes.set(held())
            reused = getattr(target, "reused_tokens", 0)
            if reused > self._reused:
                self.metrics.reused_tokens.inc(reused - self._reused)
            self._reused = reused

    def _recover(self, err: Exception) -> None:
        """After a step raised: a fresh scheduler, the rows that fail alone failed with the
        error, the others moved over as continuations (see the module's doc)."""
        with self._lock:
            old, self.scheduler = self.scheduler, self.make_scheduler()
            self._reused = 0  # a fresh batch counts from 0
            rows, self._by_scheduler_id = dict(self._rows), {}
        try:
            old.abandon()
        except Exception:  # noqa: BLE001 - a drafter broken by the failed step must not stop the recovery
            log.exception("the drafter failed to end the old batch's rows")
        log.warning("a decode step failed (%s: %s); trying its %d rows one by one", type(err).__name__, err, len(rows))
        for row_id, row in rows.items():
            continuation = self._continuation(old, row)
            failure = self._fails_alone(continuation)
            if failure is not None:
                log.exception("row %d fails alone; failing it", row_id, exc_info=failure)
                with self._lock:
                    self._rows.pop(row_id, None)
                if self.metrics:
                    self.metrics.finished.labels("error").inc()
                if isinstance(failure, FieldError):
                    row.sink.put(RowError(str(failure), failure))
                else:
                    row.sink.put(RowError(f"the decode step failed: {type(failure).__name__}: {failure}"))
                continue
            with self._lock:
                row.scheduler_id = self.scheduler.submit(continuation)
                self._by_scheduler_id[row.scheduler_id] = row_id
        if self.metrics:
            self.metrics.queue_depth(self.scheduler.running, self.scheduler.waiting)

    @staticmethod
    def _continuation(old, row: _Row):
        """The row's request from where its client is: its prompt plus the tokens sent, the
        rest of its budget, drawing on from the generator it had (a waiting row: as asked)."""
        request = row.request
        generator = old.row_generator(row.scheduler_id) or request.generator
        return dataclasses.replace(request, input_ids=list(request.input_ids) + row.sent,
                                   max_new_tokens=request.max_new_tokens - len(row.sent), generator=generator,
                                   resumed=request.resumed + len(row.sent),
                                   prompt_logprobs=request.prompt_logprobs if not row.sent else None)

    def _fails_alone(self, request) -> Exception | None:
        """Whether the request's next step raises on a scheduler of its own (a copy of its
        generator draws, so the real one is untouched); the exception, or None."""
        generator = request.generator
        if generator is not None:
            generator = torch.Generator(generator.device).manual_seed(0)
            generator.set_state(request.generator.get_state())
        probe = self.make_scheduler()
        try:
            probe.submit(dataclasses.replace(request, generator=generator))
            while not probe.step() and probe.has_work():  # a long prompt's chunks first (chunked prefill)
                pass
        except Exception as err:  # noqa: BLE001 - the probe is where a bad row shows itself
            return err
        return None
