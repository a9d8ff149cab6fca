"""Adapters: one small interface over Hugging Face causal and encoder-decoder LMs.

The decode loop only ever asks a model three things: start on a prompt, run a block of
tokens (a chain or a tree) after the cached ones, and forget or compact cache entries.
Everything model-specific (encoders, position ids, the 4D tree mask, which cache class)
lives here, never in the loop.

Cache invariant kept by the loop: the cache holds every committed token except the
newest one, the *root*, which is fed at the start of the next block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..engine import cache as kv
from ..engine.tree import TokenTree


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [block, vocab] float32
    hidden: torch.Tensor | None  # [block, hidden] last layer, when asked for


def vocab_size(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.get_text_config().vocab_size)


def model_name(model: PreTrainedModel) -> str:
    return getattr(model.config, "_name_or_path", "") or type(model).__name__


def decoder_start_token(model: PreTrainedModel) -> int:
    start = model.generation_config.decoder_start_token_id
    if start is None:
        start = model.config.decoder_start_token_id
    if start is None:
        raise ValueError(f"model {model_name(model)!r} has no decoder_start_token_id")
    return int(start)


def attention_mask(model: PreTrainedModel, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor):
    """[B, Q, K] bool (query may see key), [B, Q] and [B, K] positions -> the 4D additive
    mask(s) Hugging Face models take. Sliding-window layers also hide keys a window or more
    behind the query, measured in positions (tree depth), not block indices; models mixing
    layer kinds get one mask per kind."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ["sliding_attention"])

    def additive(mask: torch.Tensor) -> torch.Tensor:  # [B, 1, Q, K]
        low = torch.finfo(model.dtype).min
        return torch.zeros(mask.shape, dtype=model.dtype, device=mask.device).masked_fill(~mask, low)[:, None]

    if window is None or "sliding_attention" not in kinds:
        return additive(allowed)
    near = key_pos[:, None, :].to(allowed.device) > query_pos[:, :, None].to(allowed.device) - window
    sliding = additive(allowed & near)
    if kinds == {"sliding_attention"}:
        return sliding
    return {"full_attention": additive(allowed), "sliding_attention": sliding}


class ModelAdapter:
    """Drives one model through one generation. Create a fresh adapter per generation."""

    def __init__(self, model: PreTrainedModel):
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
        self._encoder_kwargs: dict = {}
        self._checked = False

    # ---- lifecycle ---------------------------------------------------------------------
    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, hidden: bool = False) -> tuple[list[int], torch.Tensor | None]:
        """Encode / prefill the prompt ([1, T]). Returns the committed tokens the decoder
        side starts from (the prompt for a causal LM, the start token for seq2seq) and,
        if asked, the last-layer hidden states of the prefilled tokens ([T - 1, hidden])."""
        input_ids = input_ids.to(self.device)
        if self.encoder_decoder:
            encoder = self.model.get_encoder()
            mask = torch.ones_like(input_ids)
            self._encoder_kwargs = {"encoder_outputs": encoder(input_ids=input_ids, attention_mask=mask), "attention_mask": mask}
            return [decoder_start_token(self.model)], None
        tokens = input_ids[0].tolist()
        states = None
        if len(tokens) > 1:
            states = self.forward(tokens[:-1], tree=None, hidden=hidden, logits_to_keep=1).hidden
        return tokens, states

    @torch.no_grad()
    def forward(
        self, block: list[int], tree: TokenTree | None, hidden: bool = False, logits_to_keep: int = 0
    ) -> ForwardOutput:
        """Run ``block`` after the cached tokens. ``tree`` describes block[1:] hanging off
        block[0]; ``None`` or a chain means plain causal order. ``logits_to_keep=k`` keeps
        only the last k positions' logits (a prefill needs none of them)."""
        past = kv.length(self.cache)
        ids = torch.tensor([block], dtype=torch.long, device=self.device)  # [1, block]
        kwargs = dict(self._encoder_kwargs)
        if tree is not None and not tree.is_chain:
            if self.encoder_decoder:
                raise ValueError("tree drafts are not supported on encoder-decoder models yet; use a chain drafter")
            kwargs["attention_mask"] = self._tree_mask(tree, past)
            kwargs["position_ids"] = (tree.block_positions + past).to(self.device)[None]  # [1, block]
        elif not self.encoder_decoder:
            kwargs["position_ids"] = torch.arange(past, past + len(block), device=self.device)[None]
        if logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        ids_key = "decoder_input_ids" if self.encoder_decoder else "input_ids"
        out = self.model(
            **{ids_key: ids}, past_key_values=self.cache, use_cache=True, output_hidden_states=hidden, **kwargs
        )
        if not self._checked:
            kv.check_rollback(self.cache, model_name(self.model))
            self._checked = True
        states = None
        if hidden:
            states = (out.decoder_hidden_states if self.encoder_decoder else out.hidden_states)[-1][0]
        return ForwardOutput(out.logits[0].float(), states)

    def _tree_mask(self, tree: TokenTree, past: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Cached tokens are visible to every node, block tokens only to their ancestors."""
        allowed = torch.cat([torch.ones(len(tree) + 1, past, dtype=torch.bool), tree.block_mask], dim=1)
        query_pos = tree.block_positions + past  # [block]
        key_pos = torch.cat([torch.arange(past), query_pos])  # [past + block]
        return attention_mask(self.model, allowed[None].to(self.device), query_pos[None], key_pos[None])

    # ---- cache -------------------------------------------------------------------------
    @property
    def cache_length(self) -> int:
        return kv.length(self.cache)

    def crop(self, new_length: int) -> None:
        kv.crop(self.cache, new_length)

    def commit(self, start: int, tree: TokenTree, accepted: tuple[int, ...]) -> None:
        """After verifying block ``[root] + nodes`` cached from ``start``: keep the root and
        the accepted path, drop every other node."""
        if tree.is_chain or list(accepted) == list(range(len(accepted))):
            kv.crop(self.cache, start + 1 + len(accepted))
        else:
            offsets = torch.tensor([0] + [node + 1 for node in accepted], device=self.device)
            kv.keep(self.cache, start, offsets)
