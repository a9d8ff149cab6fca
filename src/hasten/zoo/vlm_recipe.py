"""Train zoo:vlm-tiny, a small LLaVA, on procedurally generated scenes (hasten.zoo.scenes).

    python -m hasten.zoo.vlm_recipe --out-root DIR --minutes 25 --threads 1

The model: a tiny CLIP vision tower (128 x 128 images, 8 x 8 patches: 256 visual tokens per
image, so the visual prefill dominates a prompt), a two-layer projector, and zoo:code-tiny as
the language model (its weights and tokenizer, plus an ``<image>`` token). Every parameter
trains. A training sequence is one scene's image followed by a few turns, each a prompt line
(``Describe the image.`` or a question) and its answer ended by ``<|endoftext|>``; the loss is
on the answers only. Held-out scenes have seeds the training never draws. The model is saved
(float16) with its LlavaProcessor, so ``hasten.load(DIR/vlm-tiny)`` and
``hasten generate --model DIR/vlm-tiny --image scene.png --prompt "Describe the image."`` work.
Scratch files (checkpoints) live under --work-dir, never inside the package.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from hasten.core.schedule import adamw, decay_groups
from hasten.core.settings import Settings, add_flags, from_args, option
from hasten.machine import machine_info
from hasten.zoo import scenes
from hasten.zoo.packing import pack, unpacked
from hasten.zoo.recipe import EOT, timed_training

NAME = "vlm-tiny"
TEXT_SOURCE = Path(__file__).parent / "weights" / "code-tiny"
IMAGE_TOKEN = "<image>"
DESCRIBE = "Describe the image."
# 128 / 8 = 16 x 16 = 256 patches; CLIP's class token is dropped ("default" strategy).
VISION = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
              image_size=scenes.IMAGE_SIZE, patch_size=8)
HELDOUT_SEEDS = 10 ** 9  # held-out scenes have seeds from here on; training draws below it


@dataclass(frozen=True)
class VlmSettings(Settings):
    minutes: float = option(25.0, "wall-clock training budget, held-out evaluation included")
    lr: float = option(1e-3, "peak learning rate of the language model")
    vision_lr: float = option(2e-3, "peak learning rate of the vision tower and projector (trained from scratch)")
    batch_size: int = option(4, "sequences (scenes) per step")
    max_turns: int = option(4, "most prompt/answer turns per training sequence")
    describe_rate: float = option(0.7, "chance that a training sequence holds the description turn")
    warmup_steps: int = option(30, "linear warmup steps")
    final_lr_ratio: float = option(0.1, "learning rate at the end, as a share of the peak")
    weight_decay: float = option(0.05, "AdamW weight decay of matrices")
    eval_minutes: float = option(5.0, "cadence of held-out evaluation and checkpointing")
    eval_scenes: int = option(24, "held-out scenes in the held-out loss")
    max_steps: int | None = option(None, "stop after this many steps even if time remains")
    seed: int = option(0, "seed of the model's new weights and of the training scenes")
    resume: bool = option(False, "continue from the last checkpoint in --work-dir")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.minutes <= 0 or self.batch_size < 1 or self.max_turns < 1 or self.eval_scenes < 1:
            raise ValueError("minutes, batch_size, max_turns and eval_scenes must be positive")
        if not 0.0 <= self.describe_rate <= 1.0:
            raise ValueError(f"describe_rate must be in [0, 1], got {self.describe_rate}")


# ---------------------------------------------------------------- model and processor


def make_tokenizer(source: Path = TEXT_SOURCE):
    """code-tiny's tokenizer with the image placeholder token added (the next free id)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(unpacked(source))  # the zoo ships code-tiny packed
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    return tokenizer


