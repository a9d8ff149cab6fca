"""The HTTP layer of ``hasten serve``: OpenAI's completions and chat routes, ``/v1/models``,
``/metrics`` and ``/health`` on Starlette.

A request is checked (:mod:`.schema`), tokenized off the event loop (:class:`Encoder`), and
submitted to the decode thread (:mod:`.worker`) as one scheduler row; the row's updates arrive on an asyncio queue and
leave as one JSON answer or as server-sent events ending in ``data: [DONE]``. A client that
goes away cancels its row; so does a stop string found in the text.
"""
from __future__ import annotations

import asyncio
import copy
import hmac
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..core.errors import FieldError
from ..core.sampling import Sampling
from ..engine.stops import TextStream
from .logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from .metrics import CONTENT_TYPE, Metrics
from .schema import MAX_SEED, APIError, Params, invalid, parse_body, parse_messages, parse_params, parse_prompts
from .worker import RowError, Sink, Worker

OPEN_PATHS = ("/health",)  # answered without an API key, for load balancers' probes
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
UNBOUNDED_MAX_TOKENS = 1 << 16  # the cap on max_tokens for a model whose config sets no context
DISCONNECT_POLL_SECONDS = 0.5  # how often a non-streaming request checks that its client is still there
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class ServeOptions:
    model_name: str  # what clients pass as "model"
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 1 << 20
    # "raw": the model's own log-probabilities (vLLM's default); "processed": under each request's
    # logit rules and sampling transform, the law its tokens were drawn from
    logprobs_mode: str = "raw"
    pool_file: str | None = None  # the drafter's shared pool: loaded at start where the file exists, saved at exit


@dataclass
class Generation:
    """One request's row as it decodes."""

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


