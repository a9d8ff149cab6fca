"""The HTTP layer of ``hasten serve``: OpenAI's completions and chat routes, ``/v1/models``,
``/metrics`` and ``/health`` on Starlette.

A route reads and checks its body (:mod:`.schema`), has it translated into hasten's one request
object per sample (:mod:`.translate`: tokenized off the event loop, the endpoint's budget, ``n`` and
``best_of``), starts each as a row of the decode thread's batch (:mod:`.rows`, :mod:`.worker`) and
answers with what they decode (:mod:`.render`): one JSON answer or server-sent events ending in
``data: [DONE]``. A client that goes away cancels its rows; so does a stop string found in the text.
"""
from __future__ import annotations

import hmac
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..core.errors import FieldError
from .metrics import CONTENT_TYPE, Metrics
from .render import Renderer
from .rows import Rows
from .schema import DEFAULT_MAX_TOKENS, APIError, Params, parse_body, parse_messages, parse_params, parse_prompts
from .structured import parse_structured
from .tool_parsers import FORMATS, format_for_template
from .translate import Sample, Translator
from .worker import Worker

OPEN_PATHS = ("/health",)  # answered without an API key, for load balancers' probes
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class ServeOptions:
    model_name: str  # what clients pass as "model"
    api_key: str | None = None  # None: no authentication
    max_body_bytes: int = 1 << 20
    # "raw": the model's own log-probabilities (vLLM's default); "processed": under each request's
    # logit rules and sampling transform, the law its tokens were drawn from
    logprobs_mode: str = "raw"
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # the most tokens a request that sets no max_tokens gets
    pool_file: str | None = None  # the drafter's shared pool: loaded at start where the file exists, saved at exit
    # how the model writes tool calls (tool_choice "auto"): a name of serve.tool_parsers.FORMATS; None: the
    # one its chat template asks for (Hermes where it shows no tools: hasten writes them so)
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in FORMATS:
            raise FieldError("tool_call_parser", "invalid_value", f"{{field}} must be one of {', '.join(FORMATS)}, "
                             f"got {self.tool_call_parser!r}")
        if self.logprobs_mode not in ("raw", "processed"):
            raise FieldError("logprobs_mode", "invalid_value",
                             f"{{field}} must be raw or processed, got {self.logprobs_mode!r}")
        if isinstance(self.default_max_tokens, bool) or not isinstance(self.default_max_tokens, int) \
                or self.default_max_tokens < 1:
            raise FieldError("default_max_tokens", "invalid_value",
                             f"{{field}} must be an integer >= 1, got {self.default_max_tokens!r}")


class Service:
    """The routes: each reads and checks its body (:mod:`.schema`), has it translated into
    requests (:mod:`.translate`), starts their rows (:mod:`.rows`) and answers with what they
    decode (:mod:`.render`)."""

    def __init__(self, engine, worker: Worker, metrics: Metrics, options: ServeOptions):
        self.engine, self.worker, self.metrics, self.options = engine, worker, metrics, options
        self.tool_format = tool_format_of(engine.tokenizer, options.tool_call_parser)
        self.tool_markers = self.tool_format.special(engine.tokenizer)  # written as tokens in its grammars
        self.translate = Translator(engine, options.default_max_tokens, options.logprobs_mode == "processed",
                                    self.tool_format)
        self.encode = self.translate.encode  # the encoder thread (tests look at it)
        self.rows = Rows(worker, metrics, engine.tokenizer)
        self.render = Renderer(engine.method, engine.tokenizer)
        self.context = engine.runtime.context_length
        self.created = int(time.time())

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
        params = replace(parse_params(body), structured=parse_structured(body, chat=False))
        self._check_model(params.model)
        samples = await self.translate.completion(parse_prompts(body), params)  # every prompt before any row starts
        return await self._answer(request, "completion", samples, params)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        body = await self._read_json(request)
        params = parse_params(body, ("max_tokens", "max_completion_tokens"), chat=True)
        params = replace(params, structured=parse_structured(body, chat=True, tool_format=self.tool_format,
                                                             special=self.tool_markers))
        self._check_model(params.model)
        asked_as = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        # the tools reach the template when the model may call them (tool_choice none: the tools are ignored)
        tools = body["tools"] if params.structured is not None and params.structured.tool else None
        samples = await self.translate.chat(parse_messages(body), params, asked_as, tools)
        return await self._answer(request, "chat", samples, params)

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

    # ---- answering ---------------------------------------------------------------------------------
    async def _answer(self, request: HTTPRequest, kind: str, samples: list[Sample], params: Params) -> Response:
        gens = self.rows.start(samples, params)
        ids = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": ids, "created": int(time.time()), "model": self.options.model_name}
        if params.stream:
            return EventStream(self.render.stream(self.rows, gens, kind, head, params), media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
        texts, lasts, reasons = [""] * len(gens), [None] * len(gens), [None] * len(gens)
        try:
            async with aclosing(self.rows.merged(gens, request.is_disconnected)) as updates:
                async for index, piece, last, reason in updates:
                    texts[index] += piece
                    lasts[index], reasons[index] = last, reason
                    gens[index].record(last)
        except ConnectionAbortedError:
            return Response(status_code=499)  # nobody reads it; the rows are already cancelled
        return JSONResponse(self.render.body(kind, head, gens, texts, lasts, reasons, params))

    def _model_card(self) -> dict:
        """OpenAI's card, with vLLM's ``max_model_len`` (the context; null where the model sets
        none) and what hasten adds: the method and the default max_tokens."""
        return {"id": self.options.model_name, "object": "model", "created": self.created, "owned_by": "hasten",
                "max_model_len": self.context, "method": self.engine.method,
                "default_max_tokens": self.options.default_max_tokens}


def tool_format_of(tokenizer, name: str | None):
    """The tool-call format: the one named (``--tool-call-parser``), else the chat template's."""
    return FORMATS[name] if name is not None else format_for_template(getattr(tokenizer, "chat_template", None))


class EventStream(StreamingResponse):
    """Server-sent events whose generator is always closed when the response ends, however it
    ends, so the row's ``finally`` (cancel) runs at once rather than when the garbage is collected."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


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
    # one pool serves every request of the server, whichever client sent it (docs/serve.md)
    pool = engine.pool if options.pool_file is None else engine.open_pool(options.pool_file)
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
            service.translate.close()
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


def scheduler_factory(engine, max_batch: int = 32, max_tokens_in_flight: int | None = None,
                      max_prefill_tokens: int | None = None, kv_cache_bytes: int | None = None,
                      max_num_batched_tokens: int | None = None) -> Callable[[], object]:
    """Builds the continuous-batching scheduler over the engine's model and drafter."""
    from ..engine.batch import Scheduler

    def make():
        return Scheduler(engine.runtime, engine.drafter, max_batch=max_batch, max_tokens_in_flight=max_tokens_in_flight,
                         draft_size=engine.draft_size, max_prefill_tokens=max_prefill_tokens,
                         kv_cache_bytes=kv_cache_bytes, max_num_batched_tokens=max_num_batched_tokens)

    return make
