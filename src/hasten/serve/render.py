"""Rendering: a request's decoded rows as OpenAI's answers. One JSON body (choices, the n best of
``best_of`` samples, log-probabilities, usage) or server-sent events ending in ``data: [DONE]``;
each with hasten's own numbers under the extra field ``hasten`` (the method, tokens per step,
drafted, accepted and forced tokens, acceptance per draft position, the time queued). A tool
request's text is answered as OpenAI's ``tool_calls``: with ``tool_choice`` ``"required"`` or a named
function streamed as one delta once complete; with ``"auto"`` streamed as vLLM streams them (the content
before the first call, then each call's name and the deltas of its arguments, :class:`.tool_parsers.ToolStream`).
"""
from __future__ import annotations

import json
from contextlib import aclosing
from typing import AsyncIterator

from .logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from .rows import Generation, Rows
from .schema import APIError, Params
from .structured import tool_calls
from .tool_parsers import ToolStream


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class Renderer:
    def __init__(self, method: str, tokenizer):
        self.method = method
        self.token_text = TokenText(tokenizer)

    # ---- one JSON answer ------------------------------------------------------------------------
    def body(self, kind: str, head: dict, gens: list[Generation], texts: list[str], lasts: list, reasons: list,
             params: Params) -> dict:
        usage = usage_of(gens, params.best_of)  # every sample's tokens, the unchosen ones too (as OpenAI)
        if params.best_of > params.n:
            keep = best(gens, params)
            gens, texts, lasts, reasons = ([items[i] for i in keep] for items in (gens, texts, lasts, reasons))
        if kind == "chat":
            choices = [{"index": i, **message(text, reason, params), "logprobs": self.logprobs(gen, params, chat=True)}
                       for i, (gen, text, reason) in enumerate(zip(gens, texts, reasons))]
            # vLLM's prompt_logprobs: the request's, beside the choices (null when not asked, as vLLM)
            body = {**head, "object": "chat.completion", "choices": choices,
                    "prompt_logprobs": self.prompt_logprobs(gens[0], params)}
        else:
            choices = [{"index": i, "text": gen.echo + text, "finish_reason": reason,
                        "logprobs": self.logprobs(gen, params, echo=True),
                        "prompt_logprobs": self.prompt_logprobs(gen, params)}  # vLLM's: each choice's prompt
                       for i, (gen, text, reason) in enumerate(zip(gens, texts, reasons))]
            body = {**head, "object": "text_completion", "choices": choices}
        return {**body, "usage": usage, "hasten": self.all_stats(lasts)}

    # ---- server-sent events -----------------------------------------------------------------------
    async def stream(self, rows: Rows, gens: list[Generation], kind: str, head: dict,
                     params: Params) -> AsyncIterator[str]:
        chat = kind == "chat"
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def extra(index: int) -> dict:
            """An event's usage: none unless asked; with continuous_usage_stats the choice's so far
            (its prompt and the tokens it generated), as vLLM; else null until the last event."""
            if not params.include_usage:
                return {}
            return {"usage": usage_of([gens[index]], 1) if params.continuous_usage else None}

        def chunk(index: int, piece: str | None, reason: str | None, logprobs: dict | None = None, **more) -> str:
            if chat:
                delta = {} if piece is None else {"content": piece}
                choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": piece or "", "finish_reason": reason, "logprobs": logprobs}
            return sse({**head, "choices": [choice], **extra(index), **more})

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
                                                "finish_reason": None, "logprobs": None}], **extra(index)})
        lasts = [None] * len(gens)
        tool = params.structured.tool if chat and params.structured is not None else None
        calling = tool is not None and tool != "auto"
        held = [""] * len(gens)  # a required or named tool request's text, sent as its calls once complete
        # an auto tool request's text, read as it grows: content, then each call's name and arguments
        streams = [ToolStream(params.structured.format) for _ in gens] if tool == "auto" else None
        try:
            # aclosing: when the client leaves, the rows' generators close (and cancel) at once
            async with aclosing(rows.merged(gens)) as updates:
                async for index, piece, last, reason in updates:
                    if lasts[index] is None and params.echo:  # a completion's first event: the prompt first
                        yield scored_chunk(index, gens[index].echo, last.prompt_logprobs or [], prompt=True)
                    lasts[index] = last
                    if calling:
                        held[index] += piece
                        piece = ""
                    if streams is not None:
                        held[index] += piece
                        for delta in streams[index].push(piece, final=reason is not None):
                            yield sse({**head, "choices": [{"index": index, "delta": delta, "finish_reason": None,
                                                            "logprobs": None}], **extra(index)})
                        piece = ""
                    event = scored_chunk(index, piece, last.logprobs or [])
                    if event is not None:
                        yield event
                    if reason is not None and streams is not None:
                        reason = message(held[index], reason, params)["finish_reason"]
                    if reason is not None:
                        if calling:
                            answer = message(held[index], reason, params)
                            calls = answer["message"].get("tool_calls")
                            delta = {"tool_calls": [{"index": j, **call} for j, call in enumerate(calls)]} if calls \
                                else {"content": held[index]}
                            yield sse({**head, "choices": [{"index": index, "delta": delta, "finish_reason": None,
                                                            "logprobs": None}], **extra(index)})
                            reason = answer["finish_reason"]
                        yield chunk(index, None if chat else "", reason, hasten=self.stats(lasts[index]))
        except APIError as err:
            yield sse(err.body())
            yield "data: [DONE]\n\n"
            return
        if params.include_usage:
            yield sse({**head, "choices": [], "usage": usage_of(gens, params.best_of), "hasten": self.all_stats(lasts)})
        yield "data: [DONE]\n\n"

    # ---- log-probabilities, as each route shows them (computed by the scheduler: engine.logprobs) --------
    def logprobs(self, gen: Generation, params: Params, chat: bool = False, echo: bool = False) -> dict | None:
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

    def prompt_logprobs(self, gen: Generation, params: Params) -> list | None:
        if params.prompt_logprobs is None:
            return None
        return prompt_logprobs(gen.prompt_scored or [], params.prompt_logprobs, self.token_text)

    # ---- hasten's numbers ----------------------------------------------------------------------------
    def all_stats(self, updates: list) -> dict:
        """hasten's numbers: one choice's as they are, several choices' one entry each."""
        if len(updates) == 1:
            return self.stats(updates[0])
        return {"method": self.method, "choices": [self.stats(update) for update in updates]}

    def stats(self, update) -> dict:
        """One row's numbers: tokens per target forward (tau, the mean accepted length with the
        bonus token), steps, drafted and accepted draft tokens (and of those, the text a
        constraint forced), acceptance per draft position, whether it speculated, and its time queued."""
        if update is None:
            return {"method": self.method, "tau": 0.0, "steps": 0, "drafted_tokens": 0, "accepted_tokens": 0,
                    "forced_tokens": 0, "acceptance_by_position": []}
        stats = update.stats
        return {"method": self.method, "tau": round(stats.mean_accepted, 4), "steps": stats.steps,
                "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
                "forced_tokens": stats.forced_tokens,
                "acceptance_by_position": [round(a, 4) for a in stats.acceptance_by_position],
                "speculated": update.speculated, "queued_seconds": round(update.queued_seconds, 6)}


