"""GAD++: Aggressive Decoding's relaxed verification (Ge et al. 2022; Xia et al. 2023, SpecDec,
reference hemingkx/SpecDec ``inference_paper.py``, ``forward_decoder``): LOSSY.

A drafted token ``x`` after a verified prefix is accepted when it is among the verifier's
``beta`` most likely tokens there **and** its log-probability is within ``tau`` of the most
likely one's: ``log p(top) - log p(x) <= tau`` (the reference compares raw logits, which is the
same: the log-softmax subtracts one constant per row). The first draft token that fails ends the
accepted run; the verifier's most likely token there follows it, as in greedy decoding. With
``beta=1`` only the argmax passes: exact greedy verification (``tau=0`` too, but for exact
ties at the top). Larger ``beta``/``tau`` accept more and the output may differ from plain greedy
decoding, so it is a mode asked for by name, never a default.

``hasten.generate`` takes lossy acceptance rules for sampling only (greedy decoding is exact
already), so :func:`generate` runs hasten's one decode loop (:func:`hasten.engine.loop.decode`)
with this rule for greedy requests; ``GenerationOutput.lossy`` names it. A tree draft is walked
as greedy verification walks it, taking at each node the first child that passes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..core.sampling import Sampling
from ..core.settings import Settings
from ..core.stats import DecodeStats
from ..core.tree import TokenTree
from ..drafters.base import Drafter
from ..engine.inputs import check_inputs, eos_ids
from ..engine.loop import GenerationOutput, decode
from ..engine.sizing import SizingChoice
from ..engine.verify import Acceptance, Verdict, check_draft, greedy_ids
from ..models.hf import runtime_of


@dataclass(frozen=True)
class GADPlusPlus(Acceptance, Settings):
    beta: int = 5  # top-beta: a token must be among the verifier's beta best (the reference's inference.sh: 5)
    tau: float = 3.0  # tolerance: log p(top) - log p(token) <= tau (the reference's inference.sh: 3.0)

    lossless = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")
        if not self.tau >= 0:  # NaN fails too
            raise ValueError(f"tau must be >= 0, got {self.tau}")

    def passing(self, logits: torch.Tensor) -> list[set[int]]:
        """For each row of ``logits`` [n + 1, vocab], the tokens this rule accepts there; with
        ``beta=1`` the greedy verifier's argmax (its first maximum, even on an exact tie)."""
        best = greedy_ids(logits)  # [n + 1]
        if self.beta == 1:
            return [{b} for b in best]
        top = logits.float().topk(min(self.beta, logits.shape[-1]), dim=-1)  # values, indices: [n + 1, beta]
        close = top.values[:, :1] - top.values <= self.tau  # [n + 1, beta]
        return [set(ids[ok].tolist()) for ids, ok in zip(top.indices, close)]

    def verify(self, tree: TokenTree, tokens: tuple[int, ...], logits: torch.Tensor, q: torch.Tensor | None,
               sampling: Sampling, generator: torch.Generator | None) -> Verdict:
        if not sampling.greedy:
            raise ValueError("GAD++ relaxes greedy verification; use it with temperature 0")
        check_draft(tokens, logits.shape[-1])
        passing = self.passing(logits)
        best = greedy_ids(logits)  # [n + 1] the correction after a failed token
        node, path = -1, []
        while True:
            block = node + 1
            node = next((child for child in tree.children[block] if tokens[child] in passing[block]), None)
            if node is None:
                return Verdict(tuple(path), best[block])
            path.append(node)


def generate(model: PreTrainedModel, input_ids: torch.Tensor, *, drafter: Drafter | None, rule: GADPlusPlus,
             max_new_tokens: int = 64, eos_token_id: int | list[int] | None = None,
             draft_size: str | None = "fixed") -> GenerationOutput:
    """Greedy decoding of one prompt ([1, T]) with ``drafter``, its drafts verified by ``rule``
    (lossy). ``draft_size`` as in :func:`hasten.generate` (fixed by default: the drafter's block)."""
    runtime = runtime_of(model)
    sampling = Sampling(0.0)
    check_inputs(runtime, input_ids, drafter, max_new_tokens, None, {})
    stats = DecodeStats()
    sizing = SizingChoice(draft_size).for_request(False, seeded=False)
    pieces = decode(runtime, input_ids, drafter, max_new_tokens, sampling, eos_ids(runtime, eos_token_id), None,
                    stats, rule, sizing)
    new: list[int] = []
    while True:
        try:
            new.extend(next(pieces))
        except StopIteration as end:
            reason = end.value
            break
    head = runtime.decoder_start() if runtime.encoder_decoder else input_ids[0].tolist()
    return GenerationOutput(torch.tensor([head + new], dtype=torch.long), stats, reason, (type(rule).__name__,))
