"""Train the zoo offline on the Python standard library's own sources.

    python -m hasten.zoo.recipe all --out-root src/hasten/zoo/weights --threads 1

Stages: `tokenizer` (byte-level BPE, kept in --work-dir), `target` (code-tiny) and
`draft` (code-tiny-draft); `all` runs the three in order. `draft4` (code-tiny-draft4, a
four-layer draft for layer-parallel drafting) is trained on its own, after `tokenizer`. `long`
(code-tiny-long) continues the shipped code-tiny on long files at 16k-token windows with a larger
RoPE base (see `long_stage`). Scratch files (tokenizer,
token cache, checkpoints) live under --work-dir, never inside the package.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from hasten.core.schedule import adamw, decay_groups
from hasten.core.training_loop import Budget, Checkpoints, RunState, Schedule, TrainingLoop
from hasten.machine import machine_info
from hasten.zoo import corpus
from hasten.zoo.packing import pack, unpacked

VOCAB_SIZE = 4096
EOT = "<|endoftext|>"  # the only special token (id 0): document separator, bos, eos and pad
MAX_POSITIONS = 4096

# Both models share one tokenizer. These shapes give ~5.5M (target) and ~0.9M (draft)
# parameters; the tied 4096 x hidden embedding is a large share of each.
MODEL_SHAPES = {
    "code-tiny": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=688),
    "code-tiny-draft": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=344),
    # four layers, so layer-parallel drafting (easyspec) has groupings to choose from
    "code-tiny-draft4": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=344),
}
STAGE_MODELS = {"target": "code-tiny", "draft": "code-tiny-draft", "draft4": "code-tiny-draft4",
                "long": "code-tiny-long"}
# The shipped weights were trained with these defaults, one thread, on a 2-core AMD EPYC VM.
DEFAULT_MINUTES = {"target": 55.0, "draft": 15.0, "draft4": 15.0, "long": 45.0}
DEFAULT_LR = {"target": 1.5e-3, "draft": 3e-3, "draft4": 3e-3, "long": 5e-4}  # smaller models tolerate larger steps
# code-tiny-long: continued from code-tiny with RoPE base 10k -> 320k (the base that, untrained,
# kept the 2k-16k loss lowest of 10k/80k/320k), positions up to 16k, trained on 16k windows cut
# from files of at least LONG_MIN_FILE_TOKENS tokens, so windows hold long single files.
LONG = dict(rope_theta=320000.0, max_positions=16384, seq_len=16384, batch_size=1, min_file_tokens=4096,
            eval_tokens=16384, buckets=((0, 512), (512, 2048), (2048, 4096), (4096, 8192),
                                        (8192, 12288), (12288, 16384)))


# ---------------------------------------------------------------- tokenizer and data


def train_tokenizer(files: list[Path], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE: all 256 bytes are in the base alphabet, so any text (tabs, runs of
    spaces, non-ASCII) encodes without <unk> and decodes back to exactly the same string."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((corpus.read_text(p) for p in files), trainer)
    # clean_up_tokenization_spaces would rewrite " ," to "," on decode and break round trips.
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   clean_up_tokenization_spaces=False, model_max_length=MAX_POSITIONS)


def load_or_train_tokenizer(work_dir: Path, retrain: bool = False):
    from transformers import AutoTokenizer

    tok_dir = work_dir / "tokenizer"
    if retrain or not (tok_dir / "tokenizer.json").is_file():
        t0 = time.monotonic()
        train_tokenizer(corpus.training_files()).save_pretrained(tok_dir)
        print(f"tokenizer trained in {time.monotonic() - t0:.0f}s -> {tok_dir}", file=sys.stderr)
    return AutoTokenizer.from_pretrained(tok_dir)


def long_files(tokenizer, files: list[Path], min_tokens: int) -> list[Path]:
    """The files of at least `min_tokens` tokens, in their given order."""
    encodings = tokenizer.backend_tokenizer.encode_batch([corpus.read_text(p) for p in files],
                                                          add_special_tokens=False)
    return [p for p, e in zip(files, encodings) if len(e.ids) >= min_tokens]


def token_stream(tokenizer, files: list[Path], cache_dir: Path) -> np.ndarray:
    """All `files` tokenized and concatenated, each followed by EOT: uint16 [n_tokens].
    Cached under a key of the tokenizer and file list, so a new tokenizer never sees stale ids."""
    key = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()
                         + "\n".join(map(str, files)).encode()).hexdigest()[:16]
    cache = cache_dir / f"tokens-{key}.npy"
    if cache.is_file():
        return np.load(cache)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    encodings = tokenizer.backend_tokenizer.encode_batch(
        [corpus.read_text(p) for p in files], add_special_tokens=False)
    ids = np.array([i for e in encodings for i in (*e.ids, eot)], dtype=np.uint16)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.save(cache, ids)
    return ids


# ---------------------------------------------------------------- model


def model_config(shape: dict, tokenizer):
    from transformers import LlamaConfig

    eot = tokenizer.convert_tokens_to_ids(EOT)
    return LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=MAX_POSITIONS,
                       tie_word_embeddings=True, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                       **shape)


def build_model(config, seed: int):
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # float32 while training
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    return model


# ---------------------------------------------------------------- training


@torch.no_grad()
def loss_by_position(model, sequences: list[torch.Tensor], buckets) -> dict[str, float]:
    """Mean next-token loss of each position bucket [start, end) over 1-D token sequences, each run
    as one window from position 0 (so a late bucket's tokens see all the context before them)."""
    model.eval()
    nll = []
    for ids in sequences:  # [T]
        logits = model(input_ids=ids[None]).logits[0, :-1].float()  # [T - 1, vocab]
        nll.append(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none"))  # [T - 1]
    model.train()
    per_position = torch.stack(nll).mean(0)  # [T - 1]; position p predicts token p + 1
    return {f"{a}-{b}": round(per_position[a:b - 1].mean().item(), 4) for a, b in buckets}


@dataclass
class Settings:
    minutes: float  # wall-clock budget, evaluation included
    lr: float = 1e-3
    batch_size: int = 4
    seq_len: int = 512
    warmup_steps: int = 100
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    eval_minutes: float = 4.0  # cadence of held-out evaluation and checkpointing
    eval_windows: int = 32
    max_steps: int | None = None
    seed: int = 0
    resume: bool = False


def lr_schedule(s) -> Schedule:
    """Linear warmup over steps, then cosine decay to final_lr_ratio of the peak as the run spends its
    time budget (or its max_steps, whichever is further along): the number of steps a time budget
    buys is unknown in advance."""
    return Schedule(warmup_steps=s.warmup_steps, final_ratio=s.final_lr_ratio)


def sample_batch(stream: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - seq_len, size=batch_size)
    windows = np.stack([stream[i:i + seq_len] for i in starts]).astype(np.int64)
    return torch.from_numpy(windows)  # [batch, seq_len]


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss over fixed windows [n_windows, seq_len]."""
    model.eval()
    total = sum(model(input_ids=b, labels=b).loss.item() * len(b) for b in windows.split(batch_size))
    model.train()
    return total / len(windows)


def save_checkpoint(ckpt_dir: Path, model, optimizer, state: dict) -> None:
    """Weights and AdamW moments in safetensors, counters and RNG state in JSON. Written to
    temporary names first so an interrupted save never clobbers the previous checkpoint."""
    tensors = {}
    for name, p in model.named_parameters():  # named_parameters lists the tied lm_head once
        tensors[f"param.{name}"] = p.detach()
        if p in optimizer.state:
            tensors[f"exp_avg.{name}"] = optimizer.state[p]["exp_avg"]
            tensors[f"exp_avg_sq.{name}"] = optimizer.state[p]["exp_avg_sq"]
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, ckpt_dir / "checkpoint.safetensors.tmp")
    (ckpt_dir / "checkpoint.json.tmp").write_text(json.dumps(state))
    os.replace(ckpt_dir / "checkpoint.safetensors.tmp", ckpt_dir / "checkpoint.safetensors")
    os.replace(ckpt_dir / "checkpoint.json.tmp", ckpt_dir / "checkpoint.json")


def load_checkpoint(ckpt_dir: Path, model, optimizer) -> dict:
    tensors = load_file(ckpt_dir / "checkpoint.safetensors")
    state = json.loads((ckpt_dir / "checkpoint.json").read_text())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tensors[f"param.{name}"])
            if f"exp_avg.{name}" in tensors:
                optimizer.state[p] = {"step": torch.tensor(float(state["step"])),
                                      "exp_avg": tensors[f"exp_avg.{name}"],
                                      "exp_avg_sq": tensors[f"exp_avg_sq.{name}"]}
    return state


def timed_training(name: str, model, optimizer, rng: np.random.Generator,
                   next_loss: Callable[[np.random.Generator], torch.Tensor], heldout: Callable[[], float],
                   ckpt_dir: Path, s, seen: tuple[str, int]) -> RunState:
    """The zoo's run of the training loop: steps of ``next_loss(rng)`` until ``s.minutes`` of wall
    clock (or ``s.max_steps``) are spent, on :func:`lr_schedule`; ``heldout()`` evaluated and a
    checkpoint written at the start, every ``s.eval_minutes`` and at the end, resuming from
    ``ckpt_dir`` if ``s.resume``. ``seen``: (what a step consumes, how many per step), for the
    evaluations' record. Returns the run's state."""
    state = None
    if s.resume and (ckpt_dir / "checkpoint.json").is_file():
        saved = load_checkpoint(ckpt_dir, model, optimizer)
        rng.bit_generator.state = saved["rng"]
        state = RunState.restored(saved)
        print(f"{name}: resumed at step {state.step}", file=sys.stderr)

    def evaluate(state: RunState) -> dict:
        return {seen[0]: state.step * seen[1], "heldout_loss": heldout()}

    def save(state: RunState) -> None:
        save_checkpoint(ckpt_dir, model, optimizer, {**asdict(state), "rng": rng.bit_generator.state})

    model.train()
    checkpoints = Checkpoints(evaluate, save, every_seconds=s.eval_minutes * 60, at_start=True)
    return TrainingLoop(optimizer, lambda: next_loss(rng), lr_schedule(s), Budget(s.max_steps, s.minutes * 60.0),
                        checkpoints=checkpoints, label=name).run(state)


@torch.enable_grad()  # callers (e.g. the test suite) may have turned autograd off
def train_model(name: str, model, tokenizer, train_stream: np.ndarray, heldout_stream: np.ndarray,
                out_dir: Path, ckpt_dir: Path, s: Settings) -> dict:
    """Train `model` for the time budget, save it (float16) with the tokenizer and a
    training.json into out_dir, and return that report."""
    optimizer = adamw(decay_groups(model.parameters(), s.lr, s.weight_decay), betas=(0.9, 0.95))
    rng = np.random.default_rng(s.seed)
    n_eval = min(s.eval_windows, len(heldout_stream) // s.seq_len)
    eval_windows = torch.from_numpy(heldout_stream[:n_eval * s.seq_len].astype(np.int64)).view(n_eval, s.seq_len)

    def next_loss(rng: np.random.Generator) -> torch.Tensor:
        batch = sample_batch(train_stream, rng, s.batch_size, s.seq_len)  # [batch, seq_len]
        return model(input_ids=batch, labels=batch).loss  # labels are shifted inside the model

    state = timed_training(name, model, optimizer, rng, next_loss, lambda: heldout_loss(model, eval_windows, s.batch_size),
                           ckpt_dir, s, ("tokens", s.batch_size * s.seq_len))

    report = {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "config": {k: getattr(model.config, k) for k in (*MODEL_SHAPES["code-tiny"], "vocab_size")},
        "steps": state.step,
        "tokens_seen": state.step * s.batch_size * s.seq_len,
        "minutes": round(state.elapsed_s / 60, 2),
        "final_train_loss": state.recent_metrics().get("loss"),
        "uniform_loss": math.log(model.config.vocab_size),
        "heldout": state.evals,
        "heldout_tokens_per_eval": n_eval * (s.seq_len - 1),
        "corpus": {"python": platform.python_version(), "train_tokens": len(train_stream),
                   "heldout_tokens": len(heldout_stream)},
        "settings": asdict(s),
        "seed": s.seed,
        "machine": machine_info(),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out_dir)  # safetensors; half the size of float32
    tokenizer.save_pretrained(out_dir)
    (out_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


# ---------------------------------------------------------------- command line


def long_stage(args: argparse.Namespace) -> None:
    """code-tiny-long: the shipped code-tiny, RoPE base raised and positions extended, trained on
    with 16k-token windows of long training files; its held-out loss by position bucket (16k-token
    prefixes of the long held-out files, before and after) goes into training.json."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = unpacked(Path(__file__).parent / "weights" / "code-tiny")  # shipped packed
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.model_max_length = LONG["max_positions"]
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = model.config
    config.rope_parameters = {"rope_theta": LONG["rope_theta"], "rope_type": "default"}
    config.max_position_embeddings = LONG["max_positions"]
    long_model = type(model)(config)  # rebuilt so the rotary tables follow the new base
    long_model.load_state_dict(model.state_dict())
    long_model.generation_config = model.generation_config
    train = long_files(tokenizer, corpus.training_files(), LONG["min_file_tokens"])
    heldout = long_files(tokenizer, corpus.heldout_files(), LONG["eval_tokens"])
    train_stream = token_stream(tokenizer, train, args.work_dir)  # [n_tokens]
    heldout_stream = token_stream(tokenizer, corpus.heldout_files(), args.work_dir)
    eval_sequences = [torch.tensor(tokenizer(corpus.read_text(p), add_special_tokens=False).input_ids[
        :LONG["eval_tokens"]]) for p in heldout]  # each [eval_tokens]
    before = loss_by_position(long_model, eval_sequences, LONG["buckets"])
    print(f"code-tiny-long: loss by position before: {before}", file=sys.stderr)
    settings = Settings(minutes=args.minutes if args.minutes is not None else DEFAULT_MINUTES["long"],
                        lr=args.lr if args.lr is not None else DEFAULT_LR["long"],
                        batch_size=LONG["batch_size"], seq_len=LONG["seq_len"], warmup_steps=10,
                        eval_minutes=args.eval_minutes, eval_windows=4, max_steps=args.max_steps,
                        seed=args.seed, resume=args.resume)
    out_dir = args.out_root / "code-tiny-long"
    report = train_model("code-tiny-long", long_model, tokenizer, train_stream, heldout_stream,
                         out_dir, args.work_dir / "checkpoints" / "code-tiny-long", settings)
    after = loss_by_position(long_model.float(), eval_sequences, LONG["buckets"])
    report.update(continued_from="code-tiny", rope_theta=LONG["rope_theta"],
                  max_position_embeddings=LONG["max_positions"], train_files=len(train),
                  loss_by_position={"files": [p.name for p in heldout], "before": before, "after": after})
    (out_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    pack(out_dir)  # the zoo's shipped form (hasten.zoo.packing)
    print(f"code-tiny-long: loss by position after: {after}", file=sys.stderr)


def run_stage(stage: str, args: argparse.Namespace) -> None:
    if stage == "long":
        return long_stage(args)
    tokenizer = load_or_train_tokenizer(args.work_dir, retrain=stage == "tokenizer")
    if stage == "tokenizer":
        return
    name = STAGE_MODELS[stage]
    train_stream = token_stream(tokenizer, corpus.training_files(), args.work_dir)  # [n_train_tokens]
    heldout_stream = token_stream(tokenizer, corpus.heldout_files(), args.work_dir)  # [n_heldout_tokens]
    settings = Settings(minutes=args.minutes if args.minutes is not None else DEFAULT_MINUTES[stage],
                        lr=args.lr if args.lr is not None else DEFAULT_LR[stage],
                        batch_size=args.batch_size, seq_len=args.seq_len, eval_minutes=args.eval_minutes,
                        max_steps=args.max_steps, seed=args.seed, resume=args.resume)
    model = build_model(model_config(MODEL_SHAPES[name], tokenizer), args.seed)
    report = train_model(name, model, tokenizer, train_stream, heldout_stream,
                         args.out_root / name, args.work_dir / "checkpoints" / name, settings)
    pack(args.out_root / name)  # the zoo's shipped form (hasten.zoo.packing)
    print(f"{name}: {report['params']:,} params, {report['steps']} steps, "
          f"heldout loss {report['heldout'][0]['heldout_loss']:.3f} -> {report['heldout'][-1]['heldout_loss']:.3f}",
          file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hasten.zoo.recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["tokenizer", "target", "draft", "draft4", "long", "all"])
    p.add_argument("--out-root", type=Path, required=True, help="models are written to OUT_ROOT/<model name>/")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "hasten-zoo",
                   help="scratch: tokenizer, token cache, checkpoints (default: %(default)s)")
    p.add_argument("--minutes", type=float,
                   help="wall-clock budget per model (default: target {target:g}, draft {draft:g})".format(
                       **DEFAULT_MINUTES))
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch and tokenizers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --work-dir")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float,
                   help="peak learning rate (default: target {target:g}, draft {draft:g})".format(**DEFAULT_LR))
    p.add_argument("--eval-minutes", type=float, default=4.0, help="held-out evaluation and checkpoint cadence")
    p.add_argument("--max-steps", type=int, help="stop after this many steps even if time remains")
    args = p.parse_args(argv)

    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' Rust thread pool, created lazily
    torch.set_num_threads(args.threads)
    for stage in (["tokenizer", "target", "draft"] if args.stage == "all" else [args.stage]):
        run_stage(stage, args)


if __name__ == "__main__":
    main()
