"""A request's rows as they decode: each sample's :class:`Generation` (submitted to the decode
thread, :mod:`.worker`) and the stream of its text as updates arrive, the rows of one request
merged. Leaving a stream early (a client gone, an error, a stop string found in the text)
cancels the rows still running.
"""
from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from ..core.errors import FieldError
from ..engine.stops import TextStream
from .metrics import Metrics
from .schema import APIError, Params, invalid
from .translate import Sample
from .worker import RowError, Sink, Worker

DISCONNECT_POLL_SECONDS = 0.5  # how often a non-streaming request checks that its client is still there


@dataclass
class Generation:
    """One sample's row as it decodes."""

    row_id: int
    prompt_ids: list[int]
    text: TextStream
    queue: asyncio.Queue
    echo: str = ""  # the prompt's text, when the answer starts with it
    scored: list = field(default_factory=list)  # [TokenLogprob] of every generated token, when asked
    prompt_scored: list | None = None  # [TokenLogprob] of prompt tokens 1 .. T - 1, when asked
    submitted: float = field(default_factory=time.monotonic)
    last_token: float | None = None  # when its latest tokens arrived
    generated: int = 0  # tokens the row generated (a stop token among them, which the text leaves out)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def record(self, update) -> None:
        """Keep an update's log-probabilities."""
        if update.logprobs:
            self.scored.extend(update.logprobs)
        if update.prompt_logprobs is not None:
            self.prompt_scored = update.prompt_logprobs


class Rows:
    """Starts a request's samples on the decode thread and follows them."""

    def __init__(self, worker: Worker, metrics: Metrics, tokenizer):
        self.worker, self.metrics, self.tokenizer = worker, metrics, tokenizer

    def start(self, samples: list[Sample], params: Params) -> list[Generation]:
        """One row per sample; a refused sample refuses the request (the rows already started stop)."""
        gens: list[Generation] = []
        try:
            for sample in samples:
                gens.append(self._start(sample, params))
        except BaseException:
            for gen in gens:
                self.worker.cancel(gen.row_id)
            raise
        return gens

    def _start(self, sample: Sample, params: Params) -> Generation:
        queue: asyncio.Queue = asyncio.Queue()
        request = sample.request
        try:
            row_id = self.worker.submit(request, Sink(asyncio.get_running_loop(), queue))
        except FieldError as err:  # admission refused it: the field named in the API's words
            raise sample.refusal(err) from None
        except ValueError as err:
            raise invalid(None, str(err)) from None
        self.metrics.prompt_tokens.inc(len(request.input_ids))
        text = TextStream(self.tokenizer, params.stop, request.sampling.min_tokens, params.include_stop)
        return Generation(row_id, request.input_ids, text, queue, sample.echo)

    async def events(self, gen: Generation, disconnected: Callable | None = None) -> AsyncIterator[tuple]:
        """(text piece, update, finish_reason or None) as the row decodes; the last one has its
        finish reason. Leaving early (a client gone, an error) cancels the row."""
        done = False
        checked = [time.monotonic()]  # when the connection was last looked at
        try:
            while True:
                item = await self._next(gen.queue, disconnected, checked)
                if isinstance(item, RowError):
                    done = True  # the worker already dropped the row
                    raise APIError(500, item.message, None, "decode_failed")
                self._timed(gen, len(item.tokens))
                gen.generated += len(item.tokens)
                # the EOS or stop id that ended the row stays out of the text unless asked in, as in vLLM
                # (its log-probability and its count in the usage stay in)
                kept = item.tokens if item.stop_token is None or gen.text.include_stop else item.tokens[:-1]
                piece = gen.text.push(kept)
                if item.finished:
                    done = True
                    self.metrics.request_seconds.observe(time.monotonic() - gen.submitted)
                    piece += gen.text.finish()
                    yield piece, item, "stop" if gen.text.stopped else item.finish_reason
                    return
                if gen.text.stopped:  # a stop string in text the scheduler's token rule did not end
                    yield piece, item, "stop"
                    return
                if piece or item.logprobs or item.prompt_logprobs is not None:
                    yield piece, item, None
        finally:
            if not done:
                self.worker.cancel(gen.row_id)

    def _timed(self, gen: Generation, count: int) -> None:
        """The latency histograms, as a row's tokens reach its request."""
        if count:
            now = time.monotonic()
            since_last = None if gen.last_token is None else now - gen.last_token
            self.metrics.tokens_arrived(count, now - gen.submitted, since_last)
            gen.last_token = now

    @staticmethod
    async def _next(queue: asyncio.Queue, disconnected: Callable | None, checked: list[float]):
        """The row's next update. With ``disconnected``, the connection is looked at every
        DISCONNECT_POLL_SECONDS whether or not updates keep coming (a decoding row sends them
        all the time), and a client that left ends the wait with ConnectionAbortedError."""
        if disconnected is None:
            return await queue.get()
        while True:
            if time.monotonic() - checked[0] >= DISCONNECT_POLL_SECONDS:
                checked[0] = time.monotonic()
                if await disconnected():
                    raise ConnectionAbortedError("the client went away")
            try:
                return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                continue

    async def merged(self, gens: list[Generation],
                     disconnected: Callable | None = None) -> AsyncIterator[tuple[int, str, object, str | None]]:
        """(choice index, text piece, update, finish reason or None) of every row, as they come.
        Leaving early (a client gone, an error in any row) cancels every row still running."""
        if len(gens) == 1:
            async with aclosing(self.events(gens[0], disconnected)) as events:
                async for piece, update, reason in events:
                    yield 0, piece, update, reason
            return
        queue: asyncio.Queue = asyncio.Queue()
        ended = object()

        async def pump(index: int, gen: Generation) -> None:
            try:
                async with aclosing(self.events(gen, disconnected)) as events:
                    async for item in events:
                        queue.put_nowait((index, *item))
            except (APIError, ConnectionAbortedError) as err:
                queue.put_nowait(err)
            finally:
                queue.put_nowait(ended)

        tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is ended:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:  # a cancelled pump closes its row's events, which cancels the row
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
