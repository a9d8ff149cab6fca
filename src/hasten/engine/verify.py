"""The one verifier: acceptance rules as pure functions.

Vocabulary used across hasten:

* *draft* tokens: what a drafter proposes, arranged as a :class:`TokenTree`;
* *accepted* tokens: the draft tokens the target confirms, one root-to-node path;
* the *bonus* token: the target's own next token after the accepted path (greedy: its
  argmax; sampling: a draw from ``p`` when a whole branch was accepted);
* the *recovered* token: the token drawn from the residual distribution after a
  rejection, which is what keeps sampling exact.

``p`` is the target distribution (after temperature / top-k / top-p) and ``q`` the
draft distribution a token was sampled from. A drafter that returns no ``q`` is
deterministic: its proposal is a point mass, accepted with probability ``p(x)``.

Both rules walk the tree from the root. Block index ``b`` = node index + 1, with the
root at block index 0 (see :mod:`hasten.engine.tree`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample
from .tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    accepted: tuple[int, ...]  # node indices of the accepted path, root side first
    next_token: int  # the bonus token, or the recovered token after a rejection


def accept_greedy(tree: TokenTree, draft: list[int], target_argmax: list[int]) -> Verdict:
    """Longest path whose every token equals the target's argmax after its parent.

    target_argmax: [n + 1] argmax of the target at each block index.
    """
    node, path = -1, []
    while True:
        wanted = target_argmax[node + 1]
        node = next((child for child in tree.children[node + 1] if draft[child] == wanted), None)
        if node is None:
            return Verdict(tuple(path), wanted)
        path.append(node)


def accept_sampling(
    tree: TokenTree,
    draft: list[int],
    p: torch.Tensor,  # [n + 1, vocab] target distribution at each block index
    q: torch.Tensor | None,  # [n, vocab] distribution node i was drawn from, or None (point masses)
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative sampling over a tree (Leviathan et al. 2023; Chen et al. 2023 for a
    chain; SpecInfer-style recursive rejection over siblings for a tree).

    At each node the children are tried in order against the residual distribution.
    A lone child with a ``q`` uses ``min(1, p(x)/q(x))`` and, if rejected, the residual
    ``max(p - q, 0)``. Siblings (or any child without ``q``) are treated as point
    masses: accept with the residual's ``p(x)``, else zero ``x`` out and renormalise.
    Both keep the output distributed exactly as ``p``.
    """
    node, path = -1, []
    while True:
        residual = p[node + 1]
        kids = tree.children[node + 1]
        chosen = None
        for child in kids:
            token = draft[child]
            uniform = float(torch.rand((), generator=generator))
            if q is not None and len(kids) == 1:
                q_child = q[child]
                if uniform * float(q_child[token]) < float(residual[token]):
                    chosen = child
                    break
                residual = _normalised(torch.clamp(residual - q_child, min=0), fallback=residual)
            else:
                if uniform < float(residual[token]):
                    chosen = child
                    break
                residual = _normalised(residual.clone().index_fill_(0, torch.tensor([token]), 0.0), fallback=residual)
        if chosen is None:
            return Verdict(tuple(path), sample(residual, generator))
        path.append(chosen)
        node = chosen


def _normalised(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    # A rejection can only happen where the residual has mass; an all-zero residual is a
    # floating-point corner (p == q up to rounding) and p itself is then the right law.
    total = float(weights.sum())
    return weights / total if total > 1e-12 else fallback
