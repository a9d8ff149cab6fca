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

It relaxes greedy decoding: ``hasten.generate(model, ids, drafter=GAD(), lossy_acceptance=GADPlusPlus())``
at temperature 0; ``GenerationOutput.lossy`` names it. A tree draft is walked as greedy
verification walks it, taking at each node the first child that passes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.sampling import Sampling
from ..core.settings import Settings
from ..core.tree import TokenTree
from ..engine.verify import Acceptance, Verdict, check_draft, greedy_ids


@dataclass(frozen=True)
class GADPlusPlus(Acceptance, Settings):
    beta: int = 5  # top-beta: a token must be among the verifier's beta best (the reference's inference.sh: 5)
    tau: float = 3.0  # tolerance: log p(top) - log p(token) <= tau (the reference's inference.sh: 3.0)

    lossless = False
    relaxes = "greedy"

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

