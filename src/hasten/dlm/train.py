"""Train ``zoo:dlm-tiny``: a masked-diffusion language model adapted from ``zoo:code-tiny``.

    OMP_NUM_THREADS=1 nice -n 10 python -m hasten.dlm.train --out src/hasten/zoo/weights/dlm-tiny --minutes 25

Recipe (as Dream adapts an autoregressive model): start from code-tiny's weights, add one
``<|mask|>`` token, run the model bidirectionally (an all-zeros additive attention mask) and keep
the autoregressive habit of predicting token i from position i - 1 ("shifted logits"), which the
sampler reads from ``config.dlm_shifted_logits``. The objective is the masked-diffusion bound:
per sequence a mask ratio t ~ U(eps, 1), every token masked with probability t, cross-entropy on
the masked tokens only, weighted by 1 / t and averaged over all tokens of the batch.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hasten.core.schedule import adamw, decay_groups
from hasten.core.training_loop import Budget, Checkpoints, Schedule, TrainingLoop
from hasten.machine import machine_info
from hasten.zoo import WEIGHTS_DIR, corpus
from hasten.zoo.packing import pack, unpacked
from hasten.zoo.recipe import sample_batch, token_stream

MASK_TOKEN = "<|mask|>"
SOURCE = WEIGHTS_DIR / "code-tiny"
MIN_MASK_RATIO = 1e-3  # t never reaches 0, so the 1 / t weight stays bounded


def bidirectional_mask(batch: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """All zeros: every position attends to every position. [batch, 1, length, length]"""
    return torch.zeros(batch, 1, length, length, dtype=dtype)


def load_source(source: Path = SOURCE):
    """code-tiny in float32 with one more token, ``<|mask|>``, whose embedding starts at the mean one."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    source = unpacked(source)  # the zoo ships code-tiny packed
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    model = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa")
    old = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight  # [vocab + 1, hidden]; the lm head is tied to it
        embedding[old:] = embedding[:old].mean(0)
    mask_id = tokenizer.convert_tokens_to_ids(MASK_TOKEN)
    model.config.mask_token_id = mask_id
    model.config.dlm_shifted_logits = True
    model.generation_config.mask_token_id = mask_id
    return model, tokenizer


def diffusion_loss(model, tokens: torch.Tensor, mask_id: int, generator: torch.Generator,
                   ratios: torch.Tensor | None = None) -> torch.Tensor:
    """Masked-diffusion loss of ``tokens`` [batch, length] with shifted logits.

    Position 0 is never masked (nothing before it predicts it). ``ratios`` [batch] fixes t (held-out
    evaluation); otherwise t ~ U(MIN_MASK_RATIO, 1) from ``generator``."""
    batch, length = tokens.shape
    if ratios is None:
        ratios = MIN_MASK_RATIO + (1 - MIN_MASK_RATIO) * torch.rand(batch, generator=generator)
    masked = torch.rand(batch, length, generator=generator) < ratios[:, None]  # [batch, length]
    masked[:, 0] = False
    noisy = torch.where(masked, mask_id, tokens)
    logits = model(input_ids=noisy, attention_mask=bidirectional_mask(batch, length, torch.float32)).logits
    # Shifted: the output at position i - 1 predicts token i.  [batch, length - 1, vocab]
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
    weights = masked[:, 1:].float() / ratios[:, None]  # [batch, length - 1]
    return (per_token * weights).sum() / weights.new_tensor(batch * (length - 1))


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor, mask_id: int, seed: int = 1234) -> float:
    """Mean diffusion loss on fixed windows [n, length] with fixed masks and ratios spread over (0, 1)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ratios = (torch.arange(len(windows), dtype=torch.float32) + 0.5) / len(windows)  # [n]
    total = sum(float(diffusion_loss(model, w[None], mask_id, generator, ratios[i:i + 1]))
                for i, w in enumerate(windows))
    model.train()
    return total / len(windows)


def train(out: Path, minutes: float, seq_len: int, batch_size: int, lr: float, seed: int,
          eval_windows: int, work_dir: Path) -> dict:
    model, tokenizer = load_source()
    mask_id = model.config.mask_token_id
    train_stream = token_stream(tokenizer, corpus.training_files(), work_dir)  # [n_train_tokens]
    heldout_stream = token_stream(tokenizer, corpus.heldout_files(), work_dir)  # [n_heldout_tokens]
    windows = torch.from_numpy(heldout_stream[:eval_windows * seq_len].astype(np.int64)).view(eval_windows, seq_len)
    rng = np.random.default_rng(seed)
    generator = torch.Generator().manual_seed(seed)
    optimizer = adamw(decay_groups(model.parameters(), lr, 0.1), betas=(0.9, 0.95))

    def batch_loss() -> torch.Tensor:
        return diffusion_loss(model, sample_batch(train_stream, rng, batch_size, seq_len), mask_id, generator)

    first = {"step": 0, "minutes": 0.0, "heldout_loss": heldout_loss(model, windows, mask_id)}  # outside the budget
    print(f"dlm-tiny: start heldout loss {first['heldout_loss']:.4f}", file=sys.stderr)
    model.train()
    last = Checkpoints(lambda state: {"heldout_loss": heldout_loss(model, windows, mask_id)})  # at the end only
    state = TrainingLoop(optimizer, batch_loss, Schedule(warmup_steps=30, final_ratio=0.1), Budget(seconds=minutes * 60),
                         checkpoints=last, label="dlm-tiny").run()
    step, evals = state.step, [first, *state.evals]
    print(f"dlm-tiny: {step} steps, heldout loss {evals[0]['heldout_loss']:.4f} -> {evals[-1]['heldout_loss']:.4f}",
          file=sys.stderr)
    report = {
        "model": "dlm-tiny", "source": "zoo:code-tiny", "objective": "masked diffusion, shifted logits, 1/t weighted",
        "params": sum(p.numel() for p in model.parameters()), "mask_token_id": mask_id,
        "steps": step, "tokens_seen": step * batch_size * seq_len, "minutes": round(state.elapsed_s / 60, 2),
        "final_train_loss": state.recent_metrics().get("loss"),
        "uniform_loss": math.log(model.config.vocab_size), "heldout": evals,
        "heldout_windows": eval_windows, "settings": {"seq_len": seq_len, "batch_size": batch_size, "lr": lr,
                                                      "seed": seed, "minutes": minutes},
        "machine": machine_info(),
    }
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hasten.dlm.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=WEIGHTS_DIR / "dlm-tiny")
    p.add_argument("--minutes", type=float, default=25.0)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/hasten-zoo"))
    args = p.parse_args(argv)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    train(args.out, args.minutes, args.seq_len, args.batch_size, args.lr, args.seed, args.eval_windows, args.work_dir)
    pack(args.out)  # the zoo's shipped form (hasten.zoo.packing)


if __name__ == "__main__":
    main()
