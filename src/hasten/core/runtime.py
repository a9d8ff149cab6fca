"""The Runtime protocol: what the engine needs of whatever runs the target model.

A runtime is a plug-in, as a drafter is. Hugging Face transformers
(:class:`hasten.models.hf.HuggingFaceRuntime`) and llama.cpp
(:class:`hasten.models.llamacpp.LlamaCppModel`) are two; a third subclasses :class:`Runtime`
in one new file (docs/architecture.md has a complete small one, which a test runs). The
engine asks the runtime for its vocabulary, context, EOS ids, one-row session, many-row
batch, cost key and block timing, and never inspects a model object to find out what it is.

A runtime declares its :class:`Capability` set and a drafter the capabilities it needs
(``Drafter.needs``); the two are matched once, before any forward, and a mismatch is one
:class:`MissingCapability` naming what is missing.
"""
from __future__ import annotations

import contextlib
from enum import Enum
from typing import Any, Callable, ClassVar, Iterator

import torch

from .errors import FieldError


class Capability(str, Enum):
    """What a runtime can do for a drafter beyond verifying a chain of tokens."""

    TREES = "tree verification"  # a tree draft in one forward (else the loop verifies its main chain)
    FEATURES = "hidden states"  # the target's last-layer hidden states of every verified position
    MODULES = "torch modules"  # the target's own modules: LM head, embeddings, rotary, layers
    KV_READ = "KV read-back"  # the target's cached keys and values, readable as tensors
    QUERY_CAPTURE = "query capture"  # the attention queries of a forward, recorded per layer
    RIDERS = "riders"  # extra placeholder positions on a verification forward (hidden transfer)
    IMAGES = "image inputs"  # a vision-language prefill (pixel_values, ...)
    PROMPT_LOGITS = "prompt logits"  # the prefill's logits at every prompt position (prompt log-probabilities)

    def __str__(self) -> str:
        return self.value


class MissingCapability(FieldError):
    """A drafter needs what a runtime does not provide: refused before any forward."""

    def __init__(self, method: str, runtime: str, missing: frozenset[Capability], batched: bool = False):
        names = ", ".join(sorted(str(capability) for capability in missing))
        where = " in a batch (decode such requests one at a time)" if batched else ""
        super().__init__("method", "unsupported_method",
                         f"{method} needs {names}, which the {runtime} runtime does not provide{where}; "
                         "prompt_lookup, lookahead and draft_model run on every runtime")
        self.missing = missing


class Runtime:
    """Base of every runtime. Subclasses set the attributes and implement the methods below.

    A *session* is one generation's target (the decode step's one-row interface:
    ``start``, ``forward_rows``, ``commit``, ``crop``, ``cache_length``); a *batch* holds
    many rows in one cache (``add``, ``remove``, ``forward_rows``), for continuous batching.
    """

    name: str  # the runtime's name for messages: "Hugging Face", "llama.cpp"
    label: str  # the model's name for messages: its directory, file or class
    source: str = ""  # where the model was loaded from (a directory or file), "" if not from disk
    capabilities: frozenset[Capability] = frozenset()
    unbatched: frozenset[Capability] = frozenset()  # capabilities a session has and a batch does not
    vocab_size: int
    context_length: int | None  # positions one sequence may use; None: no limit is known
    encoder_decoder: bool = False
    device: torch.device = torch.device("cpu")  # where the loop puts prompts and generators
    # block sizes cost-aware sizing times (positions per forward): up to 128, so that a batch, whose
    # forward runs rows x widest block positions, is priced from measurements
    calibration_sizes: ClassVar[tuple[int, ...]] = (1, 2, 4, 8, 16, 32, 64, 128)

    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a generation by default (the model's generation config)."""
        raise NotImplementedError

    def check_prompt_inputs(self, input_ids: torch.Tensor, model_inputs: dict) -> None:
        """Refuse a prompt's extra inputs (a vision-language model's images) this runtime
        cannot read; ``input_ids`` [1, T] are checked already."""
        if model_inputs:
            raise FieldError("model_inputs", "unsupported_input",
                             f"{', '.join(sorted(model_inputs))}: the {self.name} runtime takes text prompts only")

    def decoder_start(self) -> list[int]:
        """What an encoder-decoder's output starts with (its decoder start token); [] for a causal LM."""
        return []

    def session(self, tree_attention: Any = None) -> Any:
        """A fresh one-row target for one generation."""
        raise NotImplementedError

    def batch(self, max_rows: int, needs: frozenset[Capability] = frozenset(),
              kv_cache_bytes: int | None = None) -> Any:
        """A target for up to ``max_rows`` generations at once, for a drafter that needs
        ``needs`` (a runtime with several batch paths picks one by them). ``kv_cache_bytes``:
        a fixed size for its KV store, allocated at once, where the batch path has one store
        (its ``kv_entries`` then says how many token entries it holds; None: the store grows)."""
        raise NotImplementedError

    def warm_up(self) -> None:
        """Pay now what this model's first forward pays once, so that the first generation does
        not (:func:`hasten.load` calls it). Nothing by default."""

    def cost_key(self) -> dict:
        """What one forward's cost depends on, besides the machine (which sizing adds). This
        default names the runtime, the model and torch's threads; a runtime whose cost depends
        on more (a dtype, a quantization, a device) names that too."""
        return {"runtime": self.name, "model": self.label, "source": self.source, "vocab": self.vocab_size,
                "threads": torch.get_num_threads(), "torch": torch.__version__}

    def synchronize(self) -> None:
        """Wait for the forwards queued on the device (a timed forward must have finished)."""

    @contextlib.contextmanager
    def timing_blocks(self, tokens: list[int], context: int,
                      sizes: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], Callable[[int], None], Callable[[], None]]]:
        """For timing one forward per block size: about ``context`` tokens cached, then yields
        ``(sizes, run, undo)``: the sizes that fit, ``run(size)`` runs the next ``size``
        tokens, ``undo()`` forgets them. The timing loop is the sizing module's. This default
        runs them through a :meth:`session`, so every runtime can be sized ``"auto"``."""
        if self.context_length:  # leave room for the largest block
            context = max(1, min(context, self.context_length - 2 - max(sizes)))
            sizes = tuple(s for s in sizes if context + 2 + s <= self.context_length) or (1,)
        session = self.session()
        session.start(torch.tensor([tokens[: context + 2]], device=self.device))  # caches all but the root
        base = session.cache_length
        self.synchronize()

        def run(size: int) -> None:
            session.forward_rows([session], [tokens[base : base + size]], [None], False)
            self.synchronize()

        yield sizes, run, lambda: session.crop(base)