def make_processor(tokenizer, vision: dict = VISION):
    """Images are drawn at the tower's size already, so resizing and cropping change nothing;
    the processor still normalises them as CLIP expects."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    size = vision["image_size"]
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=vision["patch_size"],
                          vision_feature_select_strategy="default", num_additional_image_tokens=1)


def image_tokens(vision: dict = VISION) -> int:
    return (vision["image_size"] // vision["patch_size"]) ** 2


def build_model(tokenizer, text_model=None, vision: dict = VISION, seed: int = 0):
    """A LLaVA whose language model is ``text_model`` (default: code-tiny's weights), its
    embeddings grown by the image token, and a new vision tower and projector (``seed``)."""
    from transformers import (
        AutoModelForCausalLM, CLIPVisionConfig, GenerationConfig, LlavaConfig, LlavaForConditionalGeneration,
    )

    if text_model is None:
        text_model = AutoModelForCausalLM.from_pretrained(unpacked(TEXT_SOURCE), dtype=torch.float32)
    text_model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    config = LlavaConfig(vision_config=CLIPVisionConfig(**vision), text_config=text_model.config.to_dict(),
                         image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         image_seq_length=image_tokens(vision), vision_feature_layer=-1,
                         vision_feature_select_strategy="default", tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.tie_weights()  # lm_head shares the (copied) embedding, as in code-tiny
    model.generation_config = GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot)
    return model


# ---------------------------------------------------------------- data


def conversation(scene: scenes.Scene, rng: np.random.Generator, s: VlmSettings) -> list[tuple[str, str]]:
    """A training sequence's turns (prompt line, answer): the description with chance
    ``describe_rate``, and questions of kinds drawn evenly, in a random order."""
    by_kind: dict[str, list[tuple[str, str]]] = {}
    for kind, question, answer in scene.questions():
        by_kind.setdefault(kind, []).append((question, answer))
    turns = [(DESCRIBE, scene.description())] if rng.random() < s.describe_rate else []
    while len(turns) < s.max_turns:
        kinds = sorted(by_kind)
        pool = by_kind[kinds[int(rng.integers(len(kinds)))]]
        turns.append(pool[int(rng.integers(len(pool)))])
        if turns[0][0] == DESCRIBE and len(turns) >= 2 and rng.random() < 0.5:
            break  # vary the length so shorter sequences are seen too
    order = rng.permutation(len(turns))
    return [turns[i] for i in order]


def encode(tokenizer, turns: list[tuple[str, str]], n_image: int) -> tuple[list[int], list[int]]:
    """Ids and labels (-100 where no loss) of an image and its turns. The first prompt line
    is tokenized as the processor tokenizes ``"<image>\\n" + line`` at inference (what
    ``hasten generate --image PATH --prompt LINE`` sends); answers open with a space."""
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    eot = tokenizer.convert_tokens_to_ids(EOT)
    ids, labels = [image_id] * n_image, [-100] * n_image
    for i, (line, answer) in enumerate(turns):
        prompt = tokenizer(("\n" if i == 0 else "") + line, add_special_tokens=False).input_ids
        reply = tokenizer(" " + answer, add_special_tokens=False).input_ids + [eot]
        ids += prompt + reply
        labels += [-100] * len(prompt) + reply
    return ids, labels


def pixel_values(processor, images: list[np.ndarray]) -> torch.Tensor:
    return processor.image_processor(images, return_tensors="pt")["pixel_values"]  # [images, 3, size, size]


def make_batch(processor, seeds: list[int], rng: np.random.Generator, s: VlmSettings, n_image: int) -> dict:
    """One scene per seed, right-padded: input_ids, attention_mask, labels [batch, T]; pixel_values."""
    tokenizer = processor.tokenizer
    eot = tokenizer.convert_tokens_to_ids(EOT)
    chosen = [scenes.make_scene(seed) for seed in seeds]
    encoded = [encode(tokenizer, conversation(scene, rng, s), n_image) for scene in chosen]
    width = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(encoded), width), eot, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, (ids, lab) in enumerate(encoded):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, :len(lab)] = torch.tensor(lab)
        mask[row, :len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels,
            "pixel_values": pixel_values(processor, [scene.image() for scene in chosen])}


def answer_loss(model, batch: dict, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy on the answer tokens only; the vocabulary projection runs on
    those positions alone (not on the 256 image positions)."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         pixel_values=batch["pixel_values"]).last_hidden_state  # [batch, T, hidden]
    targets = batch["labels"][:, 1:]  # [batch, T - 1]; position t predicts token t + 1
    keep = targets != -100
    logits = model.lm_head(hidden[:, :-1][keep]).float()  # [answer tokens, vocab]
    return torch.nn.functional.cross_entropy(logits, targets[keep], reduction=reduction)


@torch.no_grad()
def heldout_loss(model, batches: list[dict]) -> float:
    """Mean loss per answer token over fixed held-out batches."""
    model.eval()
    total = sum(answer_loss(model, b, "sum").item() for b in batches)
    count = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    model.train()
    return total / count


def heldout_batches(processor, s: VlmSettings, n_image: int) -> list[dict]:
    rng = np.random.default_rng(12345)  # the same held-out sequences whatever the training seed
    seeds = [HELDOUT_SEEDS + i for i in range(s.eval_scenes)]
    return [make_batch(processor, seeds[i:i + s.batch_size], rng, s, n_image)
            for i in range(0, len(seeds), s.batch_size)]


# ---------------------------------------------------------------- evaluation by generation


@torch.no_grad()
def answer(model, processor, scene: scenes.Scene, line: str, max_new_tokens: int = 96) -> str:
    """The model's greedy reply to one prompt line about ``scene`` (Hugging Face generate)."""
    model.eval()
    inputs = processor(text=f"{IMAGE_TOKEN}\n{line}", images=[scene.image()], return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def evaluate(model, processor, captions: int = 3, qa_pairs: int = 50) -> dict:
    """Greedy captions of the first held-out scenes next to their references, and exact-match
    accuracy by kind on held-out questions (one drawn per scene, kinds in turn)."""
    examples = []
    for i in range(captions):
        scene = scenes.make_scene(HELDOUT_SEEDS + i)
        examples.append({"seed": scene.seed, "reference": scene.description(), "greedy": answer(model, processor,
                                                                                                   scene, DESCRIBE)})
    kinds = ("count", "colour", "where", "shape")
    right: dict[str, list[int]] = {kind: [0, 0] for kind in kinds}
    rng = np.random.default_rng(777)
    qa, seed = [], HELDOUT_SEEDS + 1000
    while len(qa) < qa_pairs:
        scene, kind = scenes.make_scene(seed), kinds[len(qa) % len(kinds)]
        seed += 1
        pool = [(q, a) for k, q, a in scene.questions() if k == kind]
        if not pool:
            continue
        question, expected = pool[int(rng.integers(len(pool)))]
        got = answer(model, processor, scene, question, max_new_tokens=16)
        right[kind][0] += got == expected
        right[kind][1] += 1
        qa.append({"seed": scene.seed, "question": question, "expected": expected, "greedy": got})
    accuracy = {kind: {"right": r, "asked": n} for kind, (r, n) in right.items()}
    return {"captions": examples, "qa_accuracy": accuracy, "qa": qa}


# ---------------------------------------------------------------- training


def save(model, processor, out_dir: Path) -> None:
    """float16 safetensors (half the size of float32) and the processor. The model is left in
    float32 holding the rounded weights, as ``hasten.load`` reads them back."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    model.to(torch.float32)


@torch.enable_grad()  # callers (e.g. the test suite) may have turned autograd off
def train(model, processor, out_dir: Path, ckpt_dir: Path, s: VlmSettings, evaluation: dict | None = None) -> dict:
    """Train for the time budget, save the model (float16) and its processor into ``out_dir``
    with a training.json, and return that report. ``evaluation``: keyword arguments of
    :func:`evaluate` (run after training and saving, outside the budget), or None to skip it."""
    n_image = model.config.image_seq_length
    language = [p for n, p in model.named_parameters() if n.startswith("model.language_model.")]
    vision = [p for n, p in model.named_parameters() if not n.startswith("model.language_model.")]
    groups = decay_groups(language, s.lr, s.weight_decay) + [{"params": vision, "weight_decay": 0.0, "lr": s.vision_lr}]
    optimizer = adamw(groups, betas=(0.9, 0.95))
    rng = np.random.default_rng(s.seed)
    eval_batches = heldout_batches(processor, s, n_image)

    def next_loss(rng: np.random.Generator) -> torch.Tensor:
        seeds = [int(x) for x in rng.integers(0, HELDOUT_SEEDS, size=s.batch_size)]
        return answer_loss(model, make_batch(processor, seeds, rng, s, n_image))

    state = timed_training(NAME, model, optimizer, rng, next_loss, lambda: round(heldout_loss(model, eval_batches), 4),
                           ckpt_dir, s, ("scenes", s.batch_size))

    text = model.config.text_config
    report = {
        "model": NAME,
        "params": sum(p.numel() for p in model.parameters()),
        "language_model": "zoo:code-tiny (weights and tokenizer, + <image>)",
        "config": {"vision": {k: getattr(model.config.vision_config, k) for k in VISION},
                   "text": {k: getattr(text, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                          "num_key_value_heads", "intermediate_size", "vocab_size")},
                   "image_tokens": n_image},
        "steps": state.step,
        "scenes_seen": state.step * s.batch_size,
        "minutes": round(state.elapsed_s / 60, 2),
        "final_train_loss": state.recent_metrics().get("loss"),
        "heldout": state.evals,
        "heldout_scenes": f"seeds {HELDOUT_SEEDS} .. {HELDOUT_SEEDS + s.eval_scenes - 1}",
        "settings": asdict(s),
        "machine": machine_info(),
    }
    save(model, processor, out_dir)
    if evaluation is not None:  # of the saved (float16-rounded) weights, as users get them
        t0 = time.monotonic()
        report["evaluation"] = evaluate(model, processor, **evaluation)
        report["evaluation"]["minutes"] = round((time.monotonic() - t0) / 60, 2)
    (out_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hasten.zoo.vlm_recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-root", type=Path, required=True, help=f"the model is written to OUT_ROOT/{NAME}/")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "hasten-zoo",
                   help="scratch: checkpoints (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    p.add_argument("--captions", type=int, default=3, help="held-out captions generated after training")
    p.add_argument("--qa-pairs", type=int, default=50, help="held-out questions answered after training")
    add_flags(p.add_argument_group("training settings"), VlmSettings)
    args = p.parse_args(argv)
    settings = from_args(VlmSettings, args)

    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' Rust thread pool, created lazily
    torch.set_num_threads(args.threads)
    tokenizer = make_tokenizer()
    processor = make_processor(tokenizer)
    model = build_model(tokenizer, seed=settings.seed)
    report = train(model, processor, args.out_root / NAME, args.work_dir / "checkpoints" / NAME, settings,
                   evaluation={"captions": args.captions, "qa_pairs": args.qa_pairs})
    pack(args.out_root / NAME)  # the zoo's shipped form (hasten.zoo.packing)
    first, last = report["heldout"][0]["heldout_loss"], report["heldout"][-1]["heldout_loss"]
    print(f"{NAME}: {report['params']:,} params, {report['steps']} steps, heldout loss {first:.3f} -> {last:.3f}, "
          f"QA {json.dumps(report['evaluation']['qa_accuracy'])}", file=sys.stderr)
    print(f"uniform loss would be {math.log(report['config']['text']['vocab_size']):.3f}", file=sys.stderr)


if __name__ == "__main__":
    main()
