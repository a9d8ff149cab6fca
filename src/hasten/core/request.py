"""One generation as asked: the request object every door builds (``hasten.generate``, the
``Engine``, the command line through it, the server's translation of an HTTP body) and the decode
loop carries down to its :class:`~hasten.engine.sequence.Sequence`.

It is checked once, at admission (:meth:`Request.check`, against the model's runtime: vocabulary,
context, capabilities), and nowhere else; a refusal is a :class:`~hasten.core.errors.FieldError`
naming the request's field, which each door shows in its own words (the server with its API's
names). A new per-request feature is one field here and one hook where it acts: the drafting
switch :attr:`Request.speculate` is read once, where a sequence is made (a row that does not
speculate decodes plainly, in any batch); so is :attr:`Request.pool`, which keeps a row out of its
drafter's shared pool (the drafter's context carries it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .constraint import Constraint, check_constraint
from .errors import FieldError
from .runtime import Capability, Runtime
from .sampling import Sampling


@dataclass
class Request:
    input_ids: list[int]  # prompt ids, at least one
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    seed: int | None = None  # seeds this row's own generator (sampling); ignored when generator is given
    eos_token_ids: frozenset[int] | None = None  # None: the model's generation config
    stop: Any = None  # engine.stops.StopStrings: ends the row after the token that completes a stop string
    generator: torch.Generator | None = None  # a generator shared with other rows (hasten.generate's)
    logprobs: int | None = None  # score every generated token, with this many alternatives each (None: no scoring)
    processed_logprobs: bool = False  # score under the request's logit rules and sampling transform (else raw)
    prompt_logprobs: int | None = None  # score the prompt's tokens from the prefill, with this many alternatives
    stop_token_ids: frozenset[int] = frozenset()  # end the row after any of these, as after EOS (vLLM's)
    ignore_eos: bool = False  # EOS does not end the row (it may still be generated; min_tokens holds it back)
    resumed: int = 0  # the last ``resumed`` input ids were generated already (a continuation): penalties count them
    speculate: bool = True  # draft and verify (False: plain decoding, the same text, no drafting cost)
    # a drafter that learns across requests (lookahead, suffix) may draft from its shared pool and add this
    # request's text to it (False: neither; it drafts from a private pool that ends with the request)
    pool: bool = True
    model_inputs: dict = field(default_factory=dict)  # a vision-language prompt's images (pixel_values, ...)
    # the generated text follows it (structured output): a compiled core.constraint.Constraint, shared by the
    # request's rows; each row's Sequence walks it with a matcher of its own (a continuation replays its tokens)
    constraint: Constraint | None = None

    # ---- admission ---------------------------------------------------------------------------------
    def check(self, runtime: Runtime) -> None:
        """Every field against the model (``runtime``): FieldError naming the first bad one."""
        budget = self.max_new_tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise FieldError("max_new_tokens", "invalid_value", f"{{field}} must be an integer >= 0, got {budget!r}")
        ids = self.input_ids
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise FieldError("input_ids", "invalid_value", "{field} must be a non-empty list of token ids")
        vocab = runtime.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError("input_ids", "invalid_value",
                             f"{{field}} contains token id {bad}, outside the model's vocabulary [0, {vocab})")
        check_positions(runtime, len(ids), budget)
        if not isinstance(self.sampling, Sampling):
            raise TypeError(f"sampling must be a hasten Sampling, got {type(self.sampling).__name__}")
        self.sampling.check_vocab(vocab)
        stop_ids = self.stop_token_ids
        if not isinstance(stop_ids, (set, frozenset, list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop_ids):
            raise FieldError("stop_token_ids", "invalid_value",
                             f"{{field}} must be token ids in the model's vocabulary [0, {vocab}), got {stop_ids!r}")
        if self.sampling.min_tokens > budget:
            raise FieldError("min_tokens", "invalid_value",
                             f"{{field}} must be in [0, max_new_tokens], got {self.sampling.min_tokens}")
        allowed = self.sampling.allowed_token_ids
        if self.sampling.min_tokens and allowed is not None and set(allowed) <= self.suppressed_ids(runtime):
            raise FieldError("min_tokens", "invalid_value",
                             "{field} holds back every token allowed_token_ids allows (they all end the row)")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise FieldError("seed", "invalid_value", f"{{field}} must be an integer or None, got {self.seed!r}")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(self.generator).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
                raise FieldError(name, "invalid_value", f"{{field}} must be an integer >= 0 or None, got {count!r}")
        if self.prompt_logprobs is not None and Capability.PROMPT_LOGITS not in runtime.capabilities:
            raise FieldError("prompt_logprobs", "unsupported_parameter",
                             "{field} needs the prefill's logits, which this model's runtime does not keep")
        for name in ("speculate", "pool"):
            if not isinstance(getattr(self, name), bool):
                raise FieldError(name, "invalid_value", f"{{field}} must be true or false, got {getattr(self, name)!r}")
        if self.constraint is not None:
            check_constraint(self.constraint, vocab, self.ending_ids(runtime), self.sampling, self.ignore_eos)
        runtime.check_prompt_inputs(torch.tensor([ids]), self.model_inputs)

    def admit(self, runtime: Runtime) -> "Request":
        """The request checked, with the model's defaults filled in (its EOS ids, the generator
        a seed asks for): what a :class:`~hasten.engine.sequence.Sequence` is made from."""
        self.check(runtime)
        return self.replace(eos_token_ids=self.eos_ids(runtime), generator=self.own_generator(runtime.device))

    # ---- what the decode loop reads -------------------------------------------------------------
    def eos_ids(self, runtime: Runtime | None = None) -> frozenset[int]:
        """The EOS ids asked for, else the model's (its generation config's; an admitted
        request has them already)."""
        if self.eos_token_ids is not None:
            return frozenset(self.eos_token_ids)
        if runtime is None:
            raise ValueError("this request has no EOS ids yet: admit it with the model's runtime first")
        return runtime.eos_token_ids()

    def ending_ids(self, runtime: Runtime | None = None) -> frozenset[int]:
        """The tokens that end the row: EOS (unless ignored) and the stop ids."""
        return (frozenset() if self.ignore_eos else self.eos_ids(runtime)) | frozenset(self.stop_token_ids)

    def suppressed_ids(self, runtime: Runtime | None = None) -> frozenset[int]:
        """What min_tokens holds back: EOS (even with ignore_eos, as vLLM) and the stop ids."""
        return self.eos_ids(runtime) | frozenset(self.stop_token_ids)

    def own_generator(self, device: torch.device) -> torch.Generator | None:
        """The generator the row draws from: the one given, else one seeded with ``seed``."""
        if self.generator is None and self.seed is not None:
            return torch.Generator(device).manual_seed(self.seed)
        return self.generator

    def replace(self, **changes) -> "Request":
        return dataclasses.replace(self, **changes)


def check_positions(runtime: Runtime, prompt_length: int, max_new_tokens: int) -> None:
    """FieldError naming both numbers when the prompt, or the prompt and the tokens asked for,
    need more positions than the model has. An encoder-decoder reads the prompt in its encoder
    and writes the new tokens after one start token in its decoder."""
    limit = runtime.context_length
    if limit is None:
        return
    if prompt_length > limit:
        raise FieldError("input_ids", "context_length_exceeded",
                         f"the prompt has {prompt_length} tokens, more than the model's context of {limit} positions")
    if runtime.encoder_decoder:
        needed, room, where = 1 + max_new_tokens, limit - 1, f"the model's decoder has {limit} positions"
    else:
        needed, room = prompt_length + max_new_tokens, limit - prompt_length
        where = f"the prompt has {prompt_length} tokens and the model {limit} positions"
    if needed > limit:
        raise FieldError("max_new_tokens", "context_length_exceeded",
                         f"{{field}}={max_new_tokens} does not fit: {where}, room for at most {room} new tokens")


def room_for(runtime: Runtime, prompt_length: int) -> int | None:
    """The most new tokens a prompt of ``prompt_length`` leaves room for (None: no limit known)."""
    limit = runtime.context_length
    if limit is None:
        return None
    return limit - 1 if runtime.encoder_decoder else limit - prompt_length
