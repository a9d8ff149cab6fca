"""A llama.cpp target: hasten's drafters propose, llama.cpp verifies.

On a CPU, llama.cpp runs a GGUF model several times faster than PyTorch. This adapter puts
it under hasten's one decode loop (:func:`hasten.engine.sequence.step`) as one more
:class:`~hasten.engine.sequence.RowCache` and :class:`~hasten.engine.sequence.Target`:
each step's block (the root and the draft tokens) goes to llama.cpp as one batch with
logits for every position, and the rejected entries leave llama.cpp's KV cache by a
sequence removal of the positions past the accepted path. The verifier is hasten's own.

Two targets share that machinery: :class:`LlamaCppTarget` runs one generation in its own
llama.cpp context (``hasten.generate``), and :class:`LlamaCppBatch` runs many in one
context, each row a llama.cpp sequence id, all rows' blocks in one ``llama_batch`` per step
(the server's continuous batching, through the same interface as
:class:`~hasten.models.batch.BatchAdapter`).

Trees: llama.cpp could verify one through sequence ids (one per leaf path, the committed
cells shared by all), which these targets do not do yet: they verify chains
(``trees_ok = False``) and the loop cuts a tree draft to its main chain. Drafters that read
the target's features (eagle, medusa, ...) need a PyTorch target.

Needs ``llama-cpp-python`` (``pip install 'hasten[llamacpp]'``; see docs/cpu.md for the
build flags). The low-level API of ``llama_cpp.llama_cpp`` is used, not the ``Llama`` class,
because the class keeps its own token history and asks llama.cpp for one position's
logits only.

Exactness: llama.cpp's own greedy decoding feeds the prompt in one batch, then one token
at a time. With flash attention (always on here), a verification block gives each token
the logits it gets alone, and the prompt goes in as llama.cpp feeds it (see
:class:`LlamaCppRow`), so greedy output equals llama.cpp's own greedy decoding with flash
attention token for token. Without either, outputs part ways after a few dozen tokens on
SmolLM2 (a near tie decided the other way).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import warnings
from pathlib import Path

import torch

from ..core.errors import HastenWarning
from ..core.tree import TokenTree
from ..core.runtime import Runtime
from .adapter import ForwardOutput

INSTALL_HINT = ("pip install 'hasten[llamacpp]' (built from source; on a virtual machine whose CPU "
                "reports AVX-512 or AMX build it with the flags in docs/cpu.md)")
DEFAULT_CONTEXT = 4096  # positions per generation: prompt, new tokens and one draft block
IDLE_CONTEXTS = 4  # finished generations' contexts a model keeps for the next ones
# Block sizes that cost-aware draft sizing times (hasten.engine.sizing): every size up to 16,
# since llama.cpp's repacked Q4_0 kernels take rows four at a time and a block of 3 can cost
# more than one of 4 (docs/cpu.md, "The measurements behind the code's choices"); then coarser,
# for the wider blocks of a server's batches (past 64 the sizing extrapolates linearly).
CALIBRATION_SIZES = (*range(1, 17), 24, 32, 64)


# Said once per process when hasten.load opens a GGUF file on this backend (docs/cpu.md, "Exactness").
FLASH_ATTENTION_NOTE = ("the llama.cpp backend runs flash attention, so its greedy text equals llama.cpp's with "
                        "flash_attn=True; llama-cpp-python's default (flash_attn=False) writes other text")
_flash_attention_noted = False


def note_flash_attention() -> None:
    """Warn (a HastenWarning, once per process) that this backend's reference is llama.cpp
    with flash attention on, not llama-cpp-python's default."""
    global _flash_attention_noted
    if not _flash_attention_noted:
        _flash_attention_noted = True
        warnings.warn(FLASH_ATTENTION_NOTE, HastenWarning, stacklevel=4)  # at the caller of hasten.load


def llama_cpp_module():
    """``llama_cpp.llama_cpp`` (the C API), or ImportError naming the install command."""
    try:
        from llama_cpp import llama_cpp
    except ImportError as err:
        raise ImportError(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}") from err
    return llama_cpp


