"""Typical acceptance (Cai et al. 2024, Medusa): LOSSY.

A draft token ``x`` is accepted when the target finds it *plausible enough*,
``p(x) > min(threshold, alpha * exp(-H(p)))`` with ``H`` the entropy of ``p``, instead of
by the exact speculative-sampling test. More tokens are accepted per step, but sampled output
is no longer distributed as the target's: use it only when that trade is wanted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.sampling import Sampling, sample
from ..engine.tree import TokenTree
from ..engine.verify import Verdict


@dataclass(frozen=True)
class TypicalAcceptance:
    threshold: float = 0.09  # epsilon: a token this likely is always plausible
    alpha: float = 0.3  # delta: scales the entropy-dependent bar

    lossless = False

    def __post_init__(self) -> None:
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")

    def accept(
        self,
        tree: TokenTree,
        draft: list[int],
        logits: torch.Tensor,  # [n + 1, vocab] target logits at each block index
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> Verdict:
        if sampling.greedy:
            raise ValueError("typical acceptance is a sampling mode; greedy decoding is already exact")
        p = sampling.probs(logits)  # [n + 1, vocab]
        entropy = -(p * torch.log(p.clamp_min(1e-12))).sum(-1)  # [n + 1]
        bar = torch.minimum(torch.full_like(entropy, self.threshold), self.alpha * torch.exp(-entropy))
        plausible = [float(p[tree.parents[i] + 1, token]) > float(bar[tree.parents[i] + 1]) for i, token in enumerate(draft)]
        best: tuple[int, ...] = ()
        for leaf_path in tree.leaf_paths:  # longest run of plausible tokens from the root
            run = []
            for node in leaf_path:
                if not plausible[node]:
                    break
                run.append(node)
            if len(run) > len(best):
                best = tuple(run)
        last = best[-1] + 1 if best else 0
        return Verdict(best, sample(p[last], generator))
