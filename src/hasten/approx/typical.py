"""Typical acceptance (Cai et al. 2024, Medusa): LOSSY.

A draft token ``x`` is accepted when the target finds it *plausible enough*,
``p(x) > min(threshold, alpha * exp(-H(p)))`` with ``H`` the entropy of ``p``, instead of
by the exact speculative-sampling test. More tokens are accepted per step, but sampled output
is no longer distributed as the target's: use it only when that trade is wanted.

Like the exact verifier it runs on the logits' device: every node's test at once, the
longest plausible path found with the tree's ancestor mask, the next token drawn from the
path end's ``p`` there, and one host transfer per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.sampling import Sampling, check_generator, draw, uniforms
from ..core.settings import Settings
from ..core.tree import TokenTree
from ..engine.verify import Acceptance, Verdict, check_draft, draft_tensor, tree_index


@dataclass(frozen=True)
class TypicalAcceptance(Acceptance, Settings):
    threshold: float = 0.09  # epsilon: a token this likely is always plausible
    alpha: float = 0.3  # delta: scales the entropy-dependent bar

    lossless = False
    relaxes = "sampling"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha}")

    def verify(
        self,
        tree: TokenTree,
        draft: tuple[int, ...],
        logits: torch.Tensor,  # [n + 1, vocab] target logits at each block index
        q: torch.Tensor | None,  # unused: typical acceptance ignores how the draft was made
        sampling: Sampling,
        generator: torch.Generator | None,
    ) -> Verdict:
        if sampling.greedy:
            raise ValueError("typical acceptance is a sampling mode; greedy decoding is already exact")
        n, device = len(draft), logits.device
        check_draft(draft, logits.shape[-1])
        check_generator(generator, device)
        p = sampling.probs(logits)  # [n + 1, vocab]
        randoms = uniforms(1, generator, device)  # [1] for the next token
        if n == 0:
            return Verdict((), int(draw(p[:1], randoms)[0]))
        index = tree_index(tree, device)
        parents = index.parent_block
        entropy = -(p * p.clamp_min(1e-12).log()).sum(-1)  # [n + 1]
        bar = (self.alpha * torch.exp(-entropy)).clamp(max=self.threshold)  # [n + 1]
        plausible = p[parents, draft_tensor(draft, device)] > bar[parents]  # [n]
        reachable = ~(index.ancestry & ~plausible[None, :]).any(-1)  # [n] node and all its ancestors plausible
        # the deepest reachable node; among equally deep ones, the one on the first leaf path
        score = torch.where(reachable, index.depth * (n + 1) + (n - index.first_leaf), 0)  # [n]
        end = score.argmax()  # 0-dim
        found = reachable.any()  # 0-dim: False means the root
        path = index.ancestry.index_select(0, end.view(1))[0] & found  # [n]
        end_block = (end + 1) * found
        token = draw(p.index_select(0, end_block.view(1)), randoms)  # [1]
        flags = torch.cat([path.long(), token]).tolist()  # the step's one device-to-host transfer
        return Verdict(tuple(i for i in range(n) if flags[i]), flags[n])
