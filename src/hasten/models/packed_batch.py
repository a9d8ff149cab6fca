"""Many sequences through the lean Llama-family forward, packed along one token dimension.

Where the model takes the lean forward (``lean.eligible``: a Llama or Qwen2 model on hasten's
row-invariant kernels), a batch step does not pad: every row's block (a root and its draft,
a chain or a tree, of any size) is laid end to end into one [N] token sequence, every linear
layer runs once over all N tokens, and attention is one kernel call per layer in which each
query row reads its own sequence's keys (its segment of one shared store, ``models/arena.py``,
then its own ancestors in the block). The kernels compute each row alone (``kernels/ops.py``),
so **each row's logits are exactly the ones it gets decoded alone**, bit for bit, in every
dtype, whatever the other rows, their lengths or their blocks (tests/test_packed_batch.py).
This is vLLM's layout (flattened tokens, per-sequence variable-length attention) on hasten's
kernels.

A row is a :class:`PackedRow`: the same ``cache_length`` / ``commit`` / ``crop`` interface as a
single sequence's :class:`~hasten.models.adapter.ModelAdapter`, so the decode step does not know
which one it drives. A tree's accepted path is moved into place lazily, every row's at once,
before the next forward. Other architectures, and drafters that need more than
:attr:`PackedBatch.serves` (the KV cache as tensors, the attention queries), use
:class:`~hasten.models.batch.BatchAdapter` (the model's own forward, padded rows); the runtime
picks one of the two per batch. Should a hook appear anyway (a user's, a profiler's), each row
runs the model's own forward over its entries, with the same numbers, one row at a time.

**Chunked prefill.** A row added with ``defer=True`` caches nothing at once: its prompt waits in
``deferred``, and each packed forward runs what the caller asks of it beside the other rows'
blocks. :meth:`PackedBatch.feed` gives the next forward a chunk of it (the row has no block
then: it does not decode); a row whose block runs in a forward has the rest of its prompt run
first, in the same forward. A chunk's positions are a chain after the row's cached entries, so
each position attends over the row's entries up to itself, in order: the very key list a
prefill in one piece gives it, over entries with the same bits (each was computed from its own
tokens alone). The attention kernel's reduction follows the key list alone (``kernels/
invariant.c``: scores one key at a time, the exponential sum by lanes of list position, values
in list order), and the linear layers, norms and rotary embedding compute each position alone,
so however a prompt is cut, every position's numbers, and so every later logit, are the ones a
prefill in one piece gives (tests/test_chunked_prefill.py, in float32, bfloat16 and float16).
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from . import cache as kv
from . import forwards, invariant, lean
from .adapter import ForwardOutput, ModelAdapter, vocab_size
from .arena import KVArena
from .batch import RowOfBatch
from .layers import model_name
from .prefix_cache import PrefixCache
from ..core.runtime import Capability
from ..core.tree import TokenTree
from ..kernels import ops

SLACK = 64  # entries a segment holds past what its row has when it is (re)sized
DRAFT_SLACK = 16  # past a row's prompt and budget: a tree draft may run a few positions beyond them


class PackedRow(RowOfBatch):
    """One sequence of a :class:`PackedBatch`: its committed length; its entries live in the
    batch's store."""

    packed_rows = True  # its batch runs rows end to end, unpadded (what draft sizing prices a step by)

    def __init__(self, batch: "PackedBatch"):
        self.batch = batch
        self.length = 0  # committed tokens cached (all but the root)
        self.tokens: list[int] = []  # the tokens whose entries the row's segment holds, in order
        self.deferred: list[int] = []  # prompt tokens not cached yet: the row's next forward runs them first
        self.fed = 0  # of them, how many the next forward caches though the row has no block there (feed)

    @property
    def cache_length(self) -> int:
        """Committed tokens, the deferred prompt tokens counted as cached (the next forward caches them)."""
        return self.length + len(self.deferred)

    @property
    def prompt_due(self) -> int:
        """Prompt tokens not cached yet: they run in chunks fed to the batch
        (:meth:`PackedBatch.feed`), or all at once before the row's first block."""
        return len(self.deferred)

    def commit(self, start: int, tree: TokenTree, accepted: tuple[int, ...]) -> None:
        """After the block ``[root] + nodes`` cached from ``start``: keep the root and the
        accepted path (a tree's path is moved into place before the next forward)."""
        if start != self.length - self.batch.pending.get(id(self), 0):
            raise RuntimeError("commit must follow this row's block in the last forward")
        self.batch.pending.pop(id(self), None)
        if not (tree.is_chain or list(accepted) == list(range(len(accepted)))):
            base = self.batch.arena.segment(self).start + start + 1
            self.batch.moves.append(([base + node for node in accepted], list(range(base, base + len(accepted)))))
        self.tokens[start + 1:] = [self.tokens[start + 1 + node] for node in accepted]
        self.length = start + 1 + len(accepted)

    def crop(self, new_length: int) -> None:
        if new_length > self.cache_length:
            raise ValueError(f"cannot crop a row of {self.cache_length} cached tokens to {new_length}")
        del self.deferred[max(new_length - self.length, 0):]
        self.fed = min(self.fed, len(self.deferred))
        self.length = min(new_length, self.length)
        del self.tokens[new_length:]


