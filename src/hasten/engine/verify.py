"""The one verifier: acceptance rules, chosen once per generation, run on the logits' device.

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

Block index ``b`` = node index + 1, with the root at block index 0 (see
:mod:`hasten.core.tree`).

Speculative sampling as the walk reads (Leviathan et al. 2023; Chen et al. 2023; SpecInfer-
style recursive rejection over siblings): from the root, try the children of the current
node in order; take the first accepted one and go on from it; when every child is rejected
(or there is none) draw the next token from what is left of that node's ``p``. Whether a
child would be accepted depends only on its parent's row of ``p`` (and its own ``q``), on
its earlier siblings and on its own uniform, never on the path the walk took. So the
device tests every node at once, finds the walk's path with an ancestor mask, draws the
next token from the end node's row selected by device-side indexing, and hands path and
token to the host in one transfer.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..core.sampling import check_generator, draw, uniforms
from ..core.tree import TokenTree

_EMPTY_RESIDUAL = 1e-6  # a residual this light is p == q (or all mass drafted) up to rounding


@dataclass(frozen=True)
class Verdict:
    accepted: tuple[int, ...]  # node indices of the accepted path, root side first
    next_token: int  # the bonus token, or the recovered token after a rejection


def check_draft(tokens, vocab: int) -> None:
    """Draft ids must index the vocabulary: a negative id would be read from the end."""
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab):
        bad = next(t for t in tokens if not 0 <= t < vocab)
        raise ValueError(f"draft token id {bad} is outside the vocabulary [0, {vocab})")


# ---- one tree's index tensors, built once per (tree, device) ----------------------------------
@dataclass(frozen=True)
class TreeIndex:
    parent_block: torch.Tensor  # [n] long: block index of each node's parent (0: the root)
    node: torch.Tensor  # [n] long: 0 .. n - 1
    block: torch.Tensor  # [n] long: each node's own block index (node + 1)
    depth: torch.Tensor  # [n] long: 1 for a child of the root
    only_child: torch.Tensor  # [n] bool: the node has no siblings
    earlier_siblings: torch.Tensor  # [n, n] bool: [j, i] node i shares j's parent and comes before j
    earlier_siblings_f: torch.Tensor  # [n, n] float32, the same
    ancestry: torch.Tensor  # [n, n] bool: [j, i] node i is j or one of j's ancestors
    ancestry_f: torch.Tensor  # [n, n] float32, the same
    lone_child_of: torch.Tensor  # [n + 1] long: block b's only child node (0 where b has none or several)
    has_lone_child: torch.Tensor  # [n + 1] float32: 1 where block b has exactly one child
    first_leaf: torch.Tensor  # [n] long: position in tree.leaf_paths of the first leaf path through the node
    no_siblings: bool  # every node is an only child (a chain, or a tree of single branches)


@lru_cache(maxsize=256)
def tree_index(tree: TokenTree, device: torch.device) -> TreeIndex:
    """Trees are values: an equal tree (Medusa's fixed tree, a chain of the same length)
    finds its tensors here already on the device."""
    n = len(tree)
    parent_block = torch.tensor(tree.parents, dtype=torch.long) + 1  # [n]
    children = torch.bincount(parent_block, minlength=n + 1)  # [n + 1]
    same_parent = parent_block[:, None] == parent_block[None, :]  # [n, n]
    earlier = same_parent & torch.ones(n, n, dtype=torch.bool).tril(-1)
    lone = children == 1  # [n + 1]
    lone_child_of = torch.zeros(n + 1, dtype=torch.long)
    lone_child_of[parent_block[lone[parent_block]]] = torch.arange(n)[lone[parent_block]]
    first_leaf = torch.full((n,), len(tree.leaf_paths), dtype=torch.long)
    for position, path in reversed(list(enumerate(tree.leaf_paths))):
        first_leaf[path] = position
    ancestry = tree.block_mask[1:, 1:].clone()
    tensors = dict(
        parent_block=parent_block,
        node=torch.arange(n),
        block=torch.arange(1, n + 1),
        depth=torch.tensor(tree.depths, dtype=torch.long),
        only_child=lone[parent_block],
        earlier_siblings=earlier,
        earlier_siblings_f=earlier.float(),
        ancestry=ancestry,
        ancestry_f=ancestry.float(),
        lone_child_of=lone_child_of,
        has_lone_child=lone.float(),
        first_leaf=first_leaf,
    )
    on_device = {name: value.to(device, non_blocking=True) for name, value in tensors.items()}  # no stream sync
    return TreeIndex(**on_device, no_siblings=bool(lone[parent_block].all()))


def draft_tensor(tokens, device: torch.device) -> torch.Tensor:
    """[n] long draft ids on ``device`` (a host-to-device copy; nothing comes back)."""
    return torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True)


# ---- greedy ----------------------------------------------------------------------------------
def greedy_ids(logits: torch.Tensor) -> list[int]:
    """[n + 1] argmax of each row of ``logits`` [n + 1, vocab] (the first maximum, as torch's), as
    host ints: one transfer from a GPU; on the CPU through numpy, whose argmax is a tenth of
    torch's there (docs/cpu.md, "The measurements behind the code's choices")."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def accept_greedy(tree: TokenTree, draft, target_argmax: list[int]) -> Verdict:
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


# ---- speculative sampling ----------------------------------------------------------------------
def accept_sampling(
    tree: TokenTree,
    draft,
    p: torch.Tensor,  # [n + 1, vocab] target distribution at each block index
    q: torch.Tensor | None,  # [n, vocab] distribution node i was drawn from, or None (point masses)
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative sampling over a tree, on ``p``'s device, with one host transfer.

    A lone child with a ``q`` is accepted with probability ``min(1, p(x)/q(x))`` and, if
    rejected, leaves the residual ``max(p - q, 0)``. Siblings (or any child without ``q``)
    are point masses tried in order: child j is accepted with probability
    ``p(x_j) / (1 - p(earlier siblings' tokens))``, a repeat of an earlier sibling's token
    never; once all are rejected, their tokens are zeroed out of ``p``. Either way the
    output is distributed exactly as ``p``.
    """
    end, token = sampling_walk(tree, draft, p, q, generator)
    return sampling_verdict(tree, *torch.stack([end, token]).tolist())  # the step's one device-to-host transfer


def sampling_walk(tree: TokenTree, draft, p: torch.Tensor, q: torch.Tensor | None,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`accept_sampling` on the device: 0-dim long tensors of the block index where the
    walk stops and of the next token, left on the device (a batch stacks every row's and moves
    them to the host at once)."""
    draft = tuple(draft)
    n, vocab = len(draft), p.shape[-1]
    check_draft(draft, vocab)
    if len(tree) != n:
        raise ValueError(f"{n} draft tokens for a tree of {len(tree)} nodes")
    if q is not None:
        if tuple(q.shape) != (n, vocab):
            raise ValueError(f"q must be [{n}, {vocab}] (one row per draft node), got {list(q.shape)}")
        q = q.to(p.device, torch.float32)
    randoms = uniforms(n + 1, generator, p.device)  # [n + 1] one test per node, then the final draw
    if n == 0:  # plain decoding
        return torch.zeros((), dtype=torch.long, device=p.device), draw(p[:1], randoms)[0]
    index = tree_index(tree, p.device)
    tokens = draft_tensor(draft, p.device)  # [n]
    tests = randoms[:n]
    p_draft = p[index.parent_block, tokens]  # [n] p of each draft token after its parent
    if q is None:
        accept = _point_mass_tests(index, tokens, p_draft, tests)
    else:
        ratio = tests * q[index.node, tokens] < p_draft  # u < p/q, without dividing by a zero q
        accept = ratio if index.no_siblings else torch.where(
            index.only_child, ratio, _point_mass_tests(index, tokens, p_draft, tests))
    end_block = _walk(index, accept)
    law = _end_distribution(index, tokens, p, q, end_block)  # [vocab]
    return end_block, draw(law[None], randoms[n:])[0]


def sampling_verdict(tree: TokenTree, end_block: int, token: int) -> Verdict:
    return Verdict(tuple(tree.ancestors(end_block - 1)) if end_block else (), token)


def _point_mass_tests(index: TreeIndex, tokens, p_draft, tests) -> torch.Tensor:
    """[n] bool: would node j, as a point mass, be accepted if the walk tried it (parent
    taken, every earlier sibling rejected)? Its residual is p with the earlier siblings'
    tokens zeroed out, so the test is u * (1 - their mass) < p(x_j)."""
    if index.no_siblings:
        return tests < p_draft
    # an earlier sibling with the same token already zeroed it out of the residual: never accept
    repeated = (index.earlier_siblings & (tokens[:, None] == tokens[None, :])).any(-1)  # [n]
    fresh = p_draft.masked_fill(repeated, 0.0)  # [n] each distinct token's mass once
    # [n] mass not yet taken by rejected earlier siblings (a plain float32 sum: a matrix product
    # may run in TF32 on a GPU, and these are probabilities, not counts)
    left = 1 - (index.earlier_siblings_f * fresh).sum(-1)
    return tests * left.clamp_min(0.0) < fresh


def _walk(index: TreeIndex, accept: torch.Tensor) -> torch.Tensor:
    """0-dim long: block index where the walk stops (0: the root). The walk takes each
    node's first accepted child, so a node is on its path when it and every ancestor were
    accepted with no accepted earlier sibling; the path is a chain, so its deepest node has
    the largest index."""
    taken = accept.float()  # [n]
    if not index.no_siblings:  # counts of 0/1 by matrix products: exact even in TF32
        taken = taken * (index.earlier_siblings_f @ taken == 0)
    on_path = index.ancestry_f @ (1 - taken) == 0  # [n] no ancestor (or itself) left untaken
    return (on_path * index.block).max()


def _end_distribution(index: TreeIndex, tokens, p, q, end_block) -> torch.Tensor:
    """[vocab] weights of the next token at ``end_block`` (0-dim tensor): ``p`` there minus
    what its rejected children took (``q`` of a lone child, or the point-mass tokens). A
    leaf has no children, so this is ``p``: the bonus token."""
    at_end = end_block.view(1)  # [1] device-side indexing: no host sync
    p_end = p.index_select(0, at_end)[0]  # [vocab]
    residual = p_end
    if q is None or not index.no_siblings:  # some children may be point masses
        rejected = index.parent_block == end_block  # [n] every child of the end was rejected
        if q is not None:
            rejected = rejected & ~index.only_child  # a lone child with q leaves max(p - q, 0) instead
        removed = torch.zeros_like(p_end).index_add_(0, tokens, rejected.float())  # [vocab] > 0 on rejected tokens
        residual = residual.masked_fill(removed > 0, 0.0)
    if q is not None:
        q_lone = q.index_select(0, index.lone_child_of.index_select(0, at_end))[0]  # [vocab]
        residual = (residual - q_lone * index.has_lone_child.index_select(0, at_end)).clamp_min(0.0)
    return torch.where(residual.sum() > _EMPTY_RESIDUAL, residual, p_end)


# ---- rules as objects, chosen once per generation ---------------------------------------------
@dataclass(frozen=True)
class RowCheck:
    """One row's part of a step's verification: its draft tree and tokens, the target's logits
    [n + 1, vocab] at each block index (after the row's logit rules), ``q`` [n, vocab] or None,
    its sampling settings and generator."""

    tree: TokenTree
    tokens: tuple[int, ...]
    logits: torch.Tensor
    q: torch.Tensor | None
    sampling: object
    generator: torch.Generator | None


class Acceptance:
    """An acceptance rule. ``lossless`` rules keep the contract; the loop picks one rule
    before the first step (:func:`acceptance_rule`) and never branches per step. A lossy rule
    names the decoding it relaxes (``relaxes``: ``"sampling"`` or ``"greedy"``).

    ``verify_rows`` checks every row of a batch step that uses this kind of rule at once;
    rules that keep no state of their own (``batchable``) are grouped across rows by their
    class, so a step verifies all its greedy rows in one pass and all its sampled rows in
    another, each with one host transfer."""

    lossless = True
    relaxes: str | None = None
    batchable = False  # the rule holds no per-request state: one object may verify every row of its class

    def verify(self, tree: TokenTree, tokens: tuple[int, ...], logits: torch.Tensor, q: torch.Tensor | None,
               sampling, generator: torch.Generator | None) -> Verdict:
        """logits: [n + 1, vocab] target logits at each block index; q: [n, vocab] or None."""
        raise NotImplementedError

    def verify_rows(self, rows: list[RowCheck]) -> list[Verdict]:
        return [self.verify(r.tree, r.tokens, r.logits, r.q, r.sampling, r.generator) for r in rows]


class GreedyAcceptance(Acceptance):
    batchable = True

    def verify(self, tree, tokens, logits, q, sampling, generator) -> Verdict:
        check_draft(tokens, logits.shape[-1])
        return accept_greedy(tree, tokens, greedy_ids(logits))

    def verify_rows(self, rows: list[RowCheck]) -> list[Verdict]:
        """Every row's argmax in one pass over the step's logits ([sum of blocks, vocab]; the
        packed batch hands them over as one tensor) and one transfer."""
        for row in rows:
            check_draft(row.tokens, row.logits.shape[-1])
        argmax = greedy_ids(stacked([row.logits for row in rows]))  # [sum of (n + 1)]
        verdicts, at = [], 0
        for row in rows:
            verdicts.append(accept_greedy(row.tree, row.tokens, argmax[at:at + len(row.tokens) + 1]))
            at += len(row.tokens) + 1
        return verdicts


class SpeculativeSampling(Acceptance):
    batchable = True

    def verify(self, tree, tokens, logits, q, sampling, generator) -> Verdict:
        check_draft(tokens, logits.shape[-1])  # before any work on the device
        check_generator(generator, logits.device)
        return accept_sampling(tree, tokens, sampling.probs(logits), q, generator)

    def verify_rows(self, rows: list[RowCheck]) -> list[Verdict]:
        """Every row's walk on the device (each with its own law and generator), then every
        row's (end, token) to the host in one transfer."""
        for row in rows:
            check_draft(row.tokens, row.logits.shape[-1])
            check_generator(row.generator, row.logits.device)
        walks = [sampling_walk(r.tree, r.tokens, r.sampling.probs(r.logits), r.q, r.generator) for r in rows]
        found = torch.stack([value for walk in walks for value in walk]).tolist()  # [2 * rows]
        return [sampling_verdict(row.tree, found[2 * i], found[2 * i + 1]) for i, row in enumerate(rows)]


def stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` ([n_i, vocab] each) as one [sum n_i, vocab] tensor: a view when they lie end
    to end in one storage already (the packed batch's logits), else a copy."""
    first = tensors[0]
    if len(tensors) == 1:
        return first
    width = first.shape[-1]
    if all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device for t in tensors):
        at = first.data_ptr()
        adjacent = True
        for t in tensors:
            adjacent &= t.data_ptr() == at and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            at += t.numel() * t.element_size()
        if adjacent:
            rows = sum(t.shape[0] for t in tensors)
            return first.as_strided((rows, width), (width, 1))
    return torch.cat(tensors)


def verify_all(rules: list[Acceptance], rows: list[RowCheck]) -> list[Verdict]:
    """Each row's verdict under its own rule, every rule class's rows in one pass."""
    groups: dict[object, list[int]] = {}
    for i, rule in enumerate(rules):
        groups.setdefault(type(rule) if rule.batchable else id(rule), []).append(i)
    verdicts: list[Verdict | None] = [None] * len(rows)
    for members in groups.values():
        for i, verdict in zip(members, rules[members[0]].verify_rows([rows[i] for i in members])):
            verdicts[i] = verdict
    return verdicts


def acceptance_rule(sampling, lossy: Acceptance | None = None) -> Acceptance:
    """The exact rule for ``sampling`` (greedy or speculative sampling), or the lossy rule
    the user asked for by name, which must relax the decoding asked for (TypicalAcceptance
    relaxes sampling, GADPlusPlus greedy decoding)."""
    if lossy is not None:
        if not isinstance(lossy, Acceptance) or lossy.lossless:
            raise TypeError("lossy_acceptance must be a lossy rule from hasten.approx, e.g. TypicalAcceptance()")
        asked = "greedy" if sampling.greedy else "sampling"
        if lossy.relaxes != asked:
            need = "temperature 0" if lossy.relaxes == "greedy" else "temperature > 0"
            raise ValueError(f"lossy_acceptance {type(lossy).__name__} relaxes {lossy.relaxes} decoding "
                             f"({need}); this request asks for {asked} decoding")
        return lossy
    return GreedyAcceptance() if sampling.greedy else SpeculativeSampling()