class Encoder:
    """Prompts and chats to input ids on a thread of their own, so a long prompt never holds up
    the event loop (other requests' streamed tokens, /health). The thread encodes with its own
    copy of the tokenizer: a Rust fast tokenizer refuses to encode on one thread while another
    uses it ("Already borrowed"), and the event loop decodes streamed text, the decode thread
    reads stop strings, with the engine's."""

    def __init__(self, engine):
        self.engine = copy.copy(engine)  # the engine's encode/encode_chat, with a private tokenizer
        self.engine.tokenizer = copy.deepcopy(engine.tokenizer)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hasten-encode")

    async def text(self, prompt: str) -> list[int]:
        return await self._run(self.engine.encode, prompt)

    async def chat(self, messages: list[dict]) -> list[int]:
        return await self._run(self.engine.encode_chat, messages)

    async def _run(self, encode: Callable, argument) -> list[int]:
        ids = await asyncio.get_running_loop().run_in_executor(self.pool, encode, argument)  # [1, T]
        return ids[0].tolist()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Service:
    def __init__(self, engine, worker: Worker, metrics: Metrics, options: ServeOptions):
        self.engine, self.worker, self.metrics, self.options = engine, worker, metrics, options
        self.encode = Encoder(engine)
        self.context = engine.runtime.context_length
        self.vocab = engine.runtime.vocab_size
        self.created = int(time.time())
        self.token_text = TokenText(engine.tokenizer)

    # ---- routes ----------------------------------------------------------------------------------
    async def health(self, request: HTTPRequest) -> Response:
        if not self.worker.alive:
            return JSONResponse({"status": "decode thread not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: HTTPRequest) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    async def models(self, request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HTTPRequest) -> Response:
        self._check_model(request.path_params["name"])
        return JSONResponse(self._model_card())

    async def completions(self, request: HTTPRequest) -> Response:
        body = await self._read_json(request)
        params = parse_params(body)
        self._check_model(params.model)
        prompts = []  # (input ids, max tokens, echoed text) of each prompt, every one checked before any row starts
        for prompt in parse_prompts(body):
            input_ids = await self.encode.text(prompt) if isinstance(prompt, str) else self._checked_ids(prompt)
            budget = self._budget(len(input_ids), params.max_tokens, DEFAULT_COMPLETION_TOKENS, "prompt", "max_tokens")
            echo = ""  # the text the answer starts with
            if params.echo:
                echo = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)
            prompts.append((input_ids, budget, echo))
        return await self._answer(request, "completion", prompts, params)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        body = await self._read_json(request)
        params = parse_params(body, ("max_tokens", "max_completion_tokens"), chat=True)
        self._check_model(params.model)
        messages = parse_messages(body)
        try:
            input_ids = await self.encode.chat(messages)
        except ValueError as err:  # no chat template, or the template refused the messages
            raise invalid("messages", str(err)) from None
        asked_as = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = self._budget(len(input_ids), params.max_tokens, None, "messages", asked_as)
        return await self._answer(request, "chat", [(input_ids, max_tokens, "")], params)

    # ---- checks ------------------------------------------------------------------------------------
    async def _read_json(self, request: HTTPRequest) -> dict:
        limit = self.options.max_body_bytes
        too_large = APIError(413, f"the request body is larger than this server's limit of {limit} bytes", None,
                             "request_too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return parse_body(b"".join(chunks))

    def _check_model(self, name: str) -> None:
        if name != self.options.model_name:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves "
                                f"{self.options.model_name!r}", "model", "model_not_found")

    def _checked_ids(self, ids: list[int]) -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise invalid("prompt", f"token id {bad[0]} is outside the model's vocabulary [0, {self.vocab})")
        return ids

    def _budget(self, prompt_tokens: int, asked: int | None, default: int | None, prompt_param: str,
                max_param: str) -> int:
        """max_tokens checked against the model's context; a default is cut to the room left."""
        if self.context is None:
            room = UNBOUNDED_MAX_TOKENS
        elif self.engine.runtime.encoder_decoder:  # the prompt is read by the encoder
            room = self.context - 1
        else:
            room = self.context - prompt_tokens
        if room < 1 and not (asked == 0 and room == 0):  # max_tokens 0 scores a prompt that fills the context
            raise invalid(prompt_param, f"the prompt has {prompt_tokens} tokens, and the model's context of "
                                        f"{self.context} positions leaves no room for a new one",
                          "context_length_exceeded")
        if asked is None:
            return room if default is None else min(default, room)
        if asked > room:
            raise invalid(max_param, f"'{max_param}' is {asked}, but the prompt has {prompt_tokens} tokens and the "
                                     f"model's context leaves room for at most {room} new tokens",
                          "context_length_exceeded")
        return asked

    # ---- decoding ----------------------------------------------------------------------------------
    def _submit_all(self, prompts: list[tuple[list[int], int, str]], params: Params) -> list[Generation]:
        """One row per sample: ``params.best_of`` (= ``n`` unless asked) per prompt, in the order of
        the response's choices (sample j of a prompt uses ``seed + j``, so choice 0 is the single
        request's)."""
        gens: list[Generation] = []
        try:
            for input_ids, max_tokens, echo in prompts:
                for j in range(params.best_of):
                    seed = None if params.seed is None else (params.seed + j) % (MAX_SEED + 1)
                    gens.append(self._submit(input_ids, max_tokens, params, seed, echo))
        except BaseException:
            for gen in gens:  # a refused row refuses the request: the rows already started stop
                self.worker.cancel(gen.row_id)
            raise
        return gens

    def _submit(self, input_ids: list[int], max_tokens: int, params: Params, seed: int | None,
                echo: str = "") -> Generation:
        from ..engine.batch import Request  # the scheduler's request type, beside the scheduler

        stop = None
        if params.stop:
            from ..engine.stops import StopStrings

            stop = StopStrings(self.engine.tokenizer, list(params.stop))
        # Greedy decoding ignores the warpers, top_k, top_p and min_p (OpenAI accepts them with temperature 0);
        # the logit rules (penalties, logit_bias, allowed_token_ids, min_tokens) apply to both.
        rules = params.rules if params.temperature > 0 else {k: v for k, v in params.rules.items() if k != "min_p"}
        try:
            sampling = (Sampling(params.temperature, params.top_k, params.top_p, **rules) if params.temperature > 0
                        else Sampling(**rules))
        except ValueError as err:
            raise invalid(None, str(err)) from None
        request = Request(input_ids=input_ids, max_new_tokens=max_tokens, sampling=sampling, seed=seed, stop=stop,
                          logprobs=self._scoring(params), prompt_logprobs=self._prompt_scoring(params),
                          processed_logprobs=self.options.logprobs_mode == "processed",
                          stop_token_ids=frozenset(params.stop_token_ids), ignore_eos=params.ignore_eos,
                          use_pool=params.pool)
        queue: asyncio.Queue = asyncio.Queue()
        try:
            row_id = self.worker.submit(request, Sink(asyncio.get_running_loop(), queue))
        except FieldError as err:  # e.g. over --max-tokens-in-flight: the field named in the API's words
            param = REQUEST_FIELDS.get(err.field, err.field)
            raise invalid(param, err.render(param), err.code) from None
        except ValueError as err:
            raise invalid(None, str(err)) from None
        self.metrics.prompt_tokens.inc(len(input_ids))
        text = TextStream(self.engine.tokenizer, params.stop, sampling.min_tokens, params.include_stop)
        return Generation(row_id, input_ids, text, queue, echo)

    @staticmethod
    def _scoring(params: Params) -> int | None:
        """Alternatives to score each generated token with: ``logprobs``, or 0 to rank ``best_of``
        samples (None: no scoring)."""
        if params.logprobs is None and params.best_of > params.n:
            return 0
        return params.logprobs

    @staticmethod
    def _prompt_scoring(params: Params) -> int | None:
        """Alternatives to score each prompt token with: ``prompt_logprobs``, and ``logprobs``
        for an echoed prompt (None: the prefill keeps no logits)."""
        wanted = [params.prompt_logprobs, params.logprobs if params.echo else None]
        wanted = [count for count in wanted if count is not None]
        return max(wanted) if wanted else None

    async def _events(self, gen: Generation, disconnected: Callable | None = None) -> AsyncIterator[tuple]:
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

    async def _answer(self, request: HTTPRequest, kind: str, prompts: list[tuple[list[int], int, str]],
                      params: Params) -> Response:
        gens = self._submit_all(prompts, params)
        ids = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ids, "created": int(time.time()), "model": self.options.model_name}
        if params.stream:
            return EventStream(self._stream(gens, kind, head, params), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        texts, lasts, reasons = [""] * len(gens), [None] * len(gens), [None] * len(gens)
        try:
            async with aclosing(self._merged(gens, request.is_disconnected)) as updates:
                async for index, piece, last, reason in updates:
                    texts[index] += piece
                    lasts[index], reasons[index] = last, reason
                    gens[index].record(last)
        except ConnectionAbortedError:
            return Response(status_code=499)  # nobody reads it; the rows are already cancelled
        usage = self._usage(gens, params.best_of)  # every sample's tokens, the unchosen ones too (as OpenAI)
        if params.best_of > params.n:
            keep = self._best(gens, params)
            gens, texts, lasts, reasons = ([items[i] for i in keep] for items in (gens, texts, lasts, reasons))
        if kind == "chat":
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                        "logprobs": self._logprobs(gen, params, chat=True)}
                       for i, (gen, text, reason) in enumerate(zip(gens, texts, reasons))]
            # vLLM's prompt_logprobs: the request's, beside the choices (null when not asked, as vLLM)
            body = {**head, "object": "chat.completion", "choices": choices,
                    "prompt_logprobs": self._prompt_logprobs(gens[0], params)}
        else:
            choices = [{"index": i, "text": gen.echo + text, "finish_reason": reason,
                        "logprobs": self._logprobs(gen, params, echo=True),
                        "prompt_logprobs": self._prompt_logprobs(gen, params)}  # vLLM's: each choice's prompt
                       for i, (gen, text, reason) in enumerate(zip(gens, texts, reasons))]
            body = {**head, "object": "text_completion", "choices": choices}
        return JSONResponse({**body, "usage": usage, "hasten": self._all_stats(lasts)})

    @staticmethod
    def _best(gens: list[Generation], params: Params) -> list[int]:
        """Of each prompt's ``best_of`` samples, the indices of the ``n`` with the highest mean
        log-probability per generated token (the target's raw log-probabilities, as reported), in
        the order they were sampled; a sample with no tokens ranks last."""
        def mean_logprob(gen: Generation) -> float:
            return sum(entry.logprob for entry in gen.scored) / len(gen.scored) if gen.scored else float("-inf")

        keep = []
        for first in range(0, len(gens), params.best_of):
            group = range(first, first + params.best_of)
            ranked = sorted(group, key=lambda i: (-mean_logprob(gens[i]), i))
            keep += sorted(ranked[:params.n])
        return keep

    # ---- log-probabilities, as each route shows them (computed by the scheduler: engine.logprobs) --------
    def _logprobs(self, gen: Generation, params: Params, chat: bool = False, echo: bool = False) -> dict | None:
        """A choice's ``logprobs`` over every token its row generated, None when not asked.
        Completions: the legacy object, with ``echo`` the prompt's tokens first (the first has
        no log-probability); chat: ``{"content": [...]}``."""
        if params.logprobs is None:
            return None
        if chat:
            return {"content": chat_logprobs(gen.scored, self.token_text)}
        tokens, entries = [entry.token for entry in gen.scored], list(gen.scored)
        if echo and params.echo:
            tokens, entries = gen.prompt_ids + tokens, [None, *(gen.prompt_scored or [])] + entries
        return completion_logprobs(tokens, entries, params.logprobs, self.token_text)[0]

    def _prompt_logprobs(self, gen: Generation, params: Params) -> list | None:
        if params.prompt_logprobs is None:
            return None
        return prompt_logprobs(gen.prompt_scored or [], params.prompt_logprobs, self.token_text)

    async def _merged(self, gens: list[Generation],
                      disconnected: Callable | None = None) -> AsyncIterator[tuple[int, str, object, str | None]]:
        """(choice index, text piece, update, finish reason or None) of every row, as they come.
        Leaving early (a client gone, an error in any row) cancels every row still running."""
        if len(gens) == 1:
            async with aclosing(self._events(gens[0], disconnected)) as events:
                async for piece, update, reason in events:
                    yield 0, piece, update, reason
            return
        queue: asyncio.Queue = asyncio.Queue()
        ended = object()

        async def pump(index: int, gen: Generation) -> None:
            try:
                async with aclosing(self._events(gen, disconnected)) as events:
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

    async def _stream(self, gens: list[Generation], kind: str, head: dict, params: Params) -> AsyncIterator[str]:
        chat = kind == "chat"
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if params.include_usage else {}

        def chunk(index: int, piece: str | None, reason: str | None, logprobs: dict | None = None, **more) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": piece or "", "finish_reason": reason, "logprobs": logprobs}
            return sse({**head, "choices": [choice], **extra, **more})

        offsets = [0] * len(gens)  # each completion choice's text_offset so far

        def scored_chunk(index: int, piece: str, scored: list, prompt: bool = False) -> str | None:
            """The chunk carrying ``piece`` and the log-probabilities of the tokens it came with
            (with ``prompt``, the echoed prompt's); None when it would carry nothing."""
            logprobs = None
            if params.logprobs is not None and (scored or prompt):
                if chat:
                    logprobs = {"content": chat_logprobs(scored, self.token_text)}
                else:
                    tokens = gens[index].prompt_ids if prompt else [entry.token for entry in scored]
                    entries = [None, *scored] if prompt else scored
                    logprobs, offsets[index] = completion_logprobs(tokens, entries, params.logprobs, self.token_text,
                                                                   offsets[index])
            return chunk(index, piece, None, logprobs) if piece or logprobs is not None else None

        if chat:  # OpenAI opens a chat stream with the assistant's role, once per choice
            for index in range(len(gens)):
                yield sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None, "logprobs": None}], **extra})
        lasts = [None] * len(gens)
        try:
            # aclosing: when the client leaves, the rows' generators close (and cancel) at once
            async with aclosing(self._merged(gens)) as updates:
                async for index, piece, last, reason in updates:
                    if lasts[index] is None and params.echo:  # a completion's first event: the prompt first
                        yield scored_chunk(index, gens[index].echo, last.prompt_logprobs or [], prompt=True)
                    lasts[index] = last
                    event = scored_chunk(index, piece, last.logprobs or [])
                    if event is not None:
                        yield event
                    if reason is not None:
                        yield chunk(index, None if chat else "", reason, hasten=self._stats(lasts[index]))
        except APIError as err:
            yield sse(err.body())
            yield "data: [DONE]\n\n"
            return
        if params.include_usage:
            yield sse({**head, "choices": [], "usage": self._usage(gens, params.best_of), "hasten": self._all_stats(lasts)})
        yield "data: [DONE]\n\n"

    @staticmethod
    def _usage(gens: list[Generation], n: int) -> dict:
        """Each prompt's tokens once (its ``n`` choices read the same prompt); every choice's tokens."""
        prompt = sum(gen.prompt_tokens for gen in gens[::n])
        completion = sum(gen.generated for gen in gens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _all_stats(self, updates: list) -> dict:
        """hasten's numbers: one choice's as they are, several choices' one entry each."""
        if len(updates) == 1:
            return self._stats(updates[0])
        return {"method": self.engine.method, "choices": [self._stats(update) for update in updates]}

    def _stats(self, update) -> dict:
        """hasten's own numbers for this request, under the extra field ``hasten``."""
        if update is None:
            return {"method": self.engine.method, "tau": 0.0, "steps": 0, "acceptance_by_position": []}
        stats = update.stats
        return {"method": self.engine.method, "tau": round(stats.mean_accepted, 4), "steps": stats.steps,
                "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position],
                "queued_seconds": round(update.queued_seconds, 6)}

    def _model_card(self) -> dict:
        return {"id": self.options.model_name, "object": "model", "created": self.created, "owned_by": "hasten",
                "method": self.engine.method}


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, however it
    ends, so the row's ``finally`` (cancel) runs at once rather than when the garbage is collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# The scheduler names the Request field it refuses (FieldError.field); clients know the API's name for it.
REQUEST_FIELDS = {"input_ids": "prompt", "max_new_tokens": "max_tokens"}


class Guard:
    """ASGI middleware: bearer-key check on every route but ``/health``, and the request counter."""

    def __init__(self, app, api_key: str | None, metrics: Metrics):
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ROUTES else ("/v1/models/{name}" if path.startswith("/v1/models/") else "other")
        status = {"code": 500}

        async def counted_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(scope):
                error = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer KEY'",
                                 None, "invalid_api_key")
                await JSONResponse(error.body(), status_code=401)(scope, receive, counted_send)
                return
            await self.app(scope, receive, counted_send)
        finally:
            self.metrics.requests.labels(route, str(status["code"])).inc()

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, key = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())