class LlamaCppModel(Runtime):
    """A GGUF file's weights, loaded once by llama.cpp: the llama.cpp runtime. Each
    generation opens its own :class:`LlamaCppTarget` (its own KV cache) on them, or a server
    its :class:`LlamaCppBatch`. ``threads`` defaults to torch's. Chains only, no hidden
    states, no torch modules: it declares no capability."""

    name = "llama.cpp"
    capabilities = frozenset()

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
        self.context, self.n_batch = context, batch  # positions per generation, tokens per llama_decode
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        if hasattr(lib, "LLAMA_LOAD_MODE_MMAP"):  # as llama-cpp-python's Llama loads (its default use_mmap=True)
            params.load_mode = lib.LLAMA_LOAD_MODE_MMAP
        self._model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {path} (is it a GGUF model file?)")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(self._vocab))
        self.max_positions = int(lib.llama_model_n_ctx_train(self._model))
        self.context_length = min(self.max_positions, context)
        self.label, self.source = path.name, str(path)
        self._end_of_generation: frozenset[int] | None = None  # eos_token_ids, read on first use
        # Creating a context costs a noticeable share of a short generation (docs/cpu.md), so
        # finished generations hand theirs back for the next to reuse.
        self._idle: list[LlamaCppContext] = []

    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end a generation (llama.cpp's end-of-generation set), read once:
        every generation asks, and asking llama.cpp is one call per vocabulary token."""
        if self._end_of_generation is None:
            self._end_of_generation = frozenset(
                t for t in range(self.vocab_size) if self.lib.llama_vocab_is_eog(self._vocab, t))
        return self._end_of_generation

    def session(self, tree_attention=None) -> "LlamaCppTarget":
        """A fresh target (its own llama.cpp context and KV cache) for one generation."""
        return LlamaCppTarget(self)

    def _take_context(self, threads: int | None) -> "LlamaCppContext":
        """A one-sequence context: an idle one (emptied by the next prefill) or a new one."""
        threads = threads or self.threads
        for context in self._idle:
            if context.threads == threads:
                self._idle.remove(context)
                return context
        return LlamaCppContext(self, 1, threads)

    def _give_back(self, context: "LlamaCppContext") -> None:
        if getattr(self, "_model", None) and len(self._idle) < IDLE_CONTEXTS:
            self._idle.append(context)
        else:
            context.close()

    # ---- the forward's cost on this machine, for cost-aware draft sizing ------------------
    calibration_sizes = CALIBRATION_SIZES

    def cost_key(self) -> dict:
        """What a llama.cpp forward's cost depends on (besides the machine, which the sizing
        module adds): the file (its size and the hash of its first MiB, which holds the
        GGUF header: architecture, tensor types), the threads and the llama.cpp build."""
        import llama_cpp

        if getattr(self, "_head", None) is None:  # once per model: every generation asks (auto sizing's begin)
            with open(self.path, "rb") as file:
                self._head = hashlib.sha256(file.read(1 << 20)).hexdigest()[:16]
        return {"backend": "llama.cpp", "model": self.path.name, "bytes": self.path.stat().st_size, "head": self._head,
                "threads": self.threads, "llama_cpp": llama_cpp.__version__, "flash_attn": True,
                "batch": self.n_batch}

    @contextlib.contextmanager
    def timing_blocks(self, tokens: list[int], context: int, sizes: tuple[int, ...]):
        """For timing one llama_decode per block size (logits for every entry, as a
        verification asks): ``tokens[:context]`` cached in one context of this model, then
        yields ``(sizes, run, undo)``: the sizes that fit, ``run(size)`` decodes the next
        ``size`` tokens, ``undo()`` forgets them. The timing loop is the sizing module's."""
        context = max(1, min(context, self.context - max(sizes)))
        sizes = tuple(s for s in sizes if context + s <= self.context and s <= self.n_batch) or (1,)
        llama = self._take_context(None)
        try:
            llama.forget(0)
            llama.decode([0] * context, list(range(context)), tokens[:context], [False] * (context - 1) + [True])

            def run(size: int) -> None:
                llama.decode([0] * size, list(range(context, context + size)), tokens[context : context + size],
                             [True] * size)

            yield sizes, run, lambda: llama.remove(0, context)
        finally:
            llama.forget(0)
            self._give_back(llama)

    def batch(self, max_rows: int, needs: frozenset = frozenset(),
              kv_cache_bytes: int | None = None) -> "LlamaCppBatch":
        """A target for up to ``max_rows`` generations at once in one llama.cpp context (whose
        own KV cache is sized by the context: ``kv_cache_bytes`` is not used)."""
        return LlamaCppBatch(self, max_rows)

    def close(self) -> None:
        for context in getattr(self, "_idle", ()):
            context.close()
        self._idle = []
        if getattr(self, "_model", None):
            self.lib.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        self.close()


