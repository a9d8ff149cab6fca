"""``hasten train NAME``: self-distil data from a target, train a drafter's module on it, save it.
``hasten train data``: a chat model writes training data itself (:mod:`hasten.training.selfgen`).
``hasten train recipe``: every trained drafter of a model from that data (:mod:`hasten.training.recipe`).

Every registered drafter whose class has a ``Training`` attribute (a
:class:`~hasten.training.trainer.Trainable`) gets a subcommand. Its flags come from three
settings dataclasses (the drafter's ``Options``, :class:`DistillSettings`,
:class:`TrainSettings`), so defaults and validation live there only; a field name shared
by two of them (``seed``) is one flag setting both.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from ..arguments import UserError, writable_directory
from ..core.settings import add_flags, from_args
from .distill import DistillSettings, distill, pydoc_documents, read_documents, zoo_documents
from .online import SOURCES, OnlineSettings
from .selfgen import SelfGenSettings
from .trainer import Trainable, TrainSettings, train


def trainable_drafters() -> dict[str, type[Trainable]]:
    from ..drafters import REGISTRY  # importing the package registers the built-in drafters

    return {name: cls.Training for name, cls in sorted(REGISTRY.items()) if getattr(cls, "Training", None) is not None}


DATA = "data"  # the subcommand that writes self-generated data (no drafter is named so)


def add_data_arguments(subs) -> None:
    summary = ("a chat model writes training data itself: its own user turns (self-prompting), then its own "
               "greedy and sampled answers; resumable (run it again with the same --out)")
    sub = subs.add_parser(DATA, help=summary, description=summary)
    sub.add_argument("--model", required=True, help="chat model: zoo name (zoo:smollm2-135m), GGUF or local directory")
    sub.add_argument("--out", required=True, type=Path, metavar="DIR",
                     help="directory of the data shards and progress.json; an existing one is resumed")
    add_flags(sub.add_argument_group("data"), SelfGenSettings)
    sub.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1)")


def run_data(args: argparse.Namespace) -> int:
    from ..api import load
    from .selfgen import generate_data

    settings = from_args(SelfGenSettings, args)
    if args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # the tokenizers' thread pool
    writable_directory(args.out)
    engine = load(args.model, "autoregressive", dtype=getattr(torch, settings.dtype), threads=args.threads)
    try:
        progress = generate_data(engine, settings, args.out, model_name=args.model)
    except ValueError as err:
        raise UserError(str(err)) from None
    rate = sum(progress.tokens.values()) / max(progress.seconds, 1e-9)
    print(f"data: {progress.records} conversations from {progress.next_index} samples "
          f"({sum(progress.dropped.values())} dropped: {progress.dropped}), {progress.tokens} tokens, "
          f"{rate:.1f} tokens/s -> {args.out}", file=sys.stderr)
    return 0


RECIPE = "recipe"  # the subcommand that trains every method of a model on its self-generated data


def add_recipe_arguments(subs) -> None:
    from .acceptance import ProbeSettings
    from .features import FeatureSettings
    from .recipe import RecipeSettings

    summary = ("every trained drafter of one model from the conversations it wrote itself (hasten train data): "
               "features extracted once, each method trained with held-out acceptance per depth at every "
               "checkpoint; resumable (run it again with the same --work-dir)")
    sub = subs.add_parser(RECIPE, help=summary, description=summary)
    sub.add_argument("--model", required=True, help="target: zoo name (zoo:smollm2-135m), GGUF or local directory")
    sub.add_argument("--data", required=True, type=Path, metavar="DIR", help="a directory `hasten train data` wrote")
    sub.add_argument("--out", required=True, type=Path, metavar="DIR", help="trained modules go to DIR/<method>/")
    sub.add_argument("--work-dir", type=Path, help="features, checkpoints and the acceptance log (default: OUT/work)")
    added: set[str] = set()
    for title, settings_cls in (("recipe", RecipeSettings), ("features", FeatureSettings),
                                ("held-out acceptance", ProbeSettings), ("training (each method)", TrainSettings)):
        add_flags(sub.add_argument_group(title), settings_cls, added)
    sub.add_argument("--threads", type=int, default=1, help="CPU threads for torch (default 1)")
    sub.add_argument("--device", default="cpu", help="device for the target and the modules (cuda where a GPU is)")


def run_recipe(args: argparse.Namespace) -> int:
    from ..loading import load_model, resolve_path
    from .acceptance import ProbeSettings
    from .features import FeatureSettings
    from .recipe import RecipeSettings, run_recipe as recipe_run
    from .selfgen import PROGRESS

    try:
        settings = {cls: from_args(cls, args) for cls in (RecipeSettings, FeatureSettings, ProbeSettings, TrainSettings)}
    except ValueError as err:
        raise UserError(str(err)) from None
    if args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    if not (args.data / PROGRESS).is_file():
        raise UserError(f"--data {args.data}: no {PROGRESS} (not a directory `hasten train data` wrote)")
    torch.set_num_threads(args.threads)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    writable_directory(args.out)
    from transformers import AutoTokenizer

    model = load_model(args.model, device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(resolve_path(args.model))
    try:
        recipe_run(model, tokenizer, model_name=args.model, data_dir=args.data, work_dir=args.work_dir or args.out / "work",
                   out_dir=args.out, recipe=settings[RecipeSettings], train_settings=settings[TrainSettings],
                   feature_settings=settings[FeatureSettings], probe_settings=settings[ProbeSettings], device=args.device)
    except ValueError as err:
        raise UserError(str(err)) from None
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subs = parser.add_subparsers(dest="drafter", required=True, metavar="NAME")
    add_data_arguments(subs)
    add_recipe_arguments(subs)
    for name, training in trainable_drafters().items():
        summary = f"train {name} for a target on its own greedy outputs"
        sub = subs.add_parser(name, help=summary, description=summary)
        sub.add_argument("--model", required=True, help="target: zoo name (zoo:code-tiny), local directory or hub id")
        sub.add_argument("--out", required=True, type=Path, metavar="DIR",
                         help="directory the trained drafter is written to (checked writable before training)")
        if training.data_source is None:
            # gad on an encoder-decoder trains on the target's own task (seq2seq_data) and takes no text
            source = sub.add_mutually_exclusive_group(required=not hasattr(training, "seq2seq_data"))
            source.add_argument("--data", type=Path, help="text to cut prompts from: .txt (one document) or .jsonl "
                                '(one JSON string or {"text": ...} object per line)')
            source.add_argument("--zoo-corpus", action="store_true", help="cut prompts from the zoo's training corpus")
            source.add_argument("--pydoc-topics", action="store_true",
                                help="cut prompts from Python's reference text shipped with the standard library "
                                     "(pydoc_data.topics: English prose; with --chat, for chat models)")
            data_group = ("distillation", DistillSettings)
        else:  # the target runs on fresh inputs every step (hasten.training.online)
            data_group = (f"online data ({training.data_source}, made on the fly)", OnlineSettings)
        added: set[str] = set()
        for title, settings_cls in ((f"{name} options", training.Options), data_group, ("training", TrainSettings)):
            add_flags(sub.add_argument_group(title), settings_cls, added)
        runtime = sub.add_argument_group("run")
        runtime.add_argument("--work-dir", type=Path, help="distilled data and checkpoints (default: OUT/work)")
        runtime.add_argument("--resume", action="store_true",
                         help="reuse the distilled data and continue from the last checkpoint in the work dir")
        runtime.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
        runtime.add_argument("--device", default="cpu", help="device for the target and the module (default cpu)")


def run(args: argparse.Namespace) -> int:
    from ..loading import load_model, resolve_path

    if args.drafter == DATA:
        return run_data(args)
    if args.drafter == RECIPE:
        return run_recipe(args)

    # Validate what is cheap before loading anything.
    training = trainable_drafters()[args.drafter]
    options = from_args(training.Options, args)
    online = training.data_source is not None
    data_settings = from_args(OnlineSettings if online else DistillSettings, args)
    train_settings = from_args(TrainSettings, args)
    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # the tokenizers' thread pool
    documents, source = None, training.data_source
    text_given = bool(getattr(args, "data", None) or getattr(args, "zoo_corpus", False)
                      or getattr(args, "pydoc_topics", False))
    if not online and text_given:
        documents, source = (
            (read_documents(args.data), str(args.data.resolve())) if args.data
            else (pydoc_documents(), "pydoc-topics") if args.pydoc_topics
            else (zoo_documents(), "zoo-corpus")
        )
    writable_directory(args.out)  # before distilling and training, not after

    model = load_model(args.model, device=args.device)
    seq2seq = bool(model.config.is_encoder_decoder)
    if seq2seq and not hasattr(training, "seq2seq_data"):
        raise UserError(f"hasten train {args.drafter} supports causal LMs; {args.model!r} is an encoder-decoder")
    if seq2seq and text_given:
        raise UserError(f"hasten train {args.drafter} on an encoder-decoder trains on its own task's data; "
                        "drop --data, --zoo-corpus and --pydoc-topics")
    if not online and not seq2seq and not text_given:
        raise UserError("one of --data, --zoo-corpus or --pydoc-topics is required for a causal LM")
    work_dir = args.work_dir or args.out / "work"

    started = time.monotonic()
    if online:
        try:
            data = SOURCES[source](model, resolve_path(args.model), data_settings)
        except ValueError as err:
            raise UserError(f"{args.drafter}: {err}") from None
        data_report = {**dataclasses.asdict(data_settings), "source": source, "online": True}
    elif seq2seq:  # gad: corrupted gec sentences and the target's own corrections
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_path(args.model))
        data = training.seq2seq_data(model, tokenizer, data_settings, work_dir, resume=args.resume)
        data_report = {**dataclasses.asdict(data_settings), "source": "hasten.zoo.gec", "sequences": len(data),
                       "held_out": data.held_out, "generated_tokens": sum(len(o) - 1 for o in data.outputs)}
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(resolve_path(args.model))
        data = distill(model, tokenizer, documents, data_settings, work_dir, source=source, resume=args.resume)
        data_report = {**dataclasses.asdict(data_settings), "source": source, "sequences": len(data),
                       "generated_tokens": int((data.lengths - data.prompt_lengths).sum())}
    distilled_s = time.monotonic() - started
    trainable = training(model, options)
    result = train(trainable, data, train_settings, work_dir, resume=args.resume, device=args.device)

    report = {
        "drafter": args.drafter,
        "target": args.model,
        **result.report,
        "options": dataclasses.asdict(options),
        "distill": {**data_report, "seconds": round(distilled_s, 1)},
        "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
                    "device": args.device},
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    trainable.save(result.module, args.out, report)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{args.drafter}: {report['steps']} steps in {report['minutes']} min, held-out loss "
          f"{report['eval'].get('loss', float('nan')):.3f} -> {args.out}", file=sys.stderr)
    return 0


COMMANDS = [("train", "train a drafter's module (e.g. Medusa heads) on a target's own outputs", add_arguments, run)]
