"""Request translation: an API body, parsed (:mod:`.schema`), to hasten's one request object
(:class:`~hasten.core.request.Request`), one per sample.

What an API call means and hasten's request does not know lives here: the prompt's text
(tokenized off the event loop, :class:`Encoder`), the endpoint's token budget when the body sets
none, ``n`` and ``best_of`` (several samples of a prompt, sample j seeded ``seed + j``), the
scoring a ranking or an echo needs, the structured output asked for (:mod:`.structured`, compiled
off the event loop onto each sample's request), and the API's names for the request's fields, which
a refusal at admission (a :class:`~hasten.core.errors.FieldError`) is shown in. Whether the request
fits the model (its token ids, ``max_tokens`` against the context) is checked once, at admission,
by the request itself.
"""
from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from ..core.errors import FieldError
from ..core.request import Request, room_for
from ..core.sampling import Sampling
from ..engine.requests import request_from
from ..engine.stops import StopStrings
from .chat import ChatTemplate
from .schema import MAX_SEED, APIError, Params, invalid

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
UNBOUNDED_MAX_TOKENS = 1 << 16  # the cap on max_tokens for a model whose config sets no context


@dataclass(frozen=True)
class Sample:
    """One row to start: its request, and what the answer needs that the row does not."""

    request: Request
    echo: str = ""  # the prompt's text, when the answer starts with it
    names: dict[str, str] = field(default_factory=dict)  # the request's field -> the API's name for it

    def refusal(self, err: FieldError) -> APIError:
        """A refusal at admission (or of a constraint mid-row), in the API's words."""
        param = self.names.get(err.field, err.field)
        return invalid(param, err.render(param), err.code)


