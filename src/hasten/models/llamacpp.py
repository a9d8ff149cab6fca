"""A llama.cpp target: hasten's drafters propose, llama.cpp verifies.

On a CPU, llama.cpp runs a GGUF model several times faster than PyTorch. This adapter puts
it under hasten's one decode loop (:func:`hasten.engine.sequence.step`) as one more
:class:`~hasten.engine.sequence.RowCache` and :class:`~hasten.engine.sequence.Target`:
each step's block (the root and the draft tokens) goes to llama.cpp as one batch with
logits for every position, and the rejected entries leave llama.cpp's KV cache by a
sequence removal of the positions past the accepted path. The verifier is hasten's own.

Trees: llama.cpp could verify one through sequence ids (one per leaf path, the committed
cells shared by all), which this target does not do yet: it verifies chains
(``trees_ok = False``) and the loop cuts a tree draft to its main chain. Drafters that read
the target's features (eagle, medusa, ...) need a PyTorch target.

Needs ``llama-cpp-python`` (``pip install 'hasten[llamacpp]'``; see docs/cpu.md for the
build flags). The low-level API of ``llama_cpp.llama_cpp`` is used, not the ``Llama`` class,
because the class keeps its own token history and asks llama.cpp for one position's
logits only.

Exactness: llama.cpp's own greedy decoding feeds the prompt in one batch, then one token
at a time. With flash attention (always on here), a verification block gives each token
the logits it gets alone, and the prompt goes in as llama.cpp feeds it (see
:class:`LlamaCppTarget`), so greedy output equals llama.cpp's own greedy decoding with flash
attention token for token. Without either, outputs part ways after a few dozen tokens on
SmolLM2 (a near tie decided the other way).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from ..core.tree import TokenTree
from .adapter import ForwardOutput, Riders

INSTALL_HINT = ("pip install 'hasten[llamacpp]' (built from source; on a virtual machine whose CPU "
                "reports AVX-512 or AMX build it with the flags in docs/cpu.md)")
DEFAULT_CONTEXT = 4096  # positions per generation: prompt, new tokens and one draft block
SEQUENCE = 0  # the one llama.cpp sequence id a target uses


def llama_cpp_module():
    """``llama_cpp.llama_cpp`` (the C API), or ImportError naming the install command."""
    try:
        from llama_cpp import llama_cpp
    except ImportError as err:
        raise ImportError(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}") from err
    return llama_cpp


class LlamaCppModel:
    """A GGUF file's weights, loaded once by llama.cpp; each generation opens its own
    :class:`LlamaCppTarget` (its own KV cache) on them. ``threads`` defaults to torch's."""

    encoder_decoder = False

    def __init__(self, path: str | os.PathLike, threads: int | None = None, context: int = DEFAULT_CONTEXT,
                 batch: int = 512, verbose: bool = False):
        lib = llama_cpp_module()
        # llama-cpp-python prints llama.cpp's log through this logger; its Llama(verbose=False) quiets it alike
        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"no GGUF file at {path}")
        self.lib, self.path = lib, path
        self.threads = threads or torch.get_num_threads()
        self.context, self.batch = context, batch
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path} (is it a GGUF model file?)")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        self.max_positions = int(lib.llama_model_n_ctx_train(self._model))

    @property
    def name(self) -> str:
        return self.path.name

    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a generation (llama.cpp's end-of-generation set)."""
        return frozenset(t for t in range(self.vocab_size) if self.lib.llama_vocab_is_eog(self._vocab, t))

    def session(self) -> "LlamaCppTarget":
        """A fresh target (its own llama.cpp context and KV cache) for one generation."""
        return LlamaCppTarget(self)

    def close(self) -> None:
        if getattr(self, "_model", None):
            self.lib.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        self.close()


class LlamaCppTarget:
    """One generation on a :class:`LlamaCppModel`: a llama.cpp context whose KV cache holds
    the committed tokens but the newest (the loop's cache invariant). Pass a model or the
    path of a GGUF file.

    The prompt goes to llama.cpp whole, in one batch with the last position's logits, as
    llama.cpp's own decoding feeds it: llama.cpp rounds a position computed inside a batch of
    some hundred tokens otherwise than one computed alone, so prefilling all but the last
    token (the loop's invariant) and feeding that one with the first draft would make a
    different model. Its cache entry and logits wait as the *pending root*: the cache
    reports one token less, and the first block, which starts with that token, reuses them.
    """

    encoder_decoder = False
    trees_ok = False  # chains only: the loop verifies a tree draft's main chain

    def __init__(self, model: LlamaCppModel | str | os.PathLike, threads: int | None = None):
        self.model = model if isinstance(model, LlamaCppModel) else LlamaCppModel(model, threads)
        self.vocab_size = self.model.vocab_size
        lib = self.lib = self.model.lib
        params = lib.llama_context_default_params()
        params.n_ctx = self.model.context
        params.n_batch = params.n_ubatch = self.model.batch
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = threads or self.model.threads
        # Flash attention handles each query row on its own, which makes a verification block's
        # logits equal, bit for bit, those of its tokens fed one at a time (measured on SmolLM2
        # for blocks of up to 40 tokens; without it llama.cpp's attention rounds otherwise from
        # a block's 4th row on). Compare with llama.cpp run so: Llama(..., flash_attn=True).
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        self._ctx = lib.llama_init_from_model(self.model._model, params)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {params.n_ctx} positions")
        self._memory = lib.llama_get_memory(self._ctx)
        self._capacity = self.model.batch
        self._batch = lib.llama_batch_init(self._capacity, 0, 1)
        self._cells = 0  # positions in llama.cpp's KV cache, the pending root included
        self._pending: tuple[int, torch.Tensor] | None = None  # (root token, its logits [1, vocab])

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, input_ids: torch.Tensor, hidden: bool = False) -> tuple[list[int], None]:
        """Prefill the prompt ([1, T]); returns the committed tokens (the prompt)."""
        if hidden:
            raise ValueError(self._no_features())
        tokens = input_ids[0].tolist()
        self.crop(0)
        logits = None
        for begin in range(0, len(tokens), self._capacity):  # llama.cpp's own chunks of n_batch
            end = min(begin + self._capacity, len(tokens))
            logits = self._decode(tokens[begin:end], outputs="last" if end == len(tokens) else "none")
        self._pending = (tokens[-1], logits)
        return tokens, None

    def forward(self, block: list[int], tree: TokenTree | None = None, hidden: bool = False,
                riders: Riders | None = None) -> ForwardOutput:
        """Run ``block`` (a chain) after the cached tokens: logits [block, vocab] float32."""
        if hidden:
            raise ValueError(self._no_features())
        if riders is not None:
            raise ValueError("riders (hidden transfer) need a PyTorch target; the llama.cpp backend has none")
        if tree is not None and not tree.is_chain:
            raise ValueError("the llama.cpp target verifies chains only (trees_ok is False)")
        pieces = []
        if self._pending is not None:
            token, root_logits = self._pending
            self._pending = None
            if block and block[0] == token:  # the prefill computed it: reuse its cache entry and logits
                pieces.append(root_logits)
                block = block[1:]
            else:
                self._remove_from(self._cells - 1)
        for begin in range(0, len(block), self._capacity):
            pieces.append(self._decode(block[begin : begin + self._capacity], outputs="all"))
        logits = pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces else torch.empty(0, self.vocab_size)
        return ForwardOutput(logits, None)

    def forward_rows(self, rows: list["LlamaCppTarget"], blocks: list[list[int]], trees: list[TokenTree | None],
                     hidden: bool, riders: list[Riders | None]) -> list[ForwardOutput]:
        """The decode step's interface (see :mod:`hasten.engine.sequence`): one sequence, this one."""
        if len(rows) != 1 or rows[0] is not self:
            raise ValueError("a LlamaCppTarget runs one sequence")
        return [self.forward(blocks[0], trees[0], hidden, riders[0])]

    def _decode(self, tokens: list[int], outputs: str) -> torch.Tensor | None:
        """One llama_decode of ``tokens`` at the next positions. ``outputs``: "all" (logits
        [n, vocab]), "last" ([1, vocab]) or "none"."""
        lib, batch, start = self.lib, self._batch, self._cells
        if start + len(tokens) > self.model.context:
            raise ValueError(f"the llama.cpp context holds {self.model.context} positions; this generation needs "
                             f"{start + len(tokens)} (make the LlamaCppModel with a larger context)")
        for i, token in enumerate(tokens):
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside the model's vocabulary [0, {self.vocab_size})")
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = SEQUENCE
            batch.logits[i] = int(outputs == "all" or (outputs == "last" and i == len(tokens) - 1))
        batch.n_tokens = len(tokens)
        status = lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} at position {start}")
        self._cells = start + len(tokens)
        if outputs == "none":
            return None
        rows = len(tokens) if outputs == "all" else 1
        pointer = lib.llama_get_logits(self._ctx)  # the asked-for rows, in batch order
        view = np.ctypeslib.as_array(pointer, shape=(rows, self.vocab_size))  # llama.cpp's buffer, not a copy
        return torch.from_numpy(view.copy())  # [rows, vocab] float32

    # ---- cache -------------------------------------------------------------------------
    @property
    def cache_length(self) -> int:
        return self._cells - (self._pending is not None)

    def crop(self, new_length: int) -> None:
        """Forget every cached position from ``new_length`` on."""
        if new_length < self.cache_length:
            self._pending = None
        if new_length < self._cells and self._pending is None:
            self._remove_from(new_length)

    def _remove_from(self, position: int) -> None:
        if not self.lib.llama_memory_seq_rm(self._memory, SEQUENCE, position, -1):
            raise RuntimeError("llama.cpp could not remove cache entries (a recurrent or sliding-window cache "
                               "cannot be rolled back; speculative decoding would change its output)")
        self._cells = position

    def commit(self, start: int, tree: TokenTree, accepted: tuple[int, ...]) -> None:
        """After verifying the chain ``[root] + draft`` cached from ``start``: keep the root
        and the accepted tokens, drop the rest."""
        if list(accepted) != list(range(len(accepted))):
            raise ValueError("the llama.cpp target verifies chains only; the accepted path must be a prefix")
        self.crop(start + 1 + len(accepted))

    # ---- cleanup -----------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self._ctx)
            self._ctx = None

    def __del__(self):
        self.close()

    @staticmethod
    def _no_features() -> str:
        return ("the llama.cpp backend exposes no hidden states: drafters that read the target's features "
                "(needs_features: eagle, medusa, ...) need a PyTorch target")


def check_drafter(drafter) -> None:
    """ValueError when ``drafter`` cannot run on a llama.cpp target (it reads features)."""
    if drafter is not None and getattr(drafter, "needs_features", False):
        raise ValueError(f"{drafter.name} reads the target's hidden states, which the llama.cpp backend does not "
                         "expose; use prompt_lookup, lookahead or draft_model, or a PyTorch target")
