"""Text in, text out: ``hasten.load`` and the :class:`Engine` it returns."""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer, PreTrainedModel

from . import zoo
from .drafters.base import REGISTRY, Drafter, create
from .engine.inputs import check_inputs, eos_ids
from .engine.loop import decode
from .engine.verify import acceptance_rule
from .models.adapter import vocab_size
from .core.sampling import Sampling
from .core.stats import DecodeStats

AUTOREGRESSIVE = "autoregressive"  # the plain baseline: the decode loop without a drafter


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


def check_method(method: str, has_draft: bool) -> None:
    """Raise ValueError unless ``method`` exists and gets a draft model exactly when it
    needs one; cheap, so callers check it before loading any model."""
    if method != AUTOREGRESSIVE and method not in REGISTRY:
        raise ValueError(f"unknown method {method!r}; known: {', '.join([AUTOREGRESSIVE, *sorted(REGISTRY)])}")
    needs = method != AUTOREGRESSIVE and getattr(REGISTRY[method], "needs_draft_model", False)
    if needs and not has_draft:
        raise ValueError(f"method {method!r} needs a draft model: pass draft=PATH (--draft PATH)")
    if has_draft and not needs:
        takers = ", ".join(name for name, cls in sorted(REGISTRY.items()) if getattr(cls, "needs_draft_model", False))
        raise ValueError(f"method {method!r} takes no draft model (draft= / --draft is for: {takers or 'none'})")


def make_drafter(method: str, draft_model: PreTrainedModel | None = None, **method_kwargs) -> Drafter | None:
    if method == AUTOREGRESSIVE and method_kwargs:
        raise TypeError(f"method {AUTOREGRESSIVE!r} takes no settings, got {sorted(method_kwargs)}")
    check_method(method, draft_model is not None)
    if method == AUTOREGRESSIVE:
        return None
    if draft_model is not None:  # check_method made sure the method needs it
        return create(method, model=draft_model, **method_kwargs)
    return create(method, **method_kwargs)


def warn_if_tokenizers_differ(tokenizer, draft_tokenizer, draft_name: str, samples: int = 1000) -> None:
    """A draft model with the target's vocabulary size but another tokenizer is accepted
    (outputs stay exact) yet its drafts mean other text, so they are rarely accepted: warn.
    Compares the token strings of ``samples`` ids spread over the shared id range."""
    shared = min(len(tokenizer), len(draft_tokenizer))
    ids = sorted({round(i * (shared - 1) / max(samples - 1, 1)) for i in range(samples)}) if shared else []
    ours, theirs = tokenizer.convert_ids_to_tokens(ids), draft_tokenizer.convert_ids_to_tokens(ids)
    differ = [(i, a, b) for i, a, b in zip(ids, ours, theirs) if a != b]
    if differ:
        token, a, b = differ[0]
        warnings.warn(
            f"draft model {draft_name!r} has another tokenizer than the target ({len(differ)} of {len(ids)} "
            f"sampled ids differ, e.g. id {token} is {b!r} there and {a!r} in the target's): outputs stay "
            "exact but few drafts will be accepted", UserWarning, stacklevel=3,
        )


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
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        sampling = Sampling(temperature, top_k, top_p)
        input_ids = self.tokenizer(prompt, return_tensors="pt").input_ids.to(self.model.device)
        check_inputs(self.model, input_ids, self.drafter, max_new_tokens, None)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(seed)
        eos = eos_ids(self.model, None)
        acceptance = acceptance_rule(sampling)
        new: list[int] = []
        shown = ""
        for step in decode(self.model, input_ids, self.drafter, max_new_tokens, sampling, eos, generator, stats,
                           acceptance):
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
    check_method(method, draft is not None)  # before the seconds spent loading models
    model = load_model(name_or_path, dtype, device)
    tokenizer = load_tokenizer(name_or_path)
    draft_model = draft
    if isinstance(draft, str):
        draft_model = load_model(draft, dtype, device)
        draft_tokenizer = _optional_tokenizer(draft)
        if draft_tokenizer is not None and vocab_size(draft_model) == vocab_size(model):
            warn_if_tokenizers_differ(tokenizer, draft_tokenizer, draft)
    return Engine(model, tokenizer, make_drafter(method, draft_model, **method_kwargs), method)


def load_tokenizer(name_or_path: str):
    try:
        return AutoTokenizer.from_pretrained(resolve_path(name_or_path))
    except (OSError, ValueError) as err:
        raise ValueError(f"model {name_or_path!r} has no usable tokenizer: {str(err).splitlines()[0]}") from err


def _optional_tokenizer(name_or_path: str):
    """The draft's tokenizer if it ships one (a draft model needs none: it shares the target's)."""
    try:
        return load_tokenizer(name_or_path)
    except ValueError:
        return None
