"""Lossy KV and prompt compression (hasten.approx) against full-cache greedy output.

    python -m hasten.bench.compression [--budgets 128,256,512] [--prompts 4] [--length 1500] [--new 48]

On ``zoo:code-tiny`` with ``zoo:code-tiny-draft`` as SpecKV's and SpecPC's draft, for held-out
stdlib files cut to ``--length`` tokens: per policy and budget, the prefix agreement (share of
the new tokens before the first one that differs from full-cache greedy output), the
agreement (share of equal positions) and the speed (full-cache time over compressed time,
end to end, interleaved per prompt). Prints a Markdown table. Every row is LOSSY.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..api import load
from ..approx import SnapKV, SpecKV, SpecPC, StreamingLLM
from ..engine.loop import generate
from ..zoo import corpus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hasten.bench.compression", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budgets", default="128,256,512")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--length", type=int, default=1500, help="prompt tokens")
    parser.add_argument("--new", type=int, default=48, help="new tokens per generation")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = load("zoo:code-tiny", "autoregressive")
    draft = load("zoo:code-tiny-draft", "autoregressive").model
    texts = [corpus.read_text(f) for f in corpus.heldout_files()]
    prompts = [ids[: args.length] for ids in (engine.tokenizer(t).input_ids for t in texts) if len(ids) >= args.length]
    prompts = [torch.tensor([ids]) for ids in prompts[: args.prompts]]

    def run(prompt, policy=None, shortener=None):
        clock = time.perf_counter()
        ids = shortener.compress(prompt) if shortener else prompt
        out = generate(engine.model, ids, max_new_tokens=args.new, eos_token_id=[], kv_compression=policy)
        return out.sequences[0, ids.shape[1]:].tolist(), time.perf_counter() - clock

    policies = {
        "StreamingLLM": lambda b: (StreamingLLM(budget=b, window=b - 4), None),
        "SnapKV": lambda b: (SnapKV(budget=b, window=32), None),
        "SpecKV": lambda b: (SpecKV(draft=draft, budget=b, window=32, lookahead=16), None),
        "SpecPC": lambda b: (None, SpecPC(draft, budget=b, window=32, lookahead=16)),
    }
    full = [run(p)[0] for p in prompts]
    print("| policy | budget | prefix agreement | agreement | speed |\n| --- | ---: | ---: | ---: | ---: |")
    for budget in (int(b) for b in args.budgets.split(",")):
        for name, make in policies.items():
            prefix, agree, plain_s, compressed_s = [], [], 0.0, 0.0
            for prompt, reference in zip(prompts, full):
                plain_s += run(prompt)[1]
                got, seconds = run(prompt, *make(budget))
                compressed_s += seconds
                agree.append(sum(a == b for a, b in zip(got, reference)) / args.new)
                prefix.append(next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), args.new) / args.new)
            print(f"| {name} | {budget} | {statistics.mean(prefix):.2f} | {statistics.mean(agree):.2f} | "
                  f"{plain_s / compressed_s:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
