"""Vision-language targets: image + text prefill, then text decoding as any causal LM.

A vision-language model (LLaVA, Idefics3/SmolVLM) reads its images once: the prompt holds
one *placeholder* token per visual feature, and the prefill forward (given ``pixel_values``
and whatever else the model's processor returned) writes the vision tower's projected
features at those positions. After the prefill the cache holds image and text alike, and
every later block is text only, so verification (chains, trees, the 4D mask, positions) is
the causal LM's, unchanged. Drafters read ``ctx.tokens``, the prompt's ids with its
placeholders, so training-free drafters need nothing new.

What differs between families sits in :data:`FAMILIES`; a family whose text positions or
masks are not those of a causal LM (Qwen2-VL's 3D M-RoPE positions, PaliGemma/Gemma 3's
bidirectional image prefix) is refused by name rather than decoded wrongly.
"""
from __future__ import annotations

import inspect
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from transformers import PreTrainedModel

from .layers import model_name


@dataclass(frozen=True)
class VisionFamily:
    """What hasten knows of one family of vision-language models."""

    pixel_dims: tuple[str, ...]  # pixel_values' dims, named as in shape comments; the rank is checked

    @property
    def pixel_layout(self) -> str:
        return ", ".join(self.pixel_dims)

    @property
    def batched(self) -> bool:
        """Whether pixel_values' first dim counts prompts (it must then be 1)."""
        return self.pixel_dims[0] == "batch"


# model_type -> family. Each one here is tested for greedy equality with Hugging Face generate.
FAMILIES = {
    "llava": VisionFamily(("images", "channels", "height", "width")),
    "idefics3": VisionFamily(("batch", "images", "channels", "height", "width")),
    "smolvlm": VisionFamily(("batch", "images", "channels", "height", "width")),
}

# Keywords of a model's forward that the decode loop sets itself; a caller passing one
# would fight the loop over the cache, positions or mask.
LOOP_OWNED = frozenset({
    "input_ids", "inputs_embeds", "attention_mask", "position_ids", "past_key_values", "use_cache", "cache_position",
    "labels", "logits_to_keep", "output_hidden_states", "output_attentions", "return_dict",
})


def is_vision_language(model: PreTrainedModel) -> bool:
    """Whether the model has a vision tower (its config a ``vision_config``)."""
    return getattr(model.config, "vision_config", None) is not None


def image_token_id(model: PreTrainedModel) -> int | None:
    token = getattr(model.config, "image_token_id", None)
    return int(token) if token is not None else None


def check_model_inputs(model: PreTrainedModel, input_ids: torch.Tensor, model_inputs: dict) -> None:
    """The image inputs of one prompt ([1, T] ``input_ids``), each failure a ValueError or
    TypeError naming the argument. ``model_inputs``: ``pixel_values`` and the processor's
    other tensors, by keyword."""
    placeholder = image_token_id(model) if is_vision_language(model) else None
    placeholders = int((input_ids == placeholder).sum()) if placeholder is not None else 0
    if not model_inputs:
        if placeholders:
            raise ValueError(f"input_ids holds {placeholders} image placeholder token(s) (id {placeholder}) but no "
                             "pixel_values were given")
        return
    names = ", ".join(sorted(model_inputs))
    if not is_vision_language(model):
        stray = next((key for key, value in model_inputs.items() if not isinstance(value, torch.Tensor)), None)
        if stray is not None:  # a misspelt keyword of generate, not an image input
            raise TypeError(f"generate() got an unexpected keyword argument {stray!r}")
        raise ValueError(f"{names} given, but model {model_name(model)!r} ({type(model).__name__}) is a text-only "
                         "model: it has no vision tower to read images")
    family = FAMILIES.get(model.config.model_type)
    if family is None:
        raise ValueError(f"{names} given for model {model_name(model)!r} of type {model.config.model_type!r}, "
                         f"which hasten does not decode yet (its text positions or masks may differ from a causal "
                         f"LM's); supported: {', '.join(sorted(FAMILIES))}")
    _check_keywords(model, model_inputs)
    pixels = model_inputs.get("pixel_values")
    if pixels is None:
        raise ValueError(f"{names} given without pixel_values: the images themselves are missing")
    if not pixels.is_floating_point():
        raise TypeError(f"pixel_values must be a floating-point tensor, got dtype {pixels.dtype}")
    if pixels.ndim != len(family.pixel_dims):
        raise ValueError(f"pixel_values must have {len(family.pixel_dims)} dims [{family.pixel_layout}] for "
                         f"{type(model).__name__}, got shape {list(pixels.shape)}")
    if family.batched and pixels.shape[0] != 1:
        raise ValueError(f"pixel_values holds the images of {pixels.shape[0]} prompts where one is decoded "
                         f"(shape {list(pixels.shape)}; [1, images, ...] expected)")
    if placeholders == 0:
        raise ValueError(f"pixel_values given, but input_ids holds no image placeholder token (id {placeholder}): "
                         "build the prompt with the model's processor, which writes one per visual feature")
    if int(input_ids[0, -1]) == placeholder:
        raise ValueError("input_ids ends with an image placeholder token: the prompt must end with text after its "
                         "images (the last prompt token is decoded, not prefilled with the images)")


