"""Grammatical error correction prompts, Aggressive Decoding's home task (Ge et al. 2022): each
task is one held-out corrupted sentence as the encoder input of a seq2seq corrector
(``zoo:gec-tiny``), whose answer restates it with the errors fixed.

The sentences ship in ``data/gec/heldout.jsonl`` (:mod:`hasten.zoo.gec`: sentences of Python's
documentation and docstrings that ``zoo:gec-tiny`` never trained on, corrupted once with a fixed
seed; written before the model was measured). Tasks follow the file's order. A correction ends at
the model's end-of-sequence token, so these tasks stop there (``Task.stop_at_eos``) instead of
running to ``--max-new-tokens`` as the other tasks do: the tokens after a finished sentence would
be neither a correction nor a copy.
"""
from __future__ import annotations

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
