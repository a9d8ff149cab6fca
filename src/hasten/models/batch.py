"""Many sequences through one causal LM: one KV cache whose columns are not aligned across rows.

Each row accepts a different number of draft tokens per step and joins or leaves the batch
at its own time, so rows cannot share one cache length. The layout that stays simplest and
exact: every forward appends one block of columns to all rows (rows with shorter blocks
pad theirs), and two small tensors say what each column holds for each row:

* ``valid[row, column]``: the column holds one of the row's committed tokens;
* ``key_pos[row, column]``: that token's position (RoPE was applied with it).

The attention mask is built from them, so a padded or rejected column is never seen.
After a step each row's kept columns (its root and accepted path) are gathered to the
front of that step's block region and the region is cut to the longest row's; rows that
kept fewer leave a few invalid columns behind, and the whole cache is compacted once
such holes make up half of it (amortised O(1) per token).

Row ``r`` of the cache is one sequence's :class:`BatchRow`: the same ``cache_length`` /
``commit`` / ``crop`` interface as a single-sequence :class:`~hasten.models.adapter.ModelAdapter`,
so the decode step does not know which one it drives. Encoder-decoders and hidden
transfer's rider positions are served one sequence at a time by the ModelAdapter.
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from . import cache as kv
from . import forwards
from .adapter import ForwardOutput, ModelAdapter, vocab_size
from .attention import kv_heads_in_place
from .compat import cache_argument
from .layers import attention_mask, model_name
from ..core.tree import TokenTree

_COMPACT_SLACK = 32  # columns of holes tolerated before compacting, whatever the length


class RowOfBatch:
    """What every batch's row shows the decode step and the drafters: the batch's model, its
    vocabulary and device, the row's committed length (``self.length``)."""

    trees_ok = True
    encoder_decoder = False
    prompt_embeds = None  # batches take no images
    encoder_states = None  # nor encoder-decoders
    prompt_logits: torch.Tensor | None = None  # [T - 1, vocab] the prefill's logits, when add was asked for them
    kv_readable = False  # drafters run no forwards of their own on a batch's rows
    batch: object
    length: int  # committed tokens cached (all but the root)

    # what drafters read of ``ctx.target``: the batch's model
    @property
    def model(self):
        return self.batch.model

    @property
    def vocab_size(self) -> int:
        return self.batch.vocab_size

    @property
    def device(self):
        return self.batch.device

    @property
    def cache_length(self) -> int:
        return self.length


class BatchRow(RowOfBatch):
    """One sequence's view of the batch cache (one padded cache: no row's entries can be read alone)."""

    def __init__(self, batch: "BatchAdapter", slot: int, length: int):
        self.batch = batch
        self.slot = slot  # its row in the cache tensors; renumbered when earlier rows leave
        self.length = length  # committed tokens cached (all but the root)
        self.stored = length  # of them, those already in valid columns (the rest wait in batch._kept)

    def commit(self, start: int, tree: TokenTree, accepted: tuple[int, ...]) -> None:
        if start != self.length or self.slot not in self.batch._kept:
            raise RuntimeError("commit must follow this row's block in the last forward")
        self.batch._kept[self.slot] = [0, *(node + 1 for node in accepted)]  # block offsets: root + path
        self.length += 1 + len(accepted)

    def crop(self, new_length: int) -> None:
        self.batch._crop(self, new_length)


