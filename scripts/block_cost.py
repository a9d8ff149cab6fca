"""What a forward of k tokens costs on this CPU with PyTorch's kernels and with hasten's
(hasten/models/invariant.py), and how far each block's logits are from one-token steps on the
same kernels. docs/cpu.md quotes its output.

    python scripts/block_cost.py zoo:smollm2-135m --threads 1 [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hasten.loading import load_model
from hasten.models import forwards, invariant


@torch.no_grad()
def forward(model, ids: torch.Tensor, context: int, size: int, hastens: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one forward over ``size`` tokens after ``context`` cached ones, and its logits
    ([size, vocab]); the prefill on the same kernels, as in hasten."""
    with forwards.active(hastens):
        cache = DynamicCache()
        model(ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        start = time.perf_counter()
        logits = model(ids[:, context:context + size], past_key_values=cache, use_cache=True).logits[0]
        return time.perf_counter() - start, logits.float()


@torch.no_grad()
def one_token_steps(model, ids: torch.Tensor, context: int, size: int, hastens: bool) -> torch.Tensor:
    with forwards.active(hastens):
        cache = DynamicCache()
        model(ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        rows = [model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits[0]
                for i in range(context, context + size)]
    return torch.cat(rows).float()  # [size, vocab]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model hasten.load_model reads (a path, a GGUF, zoo:NAME)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--context", type=int, default=280, help="tokens cached before the timed block")
    parser.add_argument("--sizes", default="1,2,4,6,8,11,16")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=getattr(torch, args.dtype)).eval()
    if not invariant.prepare(model):
        raise SystemExit(f"this model cannot take hasten's kernels here: {invariant.unavailable(model)}")
    sizes = [int(s) for s in args.sizes.split(",")]
    ids = torch.randint(0, model.config.vocab_size, (1, args.context + max(sizes)), generator=torch.Generator().manual_seed(0))
    print(f"{args.model}, {args.dtype}, {args.threads} thread(s), {args.context} cached tokens, kernels: "
          f"{invariant.kernel_path()}; median ms of {args.repeats}")
    print("tokens  PyTorch  hasten  max|logit - one-token steps on the same kernels| (PyTorch, hasten)")
    for size in sizes:
        times = {False: [], True: []}
        for _ in range(args.repeats):  # interleaved, so drift falls on both alike
            for hastens in (False, True):
                times[hastens].append(forward(model, ids, args.context, size, hastens)[0])
        gaps = [float((forward(model, ids, args.context, size, h)[1] - one_token_steps(model, ids, args.context, size, h))
                      .abs().max()) for h in (False, True)]
        print(f"{size:6d}  {1e3 * statistics.median(times[False]):7.1f}  {1e3 * statistics.median(times[True]):6.1f}"
              f"  {gaps[0]:.1e}, {gaps[1]:.1e}")


if __name__ == "__main__":
    main()
