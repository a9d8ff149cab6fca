"""Replay the same token streams through hasten's lookahead pool and the reference's
``LookaheadCache`` (alipay/PainlessInferenceAcceleration@78c9b00, ``lookahead/lookahead/common/
lookahead_cache.py``, given by path and never vendored: it needs numpy only) and count the
drafts that agree.

    PYTHONPATH=src python scripts/lookahead_reference.py --reference /path/to/lookahead_cache.py --requests 60
    PYTHONPATH=src python scripts/lookahead_reference.py --reference /path/to/lookahead_cache.py --requests 60 --unit word

A stream is a run of requests (prompt, output) made from Spec-Bench's questions, one token per
character (or per word and per run of spaces). Per request, as ``pretrained_model.py`` drives the
reference and ``Lookahead`` drives hasten's pool (the reference's defaults: ``decoding_length``
64, ``branch_length`` 12, ``max_query_length`` 2):

* the prompt's branches go in (the reference: ``put(prompt[1:], branch_length + 1, mode="input")``;
  hasten: ``LookaheadPool.start(prompt)``, which leaves the first token out too);
* a draft at every output position after the newest tokens, *without* feeding the output (the
  reference: ``hier_get(last 2, decoding_length, branch_length, min_output_size=decoding_length
  // 2)``; hasten: ``LookaheadPool.draft`` with ``decoding_length - 1`` nodes on a stream marked
  as fed), so the reference's streaming lag, which hasten does not have, plays no part;
* the output goes in, then the prompt's frequency is dropped and the squeeze checked (the
  reference: ``stream_put(output, final=True)``; hasten: ``extend`` then ``end``, as
  ``Lookahead.end`` does).

Drafts are compared as (token, parent) lists; each difference gets one class (``classify``).
A second reference cache, whose zero-frequency nodes are dropped after every request, tells
the one documented difference (docs/fidelity.md, ``lookahead``) from the others.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from hasten.drafters.lookahead_pool import LookaheadPool

DATA = Path(__file__).resolve().parents[1] / "src/hasten/bench/data/spec_bench/question.jsonl"
QUERY = 2  # the reference's max_query_length (hasten's max_prefix)


def requests(count: int, unit: str = "char", path: Path = DATA) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs: a question's second turn as the prompt, its first as the output
    (text that repeats across requests, as answers to one task do); one token per character,
    or per word and run of spaces (thousands of distinct tokens: squeezes then run)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    vocabulary: dict[str, int] = {}

    def encode(text: str) -> list[int]:
        if unit == "char":
            return [ord(c) for c in text]
        return [vocabulary.setdefault(piece, len(vocabulary) + 1) for piece in re.findall(r"\S+|\s+", text)]

    out = []
    for row in rows[:count]:
        turns = row["turns"] + [""] * (2 - len(row["turns"]))
        out.append((encode("Q: " + turns[1]), encode(turns[0])))
    return out


def parents_of(mask: np.ndarray) -> list[int]:
    """The reference's draft mask (root first) as each draft node's parent index (-1: the root):
    a node's row is its parent's row plus itself, so its nearest ancestor is the last one."""
    parents = []
    for i in range(1, mask.shape[0]):
        ancestors = np.nonzero(mask[i, 1:i])[0]
        parents.append(int(ancestors[-1]) if len(ancestors) else -1)
    return parents


def paths(tokens: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    """Each draft node as its path from the root."""
    out: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        out.append((out[parent] if parent >= 0 else ()) + (token,))
    return out


def drop_stale(cache) -> None:
    """Remove the reference's nodes whose every frequency is 0 (ended requests' prompt branches,
    which it keeps until a squeeze and drafts at the lowest rank; hasten drops them when the
    request ends), and empty trees (hasten drops those too, squeezed empty or emptied so)."""
    def drop(nodes: dict) -> None:
        for token, node in list(nodes.items()):
            if not any(node.freqs.values()):
                del nodes[token]
            else:
                drop(node.children)

    for token, tree in list(cache.mem.items()):
        drop(tree.nodes)
        if not tree.nodes:
            del cache.mem[token]


class Replay:
    """Both sides fed the same requests: the reference (``theirs``), the reference without its
    stale nodes (``fresh``) and hasten's pool; ``squeezed`` holds, per side, the requests after
    which its squeeze check ran (1,024 trees updated since the last one; ``fresh`` may count a
    tree twice, once before ``drop_stale`` deleted it and once after a prompt made it again)."""

    def __init__(self, module, size: int = 64, branch: int = 12, max_output_node: int = 512):
        self.size, self.branch = size, branch
        self.theirs = module.LookaheadCache(eos_ids=(), max_output_node=max_output_node)
        self.fresh = module.LookaheadCache(eos_ids=(), max_output_node=max_output_node)
        self.pool = LookaheadPool(QUERY - 1 + branch, QUERY, 1, max_output_nodes=max_output_node,
                                  max_nodes=1 << 40)  # no bound on the whole pool: the reference has none
        self.squeezed: dict[str, list[int]] = {"reference": [], "fresh": [], "hasten": []}
        self.requests = 0
        self.counts_differ = 0  # requests after which the two sides count different updated trees

    def reference(self, history: list[int], cache=None) -> tuple[list[int], list[int]]:
        ids, mask, _ = (cache or self.theirs).hier_get(history[-QUERY:], decoding_length=self.size,
                                                       branch_length=self.branch, mode="mix", idx=0,
                                                       min_output_size=max(self.size // 2, 1))
        return list(ids[1:]), parents_of(np.asarray(mask))

    def hasten(self, stream, history: list[int]) -> tuple[list[int], list[int]]:
        found = self.pool.draft(stream, history, self.size - 1, self.branch)
        return list(found.tokens), list(found.parents)

    def request(self, prompt: list[int], output: list[int], compare) -> None:
        window = self.branch + 1
        for cache in (self.theirs, self.fresh):
            cache.put(prompt[1:], branch_length=window, mode="input", idx=0)
        stream = self.pool.start(prompt, fed=len(prompt))
        stream.fed = sys.maxsize  # the pool takes none of the output while it drafts
        history = list(prompt)
        for token in output:
            compare(history, self.reference(history), self.hasten(stream, history))
            history.append(token)
        for cache in (self.theirs, self.fresh):
            cache.stream_put(output, branch_length=window, final=True, mode="output", idx=0)
        drop_stale(self.fresh)
        stream.fed = len(prompt)
        self.pool.extend(stream, history)
        self.pool.end(stream)
        # an output of 2 tokens or more updates a tree on each side: an empty set after it means a squeeze check
        for side, updated in (("reference", self.theirs._update_trees), ("fresh", self.fresh._update_trees),
                              ("hasten", self.pool.updated)):
            if len(output) >= 2 and not updated:
                self.squeezed[side].append(self.requests)
        self.counts_differ += len(self.theirs._update_trees) != len(self.pool.updated)
        self.requests += 1


def classify(replay: Replay, history: list[int], theirs, mine) -> str:
    """Why two drafts differ."""
    if replay.reference(history, replay.fresh) == mine:  # the reference drafts or matches zero-frequency nodes
        if replay.squeezed["reference"] != replay.squeezed["hasten"]:
            return "stale, squeezed apart"  # ... and its stale trees, counted as updated, moved a squeeze earlier
        return "stale"
    if sorted(paths(*theirs)) == sorted(paths(*mine)):
        return "sibling order"  # the same nodes, siblings in another order
    if replay.squeezed["fresh"] != replay.squeezed["hasten"]:
        return "squeeze cadence"  # hasten squeezed after other requests than the reference would without stale trees
    return "other"


def replay(module, count: int, unit: str, size: int = 64, branch: int = 12, max_output_node: int = 512,
           shown: int = 2) -> dict:
    sides = Replay(module, size, branch, max_output_node)
    counts: Counter = Counter()
    examples: dict[str, list] = {}

    def compare(history, theirs, mine):
        counts["compared"] += 1
        counts["reference_non_empty"] += bool(theirs[0])
        if theirs == mine:
            counts["identical"] += 1
            return
        why = classify(sides, history, theirs, mine)
        counts[why] += 1
        if len(examples.setdefault(why, [])) < shown:
            examples[why].append({"request": sides.requests, "query": history[-QUERY:],
                                  "reference": list(zip(*theirs)), "hasten": list(zip(*mine))})

    for prompt, output in requests(count, unit):
        sides.request(prompt, output, compare)
    return {"requests": count, "unit": unit, **counts, "squeeze_checks_after_request": sides.squeezed,
            "updated_tree_counts_differ_after_requests": sides.counts_differ,
            "examples": examples}


def load_reference(path: str):
    spec = importlib.util.spec_from_file_location("lookahead_cache", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", required=True, help="path of the reference's lookahead_cache.py")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--unit", choices=["char", "word"], default="char", help="what one token is")
    parser.add_argument("--decoding-length", type=int, default=64, help="draft nodes with the matched token")
    parser.add_argument("--branch-length", type=int, default=12, help="deepest draft node")
    parser.add_argument("--max-output-node", type=int, default=512, help="a tree's output nodes before a squeeze")
    parser.add_argument("--examples", type=int, default=2, help="differences shown per class")
    args = parser.parse_args()
    result = replay(load_reference(args.reference), args.requests, args.unit, args.decoding_length,
                    args.branch_length, args.max_output_node, args.examples)
    examples = result.pop("examples")
    print(json.dumps(result))
    for why, shown in examples.items():
        for example in shown:  # drafts as (token, parent) pairs
            print(why, json.dumps(example))


if __name__ == "__main__":
    main()