class LlamaCppContext:
    """A llama.cpp context (its KV cache holds ``sequences`` independent sequences of
    ``model.context`` positions each) and the ``llama_batch`` that feeds it."""

    def __init__(self, model: LlamaCppModel, sequences: int, threads: int | None = None):
        self.model, self.lib, self.sequences = model, model.lib, sequences
        lib = self.lib
        params = lib.llama_context_default_params()
        params.n_ctx = model.context * sequences
        params.n_batch = params.n_ubatch = model.n_batch
        params.n_seq_max = sequences
        # One KV stream per sequence, each of model.context cells: a row attends over a
        # cache laid out as a lone generation's is, whatever the other rows hold.
        params.kv_unified = False
        self.threads = threads or model.threads
        params.n_threads = params.n_threads_batch = self.threads
        # Flash attention handles each query row on its own, which makes a verification block's
        # logits equal, bit for bit, those of its tokens fed one at a time (without it llama.cpp's
        # attention rounds otherwise from a block's 4th row on; docs/cpu.md). Compare with llama.cpp run so: Llama(..., flash_attn=True).
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        self._ctx = lib.llama_init_from_model(model._model, params)
        if not self._ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {params.n_ctx} positions")
        self._memory = lib.llama_get_memory(self._ctx)
        self.capacity = model.n_batch  # tokens per llama_decode
        self._batch = lib.llama_batch_init(self.capacity, 0, 1)
        self._view: tuple[tuple[int, int], torch.Tensor] | None = None  # ((address, rows), the logits' view)

    def decode(self, sequences: list[int], positions: list[int], tokens: list[int],
               outputs: list[bool]) -> torch.Tensor | None:
        """One llama_decode of entries (sequence id, position, token, wants logits), at most
        ``capacity`` of them; returns the asked-for logits [outputs, vocab] in entry order, read
        in place from llama.cpp's output buffer: valid until the next decode on this context
        overwrites it (a caller that keeps them longer clones them)."""
        lib, batch, vocab = self.lib, self._batch, self.model.vocab_size
        for i, (sequence, position, token, output) in enumerate(zip(sequences, positions, tokens, outputs)):
            if not 0 <= token < vocab:
                raise ValueError(f"token id {token} is outside the model's vocabulary [0, {vocab})")
            if position >= self.model.context:
                raise ValueError(f"the llama.cpp context holds {self.model.context} positions; this generation "
                                 f"needs {position + 1} (make the LlamaCppModel with a larger context)")
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = sequence
            batch.logits[i] = int(output)
        batch.n_tokens = len(tokens)
        status = lib.llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")
        rows = sum(outputs)
        if rows == 0:
            return None
        # No copy: a step reads its logits before its next decode (a fresh tensor and a memmove
        # into it, mostly the allocation, would cost every step; docs/cpu.md).
        # The buffer stays where it is from one decode to the next (llama.cpp moves it only to
        # grow it), so the view of the last decode with as many rows is that of this one.
        address = ctypes.cast(lib.llama_get_logits(self._ctx), ctypes.c_void_p).value
        if self._view is None or self._view[0] != (address, rows):
            self._view = (address, rows), torch.frombuffer((ctypes.c_float * (rows * vocab)).from_address(address),
                                                           dtype=torch.float32).view(rows, vocab)  # [rows, vocab]
        return self._view[1]

    def sequence_bytes(self, sequence: int) -> int:
        """Bytes of ``sequence``'s state in llama.cpp: its KV cells, as llama.cpp would save them."""
        return int(self.lib.llama_state_seq_get_size(self._ctx, sequence))

    def remove(self, sequence: int, position: int) -> None:
        """Forget ``sequence``'s cells from ``position`` on."""
        if not self.lib.llama_memory_seq_rm(self._memory, sequence, position, -1):
            raise RuntimeError("llama.cpp could not remove cache entries (a recurrent or sliding-window cache "
                               "cannot be rolled back; speculative decoding would change its output)")

    def forget(self, sequence: int) -> None:
        """Empty ``sequence``'s cells; a one-sequence context is cleared whole, which puts
        the next prompt where a new context would (reused contexts stay exact). The cells'
        old K and V values stay in the buffers, as llama-cpp-python's own reset leaves them:
        an empty cell is masked out of attention, and zeroing the buffers would cost every
        generation a pass over them (docs/cpu.md)."""
        if self.sequences == 1:
            self.lib.llama_memory_clear(self._memory, False)
        else:
            self.remove(sequence, 0)

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            self.lib.llama_batch_free(self._batch)
            self.lib.llama_free(self._ctx)
            self._ctx = None

    def __del__(self):
        self.close()


