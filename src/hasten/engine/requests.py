"""The one place a generation's keywords become a :class:`~hasten.core.request.Request`.

``hasten.generate`` (one prompt or a batch), :class:`hasten.Engine` (and the command line through
it) and the server's translation of an HTTP body all call :func:`request_from`, so a keyword means
the same through every door and a new per-request field is added here once. The request is checked
when the loop or the scheduler admits it (:meth:`Request.admit`), not here.
"""
from __future__ import annotations

from ..core.constraint import Constraint
from ..core.request import Request
from ..core.sampling import Sampling
from .stops import StopStrings


def request_from(
    input_ids: list[int],
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    generator=None,
    stop: str | list[str] | StopStrings | None = None,
    tokenizer=None,
    eos_token_ids: frozenset[int] | None = None,
    stop_token_ids: frozenset[int] = frozenset(),
    ignore_eos: bool = False,
    speculate: bool = True,
    pool: bool = True,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    processed_logprobs: bool = False,
    model_inputs: dict | None = None,
    constraint: Constraint | None = None,
    **rules,
) -> Request:
    """A request for ``input_ids``. ``sampling``: built already (the server's, checked under its
    API's names); else built from ``temperature``, ``top_k``, ``top_p`` and ``rules`` (the other
    fields of :class:`~hasten.core.sampling.Sampling`: ``min_p``, the penalties, ``logit_bias``,
    ``allowed_token_ids``, ``min_tokens``). ``stop``: stop strings read with ``tokenizer`` (or a
    :class:`StopStrings` already built, shared by a batch's rows). ``seed`` seeds the row's own
    generator; ``generator``: one shared with other rows instead. ``eos_token_ids`` None: the
    model's (filled in at admission). The rest are :class:`Request`'s fields of the same names."""
    if sampling is None:
        sampling = Sampling(temperature, top_k, top_p, **rules)
    elif rules or (temperature, top_k, top_p) != (0.0, None, None):
        raise ValueError("give request_from a Sampling or its settings, not both")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    if not isinstance(stop, StopStrings):
        stop = StopStrings(tokenizer, stop or [])
    return Request(list(input_ids), max_new_tokens, sampling, seed=seed, eos_token_ids=eos_token_ids, stop=stop,
                   generator=generator, logprobs=logprobs, processed_logprobs=processed_logprobs,
                   prompt_logprobs=prompt_logprobs, stop_token_ids=frozenset(stop_token_ids), ignore_eos=ignore_eos,
                   speculate=speculate, pool=pool, model_inputs=model_inputs or {}, constraint=constraint)