def _check_keywords(model: PreTrainedModel, model_inputs: dict) -> None:
    named = inspect.signature(model.forward).parameters.values()
    accepted = {p.name for p in named if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} - LOOP_OWNED
    for key, value in model_inputs.items():
        if key not in accepted:
            owned = " (the decode loop sets it)" if key in LOOP_OWNED else ""
            raise TypeError(f"unexpected keyword argument {key!r}{owned}: {type(model).__name__}'s forward takes "
                            f"{', '.join(sorted(accepted))}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{key} must be a torch.Tensor (as the model's processor returns it), got "
                            f"{type(value).__name__}")


def prefill_inputs(model: PreTrainedModel, model_inputs: dict) -> dict:
    """``model_inputs`` on the model's device, floating-point ones in its dtype."""
    moved = {}
    for key, value in model_inputs.items():
        value = value.to(model.device)
        moved[key] = value.to(model.dtype) if value.is_floating_point() else value
    return moved


@contextmanager
def placeholder_errors(model: PreTrainedModel, input_ids: torch.Tensor, model_inputs: dict) -> Iterator[None]:
    """Inside the block (the image prefill), the model's own check that placeholders and
    visual features agree fails as a ValueError naming input_ids and pixel_values with both
    counts (the model's message can miscount: LLaVA's multiplies by the hidden size)."""
    try:
        yield
    except ValueError as err:
        placeholder = image_token_id(model)
        held = int((input_ids == placeholder).sum())
        features = visual_features(model, model_inputs)
        if features == held:  # not a placeholder mismatch
            raise
        given = f"pixel_values gives {features} visual features" if features is not None else \
            f"pixel_values gives another number of visual features ({str(err).splitlines()[0]})"
        raise ValueError(f"input_ids holds {held} image placeholder tokens (id {placeholder}) but {given}: the "
                         "prompt needs one placeholder per feature, as the model's processor writes them") from err


def visual_features(model: PreTrainedModel, model_inputs: dict) -> int | None:
    """How many visual features the images give (so how many placeholders the prompt
    needs), or None where the model cannot say. Only for error messages: it runs the
    vision tower again."""
    getter = getattr(model, "get_image_features", None)
    if getter is None:
        return None
    accepted = inspect.signature(getter).parameters
    try:
        with torch.no_grad():
            pooled = getter(**{k: v for k, v in model_inputs.items() if k in accepted}, return_dict=True).pooler_output
        return sum(int(features.reshape(-1, features.shape[-1]).shape[0]) for features in pooled)
    except (TypeError, ValueError, RuntimeError, AttributeError):
        return None


# ---- images and text -> the model's inputs (what hasten.load / Engine / --image use) ----------
def read_images(images: list) -> list:
    """Each of ``images`` (a path, or an image already read: a PIL image or an array)
    as the model's processor takes it; a file that cannot be read is a ValueError naming
    it and its index."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(images, (list, tuple)):
        raise TypeError(f"images must be a list of image paths or images, got {type(images).__name__}")
    if not images:
        raise ValueError("images is an empty list: give at least one image, or none at all (images=None)")
    read = []
    for i, image in enumerate(images):
        if not isinstance(image, (str, os.PathLike)):
            read.append(image)
            continue
        try:
            with Image.open(image) as opened:
                read.append(opened.convert("RGB"))  # loads the pixels now, while the file is open
        except (OSError, UnidentifiedImageError) as err:
            why = getattr(err, "strerror", None) or str(err).splitlines()[0]
            raise ValueError(f"images[{i}] {os.fspath(image)!r} could not be read as an image: {why}") from None
    return read


def processor_inputs(processor, text: str, images: list) -> tuple[torch.Tensor, dict]:
    """``text`` and ``images`` through the model's processor: the prompt's ids [1, T], its
    image placeholders written out, and the other tensors (``pixel_values``, ...) to pass to
    ``hasten.generate`` by keyword. A text without the processor's image token gets one
    per image in front of it, each on its own line."""
    images = read_images(images)
    token = getattr(processor, "image_token", None)
    if token is None:
        raise ValueError(f"{type(processor).__name__} names no image token, so hasten cannot place the images "
                         "in the prompt")
    if token not in text:
        text = "".join(f"{token}\n" for _ in images) + text
    encoded = processor(text=text, images=images, return_tensors="pt")
    model_inputs = {key: value for key, value in encoded.items()
                    if key not in ("input_ids", "attention_mask") and isinstance(value, torch.Tensor)}
    return encoded["input_ids"], model_inputs
