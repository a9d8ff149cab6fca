"""Grammatical error correction prompts, Aggressive Decoding's home task (Ge et al. 2022): each
task is one held-out corrupted sentence as the encoder input of a seq2seq corrector
(``zoo:gec-tiny``), whose answer restates it with the errors fixed.

The sentences ship in ``data/gec/heldout.jsonl`` (:mod:`hasten.zoo.gec`: sentences of Python's
documentation and docstrings that ``zoo:gec-tiny`` never trained on, corrupted once with a fixed
seed; written before the model was measured). Tasks follow the file's order. A correction ends at
the model's end-of-sequence token, so these tasks stop there (``Task.stop_at_eos``) instead of
running to ``--max-new-tokens`` as the other tasks do: the tokens after a finished sentence would
be neither a correction nor a copy.

``python -m hasten.bench.gec_tasks [--gad DIR]`` is Aggressive Decoding's bench
(docs/benchmarks.md, GEC section): plain decoding, ``iad``, ``gad`` (the drafter ``zoo:gec-tiny``
ships, or the one ``hasten train gad --model zoo:gec-tiny`` wrote to DIR) and GAD++ (gad's drafts
under :class:`hasten.approx.GADPlusPlus`, lossy) on these tasks, each drafter at its own depth,
with the replay's copy bound (an oracle copier priced on the model's cost curve) and how often
plain decoding and GAD++ write the clean sentence.
"""
from __future__ import annotations

import time

import torch

from ..zoo import gec
from .heldout import Task, token_count

GEC_CATEGORIES = ("gec",)
SOURCE = "hasten/bench/data/gec/heldout.jsonl"


def gec_tasks(tokenizer, per_task: int = 2) -> list[Task]:
    """The first ``per_task`` held-out sentences (corrupted source; the clean sentence is the
    task's ``expected`` text)."""
    pairs = gec.heldout_pairs()
    if not 1 <= per_task <= len(pairs):
        raise ValueError(f"--per-task must be between 1 and {len(pairs)} for the gec tasks, got {per_task}")
    return [Task(f"gec-{j + 1}", "gec", pair["source"], f"{SOURCE}:{j + 1}", token_count(tokenizer, pair["source"]),
                 expected=pair["target"], stop_at_eos=True)
            for j, pair in enumerate(pairs[:per_task])]


# ---- the Aggressive Decoding bench: plain, IAD, GAD, GAD++ on the gec tasks ----------------------
def gadpp_method(model, weights: str | None, beta: int, tau: float) -> "Method":
    """GAD's drafts verified by GAD++ (:class:`hasten.approx.GADPlusPlus`, lossy): its outputs
    that differ from plain decoding are counted (``identical``), not fatal."""
    from ..approx.gadpp import GADPlusPlus
    from ..drafters import GAD
    from ..engine.loop import generate
    from .runner import Method

    rule = GADPlusPlus(beta=beta, tau=tau)

    def run(input_ids, max_new_tokens, stop_at_eos=False):
        drafter = GAD(weights=weights, require_weights=True)
        clock = time.perf_counter()
        out = generate(model, input_ids, drafter=drafter, lossy_acceptance=rule, max_new_tokens=max_new_tokens,
                       eos_token_id=None if stop_at_eos else [], draft_size="fixed", threads=None)
        seconds = time.perf_counter() - clock
        return out.sequences[0, 1:].tolist(), out.stats, seconds

    return Method(f"gad++ (beta {beta}, tau {tau:g})", "hasten", run, {"weights": weights, "beta": beta, "tau": tau},
                  "fixed", exact=False)


def aggressive_methods(model, weights: str | None, beta: int, tau: float) -> list:
    """Plain decoding, iad, gad (the trained drafter in ``weights``; None: the one shipped beside
    the model) and GAD++ at each drafter's own depth (fixed sizing: the papers' rule), and gad at
    the depth hasten's cost-aware sizing picks (``gad@auto``)."""
    from .runner import AUTOREGRESSIVE, hasten_method

    gad = dict(weights=weights, require_weights=True)
    return [hasten_method(AUTOREGRESSIVE, model), hasten_method("iad", model, draft_size="fixed"),
            hasten_method("gad", model, draft_size="fixed", **gad),
            hasten_method("gad", model, draft_size="auto", label="gad@auto", **gad),
            gadpp_method(model, weights, beta, tau)]


