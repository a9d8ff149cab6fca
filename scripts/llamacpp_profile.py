"""Where a generation's time goes on the llama.cpp backend, against llama-cpp-python's own loop:
time to first token, time per step, time inside ``llama_decode`` and outside it, logits rows
copied per step. docs/cpu.md ("The llama.cpp backend: a profile") quotes its output.

    python scripts/llamacpp_profile.py zoo:smollm2-135m --categories rag,translation --threads 1

Both sides run the same Spec-Bench first turns through the model's chat template, greedy, EOS
ignored, interleaved: hasten's default method (``hasten.load(..., backend="llama.cpp")``, the
engine's ``generate``) and ``Llama(path, n_threads, n_ctx, flash_attn=True).generate(ids,
top_k=1, temp=0)``, llama-cpp-python's own loop, on the same file, context and threads.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import hasten


class DecodeClock:
    """Wraps llama.cpp's ``llama_decode`` (both sides call it through the same module): counts
    the calls, the tokens asked for logits, and the seconds spent inside it."""

    def __init__(self, lib):
        self.lib, self.real = lib, lib.llama_decode
        self.reset()

        def timed(ctx, batch):
            start = time.perf_counter()
            status = self.real(ctx, batch)
            self.seconds.append(time.perf_counter() - start)
            self.rows.append(sum(batch.logits[i] != 0 for i in range(batch.n_tokens)))
            return status

        lib.llama_decode = timed

    def reset(self) -> None:
        self.seconds: list[float] = []
        self.rows: list[int] = []

    def close(self) -> None:
        self.lib.llama_decode = self.real


def hasten_side(engine, ids: torch.Tensor, tokens: int, clock: DecodeClock) -> dict:
    clock.reset()
    start = time.perf_counter()
    out = hasten.generate(engine.runtime, ids, drafter=engine.drafter, draft_size=engine.draft_size,
                          max_new_tokens=tokens, eos_token_id=[], threads=engine.threads)
    return summary(time.perf_counter() - start, clock, out.stats.steps, out.sequences[0, ids.shape[1]:].tolist())


def llama_side(llm, ids: list[int], tokens: int, clock: DecodeClock) -> dict:
    clock.reset()
    llm.reset()
    start = time.perf_counter()
    out = []
    for token in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        out.append(token)
        if len(out) == tokens:
            break
    return summary(time.perf_counter() - start, clock, len(clock.seconds) - 1, out)


def summary(seconds: float, clock: DecodeClock, steps: int, token_ids: list[int]) -> dict:
    prefill = clock.seconds[0] if clock.seconds else 0.0
    inside = sum(clock.seconds)
    return {"seconds": seconds, "prefill": prefill, "steps": steps,
            "per_step_ms": 1e3 * (seconds - prefill) / max(steps, 1),
            "decode_per_step_ms": 1e3 * (inside - prefill) / max(steps, 1),
            "outside_per_step_ms": 1e3 * (seconds - inside) / max(steps, 1),
            "rows_per_step": sum(clock.rows[1:]) / max(steps, 1), "tokens": list(token_ids)}


def main() -> None:
    from hasten.bench.spec_bench import spec_bench_tasks
    from hasten.bench.chat_tasks import task_input_ids
    from hasten.loading import gguf_source, gguf_tokenizer
    from llama_cpp import Llama, llama_cpp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a GGUF file or a zoo name that is one")
    parser.add_argument("--categories", default="rag,translation")
    parser.add_argument("--per-task", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = gguf_source(args.model)
    tokenizer = gguf_tokenizer(args.model)
    tasks = [t for t in spec_bench_tasks(tokenizer, args.per_task) if t.category in args.categories.split(",")]
    engine = hasten.load(args.model, backend="llama.cpp", threads=args.threads)
    context = engine.runtime.context
    llm = Llama(str(path), n_threads=args.threads, n_threads_batch=args.threads, n_ctx=context, flash_attn=True,
                n_batch=engine.runtime.n_batch, verbose=False)
    clock = DecodeClock(llama_cpp)
    print(f"{args.model}: {path.name}, {args.threads} thread(s), context {context}, {args.tokens} tokens, "
          f"best of {args.repeats} interleaved; ms per step after the prefill")
    print("task | side | prefill ms | steps | ms/step | in llama_decode | outside | logits rows/step | same text")
    try:
        for task in tasks:
            ids = task_input_ids(tokenizer, task)
            runs: dict[str, list[dict]] = {"hasten": [], "llama.cpp": []}
            for _ in range(args.repeats):
                runs["hasten"].append(hasten_side(engine, ids, args.tokens, clock))
                runs["llama.cpp"].append(llama_side(llm, ids[0].tolist(), args.tokens, clock))
            best = {side: min(found, key=lambda r: r["seconds"]) for side, found in runs.items()}
            same = best["hasten"]["tokens"] == best["llama.cpp"]["tokens"]
            for side, r in best.items():
                print(f"{task.name} ({ids.shape[1]} prompt tokens) | {side} | {1e3 * r['prefill']:.0f} | {r['steps']} | "
                      f"{r['per_step_ms']:.2f} | {r['decode_per_step_ms']:.2f} | {r['outside_per_step_ms']:.2f} | "
                      f"{r['rows_per_step']:.2f} | {same}")
            print(f"{task.name}: hasten/llama.cpp wall {best['llama.cpp']['seconds'] / best['hasten']['seconds']:.2f}x "
                  f"(medians {statistics.median(r['seconds'] for r in runs['llama.cpp']) / statistics.median(r['seconds'] for r in runs['hasten']):.2f}x)")
    finally:
        clock.close()


if __name__ == "__main__":
    main()
