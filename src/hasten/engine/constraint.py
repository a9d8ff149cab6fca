"""The decode loop's side of a constraint: one :class:`RowConstraint` per constrained row, the one
hook :class:`~hasten.engine.sequence.Sequence` calls (fit the draft, mask the logits, commit).

Exactness under speculation, step by step:

* **Drafts are checked against the grammar before verification** (:meth:`RowConstraint.fit`). A
  point-mass draft token the grammar refuses would be accepted with probability p(x) = 0 and its
  removal from the residual removes nothing, so the node and its subtree are dropped: the verdict's
  law is unchanged. A token drawn from a draft distribution ``q`` is *left to the verifier*: it
  stays, as a leaf (its subtree dropped), so that its rejection leaves the residual
  ``max(p - q, 0)`` that keeps sampling exact; dropping it would draw from ``p`` instead after
  every refused draw, which is not the target law (tests/test_constraint_law.py shows the
  difference).
* **The target's logits are masked at every verified position** (:meth:`RowConstraint.mask`):
  block index b gets the mask of the state after the path to b, after the request's logit rules and
  before the acceptance rule, so greedy takes the argmax of the masked logits and sampling draws
  from the masked law, exactly as plain constrained decoding does one token at a time.
* **The matcher advances only with committed tokens** (:meth:`RowConstraint.commit`); walking a
  draft consumes its tokens and rolls them back. A row rebuilt on a fresh scheduler (the server's
  fault isolation) or resumed replays its generated tokens into a new matcher.
* **Forced text is proposed as a draft**: where the grammar forces text (keys, punctuation and
  quotes of a fixed schema), its canonical tokenization, tokenized together with the tokens just
  written when they tokenize the same way, is proposed as a chain and verified like any draft, so
  the text cannot change; unless the method's draft already begins with it, it becomes the draft's
  first branch (beside the method's draft on a target that verifies trees, instead of it on one
  that verifies chains). Steps that carry forced text do not teach the method or the sizing rule
  (their acceptance is the grammar's, not the method's).
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.constraint import Constraint, ConstraintError, words
from ..core.tree import TokenTree
from ..drafters.base import Draft

MAX_FORCED = 16  # forced tokens proposed at once: their verification positions are nearly always accepted
TAIL = 3  # committed tokens re-tokenized with the forced text, so the draft is tokenized across the boundary


class RowConstraint:
    """One row's constraint. ``ending_ids``: the tokens that end the row (EOS, stop ids), allowed
    exactly where the constrained text is complete. ``generated``: tokens the row committed
    already (a continuation), replayed into the matcher."""

    def __init__(self, constraint: Constraint, ending_ids: frozenset[int], generated: list[int]):
        self.constraint = constraint
        self.vocab = constraint.vocab_size
        self.matcher = constraint.matcher()
        self.ending = frozenset(ending_ids)
        ids = np.array(sorted(self.ending | frozenset(getattr(constraint, "end_ids", ()))), dtype=np.int64)
        self._clear_words, self._clear_bits = ids // 32, ~(np.uint32(1) << (ids % 32).astype(np.uint32))
        ends = np.array(sorted(self.ending), dtype=np.int64)
        self._end_words, self._end_bits = ends // 32, np.uint32(1) << (ends % 32).astype(np.uint32)
        self._all = np.full(words(self.vocab), 0xFFFFFFFF, dtype=np.uint32)
        self._bits: np.ndarray | None = None  # [n + 1, words] this step's masks, one per block index
        self._empty: list[int] = []  # block indices where no token is left once every rule applied
        self.forced_nodes = 0  # this step's draft nodes that hold forced text (the first ones)
        self.committed = 0
        self.commit(list(generated))

    # ---- before the forward --------------------------------------------------------------------
    def fit(self, draft: Draft, forced_room: int, recent: list[int], trees_ok: bool) -> Draft:
        """``draft`` cut to what the grammar allows, with the forced text (at most ``forced_room``
        tokens; 0: none, as in plain decoding) as its first branch where the grammar forces some and
        the draft does not begin with it: merged into one tree when the target verifies trees, else
        instead of the draft. Computes the masks :meth:`mask` applies."""
        draft = self._cut(draft)
        forced = self._forced_tokens(min(forced_room, MAX_FORCED), recent) if forced_room > 0 else []
        self.forced_nodes = 0  # nodes 0 .. forced_nodes - 1 hold the forced text
        if forced and draft.riders is None and not _begins_with(draft, forced):
            draft = _merged(forced, draft) if trees_ok and len(draft) else Draft.chain(forced)
            self.forced_nodes = len(forced)
        self._bits = self._masks(draft)
        return draft

    def forced_accepted(self, accepted: tuple[int, ...]) -> int:
        """How many of the accepted nodes hold forced text."""
        return sum(node < self.forced_nodes for node in accepted)

    def _cut(self, draft: Draft) -> Draft:
        """Point-mass nodes the grammar refuses go with their subtrees; a node drawn from q stays, as a
        leaf (see the module's doc)."""
        if not len(draft):
            return draft
        keep: list[int] = []
        drawn = draft.probs is not None
        tree, tokens = draft.tree, draft.tokens

        def walk(block: int) -> None:
            for node in tree.children[block]:
                token = tokens[node]
                if token in self.ending:  # nothing follows an ending token
                    if drawn or self.matcher.accepting():
                        keep.append(node)
                elif self.matcher.consume(token):
                    keep.append(node)
                    walk(node + 1)
                    self.matcher.rollback(1)
                elif drawn:
                    keep.append(node)

        walk(0)
        return draft._subset(sorted(keep))

    def _masks(self, draft: Draft) -> np.ndarray:
        """[n + 1, words] uint32: the tokens allowed at each block index (the state after its path)."""
        tree, tokens = draft.tree, draft.tokens
        bits = np.empty((len(draft) + 1, words(self.vocab)), dtype=np.uint32)

        def walk(block: int) -> None:
            self._fill(bits[block])
            for node in tree.children[block]:
                if tokens[node] not in self.ending and self.matcher.consume(tokens[node]):
                    walk(node + 1)
                    self.matcher.rollback(1)
                else:  # the row ends there, or a refused token drawn from q: its row is never read
                    bits[node + 1] = self._all

        walk(0)
        return bits

    def _fill(self, row: np.ndarray) -> None:
        self.matcher.fill_bitmask(row)
        np.bitwise_and.at(row, self._clear_words, self._clear_bits)
        if self.matcher.accepting():
            np.bitwise_or.at(row, self._end_words, self._end_bits)

    def _forced_tokens(self, limit: int, recent: list[int]) -> list[int]:
        """The forced text's canonical tokens the grammar accepts, at most ``limit``."""
        if limit <= 0:
            return []
        text = self.matcher.forced_bytes()
        if not text:
            return []
        tail = recent[-TAIL:]
        tokens = self.constraint.tokenize(self.constraint.token_bytes(tail) + text)
        if tokens[: len(tail)] == tail:  # the boundary tokenizes as it was written: the tokens after it
            tokens = tokens[len(tail):]
        else:
            tokens = self.constraint.tokenize(text)
        valid = 0
        for token in tokens[:limit]:
            if token in self.ending or not self.matcher.consume(token):
                break
            valid += 1
        self.matcher.rollback(valid)
        return tokens[:valid]

    # ---- after the forward ---------------------------------------------------------------------
    def mask(self, logits: torch.Tensor, ruled: bool) -> torch.Tensor:
        """[n + 1, vocab] logits (after the request's logit rules, if ``ruled``) -> float32 with every
        token the grammar refuses at -inf. A row left with no token is recorded (:meth:`check_end`)
        and scored as uniform so that no NaN reaches the verifier; only the walk ending there matters.
        Without logit rules only the grammar can empty a row, which its bitmask tells on the host."""
        refused = np.unpackbits(~self._bits.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[-1]]
        refused = torch.from_numpy(refused.view(bool)).to(logits.device, non_blocking=True)  # [n + 1, vocab]
        masked = logits.float().masked_fill(refused, float("-inf"))  # [n + 1, vocab]
        if ruled:
            empty = torch.isneginf(masked).all(-1)  # [n + 1]
            self._empty = empty.nonzero().flatten().tolist() if bool(empty.any()) else []
        else:
            self._empty = np.flatnonzero(~self._bits.any(axis=1)).tolist()
        if self._empty:
            masked[self._empty] = 0.0
        return masked

    def check_end(self, accepted: tuple[int, ...], generated: int, sampling) -> None:
        """Refuse a step whose verdict ends where no token was allowed, naming the rule that took the
        last ones away (min_tokens while it holds EOS back, else allowed_token_ids)."""
        end = accepted[-1] + 1 if accepted else 0
        if end in self._empty:
            written = generated + len(accepted)
            field = "min_tokens" if written < sampling.min_tokens else (
                "allowed_token_ids" if sampling.allowed_token_ids is not None else "constraint")
            raise ConstraintError(f"after {written} generated tokens the constraint allows no token that {field} "
                                  "allows", "no_allowed_token", field)

    def commit(self, tokens: list[int]) -> None:
        """The row committed ``tokens`` (the last may end it)."""
        for token in tokens:
            if token in self.ending:
                break
            if not self.matcher.consume(token):
                raise ConstraintError(f"generated token {self.committed} (id {token}) does not follow the constraint",
                                      "invalid_continuation")
            self.committed += 1


def _merged(forced: list[int], draft: Draft) -> Draft:
    """One tree: the forced chain first (the main chain a chain-only target would verify), the
    draft's nodes hung on it where they agree and beside it where they do not. Every node is then
    a point mass (exact for any candidate, a drawn one included: tests/test_constraint_law.py)."""
    tokens, parents = list(forced), list(range(-1, len(forced) - 1))
    at = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, tokens))}
    index = {-1: -1}  # the draft's node -> its node in the merged tree
    for node, (token, parent) in enumerate(zip(draft.tokens, draft.tree.parents)):
        key = (index[parent], token)
        if key not in at:
            at[key] = len(tokens)
            tokens.append(token)
            parents.append(key[0])
        index[node] = at[key]
    return Draft(tuple(tokens), TokenTree(tuple(parents)))


def _begins_with(draft: Draft, tokens: list[int]) -> bool:
    """Whether the draft's main chain (each node's first child) starts with ``tokens``."""
    node = -1
    for token in tokens:
        node = next(iter(draft.tree.children[node + 1]), None)
        if node is None or draft.tokens[node] != token:
            return False
    return True
