"""The decode thread: it runs ``Scheduler.step()`` while rows are running or waiting, and hands
each row's updates to the asyncio queue of the HTTP request that asked for it.

The scheduler's ``step`` is called from this one thread only; ``submit`` and ``cancel`` are
thread-safe and come from the event loop. A step that raises fails the rows it held (their
clients get an error) and the worker starts over with a fresh scheduler, so one bad step
never leaves a batch or a cache half-updated for the requests that follow.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from .metrics import Metrics

log = logging.getLogger("hasten.serve")
IDLE_WAIT_SECONDS = 0.5  # an idle worker wakes at least this often to see whether it must stop


@dataclass(frozen=True)
class RowError:
    """Put on a row's queue instead of an update when the step decoding it failed."""

    message: str


class Sink:
    """A row's asyncio queue, filled from the decode thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue

    def put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is shutting down, nobody listens
            pass


class Worker:
    """Owns a scheduler and the thread that steps it."""

    def __init__(self, make_scheduler: Callable[[], object], metrics: Metrics | None = None):
        self.make_scheduler = make_scheduler
        self.scheduler = make_scheduler()
        self.metrics = metrics
        self._sinks: dict[int, Sink] = {}
        self._lock = threading.Lock()  # guards _sinks and swapping the scheduler
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

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
            row_id = self.scheduler.submit(request)
            self._sinks[row_id] = sink
        self._wake.set()
        if self.metrics:
            self.metrics.queue_depth(self.scheduler.running, self.scheduler.waiting)
        return row_id

    def cancel(self, row_id: int) -> None:
        """End a row at the next step boundary (its client left, or its text hit a stop string)."""
        with self._lock:
            if row_id in self._sinks:
                self.scheduler.cancel(row_id)
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
                    self._fail_all(err)
                    continue
                self._record_step()
                self._dispatch(updates)

    def _dispatch(self, updates) -> None:
        for update in updates:
            with self._lock:
                sink = self._sinks.pop(update.row_id, None) if update.finished else self._sinks.get(update.row_id)
            if update.finished and self.metrics:
                self.metrics.row_finished(update.finish_reason or "stop", update.stats, update.queued_seconds)
            if sink is not None:
                sink.put(update)

    def _record_step(self) -> None:
        info = getattr(self.scheduler, "last_step", None)
        if self.metrics and info is not None:
            self.metrics.step(info, self.scheduler.running, self.scheduler.waiting)

    def _fail_all(self, err: Exception) -> None:
        log.exception("a decode step failed; failing its %d rows and starting a fresh scheduler", len(self._sinks))
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            self.scheduler = self.make_scheduler()
        message = f"the decode step failed: {type(err).__name__}: {err}"
        for sink in sinks.values():
            if self.metrics:
                self.metrics.finished.labels("error").inc()
            sink.put(RowError(message))
