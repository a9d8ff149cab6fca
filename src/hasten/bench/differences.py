"""Where an output left its reference, and why: a near-tie that rounding can flip, or a defect.

At the first differing new token the reference's logits are recomputed as plain decoding
computed them, and three numbers are recorded:

* ``margin``: the reference's top logit minus its second (what a rounding must overcome);
* ``rounding``: the measured size of the two computations' disagreement at that position.
  For a hasten method that is the block-vs-step difference: the same positions run as one
  verification block (the last ``BLOCK`` tokens of the prefix) against one-token steps. For
  another implementation (Hugging Face ``generate``, vLLM) it is the difference between
  hasten's logits and the model's own PyTorch forward outside hasten, a measurement of how far
  another library's kernels round from hasten's (vLLM's own logits are not available here);
* ``rank``: how many tokens the reference's logits put strictly above the differing token (0: it
  ties with the top, which bfloat16 logits often do; 1: the runner-up), and ``gap``: the top
  logit minus the differing token's.

``verdict``: "near-tie" when the differing token's gap to the top is within the measured
rounding (the other computation may well have put it first), else "defect". hasten's own methods must never differ from its plain
decoding where the forwards are invariant (models/invariant.py: rounding 0), so a difference
there is a defect and fails the run.
"""
from __future__ import annotations

import torch

from ..models import forwards
from ..models.adapter import ModelAdapter
from ..models.hf import runtime_of

BLOCK = 8  # positions run as one block for the block-vs-step difference


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def classify(model, input_ids: torch.Tensor, reference: list[int], output: list[int], own_method: bool) -> dict:
    """``output`` against ``reference`` (new tokens after ``input_ids`` [1, T]) as the module
    says; ``own_method``: a hasten method (else another implementation)."""
    at = first_difference(output, reference)
    entry: dict = {"position": at}
    if at >= min(len(output), len(reference)):  # one is a prefix of the other: a length, not a token, differs
        entry["verdict"] = "length"
        return entry
    prefix = input_ids[0].tolist() + reference[:at]  # the reference's tokens up to the differing one
    step = _step_logits(model, prefix)  # [vocab] plain decoding's logits there
    top = step.topk(2).values
    entry["margin"] = float(top[0] - top[1])
    entry["rank"] = int((step > step[output[at]]).sum())  # 0: tied with the top
    entry["gap"] = float(top[0] - step[output[at]])
    if own_method:
        other = _block_logits(model, prefix)
    else:
        with forwards.active(False):  # the model's own forward: PyTorch's kernels, as generate runs them
            other = model(torch.tensor([prefix], device=model.device)).logits[0, -1].float()
    entry["rounding"] = float((other - step).abs().max())
    entry["verdict"] = verdict(entry["gap"], entry["rounding"])
    return entry


def verdict(gap: float, rounding: float) -> str:
    """A near-tie: the differing token's logit was within the two computations' measured
    disagreement of the top one. Anything else is a defect."""
    return "near-tie" if gap <= rounding else "defect"


def _step_logits(model, prefix: list[int]) -> torch.Tensor:
    """The logits after ``prefix`` as plain decoding computes them: the prompt part prefilled,
    the newest token fed as a one-token step."""
    adapter = ModelAdapter(model)
    adapter.start(torch.tensor([prefix], device=model.device))
    return adapter.forward([prefix[-1]], None).logits[-1]


def _block_logits(model, prefix: list[int]) -> torch.Tensor:
    """The same logits from a verification block over the last ``BLOCK`` tokens of ``prefix``."""
    keep = max(1, len(prefix) - BLOCK)
    adapter = ModelAdapter(model)
    adapter.start(torch.tensor([prefix[:keep]], device=model.device))
    return adapter.forward(prefix[keep - 1 :], None).logits[-1]


def explainer(model):
    """A classifier for ``run_bench``, or None where the model is not a PyTorch model (llama.cpp)."""
    if runtime_of(model).__class__.__name__ != "HuggingFaceRuntime":
        return None
    return lambda input_ids, reference, output, own: classify(model, input_ids, reference, output, own)
