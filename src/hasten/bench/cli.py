"""``hasten bench``: time hasten's methods against Hugging Face generate on the same model, or
(``--backend llama.cpp``) hasten on llama.cpp against llama.cpp's own decoding of the same GGUF."""
from __future__ import annotations

import argparse
import dataclasses
import sys
from datetime import datetime, timezone

import torch

from ..api import AUTOREGRESSIVE
from ..loading import gguf_tokenizer
from ..arguments import (
    DEFAULT_DRAFT_SIZE, DRAFT_SIZES, UserError, add_model_arguments, add_threads_argument, apply_threads, at_least,
    DTYPES, checked_device, counted, method_settings, writable_directory,
)
from ..core import settings as settings_io
from ..drafters.base import REGISTRY
from .runner import (
    HF_BASELINES, LosslessnessError, check_lengths, hasten_method, hasten_method_names, hf_method, run_bench,
)
from . import differences, llamacpp, vllm_cpu
from .chat_tasks import CHAT_CATEGORIES, chat_tasks, has_chat_template, task_input_ids
from .gec_tasks import GEC_CATEGORIES, gec_tasks
from .spec_bench import second_turns, spec_bench_tasks
from .tasks import ALL_CATEGORIES, CATEGORIES, LONG_CATEGORIES, builtin_tasks, read_prompts