class PackedBatch:
    """Drives any number of sequences of one lean-eligible causal LM through packed forwards."""

    trees_ok = True
    encoder_decoder = False
    kv_readable = False
    packed_rows = True  # rows end to end, unpadded: what draft sizing prices a step by
    defers_prompts = True  # add(defer=True) runs a prompt in the steps that follow, beside the other rows
    # what a drafter may need of it: every row's last hidden states, the target's LM head and
    # embeddings lent (a hook on its layers the lean forward does not mirror runs each row through
    # the model's own forward), tree blocks
    serves = frozenset({Capability.FEATURES, Capability.MODULES, Capability.TREES})

    def __init__(self, model: PreTrainedModel, kv_cache_bytes: int | None = None):
        """``kv_cache_bytes``: the KV store's fixed size, allocated now (None: it grows with
        what the rows hold, models/arena.py)."""
        ModelAdapter(model)  # the single-sequence adapter checks the model once
        if not lean.eligible(model):
            raise ValueError(f"{model_name(model)!r} does not take the lean forward; batch it with BatchAdapter")
        self.model = model
        self.vocab_size = vocab_size(model)
        self.device = model.device
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.arena = KVArena(config.num_hidden_layers, config.num_key_value_heads, head_dim, model.dtype, self.device,
                             kv_cache_bytes)
        self.rows: list[PackedRow] = []
        self.pending: dict[int, int] = {}  # id(row) -> block size cached by the last forward, until commit
        self.moves: list[tuple[list[int], list[int]]] = []  # trees' accepted paths: (from entries, to entries)
        self._modules = list(model.modules())
        self.prefixes = PrefixCache()  # finished rows' entries, for prompts that start the same way
        self._pinned: object | None = None  # kept entries being copied from: not to be reclaimed meanwhile
        self.arena.reclaim = self._reclaim
        self.reused_tokens = 0  # prompt tokens whose entries came from the prefix cache (not prefilled)

    def held_bytes(self) -> int:
        """Bytes of the batch's KV store (allocated; it never shrinks, see models/arena.py)."""
        return self.arena.held_bytes()

    @property
    def kv_entries(self) -> int | None:
        """Entries a fixed store holds (None: it grows). Rows fit while their
        :meth:`entries_for` add up to at most this."""
        return self.arena.fixed_entries

    @staticmethod
    def entries_for(reserved: int) -> int:
        """Entries a row that may hold ``reserved`` tokens (its prompt and budget) takes."""
        return reserved + DRAFT_SLACK

    # ---- rows joining and leaving ------------------------------------------------------------------
    @torch.no_grad()
    def add(self, tokens: list[int], hidden: bool = False, logits: bool = False,
            room: int | None = None, defer: bool = False) -> tuple[PackedRow, torch.Tensor | None]:
        """Prefill a new sequence (every prompt token but the last, the root) and give it a row.
        Entries a finished row left for the same first tokens are copied, not computed
        (:mod:`~hasten.models.prefix_cache`; not when features or logits of every prompt
        position are asked for). Returns the row and, if asked, the prefilled tokens' features
        [T - 1, hidden]; ``logits``: the row's ``prompt_logits`` holds the prefill's logits [T - 1, vocab].
        ``room``: the tokens the row may come to hold (its prompt and token budget), its segment's
        size (past it, the segment moves). ``defer``: prefill nothing now: the prompt's tokens past
        the reused entries run in the packed forwards to come, beside the other rows' blocks, in
        chunks fed to them (:meth:`feed`) or all before the row's first block (a server's step:
        one forward instead of a prefill's and the step's; the same numbers, as the kernels
        compute each row alone); not with ``hidden`` or ``logits``."""
        self._flush()
        prompt = tokens[:-1]
        row = PackedRow(self)
        size = self.entries_for(max(room, len(tokens))) if room else len(prompt) + SLACK
        kept, reused = (None, 0) if hidden or logits else self.prefixes.find(prompt)
        # all the kept entries hold is this prompt's start, in a segment large enough for the row
        takes_over = kept is not None and reused == len(kept.tokens) and self.arena.segment(kept).size >= size
        if kept is not None and not takes_over and self.arena.fixed_entries is not None:
            rows_hold = sum(self.arena.segment(r).size for r in self.rows)
            if self.arena.capacity - rows_hold - self.arena.segment(kept).size < size:
                kept, reused = None, 0  # no room beside the entries to copy (a fixed store would grow): prefill
        if takes_over:  # the row takes the segment over (no copy, no second one kept)
            self.prefixes.forget(kept)
            self.arena.hand_over(kept, row)
        else:
            self._pinned = kept
            try:
                self.arena.allocate(row, size)
                if reused:
                    self.arena.copy(kept, row, reused)
            finally:
                self._pinned = None
        self.rows.append(row)
        row.length, row.tokens = reused, list(prompt[:reused])
        self.reused_tokens += reused
        if logits:
            row.prompt_logits = torch.zeros(0, self.vocab_size, device=self.device)  # [0, vocab] a one-token prompt
        if reused == len(prompt):
            return row, None
        if defer and not (hidden or logits):
            row.deferred = list(prompt[reused:])
            return row, None
        try:
            out = self._forward([row], [prompt[reused:]], [None], hidden, scored=logits)[0]
        except BaseException:
            self.remove(row)
            raise
        self.pending.pop(id(row))
        row.length, row.tokens = len(prompt), list(prompt)
        if logits:
            row.prompt_logits = out.logits  # [T - 1, vocab]
        return row, out.hidden

    def remove(self, row: PackedRow) -> None:
        """Forget a row (finished or cancelled); its entries are kept for a prompt that starts
        the same way (until a running row needs their room)."""
        self._flush()
        if row.batch is not self or row not in self.rows:
            raise ValueError("this row is not in this batch")
        self.rows.remove(row)
        self.pending.pop(id(row), None)
        kept, superseded = self.prefixes.keep(row.tokens[:row.length])
        for old in superseded:
            self.arena.release(old)
        if kept is None:
            self.arena.release(row)
        else:  # the whole segment: a row that takes it over later has room to go on
            self.arena.hand_over(row, kept)

    def _reclaim(self) -> bool:
        """Free the least recently used kept entries (True), if any may go."""
        kept = next((k for k in self.prefixes.kept if k is not self._pinned), None)  # least recently used first
        if kept is None:
            return False
        self.prefixes.forget(kept)
        self.arena.release(kept)
        return True

    def feed(self, row: PackedRow, count: int) -> None:
        """Chunked prefill: the next packed forward caches the first ``count`` of ``row``'s
        deferred prompt tokens (a chunk, appended to the row's segment), beside the blocks of the
        rows it runs, with no block of ``row``'s own (it does not decode until its prompt is
        cached; the forward that runs its first block runs what is left of it first). The
        chunk's numbers are those of a prefill in one piece (the module's docstring)."""
        if row.batch is not self or row not in self.rows:
            raise ValueError("this row is not in this batch")
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(row.deferred):
            raise ValueError(f"count must be an integer in [1, {len(row.deferred)}] (the row's deferred prompt "
                             f"tokens), got {count!r}")
        row.fed = count

    # ---- the packed forward --------------------------------------------------------------------
    @torch.no_grad()
    def forward_rows(self, rows: list[PackedRow], blocks: list[list[int]], trees: list[TokenTree | None],
                     hidden: bool) -> list[ForwardOutput]:
        """Every row's block (``block[1:]`` a tree hanging off ``block[0]``) in one packed
        forward; any subset of the batch's rows, in any order. Each row's logits [block, vocab]
        are views of one [M, vocab] float32 tensor (the step's verifier reads them in one pass).
        The same forward runs the chunks fed to other rows (:meth:`feed`); with no ``rows``, it
        runs those alone."""
        if any(row.batch is not self for row in rows) or len({id(r) for r in rows}) != len(rows):
            raise ValueError("forward_rows takes rows of this batch, each once")
        self._flush()
        stepping = {id(row) for row in rows}
        for row in rows:
            row.fed = 0  # a row with a block runs all of its deferred prompt first
        fed = [row for row in self.rows if row.fed and id(row) not in stepping]
        if not rows and not fed:
            return []
        outs = self._forward(rows, blocks, trees, hidden, scored=True, fed=fed)
        for row, block in zip(rows, blocks):
            row.length += len(block)  # cached until commit keeps the root and the accepted path
            row.tokens += block
        return outs

    def _forward(self, rows: list[PackedRow], blocks: list[list[int]], trees: list[TokenTree | None],
                 hidden: bool, scored: bool, fed: list[PackedRow] = ()) -> list[ForwardOutput]:
        """The rows' blocks after their cached entries (each row's deferred prompt tokens run
        first), and the chunks fed to the rows of ``fed`` (no block), all of which the store
        gains (each block row's length is moved on by the caller). ``scored``: logits at every
        block position (else none)."""
        pieces = [*zip(rows, blocks), *((row, []) for row in fed)]
        for row, block in pieces:  # first every move (finding room may move other rows' segments)
            segment = self.arena.segment(row)
            if row.cache_length + len(block) > segment.size:  # it outgrew its segment: a larger one, its entries along
                self.arena.allocate(row, max(2 * segment.size, row.cache_length + len(block) + SLACK),
                                    keep=row.length)
        if not lean.usable(self.model, self._modules):  # hooks (a user's, a profiler's), training mode
            for row in fed:
                self._own_forward(row, row.deferred[:row.fed], None, False, False)
                self._cached_deferred(row, row.fed)
            outs = []
            for row, block, tree in zip(rows, blocks, trees):
                if row.deferred:
                    self._own_forward(row, row.deferred, None, False, False)
                    self._cached_deferred(row)
                outs.append(self._own_forward(row, block, tree, hidden, scored))
                self.pending[id(row)] = len(block)
            return outs
        ids, positions, slots, start, prefix = [], [], [], [], []
        offsets, extra, any_tree = [0], [], False
        kept = []  # the blocks' indices in the packed tokens (prompt tokens, deferred or fed, are not scored)

        def place(row: PackedRow, block: list[int], tree: TokenTree | None, past: int) -> None:
            nonlocal any_tree
            size = len(block)
            segment = self.arena.segment(row)
            first = segment.start + past  # the store entry of the block's first token
            ids.extend(block)
            slots.extend(range(first, first + size))
            start.extend([segment.start] * size)
            if tree is None or tree.is_chain:  # causal: each token sees the cache and the block up to itself
                positions.extend(range(past, past + size))
                prefix.extend(range(first + 1, first + size + 1))
                offsets.extend([offsets[-1]] * size)
            else:  # a tree token sees the cache, then its ancestors in the block (and itself), in order
                any_tree = True
                positions.extend((tree.block_positions + past).tolist())
                prefix.extend([first] * size)
                for seen in tree.block_mask.tolist():
                    extra.extend(first + j for j, visible in enumerate(seen) if visible)
                    offsets.append(len(extra))

        for row in fed:
            place(row, row.deferred[:row.fed], None, row.length)  # a chunk of a deferred prompt: a chain
        reported = []  # per row: its deferred prompt tokens whose states it gets (with hidden states)
        for row, block, tree in zip(rows, blocks, trees):
            place(row, row.deferred, None, row.length)  # a deferred prefill: a chain before the block
            reported.append(len(row.deferred) if hidden else 0)
            kept.extend(range(len(ids) - reported[-1], len(ids)))
            place(row, block, tree, row.cache_length)
            kept.extend(range(len(ids) - len(block), len(ids)))
            self.pending[id(row)] = len(block)
        index = dict(dtype=torch.long, device=self.device)
        lists = ops.KeyLists(torch.tensor(start, **index), torch.tensor(prefix, **index),
                             torch.tensor(offsets, **index) if any_tree else None,
                             torch.tensor(extra, **index) if any_tree else None)
        slot_index = torch.tensor(slots, **index)  # [N]
        arena = self.arena

        def attend(index: int, scale: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            arena.write(index, slot_index, k, v)
            return invariant.attend(q, arena.keys[index], arena.values[index], lists, scale)  # [N, H, D]

        keep = None if len(kept) == len(ids) else torch.tensor(kept, **index)  # [M] where prompt tokens ran too
        with forwards.active():
            states = lean.run(self.model, torch.tensor(ids, **index), torch.tensor(positions, **index), attend,
                              keep)  # [M, hidden] the final norm's output at the kept positions
            scoring = states
            if any(reported):  # the LM head reads the blocks' rows alone (each row's logits its own alone)
                at, blocks_at = 0, []
                for count, block in zip(reported, blocks):
                    blocks_at.extend(range(at + count, at + count + len(block)))
                    at += count + len(block)
                scoring = states[blocks_at]  # [blocks' tokens, hidden]
            logits = self.model.lm_head(scoring).float() if scored and kept else None  # [blocks' tokens, vocab]
        for row in rows:
            self._cached_deferred(row)
        for row in fed:
            self._cached_deferred(row, row.fed)
        outs, at, scored_at = [], 0, 0
        for count, block in zip(reported, blocks):
            prompt_hidden = states[at:at + count] if count else None
            at += count
            outs.append(ForwardOutput(None if logits is None else logits[scored_at:scored_at + len(block)],
                                      states[at:at + len(block)] if hidden else None, prompt_hidden=prompt_hidden))
            at += len(block)
            scored_at += len(block)
        return outs

    @staticmethod
    def _cached_deferred(row: PackedRow, count: int | None = None) -> None:
        """A forward cached the first ``count`` of the row's deferred prompt tokens (None: all)."""
        count = len(row.deferred) if count is None else count
        row.tokens += row.deferred[:count]
        row.length += count
        del row.deferred[:count]
        row.fed = 0

    def _own_forward(self, row: PackedRow, block: list[int], tree: TokenTree | None, hidden: bool,
                     scored: bool) -> ForwardOutput:
        """One row through the model's own forward (the same numbers as the lean one,
        tests/test_lean.py), for what the lean forward does not take: the row's entries lent as
        a cache, the block's entries written back to its segment."""
        start, past, size = self.arena.segment(row).start, row.length, len(block)
        cache = kv.new_cache(False)
        for keys, values in zip(self.arena.keys, self.arena.values):
            layer = kv.GrowingLayer()
            layer.lazy_initialization(keys[None, :, :0], values[None, :, :0])
            layer.keys, layer.values = keys[None, :, start:start + past], values[None, :, start:start + past]
            cache.layers.append(layer)
        single = ModelAdapter(self.model)
        single.cache = cache
        out = single.forward(block, tree, hidden, logits_to_keep=0 if scored else 1)
        slots = torch.arange(start + past, start + past + size, device=self.device)
        for index, layer in enumerate(cache.layers):  # [1, H_kv, past + size, D]: the block's entries back
            self.arena.write(index, slots, layer.keys[0, :, past:].transpose(0, 1), layer.values[0, :, past:].transpose(0, 1))
        return ForwardOutput(out.logits if scored else None, out.hidden)

    def _flush(self) -> None:
        """Move the trees' accepted paths into place, every row's at once."""
        if self.moves:
            source = torch.tensor([s for moved, _ in self.moves for s in moved], dtype=torch.long)
            target = torch.tensor([t for _, placed in self.moves for t in placed], dtype=torch.long)
            self.moves = []
            self.arena.move(source, target)
