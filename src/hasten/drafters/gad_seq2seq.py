"""GAD in its seq2seq home: what the drafter needs to read an encoder-decoder target's source.

* :class:`CrossAttention`: the drafter's layers attend to the target's encoder states of the
  whole source (SpecDec's drafter decoder has cross-attention to its encoder's output);
* :class:`Seq2SeqBatch` and :class:`CorrectionPairs`: the training data ``hasten train gad``
  uses on an encoder-decoder: corrupted sentences of :mod:`hasten.zoo.gec` (the target's own
  task), the target's own greedy corrections as labels (self-distillation), and per batch the
  target's encoder states and decoder features from one teacher-forced forward.
"""
from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, safe_open, save_file
from torch import nn
from tqdm import tqdm
from transformers import PreTrainedModel

from .nn import RMSNorm
from .trainable import Batch

CACHE = "gad_pairs.safetensors"
GENERATE_BATCH = 32  # sentences corrected per Hugging Face generate call while distilling


class CrossAttention(nn.Module):
    """Pre-norm attention of the drafter's positions (queries) to the encoder states (keys and
    values, already projected to the drafter's width). The output projection starts at zero,
    so an untrained layer changes nothing."""

    def __init__(self, size: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = RMSNorm(size)
        self.q = nn.Linear(size, size, bias=False)
        self.kv = nn.Linear(size, 2 * size, bias=False)
        self.proj = nn.Linear(size, size, bias=False)
        nn.init.zeros_(self.proj.weight)

    def keys_values(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """source: [B, s, D] -> keys and values [B, h, s, d] each (fixed for a generation: made once)."""
        batch, size = source.shape[0], source.shape[-1]
        k, v = self.kv(source).view(batch, -1, 2, self.heads, size // self.heads).permute(2, 0, 3, 1, 4)
        return k, v

    def forward(self, x: torch.Tensor, keys_values: tuple[torch.Tensor, torch.Tensor],
                source_present: torch.Tensor | None) -> torch.Tensor:
        """x: [B, n, D]; keys_values: from :meth:`keys_values`; source_present: [B, s] bool or None (all present)."""
        batch, n, size = x.shape
        q = self.q(self.norm(x)).view(batch, n, self.heads, size // self.heads).transpose(1, 2)  # [B, h, n, d]
        mask = None if source_present is None else source_present[:, None, None, :]  # [B, 1, 1, s]
        attended = F.scaled_dot_product_attention(q, *keys_values, attn_mask=mask)  # [B, h, n, d]
        return x + self.proj(attended.transpose(1, 2).reshape(batch, n, size))


def sinusoid(positions: torch.Tensor, size: int) -> torch.Tensor:
    """[B, n, size] the sine-cosine embedding of integer positions [B, n] (no parameters)."""
    half = size // 2
    frequencies = 10000.0 ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)  # [half]
    angles = positions[..., None].float() * frequencies  # [B, n, half]
    return torch.cat([angles.sin(), angles.cos()], -1)


# ---- training data on an encoder-decoder ---------------------------------------------------------
@dataclass
class Seq2SeqBatch(Batch):
    """A :class:`Batch` whose ``ids`` are decoder tokens (the start token, then the target's
    correction up to its end-of-sequence token), with the source's encoder states."""

    source: torch.Tensor | None = None  # [B, s, He] encoder states
    source_present: torch.Tensor | None = None  # [B, s] bool: real source tokens (not padding)


@dataclass
class CorrectionPairs:
    """Sources (encoder inputs) and the target's greedy outputs (decoder tokens, start token
    first), training rows then held-out rows; the trainer's ``split`` and ``batch`` protocol."""

    sources: list[list[int]]
    outputs: list[list[int]]
    held_out: int  # the last rows

    def __len__(self) -> int:
        return len(self.sources)

    def split(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(len(self))
        return rows[: len(self) - self.held_out], rows[len(self) - self.held_out:]

    @torch.no_grad()
    def batch(self, rows: torch.Tensor, target: PreTrainedModel, device: str = "cpu") -> Seq2SeqBatch:
        picked = rows.tolist()
        source, source_present = padded([self.sources[i] for i in picked])  # [B, s]
        ids, present = padded([self.outputs[i] for i in picked])  # [B, T]
        out = target(input_ids=source.to(target.device), attention_mask=source_present.long().to(target.device),
                     decoder_input_ids=ids.to(target.device), output_hidden_states=True)
        label_mask = present.clone()
        label_mask[:, 0] = False  # the start token is not the target's
        return Seq2SeqBatch(ids.to(device), out.decoder_hidden_states[-1].float().to(device), label_mask.to(device),
                            source=out.encoder_last_hidden_state.float().to(device),
                            source_present=source_present.to(device))


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [n, L] (zeros) and the bool mask of real tokens [n, L]."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    return ids, torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]


def gec_pairs(model: PreTrainedModel, tokenizer, samples: int, gen_tokens: int, seed: int, work_dir: Path,
              *, resume: bool = False, progress: bool = True) -> CorrectionPairs:
    """``samples`` training sentences of :mod:`hasten.zoo.gec` corrupted with ``seed``, and as
    held-out rows the held-out sentences the bench never uses (not in the shipped
    ``heldout.jsonl``), each with the target's greedy correction (at most ``gen_tokens`` new
    tokens). Cached in ``work_dir`` (reused with ``resume`` when made with the same settings)."""
    from ..zoo import gec

    key = json.dumps({"model": model.config._name_or_path, "samples": samples, "gen_tokens": gen_tokens,
                      "seed": seed, "data": "gec"}, sort_keys=True)
    path = Path(work_dir) / CACHE
    if resume and path.is_file():
        with safe_open(path, "pt") as f:
            if f.metadata().get("key") == key:
                return _load(path)
    training, heldout = gec.split(gec.sentences())
    shipped = {p["target"] for p in gec.heldout_pairs()}
    rng = random.Random(seed)
    texts = [gec.corrupt(s, rng)[0] for s in rng.sample(training, min(samples, len(training)))]
    eval_texts = [gec.corrupt(s, rng)[0] for s in heldout if s not in shipped]
    sources = [tokenizer(t).input_ids for t in texts + eval_texts]
    outputs = []
    for i in tqdm(range(0, len(sources), GENERATE_BATCH), desc="distill", disable=not progress, file=sys.stderr):
        ids, present = padded(sources[i:i + GENERATE_BATCH])
        made = model.generate(input_ids=ids.to(model.device), attention_mask=present.long().to(model.device),
                              do_sample=False, num_beams=1, max_new_tokens=gen_tokens)
        outputs += [until_eos(row, model.generation_config.eos_token_id) for row in made.tolist()]
    pairs = CorrectionPairs(sources, outputs, len(eval_texts))
    _save(path, key, pairs)
    return pairs


def until_eos(row: list[int], eos: int | None) -> list[int]:
    """The start token and the output up to its first end-of-sequence token (included)."""
    for j in range(1, len(row)):
        if row[j] == eos:
            return row[: j + 1]
    return row


def _save(path: Path, key: str, pairs: CorrectionPairs) -> None:
    sources, source_present = padded(pairs.sources)
    outputs, output_present = padded(pairs.outputs)
    tensors = {"sources": sources, "source_lengths": source_present.sum(1), "outputs": outputs,
               "output_lengths": output_present.sum(1), "held_out": torch.tensor([pairs.held_out])}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path, metadata={"key": key})


def _load(path: Path) -> CorrectionPairs:
    t = load_file(path)
    sources = [row[:n].tolist() for row, n in zip(t["sources"], t["source_lengths"].tolist())]
    outputs = [row[:n].tolist() for row, n in zip(t["outputs"], t["output_lengths"].tolist())]
    return CorrectionPairs(sources, outputs, int(t["held_out"][0]))