async def api_error(request: HTTPRequest, err: APIError) -> Response:
    return JSONResponse(err.body(), status_code=err.status)


async def http_error(request: HTTPRequest, err: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
    return JSONResponse(APIError(err.status_code, str(err.detail), None, code).body(), status_code=err.status_code)


async def server_error(request: HTTPRequest, err: Exception) -> Response:
    body = APIError(500, f"internal error: {type(err).__name__}: {err}", None, "internal_error").body()
    return JSONResponse(body, status_code=500)


def create_app(engine, make_scheduler: Callable[[], object], options: ServeOptions,
               metrics: Metrics | None = None) -> Starlette:
    """The ASGI app; its lifespan starts and stops the decode thread that steps the scheduler."""
    metrics = metrics or Metrics()
    pool = shared_pool(engine, options.pool_file)
    if pool is not None:
        metrics.watch_pool(pool)
    worker = Worker(make_scheduler, metrics)
    service = Service(engine, worker, metrics, options)

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            worker.stop()
            service.encode.close()
            if options.pool_file is not None:
                pool.save(options.pool_file)  # after the decode thread: every row's text is in

    routes = [
        Route("/health", service.health, methods=["GET"]),
        Route("/metrics", service.metrics_text, methods=["GET"]),
        Route("/v1/models", service.models, methods=["GET"]),
        Route("/v1/models/{name:path}", service.model, methods=["GET"]),
        Route("/v1/completions", service.completions, methods=["POST"]),
        Route("/v1/chat/completions", service.chat_completions, methods=["POST"]),
    ]
    handlers = {APIError: api_error, HTTPException: http_error, Exception: server_error}
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    app.add_middleware(Guard, api_key=options.api_key, metrics=metrics)
    app.state.service = service
    return app


def shared_pool(engine, pool_file: str | None):
    """The drafter's shared pool (None without one), loaded from ``pool_file`` where that exists
    (ValueError: a pool file for a drafter that learns nothing, or not a saved pool). One pool
    serves every request of the server, whichever client sent it (docs/serve.md)."""
    pool = None if engine.drafter is None else engine.drafter.pool
    if pool_file is not None:
        if pool is None:
            raise ValueError(f"a pool file needs a method that learns across requests (lookahead or suffix), not "
                             f"{engine.method}")
        if os.path.exists(pool_file):
            pool.load(pool_file)
    return pool


def scheduler_factory(engine, max_batch: int = 8, max_tokens_in_flight: int | None = None,
                      max_prefill_tokens: int | None = None) -> Callable[[], object]:
    """Builds the continuous-batching scheduler over the engine's model and drafter."""
    from ..engine.batch import Scheduler

    def make():
        return Scheduler(engine.runtime, engine.drafter, max_batch=max_batch, max_tokens_in_flight=max_tokens_in_flight,
                         draft_size=engine.draft_size, max_prefill_tokens=max_prefill_tokens)

    return make