AUTO = "auto"
LLAMA_CPP = "llama.cpp"
# --tasks presets: "auto" is chat for a model whose tokenizer has a chat template, else code.
TASK_PRESETS = {"code": CATEGORIES, "chat": CHAT_CATEGORIES}
SPEC_BENCH = "spec-bench"  # Spec-Bench's 480 questions, six categories (spec_bench.py)


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, per_method=True)  # --model, --draft, --method-arg KEY=VALUE or METHOD.KEY=VALUE
    parser.add_argument(
        "--methods", default=AUTO,
        help="comma-separated hasten methods; autoregressive, the reference, is always added (default auto: "
        f"every registered method that runs with the given models; known: {', '.join(hasten_method_names())}). "
        "Settings: --method-arg KEY=VALUE sets every method that has KEY, METHOD.KEY=VALUE one method",
    )
    parser.add_argument(
        "--baselines", default=AUTO,
        help=f"comma-separated baselines, or none (default: all that the given models allow; torch backend: "
        f"{', '.join(HF_BASELINES)}, and {', '.join(vllm_cpu.BASELINES)} when vLLM's environment exists "
        "(make vllm; docs/benchmarks.md); llama.cpp backend: "
        f"{', '.join(llamacpp.BASELINES)})",
    )
    add_workload_arguments(parser)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method and prompt (default 3)")
    parser.add_argument(
        "--draft-size", default=DEFAULT_DRAFT_SIZE, metavar="SIZES",
        help=f"draft sizing, or several comma-separated to time each method with each ({', '.join(DRAFT_SIZES)}); "
        "the first keeps the method's name, the others are timed as METHOD@SIZE, e.g. auto,fixed times "
        f"prompt_lookup (auto) and prompt_lookup@fixed (default {DEFAULT_DRAFT_SIZE})",
    )
    parser.add_argument("--out", default="bench-out", metavar="DIR",
                        help="output directory, checked writable before the run (default bench-out)")
    parser.add_argument("--progress", choices=("bar", "lines", "none"), default="bar",
                        help="a progress bar (default), one plain line per run on stderr (for logs), or nothing")
    parser.add_argument("--no-progress", action="store_const", const="none", dest="progress",
                        help="the same as --progress none")
    parser.add_argument("--device", default="cpu", metavar="DEVICE",
                        help="where the models run with --backend torch: cpu (default), cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="dtype of the models' weights with --backend torch, as hasten generate's (default "
                        "float32; int8: int8 linear layers on the CPU, not for the vLLM baselines)")
    parser.add_argument("--count-differences", action="store_true",
                        help="count outputs that differ from autoregressive's (the identical column) instead of "
                        "stopping at the first: for a GPU in bfloat16, whose kernels may round a near-tie "
                        "differently in a block than token by token")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """--backend, --tasks, --prompts, --per-task, --max-new-tokens, --threads: what is run, on
    what (shared by ``hasten bench`` and ``hasten record``)."""
    parser.add_argument(
        "--backend", default="torch", choices=("torch", LLAMA_CPP),
        help="torch (default): PyTorch models against Hugging Face generate; llama.cpp: a .gguf target (and "
        "--draft) run by llama.cpp, hasten's methods against llama.cpp's own decoding of the same file, with "
        "the same context and --threads (pip install 'hasten[llamacpp]'; docs/cpu.md)",
    )
    parser.add_argument(
        "--tasks", default=AUTO,
        help="built-in task categories, comma-separated: code (= " + ",".join(CATEGORIES) + "), chat (= "
        + ",".join(CHAT_CATEGORIES) + ", through the model's chat template), spec-bench (Spec-Bench's "
        "questions, first turns, --per-task of each of its six categories, vendored with its Apache-2.0 "
        "licence), gec (held-out corrupted sentences for a seq2seq corrector such as zoo:gec-tiny, each run "
        "to its end-of-sequence token), or single categories; the "
        "long-context " + ",".join(LONG_CATEGORIES) + " only by name (they need a model with 16k positions, "
        "e.g. zoo:code-tiny-long) (default auto: chat if the tokenizer has a chat template, else code)",
    )
    parser.add_argument("--prompts", help="JSONL file of your own prompts ({prompt, category} or Spec-Bench turns)")
    parser.add_argument("--per-task", type=int, default=2, help="prompts per category (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens every method generates (default 128)")
    add_threads_argument(parser, "torch threads, and llama.cpp's with --backend llama.cpp")


def _settings_class(method: str) -> type | None:
    return getattr(REGISTRY.get(method), "Settings", None)


def _known_settings(method: str) -> set[str]:
    settings_cls = _settings_class(method)
    return set(settings_io.field_kinds(settings_cls)) if settings_cls else set()


def _settings_for(method: str, pairs: list[str]) -> dict:
    """--method-arg METHOD.KEY=VALUE sets one method; KEY=VALUE every method that has KEY.
    The values are typed and range-checked by the method's settings dataclass."""
    mine = []
    for pair in pairs:
        key = pair.partition("=")[0]
        target, dot, _ = key.partition(".")
        if dot and target == method:
            mine.append(pair[len(target) + 1 :])
        elif not dot and key in _known_settings(method):
            mine.append(pair)
    values = method_settings(method, _settings_class(method), mine)
    if values:
        settings_io.build(_settings_class(method), **values)
    return values


def _check_method_args(pairs: list[str], names: list[str]) -> None:
    """A setting that no listed method takes is a typo, not something to ignore."""
    for pair in pairs:
        key = pair.partition("=")[0]
        target, dot, field = key.partition(".")
        takers, wanted = ([target], field) if dot else (names, key)
        if not any(n in names and wanted in _known_settings(n) for n in takers):
            raise UserError(f"--method-arg {pair!r}: none of the methods {names} has that setting")


def _chosen(args) -> tuple[list[str], list[str]]:
    """The hasten methods and baselines asked for, checked before any model is loaded."""
    on_llama_cpp = args.backend == LLAMA_CPP
    names = hasten_method_names() if args.methods == AUTO else _csv(args.methods)
    unknown = [n for n in names if n not in hasten_method_names()]
    if unknown:
        raise UserError(f"--methods: unknown {unknown}; known: {', '.join(hasten_method_names())}")
    if on_llama_cpp:
        try:
            names = llamacpp.method_names(names, args.draft is not None, args.methods == AUTO)
        except ValueError as err:
            raise UserError(f"--methods: {err}") from None
    if AUTOREGRESSIVE not in names:  # always timed: it is the reference output and the speed baseline
        names.insert(0, AUTOREGRESSIVE)
    _check_method_args(args.method_arg, names)
    known_baselines = llamacpp.BASELINES if on_llama_cpp else (*HF_BASELINES, *vllm_cpu.BASELINES)
    automatic = [n for n in known_baselines if n not in vllm_cpu.ON_REQUEST
                 and (n not in vllm_cpu.BASELINES or vllm_cpu.vllm_python())]
    presets = {AUTO: automatic, "none": []}
    baselines = presets[args.baselines] if args.baselines in presets else _csv(args.baselines)
    unknown = [n for n in baselines if n not in known_baselines]
    if unknown:
        raise UserError(f"--baselines: unknown {unknown}; known: {', '.join(known_baselines)}, none")
    check_workload(args)
    return names, baselines


def check_workload(args: argparse.Namespace) -> None:
    """The arguments of add_workload_arguments, checked before any model loads; torch gets its
    --threads (recorded in the results) now."""
    known = [AUTO, *TASK_PRESETS, SPEC_BENCH, *ALL_CATEGORIES, *CHAT_CATEGORIES, *GEC_CATEGORIES]
    unknown = [c for c in _csv(args.tasks) if c not in known]
    if unknown:
        raise UserError(f"--tasks: unknown {unknown}; known: {', '.join(known)}")
    at_least(args, 1, "per_task", "max_new_tokens")
    apply_threads(args.threads)


def _builtin(spec: str, tokenizer, per_task: int) -> list:
    """The built-in tasks --tasks names: presets expanded, code tasks first, then chat tasks,
    then Spec-Bench's questions, then the gec sentences."""
    chosen = []
    for name in _csv(spec):
        if name == AUTO:
            name = "chat" if has_chat_template(tokenizer) else "code"
        chosen += TASK_PRESETS.get(name, (name,))
    code = [c for c in ALL_CATEGORIES if c in chosen]  # the long ones only when named
    chat = [c for c in CHAT_CATEGORIES if c in chosen]
    try:
        return (builtin_tasks(tokenizer, code, per_task) if code else []) + (
            chat_tasks(tokenizer, chat, per_task) if chat else []) + (
            spec_bench_tasks(tokenizer, per_task) if SPEC_BENCH in chosen else []) + (
            gec_tasks(tokenizer, per_task) if "gec" in chosen else [])
    except ValueError as err:  # e.g. --per-task beyond the prompts a chat category has
        raise UserError(str(err)) from None


def draft_sizes(spec: str) -> list[str]:
    """--draft-size auto,fixed -> ["auto", "fixed"], checked."""
    sizes = _csv(spec)
    unknown = [s for s in sizes if s not in DRAFT_SIZES]
    if not sizes or unknown or len(set(sizes)) != len(sizes):
        raise UserError(f"--draft-size {spec!r}: give one or more of {', '.join(DRAFT_SIZES)}, comma-separated")
    return sizes


def bench_settings(name: str, settings: dict, args) -> dict:
    """A method's settings for the bench. Chosen automatically, a trained drafter must find
    its weights (an untrained one's numbers would mislead): it refuses, and is left out,
    instead of running untrained; asked for by name, it runs as told."""
    if args.methods == AUTO and "require_weights" in _known_settings(name):
        return {"require_weights": True, **settings}
    return settings


def _build_methods(args, names, settings, baselines, model, draft, input_ids) -> tuple[list, dict[str, str]]:
    """The methods to time, and why any default one was left out."""
    probe_ids = input_ids[0]
    max_model_len = llamacpp.context_for(input_ids, args.max_new_tokens)  # vLLM's, sized as llama.cpp's
    methods, skipped = [], {}
    sizes = draft_sizes(args.draft_size)
    variants = [(name, size) for name in names for size in (sizes[:1] if name == AUTOREGRESSIVE else sizes)]
    for name, size in variants:
        label = name if size == sizes[0] else f"{name}@{size}"
        try:
            method = hasten_method(name, model, draft, size, label, **bench_settings(name, settings[name], args))
            if args.methods == AUTO:  # a registered method may not fit these models: try it on 2 tokens
                method.run(probe_ids, 2)
        except (ValueError, TypeError, OSError) as err:
            if args.methods != AUTO:
                raise
            skipped[label] = str(err).splitlines()[0]
            continue
        methods.append(method)
    for name in baselines:
        try:
            if args.backend == LLAMA_CPP:
                methods.append(llamacpp.baseline_method(name, model))
            elif name in vllm_cpu.BASELINES:
                methods.append(vllm_cpu.baseline_method(name, model, max_model_len, args.threads))
            else:
                methods.append(hf_method(name, model, draft))
        except (ValueError, UserError) as err:
            if args.baselines != AUTO:
                raise
            skipped[name] = str(err)
    if args.count_differences:
        for method in methods:
            method.exact = False
    return methods, skipped


def load_tasks_and_models(args: argparse.Namespace) -> tuple[list, list[torch.Tensor], object, object]:
    """The tasks ``--tasks``/``--prompts`` name (chat tasks through the model's template), their
    input ids, and the target and ``--draft`` models on ``--backend`` (the draft None when not
    given), lengths checked against the model's positions."""
    from transformers import AutoTokenizer

    from ..loading import load_model, resolve_path

    if args.backend == LLAMA_CPP:
        try:
            tokenizer = gguf_tokenizer(args.model)
        except ValueError as err:  # no GGUF file
            raise UserError(str(err)) from None
    else:
        tokenizer = AutoTokenizer.from_pretrained(resolve_path(args.model))
    if args.prompts:
        tasks = read_prompts(args.prompts, tokenizer, args.per_task)
    else:
        tasks = _builtin(args.tasks, tokenizer, args.per_task)
    input_ids = [task_input_ids(tokenizer, t) for t in tasks]  # chat tasks through the template
    draft_name = getattr(args, "draft", None)
    follow_up = not args.prompts and SPEC_BENCH in _csv(args.tasks)  # MT-bench's second turns, once answered
    if args.backend == LLAMA_CPP:  # llama.cpp's contexts sized to these prompts, the same for every method
        # a second turn holds its first turn, an answer of at most --max-new-tokens and a question
        room = 2 * args.max_new_tokens + llamacpp.SECOND_TURN_ROOM if follow_up else 0
        context = llamacpp.context_for(input_ids, args.max_new_tokens + room)
        try:
            model = llamacpp.load(args.model, torch.get_num_threads(), context)
            draft = llamacpp.load(draft_name, torch.get_num_threads(), context) if draft_name else None
        except (ValueError, ImportError) as err:  # no GGUF file; llama-cpp-python missing (with the install hint)
            raise UserError(str(err)) from None
    else:
        device, dtype = getattr(args, "device", "cpu"), getattr(args, "dtype", "float32")  # `hasten record` has neither
        model = load_model(args.model, dtype, device)
        draft = load_model(draft_name, dtype, device) if draft_name else None
        input_ids = [ids.to(model.device) for ids in input_ids]
    if follow_up:
        more = second_turns(tokenizer, tasks, first_answer(model, tokenizer, tasks, input_ids, args.max_new_tokens))
        more_ids = [task_input_ids(tokenizer, t) for t in more]
        tasks, input_ids = tasks + more, input_ids + [ids.to(input_ids[0].device) for ids in more_ids]
    check_lengths(model, tasks, input_ids, args.max_new_tokens)
    return tasks, input_ids, model, draft


def first_answer(model, tokenizer, tasks, input_ids, max_new_tokens: int):
    """The model's own answer to a task, as a chat would give it: greedy plain decoding to
    its EOS or ``max_new_tokens``, special tokens dropped (MT-bench's second turn follows it)."""
    from ..engine.loop import generate

    ids_of = {task.name: ids for task, ids in zip(tasks, input_ids)}

    def answer(task) -> str:
        ids = ids_of[task.name]
        out = generate(model, ids, max_new_tokens=max_new_tokens, threads=None).sequences[0, ids.shape[1]:]
        return tokenizer.decode(out.tolist(), skip_special_tokens=True).strip()

    return answer


def run(args: argparse.Namespace) -> int:
    from ..machine import machine_info
    from .report import command_line, terminal_summary, write_report

    at_least(args, 1, "repeats")
    names, baselines = _chosen(args)
    draft_sizes(args.draft_size)  # checked before any model loads
    settings = {name: _settings_for(name, args.method_arg) for name in names}
    writable_directory(args.out)  # now, not after the whole run
    if args.device != "cpu" and args.backend == LLAMA_CPP:
        raise UserError(f"--device {args.device}: the llama.cpp backend runs on the CPU here; leave --device out")
    checked_device(args.device)
    tasks, input_ids, model, draft = load_tasks_and_models(args)
    methods, skipped = _build_methods(args, names, settings, baselines, model, draft, input_ids)
    print(
        f"hasten bench: {counted(len(methods), 'method')} x {counted(len(tasks), 'prompt')} x "
        f"{counted(args.repeats, 'repeat')}, {counted(args.max_new_tokens, 'new token')}, "
        f"{counted(torch.get_num_threads(), 'thread')}"
        + (" (hasten and llama.cpp, on llama.cpp)" if args.backend == LLAMA_CPP else ""),
        file=sys.stderr,
    )
    machine = machine_info()  # before the run, so the load average shows only other work
    try:
        measured = run_bench(methods, tasks, input_ids, args.max_new_tokens, args.repeats, args.progress,
                             explain=differences.explainer(model))
    except LosslessnessError as err:
        print(f"hasten bench: LOSSLESSNESS FAILURE: {err}", file=sys.stderr)
        return 1
    finally:
        for method in methods:
            if method.close:
                method.close()
    methods_by_name = {method.name: method for method in methods}
    results = {
        "command": command_line(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "settings": {
            "model": args.model, "draft": args.draft, "backend": args.backend, "device": args.device,
            "dtype": args.dtype, "count_differences": args.count_differences, "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, "per_task": args.per_task, "prompts": args.prompts,
            "tasks": None if args.prompts else args.tasks, "chat_template": any(t.messages for t in tasks),
        },
        "tasks": [dataclasses.asdict(t) for t in tasks],
        "skipped": skipped,
        **measured,
    }
    paths = write_report(results, args.out)
    print(terminal_summary(results))
    print(f"hasten bench: wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    defects = [f"{method} on {task['task']} at new token {found['position']} (margin {found['margin']:.3g}, "
               f"gap {found['gap']:.3g}, rounding {found['rounding']:.3g})"
               for task in results["by_task"] for method, found in task.get("difference_classes", {}).items()
               if found["verdict"] == "defect" and methods_by_name[method].kind == "hasten"]
    if defects:  # a near-tie is rounding; anything else from hasten's own methods is a bug
        print("hasten bench: LOSSLESSNESS FAILURE: outputs differ beyond rounding: " + "; ".join(defects),
              file=sys.stderr)
        return 1
    return 0


COMMANDS = [
    ("bench", "time hasten's methods against Hugging Face generate, checking outputs match", add_arguments, run),
]