class Encoder:
    """Prompts and chats to input ids on a thread of their own, so a long prompt never holds up
    the event loop (other requests' streamed tokens, /health). The thread encodes with its own
    copy of the tokenizer: a Rust fast tokenizer refuses to encode on one thread while another
    uses it ("Already borrowed"), and the event loop decodes streamed text, the decode thread
    reads stop strings, with the engine's."""

    def __init__(self, engine, tool_format):
        self.engine = copy.copy(engine)  # the engine's encode, with a private tokenizer
        self.engine.tokenizer = copy.deepcopy(engine.tokenizer)
        self.template = ChatTemplate(self.engine.tokenizer, tool_format)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="hasten-encode")

    async def text(self, prompt: str) -> list[int]:
        return await self._run(self.engine.encode, prompt)

    async def chat(self, messages: list[dict], tools: list[dict] | None = None, write_tools: bool = True) -> list[int]:
        """The chat through the template (:mod:`.chat`); a refusal is a 400 naming the message."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.template.encode, messages, tools,
                                                                 write_tools)

    async def compile(self, spec):
        """A structured-output spec compiled for the model, on this thread (the grammar engine reads
        this thread's private tokenizer; the compile itself is bounded in time and cached)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.engine.constraint, spec)

    async def _run(self, encode: Callable, argument) -> list[int]:
        ids = await asyncio.get_running_loop().run_in_executor(self.pool, encode, argument)  # [1, T]
        return ids[0].tolist()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class Translator:
    def __init__(self, engine, default_max_tokens: int, processed_logprobs: bool, tool_format=None):
        self.engine, self.runtime = engine, engine.runtime
        self.default_max_tokens = default_max_tokens
        self.processed_logprobs = processed_logprobs
        self.encode = Encoder(engine, tool_format)

    async def completion(self, prompts: list[str | list[int]], params: Params) -> list[Sample]:
        """Every sample of a completion's prompts, in the order of the response's choices."""
        constraint = await self.constraint(params)
        samples = []
        for prompt in prompts:
            ids = await self.encode.text(prompt) if isinstance(prompt, str) else prompt
            budget = self.budget(len(ids), params.max_tokens, DEFAULT_COMPLETION_TOKENS, "prompt")
            echo = (prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)) if params.echo else ""
            samples += self.samples(ids, budget, params, echo, {"input_ids": "prompt", "max_new_tokens": "max_tokens"},
                                    constraint)
        return samples

    async def chat(self, messages: list[dict], params: Params, asked_as: str,
                   tools: list[dict] | None = None) -> list[Sample]:
        """The samples of a chat (``asked_as``: the body's name for its budget, ``max_tokens``
        or ``max_completion_tokens``; ``tools``: shown to the chat template, for a tool request)."""
        auto = params.structured is not None and params.structured.tool == "auto"
        try:
            ids = await self.encode.chat(messages, tools, write_tools=auto)
        except ValueError as err:  # no chat template, or the template refused the messages
            raise invalid("messages", str(err)) from None
        budget = self.budget(len(ids), params.max_tokens, None, "messages")
        constraint = await self.constraint(params)
        return self.samples(ids, budget, params, "", {"input_ids": "messages", "max_new_tokens": asked_as}, constraint)

    async def constraint(self, params: Params):
        """The request's structured output compiled, off the event loop (None: free text)."""
        if params.structured is None:
            return None
        try:
            return await self.encode.compile(params.structured.spec)
        except FieldError as err:
            raise invalid(params.structured.field, f"'{params.structured.field}': {err}", err.code) from None

    def budget(self, prompt_tokens: int, asked: int | None, default: int | None, prompt_param: str) -> int:
        """The tokens a request may generate: what it asked (checked at admission), else the
        endpoint's default (None: the room the context leaves, as OpenAI's chat), at most the
        operator's ``default_max_tokens`` and the room left."""
        if asked is not None:
            return asked
        room = room_for(self.runtime, prompt_tokens)
        room = UNBOUNDED_MAX_TOKENS if room is None else room
        if room < 1:
            raise invalid(prompt_param, f"the prompt has {prompt_tokens} tokens, and the model's context of "
                                        f"{self.runtime.context_length} positions leaves no room for a new one",
                          "context_length_exceeded")
        return min(room, self.default_max_tokens, room if default is None else default)

    def samples(self, ids: list[int], budget: int, params: Params, echo: str, names: dict[str, str],
                constraint=None) -> list[Sample]:
        """``params.best_of`` samples of one prompt (= ``n`` unless asked), each following
        ``constraint`` (compiled; None: free text); sample j of a seeded request seeds ``seed + j``,
        so choice 0 is the single request's."""
        try:
            sampling = Sampling.asked(params.temperature, params.top_k, params.top_p, **params.rules)
        except ValueError as err:
            raise invalid(None, str(err)) from None
        stop = StopStrings(self.engine.tokenizer, list(params.stop)) if params.stop else None
        if params.structured is not None:  # a constraint's refusal names the field that asked for it
            names = {**names, "constraint": params.structured.field}
        samples = []
        for j in range(params.best_of):
            seed = None if params.seed is None else (params.seed + j) % (MAX_SEED + 1)
            request = request_from(ids, budget, sampling=sampling, seed=seed, stop=stop, logprobs=scoring(params),
                                   prompt_logprobs=prompt_scoring(params), processed_logprobs=self.processed_logprobs,
                                   stop_token_ids=frozenset(params.stop_token_ids), ignore_eos=params.ignore_eos,
                                   speculate=params.speculate, pool=params.pool, constraint=constraint)
            samples.append(Sample(request, echo, names))
        return samples

    def close(self) -> None:
        self.encode.close()


def scoring(params: Params) -> int | None:
    """Alternatives to score each generated token with: ``logprobs``, or 0 to rank ``best_of``
    samples (None: no scoring)."""
    if params.logprobs is None and params.best_of > params.n:
        return 0
    return params.logprobs


def prompt_scoring(params: Params) -> int | None:
    """Alternatives to score each prompt token with: ``prompt_logprobs``, and ``logprobs`` for
    an echoed prompt (None: the prefill keeps no logits)."""
    wanted = [count for count in (params.prompt_logprobs, params.logprobs if params.echo else None) if count is not None]
    return max(wanted) if wanted else None
