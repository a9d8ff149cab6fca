"""The elastic visual compressor of SpecVLM (Huang et al. 2025, "SpecVLM: Fast Speculative
Decoding in Vision-Language Models"): fewer visual inputs for the *drafter*.

A VLM prompt is mostly image placeholders (256 of them per image on zoo:vlm-tiny), so a
drafter that reads one input per prompt position pays for the image in its own prefill and
in every later attention. The compressor turns one image's run of drafter inputs
(``[B, n, H]``) into fewer:

* ``full``: all ``n`` (no compression: the plain EagleVLM baseline);
* ``prune``: the ``n / 4`` inputs a learned score ranks highest, in their order, each
  scaled by its sigmoid score (so the score learns);
* ``pool``: the mean of each 2 x 2 window of the patch grid (``n / 4``);
* ``conv``: a learned linear map of each 2 x 2 window (a stride-2 convolution; starts as the mean);
* ``resample``: ``queries`` learned queries attending over all ``n`` (a one-layer resampler);
* ``text``: none at all (the drafter reads the text only).

A gate picks one branch per input from the image's and the prompt text's mean inputs:
Gumbel-softmax while training, argmax at inference. The compressor changes what the drafter
reads, never what the target computes, so decoding stays lossless whatever it picks.

Windows: a run of ``side x side`` inputs (``side`` even) is a patch grid and windows are its
2 x 2 blocks; any other run is read in windows of 4 consecutive inputs (the last one padded by
repeating its final input).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

BRANCHES = ("full", "prune", "pool", "conv", "resample", "text")
WINDOW = 4  # inputs per pooling window (2 x 2 on a grid); prune keeps 1 in WINDOW too


def windows(x: torch.Tensor) -> torch.Tensor:
    """[B, n, H] one image's inputs -> [B, ceil(n / 4), 4, H] its windows (see the module doc)."""
    batch, n, size = x.shape
    side = math.isqrt(n)
    if side * side == n and side % 2 == 0:  # a patch grid: 2 x 2 blocks, row by row
        grid = x.view(batch, side // 2, 2, side // 2, 2, size)
        return grid.permute(0, 1, 3, 2, 4, 5).reshape(batch, n // WINDOW, WINDOW, size)
    pad = -n % WINDOW
    if pad:
        x = torch.cat([x, x[:, -1:].expand(batch, pad, size)], dim=1)
    return x.view(batch, -1, WINDOW, size)


class VisualCompressor(nn.Module):
    def __init__(self, size: int, heads: int, queries: int):
        super().__init__()
        self.score = nn.Linear(size, 1)
        self.window_map = nn.Linear(WINDOW * size, size)
        with torch.no_grad():  # start as the window mean
            self.window_map.weight.copy_(torch.eye(size).repeat(1, WINDOW) / WINDOW)
            self.window_map.bias.zero_()
        self.queries = nn.Parameter(torch.randn(queries, size) * size ** -0.5)
        self.resampler = nn.MultiheadAttention(size, heads, batch_first=True)
        self.gate = nn.Sequential(nn.Linear(2 * size, size), nn.GELU(), nn.Linear(size, len(BRANCHES)))

    def compress(self, branch: str, x: torch.Tensor) -> torch.Tensor:
        """[B, n, H] one image's drafter inputs -> [B, m, H] what ``branch`` keeps of them."""
        batch, n, size = x.shape
        if branch == "full":
            return x
        if branch == "text":
            return x[:, :0]
        if branch == "pool":
            return windows(x).mean(2)
        if branch == "conv":
            return self.window_map(windows(x).flatten(2))
        if branch == "prune":
            scores = self.score(x).squeeze(-1)  # [B, n]
            kept = scores.topk(-(-n // WINDOW), dim=1).indices.sort(dim=1).values  # [B, m] in their order
            picked = x.gather(1, kept[..., None].expand(-1, -1, size))  # [B, m, H]
            return picked * torch.sigmoid(scores.gather(1, kept))[..., None] * 2  # x 2: a score of 0 keeps x
        if branch == "resample":
            queries = self.queries[None].expand(batch, -1, -1).to(x.dtype)  # [B, q, H]
            return queries + self.resampler(queries, x, x, need_weights=False)[0]
        raise ValueError(f"unknown compressor branch {branch!r}; known: {', '.join(BRANCHES)}")

    def kept(self, branch: str, n: int) -> int:
        """How many inputs ``branch`` keeps of an image's ``n``."""
        return {"full": n, "text": 0, "resample": len(self.queries)}.get(branch, -(-n // WINDOW))

    def gate_logits(self, visual: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        """[B, n, H] an image's inputs and [B, t, H] the prompt text's after it (t may be 0)
        -> [B, branches] the gate's scores."""
        text_mean = text.mean(1) if text.shape[1] else torch.zeros_like(visual[:, 0])
        return self.gate(torch.cat([visual.mean(1), text_mean], dim=-1))

    def gate_weights(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """[B, branches] one-hot choices with Gumbel-softmax gradients (training)."""
        return F.gumbel_softmax(logits, tau=temperature, hard=True)