class BatchAdapter:
    """Drives any number of sequences of one causal LM through shared forwards."""

    trees_ok = True
    encoder_decoder = False
    kv_readable = False  # the rows share one padded cache: no row's entries can be read alone
    packed_rows = False  # every row's block is padded to the widest (what draft sizing prices a step by)
    defers_prompts = False  # add() prefills a prompt at once, even when asked to defer it
    kv_entries = None  # its cache grows with the rows (no fixed store to admit rows by)

    def __init__(self, model: PreTrainedModel):
        # the single-sequence adapter checks the model once (type, rollback-able cache)
        ModelAdapter(model)
        if model.config.is_encoder_decoder:
            raise ValueError(f"batched decoding needs a causal LM; {model_name(model)!r} is an encoder-decoder "
                             "(decode its sequences one at a time)")
        self.model = model
        self.vocab_size = vocab_size(model)
        self.device = model.device
        self.rows: list[BatchRow] = []
        self._reset()

    def _reset(self) -> None:
        self.cache = kv.new_cache(False)
        self.valid = torch.zeros(0, 0, dtype=torch.bool, device=self.device)  # [rows, columns]
        self.key_pos = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [rows, columns]
        self._kept: dict[int, list[int] | None] = {}  # slot -> kept offsets of the last block
        self._block_start = 0
        self._checked = False

    @property
    def columns(self) -> int:
        return self.valid.shape[1]

    # ---- rows joining and leaving ------------------------------------------------------
    @torch.no_grad()
    def add(self, tokens: list[int], hidden: bool = False, logits: bool = False,
            room: int | None = None, defer: bool = False) -> tuple[BatchRow, torch.Tensor | None]:
        """Prefill a new sequence (alone, exactly as a single generation does) and give it a
        row. Returns the row and, if asked, the prefilled tokens' features [T - 1, hidden].
        ``logits``: the row's ``prompt_logits`` holds the prefill's logits [T - 1, vocab]
        (row i scores token i + 1) until its reader drops them. ``room``: the tokens the row may
        come to hold (the padded cache widens as it must: nothing to reserve). ``defer``: the
        prompt is prefilled now all the same (a padded batch's rows start from a cache of their own)."""
        self.flush()
        single = ModelAdapter(self.model)
        _, prefilled = single.start(torch.tensor([tokens], dtype=torch.long), hidden=hidden, logits=logits)
        length = len(tokens) - 1
        width = max(self.columns, length)
        self._widen(width)
        rows = len(self.rows)
        new_layers = single.cache.layers
        if not self.cache.layers and new_layers:  # the first keys the batch sees: adopt the layers' shapes
            self.cache = single.cache
            for layer in self.cache.layers:
                layer.keys = _pad_rows(_pad_columns(layer.keys, width), rows, before=True)
                layer.values = _pad_rows(_pad_columns(layer.values, width), rows, before=True)
        else:
            for layer, new in zip(self.cache.layers, new_layers):
                layer.keys = torch.cat([layer.keys, _pad_columns(new.keys, width)], dim=0)
                layer.values = torch.cat([layer.values, _pad_columns(new.values, width)], dim=0)
            if self.cache.layers and not new_layers:  # a one-token prompt caches nothing: an empty row
                for layer in self.cache.layers:
                    layer.keys = _pad_rows(layer.keys, 1)
                    layer.values = _pad_rows(layer.values, 1)
        valid = torch.zeros(1, width, dtype=torch.bool, device=self.device)
        valid[0, :length] = True
        key_pos = torch.zeros(1, width, dtype=torch.long, device=self.device)
        key_pos[0, :length] = torch.arange(length, device=self.device)
        self.valid = torch.cat([self.valid, valid])
        self.key_pos = torch.cat([self.key_pos, key_pos])
        row = BatchRow(self, rows, length)
        row.prompt_logits = single.prompt_logits
        self.rows.append(row)
        return row, prefilled

    def remove(self, row: BatchRow) -> None:
        """Forget a row (finished or cancelled); the others keep their slots' order."""
        self.flush()
        if row.batch is not self or self.rows[row.slot] is not row:
            raise ValueError("this row is not in this batch")
        self.rows.pop(row.slot)
        if not self.rows:
            self._reset()
            return
        for later in self.rows[row.slot:]:
            later.slot -= 1
        others = torch.tensor([r for r in range(len(self.rows) + 1) if r != row.slot], device=self.device)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys = layer.keys.index_select(0, others)
                layer.values = layer.values.index_select(0, others)
        self.valid = self.valid.index_select(0, others)
        self.key_pos = self.key_pos.index_select(0, others)

    # ---- the shared forward ----------------------------------------------------------------
    @torch.no_grad()
    def forward_rows(self, rows: list[BatchRow], blocks: list[list[int]], trees: list[TokenTree | None],
                     hidden: bool) -> list[ForwardOutput]:
        """Run every row's block (``block[1:]`` a tree hanging off ``block[0]``) in one
        forward. ``rows`` must be all of this batch's rows, in any order."""
        if sorted(row.slot for row in rows) != list(range(len(self.rows))) or any(r.batch is not self for r in rows):
            raise ValueError("forward_rows needs every row of the batch exactly once")
        self.flush()
        order = sorted(range(len(rows)), key=lambda i: rows[i].slot)  # call order -> slot order
        blocks = [blocks[i] for i in order]
        trees = [trees[i] or TokenTree.chain(len(blocks[n]) - 1) for n, i in enumerate(order)]
        count, width, past = len(blocks), max(len(b) for b in blocks), self.columns
        ids = torch.zeros(count, width, dtype=torch.long)  # [rows, width] padded with token 0
        block_mask = torch.eye(width, dtype=torch.bool).repeat(count, 1, 1)  # [rows, width, width] padding sees itself
        query_pos = torch.zeros(count, width, dtype=torch.long)  # [rows, width]
        for slot, (block, tree) in enumerate(zip(blocks, trees)):
            size = len(block)
            ids[slot, :size] = torch.tensor(block)
            block_mask[slot, :size, :size] = tree.block_mask
            start = self.rows[slot].length
            query_pos[slot, :size] = tree.block_positions + start
            query_pos[slot, size:] = torch.arange(size, width) + start
        ids, block_mask, query_pos = ids.to(self.device), block_mask.to(self.device), query_pos.to(self.device)
        allowed = torch.cat([self.valid[:, None, :].expand(count, width, past), block_mask], dim=2)  # [rows, width, past + width]
        key_pos = torch.cat([self.key_pos, query_pos], dim=1)  # [rows, past + width]
        with kv_heads_in_place(self.model, width, past), forwards.active():
            out = self.model(
                input_ids=ids, **cache_argument(self.model, self.cache), use_cache=True, output_hidden_states=hidden,
                attention_mask=attention_mask(self.model, allowed, query_pos, key_pos), position_ids=query_pos,
            )
        if not self._checked:
            kv.check_rollback(self.cache, model_name(self.model))
            self._checked = True
        self.valid = torch.cat([self.valid, torch.zeros(count, width, dtype=torch.bool, device=self.device)], dim=1)
        self.key_pos = key_pos
        self._block_start = past
        self._kept = {slot: None for slot in range(count)}
        logits = out.logits.float()  # [rows, width, vocab]
        states = out.hidden_states[-1] if hidden else None  # [rows, width, hidden]
        results = [None] * count
        for n, i in enumerate(order):
            size = len(blocks[n])
            results[i] = ForwardOutput(logits[n, :size], None if states is None else states[n, :size])
        return results

    # ---- keeping the cache small ----------------------------------------------------------------
    def flush(self) -> None:
        """Store the last step's commits (done before anything else touches the cache):
        move each row's kept columns of the last block to the front of the block region,
        cut the region to the longest row's, then compact everything if holes dominate."""
        if not self._kept:
            return
        kept = [self._kept.get(slot) or [] for slot in range(len(self.rows))]
        self._kept = {}
        start = self._block_start
        width = max((len(k) for k in kept), default=0)
        index = torch.zeros(len(kept), width, dtype=torch.long)  # [rows, width] block offsets to keep
        keep = torch.zeros(len(kept), width, dtype=torch.bool)  # [rows, width]
        for slot, offsets in enumerate(kept):
            index[slot, : len(offsets)] = torch.tensor(offsets, dtype=torch.long)
            keep[slot, : len(offsets)] = True
            self.rows[slot].stored += len(offsets)
        self._gather(index.to(self.device) + start, keep.to(self.device), start)
        for row in self.rows:
            row.stored = row.length = min(row.stored, row.length)
        longest = int(self.valid.sum(1).max()) if len(self.rows) else 0
        if self.columns > 2 * longest + _COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        """Every row's valid columns moved to the front, in order; the rest dropped."""
        counts = self.valid.sum(1)  # [rows]
        width = int(counts.max())
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :width]  # valid columns first
        keep = torch.arange(width, device=self.device)[None] < counts[:, None]  # [rows, width]
        self._gather(order, keep, 0)

    def _gather(self, index: torch.Tensor, keep: torch.Tensor, start: int) -> None:
        """Columns >= ``start`` become ``index`` ([rows, width] column ids), valid where ``keep``."""
        for layer in self.cache.layers:
            if layer.is_initialized and layer.keys.numel():
                at = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys.gather(2, at)], dim=2)
                layer.values = torch.cat([layer.values[:, :, :start], layer.values.gather(2, at)], dim=2)
        self.valid = torch.cat([self.valid[:, :start], keep], dim=1)
        self.key_pos = torch.cat([self.key_pos[:, :start], self.key_pos.gather(1, index)], dim=1)

    def _crop(self, row: BatchRow, new_length: int) -> None:
        """Forget the row's committed tokens from position ``new_length`` on."""
        pending = self._kept.get(row.slot)
        if pending is not None and new_length >= row.stored:
            self._kept[row.slot] = pending[: new_length - row.stored]
        else:
            if pending is not None:
                self._kept[row.slot] = []
            columns = self.valid[row.slot].nonzero().flatten()
            self.valid[row.slot, columns[new_length:]] = False
            row.stored = min(row.stored, new_length)
        row.length = new_length

    def _widen(self, width: int) -> None:
        """Give every row at least ``width`` columns (new ones invalid)."""
        extra = width - self.columns
        if extra <= 0:
            return
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys = _pad_columns(layer.keys, width)
                layer.values = _pad_columns(layer.values, width)
        rows = self.valid.shape[0]
        self.valid = torch.cat([self.valid, torch.zeros(rows, extra, dtype=torch.bool, device=self.device)], dim=1)
        self.key_pos = torch.cat([self.key_pos, torch.zeros(rows, extra, dtype=torch.long, device=self.device)], dim=1)


def _pad_columns(states: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, columns, dim] -> [rows, heads, width, dim], zeros after."""
    extra = width - states.shape[2]
    if extra <= 0:
        return states
    return torch.cat([states, states.new_zeros(*states.shape[:2], extra, states.shape[3])], dim=2)


def _pad_rows(states: torch.Tensor, rows: int, before: bool = False) -> torch.Tensor:
    """Add ``rows`` rows of zeros (an empty row's keys), before or after."""
    if rows == 0:
        return states
    zeros = states.new_zeros(rows, *states.shape[1:])
    return torch.cat([zeros, states] if before else [states, zeros], dim=0)
