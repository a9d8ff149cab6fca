"""What one batched decode step costs on this CPU, per path: B rows of k tokens each after a
cached context, through the padded batch (the model's own forward, models/batch.py), the packed
batch (the lean forward, rows packed along one token dimension, models/packed_batch.py) and B
single-sequence lean forwards one after another. docs/serve.md quotes its output.

    python scripts/batch_cost.py zoo:smollm2-135m --threads 1 --rows 1,4,8,16,32 --tokens 1,4
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hasten.core.tree import TokenTree
from hasten.loading import load_model
from hasten.models import invariant
from hasten.models.adapter import ModelAdapter
from hasten.models.batch import BatchAdapter
from hasten.models.packed_batch import PackedBatch


def prompts(vocab: int, rows: int, context: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (context + (7 * r) % 40,), generator=g).tolist() for r in range(rows)]


def time_batch(batch, rows: list[list[int]], tokens: int, repeats: int) -> float:
    """Median seconds of one step of every row's ``tokens``-token chain; rolled back after each."""
    handles = [batch.add(prompt)[0] for prompt in rows]
    seconds = []
    for rep in range(repeats + 1):
        starts = [h.cache_length for h in handles]
        blocks = [[3 + (r + i) % 50 for i in range(tokens)] for r in range(len(rows))]
        clock = time.perf_counter()
        batch.forward_rows(handles, blocks, [None] * len(rows), False)
        if rep:
            seconds.append(time.perf_counter() - clock)
        for h, start in zip(handles, starts):
            h.commit(start, TokenTree.chain(tokens - 1), ())
            h.crop(start)
    for h in handles:
        batch.remove(h)
    return statistics.median(seconds)


def time_singles(model, rows: list[list[int]], tokens: int, repeats: int) -> float:
    adapters = []
    for prompt in rows:
        adapter = ModelAdapter(model)
        adapter.start(torch.tensor([prompt]))
        adapters.append(adapter)
    seconds = []
    for rep in range(repeats + 1):
        clock = time.perf_counter()
        for r, adapter in enumerate(adapters):
            start = adapter.cache_length
            adapter.forward([3 + (r + i) % 50 for i in range(tokens)], None)
            adapter.crop(start)
        if rep:
            seconds.append(time.perf_counter() - clock)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--context", type=int, default=160, help="cached tokens per row (rows vary by up to 40)")
    parser.add_argument("--rows", default="1,4,8,16,32")
    parser.add_argument("--tokens", default="1,4")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--paths", default="padded,packed,singles")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=getattr(torch, args.dtype)).eval()
    if not invariant.prepare(model):
        raise SystemExit(f"no hasten kernels here: {invariant.unavailable(model)}")
    paths = args.paths.split(",")
    print(f"{args.model}, {args.dtype}, {args.threads} thread(s), ~{args.context} cached tokens per row; "
          f"median ms per step of {args.repeats} (ms per row-token in brackets)")
    print("rows  tokens  " + "  ".join(f"{p:>18}" for p in paths))
    for count in [int(r) for r in args.rows.split(",")]:
        rows = prompts(model.config.vocab_size, count, args.context)
        for tokens in [int(t) for t in args.tokens.split(",")]:
            cells = []
            for path in paths:
                if path == "padded":
                    s = time_batch(BatchAdapter(model), rows, tokens, args.repeats)
                elif path == "packed":
                    s = time_batch(PackedBatch(model), rows, tokens, args.repeats)
                else:
                    s = time_singles(model, rows, tokens, args.repeats)
                cells.append(f"{1e3 * s:8.1f} ({1e3 * s / (count * tokens):6.2f})")
            print(f"{count:4d}  {tokens:6d}  " + "  ".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