def message(text: str, reason: str | None, params: Params) -> dict:
    """A chat choice's message and finish reason: the text, or for a tool request the calls its
    text makes (OpenAI's ``tool_calls``, finish reason "tool_calls"; the text as content when
    max_tokens or a stop string cut the call short; with ``tool_choice`` auto, the text before the
    first call as content and the complete calls)."""
    structured = params.structured
    calls = tool_calls(structured, text) if structured and structured.tool else None
    if calls is None:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": reason}
    if structured.tool == "auto":  # the free text before the first call, as vLLM's parsers answer it; a
        # complete call makes the reason tool_calls even where text after it ran out of tokens (as vLLM)
        content = structured.format.parse(text, final=True).content or None
        message_ = {"role": "assistant", "content": content, "tool_calls": calls}
        return {"message": message_, "finish_reason": "tool_calls"}
    return {"message": {"role": "assistant", "content": None, "tool_calls": calls},
            "finish_reason": "tool_calls" if reason == "stop" else reason}


def usage_of(gens: list[Generation], n: int) -> dict:
    """Each prompt's tokens once (its ``n`` choices read the same prompt); every choice's tokens."""
    prompt = sum(gen.prompt_tokens for gen in gens[::n])
    completion = sum(gen.generated for gen in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def best(gens: list[Generation], params: Params) -> list[int]:
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
