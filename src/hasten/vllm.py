"""hasten's drafters inside vLLM: proposers for vLLM's ``custom_class`` speculative method.

::

    from vllm import LLM
    llm = LLM(model=..., speculative_config={
        "method": "custom_class", "model": "hasten.vllm.PromptLookup", "num_speculative_tokens": 10})

vLLM builds the class with its ``VllmConfig`` and, after every step, asks ``propose`` for each
running request's draft (an empty list: no draft this step); vLLM verifies the drafts with
its own rejection sampler, so its output stays its own plain decoding's. This module imports
neither torch models nor transformers (only :mod:`hasten.core.ngram`), so it loads in vLLM's
environment, which pins other versions (``make vllm`` installs hasten there without its
dependencies).

:class:`PromptLookup` is hasten's ``prompt_lookup`` drafter's rule: the longest suffix of 3,
2, then 1 tokens found earlier in the request's tokens (prompt and output), its latest
occurrence, and what followed it copied (cyclically where the match overlaps the suffix), as
many tokens as ``num_speculative_tokens``. hasten's cost-aware sizing (a draft depth per
request from its own history) is not wired into vLLM yet: vLLM's depth is fixed.
"""
from __future__ import annotations

from .core.ngram import MAX_NGRAM, MIN_NGRAM, NgramIndex, find


class PromptLookup:
    """hasten's prompt lookup as a vLLM proposer (``speculative_config["model"] =
    "hasten.vllm.PromptLookup"``)."""

    def __init__(self, vllm_config):
        speculative = vllm_config.speculative_config
        self.depth = int(speculative.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.sizes = range(MAX_NGRAM, MIN_NGRAM - 1, -1)  # longest first
        # batch row -> (the tokens indexed, their index): rows move between requests, so an
        # index is reused only while the row's tokens still start with what it covers
        self._rows: dict[int, tuple[list[int], NgramIndex]] = {}

    def load_model(self, *args, **kwargs) -> None:
        """No model: the drafts come from the request's own tokens."""

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu,
                slot_mappings=None) -> list[list[int]]:
        """Each request's draft: ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` are row ``i``'s
        tokens so far (numpy); a row that sampled nothing this step (still prefilling) or has
        no room left gets none."""
        drafts = []
        for row, sampled in enumerate(sampled_token_ids):
            length = int(num_tokens_no_spec[row])
            room = min(self.depth, self.max_model_len - length)
            if not sampled or room < 1:
                drafts.append([])
                continue
            tokens = token_ids_cpu[row, :length].tolist()
            match = find(tokens, [(self._index(row, tokens), tokens)])
            drafts.append([] if match is None else match.copy(room))
        return drafts

    def _index(self, row: int, tokens: list[int]) -> NgramIndex:
        seen, index = self._rows.get(row, ((), None))
        if index is None or len(seen) > len(tokens) or tokens[: len(seen)] != seen:
            index = NgramIndex(self.sizes)  # a new request in this row, or tokens taken back
        index.extend(tokens)
        self._rows[row] = (tokens, index)
        return index
