"""Text in, text out: ``hasten.load`` and the :class:`Engine` it returns."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedModel

from . import zoo
from .drafters.base import Drafter, create
from .engine.loop import check_inputs, decode, eos_ids
from .engine.sampling import Sampling
from .engine.stats import DecodeStats

AUTOREGRESSIVE = "autoregressive"  # the plain baseline: the decode loop without a drafter
MODEL_DRAFTERS = {"draft_model"}  # methods that need a second model (``draft=``)


def resolve_path(name_or_path: str) -> str:
    """A zoo name ("zoo:code-tiny"), a local directory, or a Hugging Face hub id."""
    if zoo.is_zoo_name(name_or_path):
        return str(zoo.resolve(name_or_path))
    return name_or_path


def load_model(name_or_path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    path = resolve_path(name_or_path)
    try:
        config = AutoConfig.from_pretrained(path)
        auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError) as err:
        where = "no such directory" if not os.path.exists(path) else str(err).splitlines()[0]
        raise ValueError(f"model {name_or_path!r} could not be loaded: {where}") from err
    return model.to(device).eval()


def make_drafter(method: str, draft_model: PreTrainedModel | None = None, **method_kwargs) -> Drafter | None:
    if method == AUTOREGRESSIVE:
        if method_kwargs:
            raise TypeError(f"method {AUTOREGRESSIVE!r} takes no settings, got {sorted(method_kwargs)}")
        return None
    if method in MODEL_DRAFTERS:
        if draft_model is None:
            raise ValueError(f"method {method!r} needs a draft model: pass draft=PATH")
        return create(method, model=draft_model, **method_kwargs)
    return create(method, **method_kwargs)


@dataclass
class EngineOutput:
    text: str  # the generated text only
    token_ids: list[int]  # the generated tokens only
    stats: DecodeStats


class Engine:
    """A model, its tokenizer and one acceleration method, ready to generate text."""

    def __init__(self, model: PreTrainedModel, tokenizer, drafter: Drafter | None, method: str):
        self.model, self.tokenizer, self.drafter, self.method = model, tokenizer, drafter, method

    def stream(self, prompt: str, **kwargs) -> Iterator[str]:
        """Yield text pieces as tokens are accepted (same keywords as :meth:`generate`)."""
        for piece, _ in self.steps(prompt, DecodeStats(), **kwargs):
            yield piece

    def generate(self, prompt: str, **kwargs) -> EngineOutput:
        """Generate after ``prompt``; keywords: max_new_tokens, temperature, top_k, top_p, seed."""
        stats = DecodeStats()
        text, ids = "", []
        for piece, new in self.steps(prompt, stats, **kwargs):
            text += piece
            ids.extend(new)
        return EngineOutput(text, ids, stats)

    def steps(
        self,
        prompt: str,
        stats: DecodeStats,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> Iterator[tuple[str, list[int]]]:
        """Yield (text piece, token ids) per decode step; ``stats`` fills in as it runs."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt is empty")
        sampling = Sampling(temperature, top_k, top_p)
        input_ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.model.device)
        check_inputs(self.model, input_ids, self.drafter, max_new_tokens, None)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(seed)
        eos = eos_ids(self.model, None)
        new: list[int] = []
        shown = ""
        for step in decode(self.model, input_ids, self.drafter, max_new_tokens, sampling, eos, generator, stats):
            new.extend(step)
            text = self.tokenizer.decode(new, skip_special_tokens=True)
            # Hold text back while it ends inside a multi-byte character.
            piece = text[len(shown) :] if text.startswith(shown) and not text.endswith("\ufffd") else ""
            shown += piece
            yield piece, step
        tail = self.tokenizer.decode(new, skip_special_tokens=True)[len(shown) :]
        if tail:
            yield tail, []


def load(
    name_or_path: str,
    method: str = "prompt_lookup",
    *,
    draft: str | PreTrainedModel | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **method_kwargs,
) -> Engine:
    """Load a model (zoo name, local directory or hub id) with an acceleration method.

    ``method`` is ``"autoregressive"`` or a registered drafter name; ``method_kwargs``
    are that drafter's settings, e.g. ``load(path, "prompt_lookup", num_tokens=8)``.
    """
    model = load_model(name_or_path, dtype, device)
    path = resolve_path(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"model {name_or_path!r} has no usable tokenizer: {str(err).splitlines()[0]}") from err
    draft_model = load_model(draft, dtype, device) if isinstance(draft, str) else draft
    return Engine(model, tokenizer, make_drafter(method, draft_model, **method_kwargs), method)
