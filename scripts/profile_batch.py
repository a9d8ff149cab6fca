"""Where a batched decode step's time goes on this CPU (issue 57), and what each of the model's
linear shapes costs through hasten's row-invariant kernel and through PyTorch's oneDNN matmul.

Two tables, both on the threads given (one by default, as ``hasten serve`` decodes):

* **step**: the server's scheduler (engine/batch.py) running plain decoding over B rows of a
  packed batch, one token a row per step; each step's time split into hasten's linear kernel
  (every projection and the LM head), its attention kernel, and the rest (norms, rotary,
  sampling, the scheduler's Python);
* **shapes**: the model's linear shapes (q and o, k and v, gate and up, down, the head, and the
  fused q+k+v and gate+up products the lean forward runs; in -> out) at 1-64 rows: hasten's
  kernel on a packed weight (each bfloat16 layout this CPU has) beside
  ``torch.nn.functional.linear`` (oneDNN) on the plain weight.

Medians of ``--repeats`` runs, the paths interleaved. docs/cpu.md quotes its output.

    python scripts/profile_batch.py zoo:smollm2-135m --dtypes bfloat16,float32 --rows 1,2,4,8,16,32
    python scripts/profile_batch.py --dtypes bfloat16 --parts step --step-layouts pairs,amx   # before/after
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from hasten.kernels import ops
from hasten.loading import load_model
from hasten.models import invariant


class KernelClock:
    """Seconds spent in ``ops.linear`` and ``ops.attention`` while :meth:`installed` (the model's
    layers call them through the module, so wrapping the module's names sees every call)."""

    def __init__(self) -> None:
        self.seconds = {"linear": 0.0, "attention": 0.0}

    def _timed(self, name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            clock = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - clock
        return wrapper

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        real = ops.linear, ops.attention
        ops.linear, ops.attention = self._timed("linear", real[0]), self._timed("attention", real[1])
        try:
            yield
        finally:
            ops.linear, ops.attention = real

    def reset(self) -> dict[str, float]:
        seconds, self.seconds = self.seconds, {"linear": 0.0, "attention": 0.0}
        return seconds


def step_profile(model, rows: int, context: int, repeats: int) -> dict[str, float]:
    """Median ms per scheduler step of plain decoding over ``rows`` running rows: total, linear,
    attention, rest."""
    from hasten.engine.batch import Request, Scheduler

    scheduler = Scheduler(model, None, max_batch=rows)
    g = torch.Generator().manual_seed(0)
    for r in range(rows):
        prompt = torch.randint(3, model.config.vocab_size, (context + (7 * r) % 40,), generator=g).tolist()
        scheduler.submit(Request(prompt, max_new_tokens=repeats + 40, ignore_eos=True, speculate=False))
    while scheduler.waiting or scheduler.running < rows:  # every row admitted and prefilled
        scheduler.step()
    for _ in range(2):
        scheduler.step()
    clock, parts = KernelClock(), {"total": [], "linear": [], "attention": [], "rest": []}
    with clock.installed():
        for _ in range(repeats):
            clock.reset()
            start = time.perf_counter()
            scheduler.step()
            total = time.perf_counter() - start
            kernels = clock.reset()
            parts["total"].append(total)
            parts["linear"].append(kernels["linear"])
            parts["attention"].append(kernels["attention"])
            parts["rest"].append(total - kernels["linear"] - kernels["attention"])
    assert scheduler.running == rows
    scheduler.abandon()
    return {name: 1e3 * statistics.median(values) for name, values in parts.items()}


def repack(model, layout: str) -> None:
    """Pack ``model``'s bfloat16 layers again, in ``layout`` (ops.bf16_layouts), on their next
    forward: the environment switches ops.bf16_layout reads, and the packed copies dropped."""
    os.environ["HASTEN_BF16_DOT"] = "0" if layout == "fma" else "1"
    os.environ["HASTEN_AMX"] = "1" if layout == "amx" else "0"
    for module in model.modules():
        if hasattr(module, "_packed"):
            module._packed = module._packed_of = None
        module.__dict__.pop("_hasten_invariant_fused", None)


def shapes_of(model) -> list[tuple[str, int, int]]:
    """The model's linear shapes (name, in, out), and the two fused products the lean forward
    runs in their place (q, k and v in one; gate and up in one)."""
    c = model.config
    hidden, inter = c.hidden_size, c.intermediate_size
    head_dim = getattr(c, "head_dim", None) or hidden // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    return [("q, o", hidden, hidden), ("k, v", hidden, kv), ("gate, up", hidden, inter), ("down", inter, hidden),
            ("head", hidden, c.vocab_size),
            ("q+k+v fused", hidden, hidden + 2 * kv), ("gate+up fused", hidden, 2 * inter)]


def time_calls(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each call, the calls interleaved (one warm-up round first)."""
    seconds = {name: [] for name in calls}
    for rep in range(repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if rep:
                seconds[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(values) for name, values in seconds.items()}


def shape_profile(in_features: int, out_features: int, dtype: torch.dtype, rows: list[int],
                  repeats: int) -> list[tuple[int, dict[str, float]]]:
    torch.manual_seed(0)
    weight = (torch.randn(out_features, in_features) * 0.05).to(dtype)
    layouts = ops.bf16_layouts() if dtype == torch.bfloat16 else ["fma"]
    packed = {f"hasten {layout}": ops.pack(weight, layout) for layout in layouts}
    table = []
    for count in rows:
        x = torch.randn(count, in_features).to(dtype)
        calls = {name: (lambda p=p: ops.linear(x, p, None)) for name, p in packed.items()}
        calls["oneDNN"] = lambda: F.linear(x, weight)
        table.append((count, time_calls(calls, repeats)))
    return table


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="zoo:smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="running rows of the step profile")
    parser.add_argument("--shape-rows", default="1,2,4,8,16,32,64", help="rows of the per-shape timings")
    parser.add_argument("--context", type=int, default=160, help="prompt tokens per row (rows vary by up to 40)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--parts", default="step,shapes")
    parser.add_argument("--step-layouts", default=None,
                        help="bfloat16 layouts the step runs, interleaved by row count (default: this CPU's own)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    print(f"{args.threads} thread(s); kernels: {invariant.kernel_path()}; torch {torch.__version__}; "
          f"load average {load_average()}", flush=True)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        model = load_model(args.model, dtype=dtype).eval()
        if not invariant.prepare(model):
            raise SystemExit(f"no hasten kernels here: {invariant.unavailable(model)}")
        if "step" in parts:
            print(f"\n{args.model} {dtype_name}: one plain decode step of the packed batch, ~{args.context} cached "
                  f"tokens a row, median ms of {args.repeats}")
            layouts = args.step_layouts.split(",") if args.step_layouts and dtype == torch.bfloat16 else [None]
            print("rows  layout    total   linear  attention    rest   ms/row   load")
            for count in [int(r) for r in args.rows.split(",")]:
                for layout in layouts:
                    if layout is not None:
                        repack(model, layout)
                    p = step_profile(model, count, args.context, args.repeats)
                    print(f"{count:4d}  {layout or ops.bf16_layout() if dtype == torch.bfloat16 else 'fma':6s}  "
                          f"{p['total']:7.2f}  {p['linear']:7.2f}  {p['attention']:9.2f}  {p['rest']:6.2f}  "
                          f"{p['total'] / count:7.2f}   {load_average()}", flush=True)
        if "shapes" in parts:
            for name, k, n in shapes_of(model):
                table = shape_profile(k, n, dtype, [int(r) for r in args.shape_rows.split(",")], args.repeats)
                paths = list(table[0][1])
                print(f"\n{dtype_name} {name} {k}->{n}: median ms of {args.repeats} (load {load_average()})")
                print("rows  " + "  ".join(f"{p:>13}" for p in paths))
                for count, ms in table:
                    print(f"{count:4d}  " + "  ".join(f"{ms[p]:13.3f}" for p in paths), flush=True)


if __name__ == "__main__":
    main()