class LlamaCppRow:
    """One generation's llama.cpp sequence: its KV cells hold the committed tokens but the
    newest (the loop's cache invariant).

    The prompt goes to llama.cpp whole, in one batch with the last position's logits, as
    llama.cpp's own decoding feeds it: llama.cpp rounds a position computed inside a batch of
    some hundred tokens otherwise than one computed alone, so prefilling all but the last
    token (the loop's invariant) and feeding that one with the first draft would make a
    different model. Its cache entry and logits wait as the *pending root*: the cache
    reports one token less, and the first block, which starts with that token, reuses them.
    """

    encoder_decoder = False
    trees_ok = False  # chains only: the loop verifies a tree draft's main chain
    prompt_embeds = None  # text prompts only
    encoder_states = None  # causal models only
    kv_readable = False  # llama.cpp's KV cells are not exposed

    def __init__(self, context: LlamaCppContext, sequence: int):
        self.context, self.sequence = context, sequence
        self.model = context.model
        self.vocab_size = self.model.vocab_size
        self._cells = 0  # positions in llama.cpp's KV cache, the pending root included
        self._pending: tuple[int, torch.Tensor] | None = None  # (root token, its logits [1, vocab])

    def prefill(self, tokens: list[int]) -> None:
        """Forget everything, then feed the prompt in llama.cpp's own chunks of n_batch."""
        self.crop(0)
        self.context.forget(self.sequence)
        logits, capacity = None, self.context.capacity
        for begin in range(0, len(tokens), capacity):
            chunk = tokens[begin : begin + capacity]
            last = begin + len(chunk) == len(tokens)
            logits = self._decode(chunk, [last and i == len(chunk) - 1 for i in range(len(chunk))])
        self._pending = (tokens[-1], logits.clone())  # kept past the next decode

    def take_block(self, block: list[int], tree: TokenTree | None, hidden: bool) -> tuple[torch.Tensor | None, list[int]]:
        """Check a block and settle the pending root: (the root's reused logits or None, the
        tokens still to decode)."""
        if hidden:
            raise ValueError(no_features())
        if tree is not None and not tree.is_chain:
            raise ValueError("the llama.cpp target verifies chains only (trees_ok is False)")
        if self._pending is None:
            return None, block
        token, root_logits = self._pending
        self._pending = None
        if block and block[0] == token:  # the prefill computed it: reuse its cache entry and logits
            return root_logits, block[1:]
        self._remove_from(self._cells - 1)
        return None, block

    def place(self, count: int) -> list[int]:
        """The positions of the next ``count`` cells, taken (the decode that fills them follows)."""
        start = self._cells
        self._cells = start + count
        return list(range(start, start + count))

    def _decode(self, tokens: list[int], outputs: list[bool]) -> torch.Tensor | None:
        return self.context.decode([self.sequence] * len(tokens), self.place(len(tokens)), tokens, outputs)

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
        self.context.remove(self.sequence, position)
        self._cells = position

    def cache_bytes(self) -> int:
        """KV bytes this generation holds in llama.cpp (read once, at its end, by the loop)."""
        return self.context.sequence_bytes(self.sequence)

    def commit(self, start: int, tree: TokenTree, accepted: tuple[int, ...]) -> None:
        """After verifying the chain ``[root] + draft`` cached from ``start``: keep the root
        and the accepted tokens, drop the rest."""
        if list(accepted) != list(range(len(accepted))):
            raise ValueError("the llama.cpp target verifies chains only; the accepted path must be a prefix")
        self.crop(start + 1 + len(accepted))


