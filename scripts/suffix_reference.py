"""Record SuffixDecoding's reference (``arctic-inference``) on token streams, for tests/test_suffix.py.

Run with a Python that imports ``arctic_inference.suffix_decoding`` (its sdist builds on a CPU:
docs/fidelity.md, "suffix", says how) and hasten's source on the path:

    PYTHONPATH=src /tmp/arctic/venv/bin/python scripts/suffix_reference.py tests/data/suffix_reference.json.gz

It drives the reference's ``SuffixDecodingCache`` through generations that start, grow a token at
a time (or a few, as accepted drafts do), speculate at every step with path and tree drafts, and
stop, some interleaved, with a global cache small enough to evict; every call and every draft is
written down. hasten's port (``hasten.drafters.suffix_pool``) must give the same drafts for the same
calls; the script checks that too and prints how many drafts it compared.
"""
from __future__ import annotations

import gzip
import json
import random
import sys

from hasten.drafters.suffix_pool import SuffixPool

DEPTHS = (6, 12, 24)
SETTINGS = [  # (max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, use_tree_spec)
    (8, 1.0, 0.0, 0.1, False), (8, 1.0, 0.0, 0.1, True), (16, 2.0, 1.0, 0.05, True), (6, 0.5, 2.0, 0.3, False),
]


def stream(rng: random.Random, length: int, alphabet: int, phrases: list[list[int]]) -> list[int]:
    """Tokens with repetition: stock phrases (shared by every generation) among random ones."""
    out: list[int] = []
    while len(out) < length:
        if rng.random() < 0.5:
            out.extend(rng.choice(phrases))
        else:
            out.append(rng.randrange(alphabet))
    return out[:length]


def record(seed: int, generations: int = 12) -> dict:
    from arctic_inference.suffix_decoding import SuffixDecodingCache  # here: tests/test_suffix.py imports replay

    rng = random.Random(seed)
    depth = rng.choice(DEPTHS)
    max_cached = rng.choice([1, 2, 4, -1])  # -1: no bound (the reference's)
    alphabet = rng.choice([6, 12, 40])
    phrases = [[rng.randrange(alphabet) for _ in range(rng.randint(2, 7))] for _ in range(5)]
    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=max_cached)
    ops: list[list] = []
    running: dict[str, tuple[list[int], list[int]]] = {}  # id -> (sequence so far, tokens still to come)
    started = 0
    while started < generations or running:
        if started < generations and (not running or rng.random() < 0.3):
            name = f"r{started}"
            started += 1
            prompt = stream(rng, rng.randint(0, 40), alphabet, phrases)
            cache.start_request(name, prompt)
            running[name] = (list(prompt), stream(rng, rng.randint(1, 60), alphabet, phrases))
            ops.append(["start", name, prompt])
            continue
        name = rng.choice(sorted(running))
        sequence, rest = running[name]
        if not rest:
            cache.stop_request(name)
            del running[name]
            ops.append(["stop", name])
            continue
        take = min(len(rest), rng.choice([1, 1, 1, 2, 3]))
        new, rest = rest[:take], rest[take:]
        cache.add_active_response(name, new)
        sequence = sequence + new
        running[name] = (sequence, rest)
        ops.append(["add", name, new])
        settings = SETTINGS[rng.randrange(len(SETTINGS))]
        context = sequence[-depth:]
        draft = cache.speculate(name, context, max_spec_tokens=settings[0], max_spec_factor=settings[1],
                                max_spec_offset=settings[2], min_token_prob=settings[3], use_tree_spec=settings[4])
        ops.append(["speculate", name, list(settings),
                    [list(draft.token_ids), list(draft.parents), list(draft.probs), draft.score, draft.match_len]])
    return {"seed": seed, "max_tree_depth": depth, "max_cached_requests": max_cached, "ops": ops}


def replay(case: dict) -> int:
    """Run ``case``'s calls through hasten's port; AssertionError at the first draft that differs
    from the reference's, floats included. Returns the drafts compared."""
    pool = SuffixPool(case["max_tree_depth"], case["max_cached_requests"], max_cached_tokens=1 << 30)
    requests, sequences, compared = {}, {}, 0
    for op in case["ops"]:
        if op[0] == "start":
            requests[op[1]] = pool.start(op[2], fed=len(op[2]))
            sequences[op[1]] = list(op[2])
        elif op[0] == "add":
            sequences[op[1]] += op[2]
            pool.extend(requests[op[1]], sequences[op[1]])
        elif op[0] == "stop":
            pool.end(requests.pop(op[1]))
        else:
            spec_tokens, factor, offset, floor, tree = op[2]
            draft, _ = pool.speculate(requests[op[1]], sequences[op[1]], spec_tokens, factor, offset, floor, tree)
            got = [draft.token_ids, draft.parents, draft.probs, draft.score, draft.match_len]
            assert got == op[3], f"seed {case['seed']}, op {compared}: hasten {got} != reference {op[3]}"
            compared += 1
    return compared


def main() -> None:
    cases = [record(seed) for seed in range(10)]
    compared = sum(replay(case) for case in cases)
    print(f"{compared} drafts compared over {len(cases)} recorded runs: all equal")
    if len(sys.argv) > 1:
        with gzip.open(sys.argv[1], "wt", encoding="utf-8") as f:
            json.dump({"source": "arctic-inference 0.3.0 (sdist, built here), scripts/suffix_reference.py",
                       "cases": cases}, f, separators=(",", ":"))
            f.write("\n")


if __name__ == "__main__":
    main()
