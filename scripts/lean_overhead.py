"""What a forward of a Llama-family model costs through Hugging Face's modules and
through hasten's leaner forward (hasten/models/lean.py), with its linear layers and with them
stubbed out (so what is left is everything around the weights). docs/cpu.md quotes its output.

    python scripts/lean_overhead.py zoo:smollm2-135m --threads 1 [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from hasten.loading import load_model
from hasten.models import cache as kv
from hasten.kernels import ops
from hasten.models import lean
from hasten.models.adapter import ModelAdapter
from hasten.models.hf import HuggingFaceRuntime


@contextlib.contextmanager
def stubbed_linears(on: bool):
    """Within it (when ``on``), every linear product returns zeros of its shape at once."""
    if not on:
        yield
        return
    real = ops.linear
    ops.linear = lambda x, packed, bias: x.new_zeros(*x.shape[:-1], packed.out_features)
    try:
        yield
    finally:
        ops.linear = real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a model hasten.load_model reads (a path, a GGUF, zoo:NAME)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=100, help="tokens cached before the timed forward")
    parser.add_argument("--sizes", default="1,7")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=getattr(torch, args.dtype)).eval()
    HuggingFaceRuntime(model)  # hasten's kernels, as hasten prepares a model
    if not lean.eligible(model):
        raise SystemExit("this model does not take the lean forward here (see hasten/models/lean.py)")
    adapter = ModelAdapter(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    adapter.start(prompt)
    modules = adapter._lean_modules

    def timed(size: int, use_lean: bool) -> float:
        adapter._lean_modules = modules if use_lean else None
        start = time.perf_counter()
        adapter.forward(list(range(1, size + 1)), tree=None)
        seconds = time.perf_counter() - start
        kv.crop(adapter.cache, args.context - 1)
        return seconds

    print(f"{args.model}, {args.dtype}, {args.threads} thread(s), {args.context} cached tokens, "
          f"hasten's kernels; median ms of {args.repeats}")
    print("tokens  linear layers  Hugging Face  lean")
    for stub in (False, True):
        with stubbed_linears(stub):
            for size in (int(s) for s in args.sizes.split(",")):
                times = {False: [], True: []}
                for _ in range(args.repeats):  # interleaved, so drift falls on both alike
                    for use_lean in (False, True):
                        times[use_lean].append(timed(size, use_lean))
                print(f"{size:6d}  {'stubbed' if stub else 'real':>13}  {1e3 * statistics.median(times[False]):12.1f}"
                      f"  {1e3 * statistics.median(times[True]):4.1f}")


if __name__ == "__main__":
    main()
