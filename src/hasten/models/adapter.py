"""Adapters: one small interface over Hugging Face causal and encoder-decoder LMs.

The decode loop only ever asks a model three things: start on a prompt, run a block of
tokens (a chain or a tree) after the cached ones, and forget or compact cache entries.
Everything model-specific (encoders, position ids, the 4D tree mask, which cache class)
lives here, never in the loop.

Cache invariant kept by the loop: the cache holds every committed token except the
newest one, the *root*, which is fed at the start of the next block.
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from . import cache as kv
from .attention import MaskedTree, kv_heads_in_place
from .compat import cache_argument
from . import forwards, invariant, lean, vlm
from .layers import attention_mask, forward_with_placeholders, last_queries, model_name  # model_name: also imported from here
from ..core.rows import ForwardOutput, Riders  # the row contract lives on the ground floor; imported from here too
from ..core.tree import TokenTree


def vocab_size(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    if head is None:
        return int(model.config.get_text_config().vocab_size)
    # out_features first: an int8 head (models.quantize.Int8Linear) rebuilds its float weight on each .weight read
    return int(getattr(head, "out_features", None) or head.weight.shape[0])


def decoder_start_token(model: PreTrainedModel) -> int:
    start = model.generation_config.decoder_start_token_id
    if start is None:
        start = model.config.decoder_start_token_id
    if start is None:
        raise ValueError(f"model {model_name(model)!r} has no decoder_start_token_id")
    return int(start)


class ModelAdapter:
    """Drives one model through one generation. Create a fresh adapter per generation."""

    def __init__(self, model: PreTrainedModel, tree_attention: MaskedTree | None = None):
        if not isinstance(model, PreTrainedModel):
            raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
        if getattr(model, "_is_stateful", False):
            raise kv.CacheRollbackError(
                f"model {model_name(model)!r} keeps recurrent state that cannot be rolled back; "
                "speculative decoding would change its output"
            )
        self.model = model
        self.encoder_decoder = bool(model.config.is_encoder_decoder)
        self.vocab_size = vocab_size(model)
        self.device = model.device
        self.cache = kv.new_cache(self.encoder_decoder)
        # how tree blocks attend (models/attention.py); an invariant model attends one way only
        self.tree_attention = MaskedTree() if invariant.is_prepared(model) else (tree_attention or MaskedTree())
        # positions minus cache entries: 0, unless a lossy KV compression (hasten.approx) left
        # fewer entries than the prompt has tokens; every length this adapter reports or takes
        # is in positions, the cache's own in entries
        self.offset = 0
        # [T - 1, embed] what the language model read at the prefilled prompt positions (the
        # projected visual features at image placeholders): set by an image prefill with hidden
        # states asked for, for drafters whose inputs there are the target's (eagle_vlm)
        self.prompt_embeds: torch.Tensor | None = None
        self.prompt_logits: torch.Tensor | None = None  # [T - 1, vocab] the prefill's logits, when start was asked
        self._encoder_kwargs: dict = {}
        self._checked = False
        # a Llama-family float32 CPU model: its modules, for the leaner forward (models/lean.py)
        self._lean_modules = list(model.modules()) if lean.eligible(model) else None

    @property
    def encoder_states(self) -> torch.Tensor | None:
        """[1, s, He] the encoder's output over the source (computed once by ``start``), or None for a causal LM."""
        encoded = self._encoder_kwargs.get("encoder_outputs")
        return None if encoded is None else encoded.last_hidden_state

    # ---- lifecycle ---------------------------------------------------------------------
    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, hidden: bool = False, logits: bool = False,
              **model_inputs: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
        """Encode / prefill the prompt ([1, T]). Returns the committed tokens the decoder
        side starts from (the prompt for a causal LM, the start token for seq2seq) and,
        if asked, the last-layer hidden states of the prefilled tokens ([T - 1, hidden]).
        ``logits``: keep the prefill's logits in ``prompt_logits`` ([T - 1, vocab]: row i
        scores prompt token i + 1; a causal LM's text prompt only), for prompt log-probabilities.
        ``model_inputs``: a vision-language model's images (``pixel_values`` and the
        processor's other tensors), read by the prefill only (see :mod:`hasten.models.vlm`)."""
        input_ids = input_ids.to(self.device)
        if model_inputs:
            return self._start_with_images(input_ids, hidden, model_inputs)
        if self.encoder_decoder:
            encoder = self.model.get_encoder()
            mask = torch.ones_like(input_ids)
            self._encoder_kwargs = {"encoder_outputs": encoder(input_ids=input_ids, attention_mask=mask), "attention_mask": mask}
            return [decoder_start_token(self.model)], None
        tokens = input_ids[0].tolist()
        states = None
        if logits:
            self.prompt_logits = torch.zeros(0, self.vocab_size, device=self.device)  # [0, vocab] a one-token prompt
        if len(tokens) > 1:
            out = self.forward(tokens[:-1], tree=None, hidden=hidden, logits_to_keep=0 if logits else 1)
            states = out.hidden
            if logits:
                self.prompt_logits = out.logits  # [T - 1, vocab]
        return tokens, states

    def _start_with_images(self, input_ids: torch.Tensor, hidden: bool,
                           model_inputs: dict) -> tuple[list[int], torch.Tensor | None]:
        """A vision-language prefill: every prompt token but the last (text: checked by
        vlm.check_model_inputs) with the images; later blocks are text only."""
        tokens = input_ids[0].tolist()
        model_inputs = vlm.prefill_inputs(self.model, model_inputs)
        with vlm.placeholder_errors(self.model, input_ids, model_inputs):
            out = self.forward(tokens[:-1], tree=None, hidden=hidden, logits_to_keep=1, model_inputs=model_inputs)
        self.prompt_embeds = out.embeds
        return tokens, out.hidden

    @torch.no_grad()
    def forward(
        self, block: list[int], tree: TokenTree | None, hidden: bool = False, logits_to_keep: int = 0,
        riders: Riders | None = None, model_inputs: dict | None = None,
    ) -> ForwardOutput:
        """Run ``block`` after the cached tokens. ``tree`` describes block[1:] hanging off
        block[0]; ``None`` or a chain means plain causal order. ``logits_to_keep=k`` keeps
        only the last k positions' logits (a prefill needs none of them). ``riders`` add
        placeholder positions after every block position (see :class:`Riders`); their
        logits come back in ``ForwardOutput.riders``. ``model_inputs``: extra keywords of
        the model's forward (a VLM prefill's images). A CPU model's linear layers and attention
        run hasten's row-invariant kernels here (models/invariant.py)."""
        if riders is not None:
            return self._forward_with_riders(block, tree, hidden, riders)
        past = kv.length(self.cache)
        first = past + self.offset  # the block's first position
        ids = torch.tensor([block], dtype=torch.long, device=self.device)  # [1, block]
        kwargs = dict(self._encoder_kwargs)
        if tree is not None and not tree.is_chain:
            if self.encoder_decoder:
                raise ValueError("tree drafts are not supported on encoder-decoder models yet; use a chain drafter")
            kwargs["attention_mask"] = self._tree_mask(tree, past)
            kwargs["position_ids"] = (tree.block_positions + first).to(self.device)[None]  # [1, block]
        elif not self.encoder_decoder:
            kwargs["position_ids"] = torch.arange(first, first + len(block), device=self.device)[None]
        if logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        kwargs.update(model_inputs or {})
        ids_key = "decoder_input_ids" if self.encoder_decoder else "input_ids"
        path = self.tree_attention if "attention_mask" in kwargs else MaskedTree()  # only tree blocks have a mask
        if not model_inputs and type(path) is MaskedTree and lean.usable(self.model, self._lean_modules):
            with forwards.active():
                kept = 0 if hidden else logits_to_keep  # features are every position's
                states = lean.forward(self.model, ids, self.cache, kwargs["position_ids"], kwargs.get("attention_mask"),
                                      kept)  # [Q or logits_to_keep, hidden]
                logits = self.model.lm_head(states[-logits_to_keep:] if logits_to_keep else states)
            self._check_rollback()
            return ForwardOutput(logits.float(), states if hidden else None)
        with path.active(self.model), kv_heads_in_place(self.model, len(block), past), forwards.active():
            out = self.model(
                **{ids_key: ids}, **cache_argument(self.model, self.cache), use_cache=True, output_hidden_states=hidden, **kwargs
            )
        self._check_rollback()
        states = embeds = None
        if hidden:
            states = (out.decoder_hidden_states if self.encoder_decoder else out.hidden_states)[-1][0]
            if model_inputs:  # an image prefill: keep what the language model read there too
                embeds = out.hidden_states[0][0]
        return ForwardOutput(out.logits[0].float(), states, embeds=embeds)

    def forward_rows(self, rows: list["ModelAdapter"], blocks: list[list[int]], trees: list[TokenTree | None],
                     hidden: bool, riders: list[Riders | None] = (None,)) -> list[ForwardOutput]:
        """The decode step's interface (see :mod:`hasten.engine.sequence`): this adapter is
        one sequence, its own row; ``riders`` come only with a draft that has them."""
        if len(rows) != 1 or rows[0] is not self:
            raise ValueError("a ModelAdapter runs one sequence; use hasten.models.batch.BatchAdapter for several")
        return [self.forward(blocks[0], trees[0], hidden, riders=riders[0])]

    def _forward_with_riders(self, block: list[int], tree: TokenTree | None, hidden: bool,
                             riders: Riders) -> ForwardOutput:
        """The block as a tree (a chain is one), with ``riders.count`` placeholders after
        every block position; their cache entries follow the block's, so ``commit``
        drops them."""
        if self.encoder_decoder:
            raise ValueError("riders (hidden transfer's placeholders) need a causal LM; "
                             f"{model_name(self.model)!r} is an encoder-decoder")
        if self.offset:
            raise ValueError("riders (hidden transfer) need the full KV cache; a lossy KV compression dropped some")
        tree = TokenTree.chain(len(block) - 1) if tree is None else tree
        past = kv.length(self.cache)
        size = len(block)
        ids = torch.tensor([block], dtype=torch.long, device=self.device)  # [1, block]
        allowed, positions = self._tree_layout(tree, past)
        every_position = torch.arange(size, device=self.device)[None]  # [1, block]: each one anchors riders
        with kv_heads_in_place(self.model, size * (1 + riders.count), past), forwards.active():
            out = forward_with_placeholders(
                self.model, ids, allowed, positions, every_position,
                riders.count, riders.layer, riders.transfer, past_positions=torch.arange(past, device=self.device),
                **cache_argument(self.model, self.cache), use_cache=True, output_hidden_states=hidden,
            )
        self._check_rollback()
        logits = out.logits[0].float()  # [block + block * count, vocab]
        states = out.hidden_states[-1][0, :size] if hidden else None
        return ForwardOutput(logits[:size], states, logits[size:].view(size, riders.count, -1))

    def _check_rollback(self) -> None:
        if not self._checked:  # the cache's layers exist only after the first forward
            kv.check_rollback(self.cache, model_name(self.model))
            self._checked = True

    def _tree_layout(self, tree: TokenTree, past: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached tokens are visible to every node, block tokens only to their ancestors:
        [1, block, past + block] bool, and the block's positions [1, block]."""
        allowed = torch.cat([torch.ones(len(tree) + 1, past, dtype=torch.bool), tree.block_mask], dim=1)
        return allowed[None].to(self.device), (tree.block_positions + past + self.offset)[None].to(self.device)

    def _tree_mask(self, tree: TokenTree, past: int) -> torch.Tensor | dict[str, torch.Tensor]:
        allowed, query_pos = self._tree_layout(tree, past)
        key_pos = torch.cat([torch.arange(past, device=self.device)[None], query_pos], dim=1)  # [1, past + block]
        return attention_mask(self.model, allowed, query_pos, key_pos)

    @property
    def trees_ok(self) -> bool:
        """Whether this target verifies tree drafts (encoder-decoders verify chains only)."""
        return not self.encoder_decoder

    # ---- what a drafter may read of this sequence (declared by kv_readable) --------------------
    @property
    def kv_readable(self) -> bool:
        """Whether :meth:`read_kv` and :meth:`probe_queries` answer: one causal sequence's full
        cache (not an encoder-decoder's, not a compressed prompt's)."""
        return not self.encoder_decoder and self.offset == 0

    def read_kv(self, layer: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s cached keys and values as the model stored them (post-RoPE),
        [1, kv_heads, entries, head_dim] each: views to read, never to write."""
        entry = self.cache.layers[layer]
        return entry.keys, entry.values

    def read_all_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's :meth:`read_kv`, in layer order."""
        return [(entry.keys, entry.values) for entry in self.cache.layers]

    def probe_queries(self, token: int) -> dict[int, torch.Tensor]:
        """Each layer's post-RoPE query of ``token`` fed after the cached entries
        (``{layer: [heads, 1, head_dim]}``); the cache is as it was afterwards, however the
        forward ends. The model must route attention through transformers' attention
        interface (the runtime's query capture capability)."""
        length = self.cache_length
        try:
            with last_queries(self.model) as queries:
                self.forward([token], tree=None)
        finally:
            self.crop(length)
        return queries

    # ---- cache -------------------------------------------------------------------------
    @property
    def cache_length(self) -> int:
        return kv.length(self.cache) + self.offset

    def crop(self, new_length: int) -> None:
        kv.crop(self.cache, new_length - self.offset)

    def adopt(self, cache, length: int) -> None:
        """Decode on from ``cache``, which stands for the first ``length`` positions with as
        many entries as a lossy compression kept (full attention only: the model masks in
        cache order, which is position order for every kept entry)."""
        self.cache = cache
        self.offset = length - kv.length(cache)
        self._checked = False

    def commit(self, start: int, tree: TokenTree, accepted: tuple[int, ...]) -> None:
        """After verifying block ``[root] + nodes`` cached from ``start``: keep the root and
        the accepted path, drop every other node."""
        start -= self.offset  # in cache entries
        if tree.is_chain or list(accepted) == list(range(len(accepted))):
            kv.crop(self.cache, start + 1 + len(accepted))
        else:
            offsets = torch.tensor([0] + [node + 1 for node in accepted], device=self.device)
            kv.keep(self.cache, start, offsets)
