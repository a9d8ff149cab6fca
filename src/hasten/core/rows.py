"""The row contract: what the decode step exchanges with whatever runs the target, on the ground
floor so that drafters (and :mod:`hasten.vllm`, which wraps them inside vLLM) never import model
code to speak it.

A *row* is one sequence's share of the target: a one-row session (Hugging Face's
``ModelAdapter``, llama.cpp's session) or one row of a batch. The step hands the target one
block per row (the root token and the row's draft, a chain or a tree) and gets one
:class:`ForwardOutput` back per row. :class:`Riders` are extra placeholder positions a drafter
(hidden transfer) may hang on a verification forward, when the runtime declares
``Capability.RIDERS``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .tree import TokenTree


@dataclass(frozen=True)
class Riders:
    """Placeholder positions riding on a verification forward (hidden transfer): ``count``
    of them after every block position ``b``, in causal order, seeing what ``b`` sees plus
    ``b`` itself; their input to decoder layer ``layer`` is ``transfer(h_b)``, ``h_b`` being
    ``b``'s input to that layer (the layers below never run them). Real tokens never see
    them, so verification is unchanged, and their cache entries are dropped with the
    rejected nodes."""

    count: int
    layer: int
    transfer: Callable[[torch.Tensor], torch.Tensor]  # [..., hidden] -> [..., count, hidden]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [block, vocab] float32
    hidden: torch.Tensor | None  # [block, hidden] last layer, when asked for
    riders: torch.Tensor | None = None  # [block, count, vocab] rider logits, when riders were given
    embeds: torch.Tensor | None = None  # [block, embed] the inputs the language model read (an image prefill's)
    # [n, hidden] last layer at the row's deferred prompt tokens this forward ran before its block (its prompt's
    # last n), when hidden states were asked for; None when it ran none
    prompt_hidden: torch.Tensor | None = None


class RowCache(Protocol):
    """One sequence's target: its model, and its rows of the KV cache. A ModelAdapter is
    one; so is a BatchRow. Drafters see a :class:`~hasten.drafters.base.TargetView` of it."""

    model: object
    vocab_size: int
    encoder_decoder: bool
    trees_ok: bool
    prompt_embeds: torch.Tensor | None  # [T - 1, embed] what an image prefill fed the language model
    kv_readable: bool  # whether read_kv, read_all_kv and probe_queries answer (one sequence's full cache)

    @property
    def cache_length(self) -> int: ...

    def commit(self, start: int, tree: TokenTree, accepted: tuple[int, ...]) -> None: ...

    def crop(self, new_length: int) -> None: ...


class Target(Protocol):
    """Runs one block per sequence, all in one forward. ``riders`` (per row) is passed only
    when a draft carries riders, which only a target with ``Capability.RIDERS`` is given.
    The outputs are read before the next ``forward_rows`` (the decode step does): a target may
    hand out views of its own buffers that the next forward overwrites (llama.cpp's logits)."""

    def forward_rows(self, rows: list[RowCache], blocks: list[list[int]], trees: list[TokenTree],
                     hidden: bool, **riders: list[Riders | None]) -> list[ForwardOutput]: ...