class LlamaCppTarget(LlamaCppRow):
    """One generation on a :class:`LlamaCppModel`, in a llama.cpp context of its own. Pass
    a model or the path of a GGUF file."""

    def __init__(self, model: LlamaCppModel | str | os.PathLike, threads: int | None = None):
        model = model if isinstance(model, LlamaCppModel) else LlamaCppModel(model, threads)
        super().__init__(model._take_context(threads), 0)
        self.lib = model.lib

    def start(self, input_ids: torch.Tensor, hidden: bool = False) -> tuple[list[int], None]:
        """Prefill the prompt ([1, T]); returns the committed tokens (the prompt)."""
        if hidden:
            raise ValueError(no_features())
        tokens = input_ids[0].tolist()
        self.prefill(tokens)
        return tokens, None

    def forward(self, block: list[int], tree: TokenTree | None = None, hidden: bool = False) -> ForwardOutput:
        """Run ``block`` (a chain) after the cached tokens: logits [block, vocab] float32, the
        caller's to keep."""
        out = self._forward(block, tree, hidden)
        return ForwardOutput(out.logits.clone(), None)

    def _forward(self, block: list[int], tree: TokenTree | None, hidden: bool) -> ForwardOutput:
        """:meth:`forward` with the logits left where llama.cpp wrote them when it can (valid until
        the next decode on this context)."""
        root_logits, rest = self.take_block(block, tree, hidden)
        pieces = [] if root_logits is None else [root_logits]
        capacity = self.context.capacity
        for begin in range(0, len(rest), capacity):
            chunk = rest[begin : begin + capacity]
            logits = self._decode(chunk, [True] * len(chunk))
            pieces.append(logits if begin + capacity >= len(rest) else logits.clone())  # the next chunk overwrites it
        return ForwardOutput(joined(pieces, self.vocab_size), None)

    def forward_rows(self, rows: list["LlamaCppTarget"], blocks: list[list[int]], trees: list[TokenTree | None],
                     hidden: bool) -> list[ForwardOutput]:
        """The decode step's interface (see :mod:`hasten.engine.sequence`): one sequence, this one;
        its logits read in place (until the next forward)."""
        if len(rows) != 1 or rows[0] is not self:
            raise ValueError("a LlamaCppTarget runs one sequence")
        return [self._forward(blocks[0], trees[0], hidden)]

    def close(self) -> None:
        """Hand the context back to the model for the next generation (its cells are
        forgotten by the next prefill)."""
        context, self.context = getattr(self, "context", None), None
        if context is not None and context._ctx:
            self.model._give_back(context)

    def __del__(self):
        self.close()