def copy_bound_speedup(model, input_ids: list[torch.Tensor], outputs: list[list[int]]) -> float:
    """The replay's copy bound (:func:`hasten.bench.replay.copy_bound`) over these sentences: plain
    decoding's forward seconds on the model's cost curve over an oracle copier's, which drafts at
    each step the longest stretch of the true output found in the source and the output so far."""
    from ..engine.calibration import load_or_calibrate
    from .replay import Recorded, Recording, copy_bound

    curve = load_or_calibrate(model)
    entries = [Recorded("gec", ids[0].tolist(), out) for ids, out in zip(input_ids, outputs)]
    recording = Recording("gec", "torch", model.config.vocab_size, False, curve, entries)
    plain = sum(len(e.output) * curve(1) for e in entries)
    return plain / sum(copy_bound(recording, e) for e in entries)


def correct_share(tokenizer, tasks: list[Task], outputs: list[list[int]]) -> float:
    """Share of outputs equal to the clean sentence (the task's ``expected``)."""
    return sum(tokenizer.decode(o, skip_special_tokens=True) == t.expected for o, t in zip(outputs, tasks)) / len(tasks)


def main(argv: list[str] | None = None) -> None:
    """``python -m hasten.bench.gec_tasks [--gad DIR]``: the table of docs/benchmarks.md's GEC section."""
    import argparse
    import json

    from transformers import AutoTokenizer

    from .. import zoo
    from ..approx.gadpp import GADPlusPlus
    from ..engine.loop import generate
    from ..drafters import GAD
    from ..loading import load_model
    from ..machine import machine_info
    from .runner import OVERALL, run_bench

    p = argparse.ArgumentParser(prog="python -m hasten.bench.gec_tasks", description=main.__doc__)
    p.add_argument("--gad", help="a trained gad drafter's directory (hasten train gad --out); default: the one "
                                 "zoo:gec-tiny ships")
    p.add_argument("--per-task", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--beta", type=int, default=5)
    p.add_argument("--tau", type=float, default=3.0)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", help="write the results (JSON) here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model("zoo:gec-tiny")
    tokenizer = AutoTokenizer.from_pretrained(zoo.resolve("gec-tiny"))
    # named, so each run's drafter loads its weights when built, outside the timed call
    args.gad = args.gad or str(zoo.resolve("gec-tiny") / "gad")
    tasks = gec_tasks(tokenizer, args.per_task)
    input_ids = [tokenizer(t.prompt, return_tensors="pt").input_ids for t in tasks]
    results = run_bench(aggressive_methods(model, args.gad, args.beta, args.tau), tasks, input_ids,
                        args.max_new_tokens, args.repeats, progress="lines")
    rule = GADPlusPlus(beta=args.beta, tau=args.tau)
    outputs = {"plain": [generate(model, ids, max_new_tokens=args.max_new_tokens,
                                  threads=None).sequences[0, 1:].tolist() for ids in input_ids],
               "gad++": [generate(model, ids, drafter=GAD(weights=args.gad, require_weights=True), lossy_acceptance=rule,
                                  max_new_tokens=args.max_new_tokens, draft_size="fixed",
                                  threads=None).sequences[0, 1:].tolist()
                         for ids in input_ids]}
    results["correct"] = {name: round(correct_share(tokenizer, tasks, out), 4) for name, out in outputs.items()}
    results["copy_bound_speedup"] = round(copy_bound_speedup(model, input_ids, outputs["plain"]), 3)
    results["machine"] = machine_info()
    print("| method | tok/s | speed-up | tau | identical to plain |\n|---|---|---|---|---|")
    for row in results["by_category"][OVERALL]:
        print(f"| {row['method']} | {row['tokens_per_second']:,.0f} | {row['speedup_vs_ar']:.2f}x | {row['tau']:.2f} "
              f"| {row['identical']} |")
    print(f"copy bound (replay, oracle copier on the cost curve): {results['copy_bound_speedup']:.2f}x; "
          f"equal to the clean sentence: plain {results['correct']['plain']:.1%}, "
          f"GAD++ {results['correct']['gad++']:.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