class LlamaCppBatch:
    """Many generations in one llama.cpp context, each row a llama.cpp sequence id: the
    interface of :class:`~hasten.models.batch.BatchAdapter` (``add``, ``remove``,
    ``forward_rows``) for the scheduler. Each step every row's block goes into one
    ``llama_batch`` (entries tagged with the row's sequence id and positions), and each
    row's rejected entries leave by a removal on its own sequence."""

    trees_ok = False
    encoder_decoder = False
    kv_readable = False  # llama.cpp's KV cells are not exposed
    packed_rows = False  # priced as padded rows (its batch path is not calibrated)
    defers_prompts = False  # a joining prompt is prefilled at once
    kv_entries = None  # its KV cache is llama.cpp's, sized by the context
    device = torch.device("cpu")

    def __init__(self, model: LlamaCppModel, rows: int):
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
        self.model, self.vocab_size = model, model.vocab_size
        self.context = LlamaCppContext(model, rows)
        self._free = list(range(rows))  # sequence ids no row holds
        self.rows: list[LlamaCppRow] = []

    def add(self, tokens: list[int], hidden: bool = False, room: int | None = None,
            defer: bool = False) -> tuple[LlamaCppRow, None]:
        """Prefill a new generation (alone in its batches, as a lone generation's prompt) on a free
        sequence id (``room``: llama.cpp's context holds every sequence's cells: nothing to reserve;
        ``defer``: the prompt is prefilled now all the same, as llama.cpp's own loop does)."""
        if hidden:
            raise ValueError(no_features())
        if not self._free:
            raise RuntimeError(f"all {len(self.rows)} llama.cpp sequences are in use "
                               "(the batch was made for that many)")
        row = LlamaCppRow(self.context, self._free.pop(0))
        row.prefill(list(tokens))
        self.rows.append(row)
        return row, None

    def remove(self, row: LlamaCppRow) -> None:
        """Free the row's sequence id and its cells."""
        self.rows.remove(row)
        self.context.forget(row.sequence)
        self._free.append(row.sequence)

    def forward_rows(self, rows: list[LlamaCppRow], blocks: list[list[int]], trees: list[TokenTree | None],
                     hidden: bool) -> list[ForwardOutput]:
        """Every row's block in one llama_batch (more than one only past n_batch tokens):
        logits [block, vocab] per row, read in place where they can be (until the next forward)."""
        reused, entries = [], []  # entries: (row index, sequence, position, token)
        for index, (row, block, tree) in enumerate(zip(rows, blocks, trees)):
            root_logits, rest = row.take_block(block, tree, hidden)
            reused.append(root_logits)
            entries += [(index, row.sequence, position, token) for position, token in zip(row.place(len(rest)), rest)]
        decoded: list[list[torch.Tensor]] = [[] for _ in rows]
        capacity = self.context.capacity
        for begin in range(0, len(entries), capacity):
            chunk = entries[begin : begin + capacity]
            _, sequences, positions, tokens = (list(column) for column in zip(*chunk))
            logits = self.context.decode(sequences, positions, tokens, [True] * len(chunk))  # [chunk, vocab]
            if begin + capacity < len(entries):
                logits = logits.clone()  # the next chunk overwrites it
            for row_logits, index in runs([index for index, *_ in chunk], logits):
                decoded[index].append(row_logits)
        outs = []
        for root_logits, pieces in zip(reused, decoded):
            pieces = ([] if root_logits is None else [root_logits]) + pieces
            outs.append(ForwardOutput(joined(pieces, self.vocab_size), None))
        return outs

    def close(self) -> None:
        self.context.close()


def joined(pieces: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """A block's logits [n, vocab] from its pieces (the reused root, decoded chunks): the one
    piece itself (no copy), or the pieces concatenated."""
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces) if pieces else torch.empty(0, vocab)


def runs(owners: list[int], logits: torch.Tensor):
    """(logits rows [n, vocab], owner) for each run of consecutive entries with one owner."""
    start = 0
    for end in range(1, len(owners) + 1):
        if end == len(owners) or owners[end] != owners[start]:
            yield logits[start:end], owners[start]
            start = end


def no_features() -> str:
    return ("the llama.cpp backend exposes no hidden states: drafters that read the target's features "
            "(eagle, medusa, ...) need a PyTorch target")

