"""Vision-language targets: image + text prefill, then text decoding as any causal LM.

A vision-language model (LLaVA, Idefics3/SmolVLM, Qwen2-VL, Gemma 3) reads its images once:
the prompt holds one *placeholder* token per visual feature, and the prefill forward (given
``pixel_values`` and whatever else the model's processor returned) writes the vision
tower's projected features at those positions. After the prefill the cache holds image and
text alike, and every later block is text only, so verification (chains, trees, the 4D
mask, positions) is the causal LM's, unchanged. Drafters read ``ctx.tokens``, the prompt's
ids with its placeholders, so training-free drafters need nothing new.

Two families need more than ``pixel_values`` in the prefill, and nothing after it:

* Qwen2-VL / Qwen2.5-VL place tokens with 3D M-RoPE: an image takes fewer positions than
  it has tokens, so text after it sits at ``cache position + rope delta`` (delta <= 0) on
  all three axes. RoPE attention depends on position differences only, so hasten shifts
  the whole prompt's 3D positions by ``-delta``: text after the prompt then sits at its
  cache position, and every later block (chains, trees, hybrid tree attention) keeps
  the causal LM's positions. The positions come from the model's own ``get_rope_index``
  over the processor's ``mm_token_type_ids`` (which marks the placeholders).
* Gemma 3 lets the tokens of one image see each other both ways during the prefill (its
  ``token_type_ids`` mark them); every later block is causal text, which it builds itself
  when given no ``token_type_ids``, as Hugging Face ``generate`` does after its prefill.

What differs between families sits in :data:`FAMILIES`; a family whose text positions or
masks are not known to be those above (PaliGemma's bidirectional text prefix, Qwen3-VL,
...) is refused by name rather than decoded wrongly.
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
    type_ids: str | None = None  # the processor's per-token type tensor [1, T] (1: image placeholder), if read
    required: tuple[str, ...] = ()  # other processor outputs the prefill cannot do without
    mrope: bool = False  # 3D M-RoPE positions from the model's get_rope_index (Qwen2-VL)

    @property
    def pixel_layout(self) -> str:
        return ", ".join(self.pixel_dims)

    @property
    def batched(self) -> bool:
        """Whether pixel_values' first dim counts prompts (it must then be 1)."""
        return self.pixel_dims[0] == "batch"


_QWEN_VL = VisionFamily(("patches", "features"), type_ids="mm_token_type_ids", required=("image_grid_thw",),
                        mrope=True)

# model_type -> family. Each one here is tested for greedy equality with Hugging Face generate.
FAMILIES = {
    "llava": VisionFamily(("images", "channels", "height", "width")),
    "idefics3": VisionFamily(("batch", "images", "channels", "height", "width")),
    "smolvlm": VisionFamily(("batch", "images", "channels", "height", "width")),
    "qwen2_vl": _QWEN_VL,
    "qwen2_5_vl": _QWEN_VL,
    "gemma3": VisionFamily(("images", "channels", "height", "width"), type_ids="token_type_ids"),
}

# Keywords of a model's forward that the decode loop sets itself; a caller passing one
# would fight the loop over the cache, positions or mask.
LOOP_OWNED = frozenset({
    "input_ids", "inputs_embeds", "attention_mask", "position_ids", "past_key_values", "cache", "use_cache", "cache_position",
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
    _check_family_inputs(model, family, input_ids, model_inputs, placeholder)


def _check_family_inputs(model: PreTrainedModel, family: VisionFamily, input_ids: torch.Tensor, model_inputs: dict,
                         placeholder: int) -> None:
    """The processor outputs a family's prefill reads besides pixel_values: present, and the
    type ids marking exactly the placeholders of input_ids."""
    kind = type(model).__name__
    for key in family.required:
        if key not in model_inputs:
            raise ValueError(f"{kind} needs {key} with pixel_values (its processor returns it): without it the "
                             "images cannot be read")
    if family.type_ids is None:
        return
    why = "the 3D positions of its tokens" if family.mrope else "which tokens see each other both ways in the prefill"
    types = model_inputs.get(family.type_ids)
    if types is None:
        raise ValueError(f"{kind} needs {family.type_ids} with pixel_values, as its processor returns it: it marks "
                         f"the image placeholders, from which the model takes {why}")
    if types.shape != input_ids.shape:
        raise ValueError(f"{family.type_ids} must have input_ids' shape {list(input_ids.shape)}, got "
                         f"{list(types.shape)}")
    if not torch.equal(types.to(input_ids.device) == 1, input_ids == placeholder):
        raise ValueError(f"{family.type_ids} must be 1 exactly at input_ids' image placeholder tokens (id "
                         f"{placeholder}); build both with the model's processor")


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
    """``model_inputs`` on the model's device, floating-point ones in its dtype, as the
    prefill takes them: the prompt's every token but the last (see ModelAdapter.start), so
    per-token tensors lose their last column, and a Qwen2-VL's 3D positions, shifted so that
    text after the prompt sits at its cache position (see the module's docstring)."""
    moved = {}
    for key, value in model_inputs.items():
        value = value.to(model.device)
        moved[key] = value.to(model.dtype) if value.is_floating_point() else value
    family = FAMILIES.get(model.config.model_type)
    if family is None or family.type_ids is None:
        return moved
    types = moved[family.type_ids]  # [1, T]
    moved[family.type_ids] = types[:, :-1]
    if family.mrope:
        moved["position_ids"] = shifted_mrope_positions(model, types, moved)[:, :, :-1]  # [3, 1, T - 1]
    return moved


def shifted_mrope_positions(model: PreTrainedModel, types: torch.Tensor, model_inputs: dict) -> torch.Tensor:
    """The prompt's 3D M-RoPE positions [3, 1, T] from the model's own get_rope_index, minus
    its rope delta, so that the text after the prompt sits at its cache position."""
    rope_index = model.model.get_rope_index
    accepted = inspect.signature(rope_index).parameters
    grids = {key: value for key, value in model_inputs.items()
             if key in accepted and key not in ("input_ids", "mm_token_type_ids", "attention_mask")}
    # get_rope_index reads the token kinds from mm_token_type_ids; of input_ids only the shape
    shape_only = torch.zeros_like(types, dtype=torch.long)  # [1, T]
    positions, delta = rope_index(shape_only, mm_token_type_ids=types, **grids)  # [3, 1, T], [1, 1]
    return positions - delta.to(positions.device)


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


# ---- chats with images ------------------------------------------------------------------------
def check_messages(messages, entries_ok: bool) -> None:
    """A chat's shape, the one check of it: a non-empty list of dicts with a non-empty str
    'role' and a 'content' that is a str or, where ``entries_ok`` (a chat with images), a
    list (whose entries :func:`chat_images` reads); a ValueError naming the message."""
    content = "a str or a list of text and image entries" if entries_ok else "a str"
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': str, 'content': {content}}} dicts, "
                         f"got {messages!r:.80}")
    kinds = (str, list) if entries_ok else (str,)
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and message["role"]
                and isinstance(message.get("content"), kinds)):
            raise ValueError(f"messages[{i}] must be a dict with a str 'role' and a 'content' that is {content}, "
                             f"got {message!r:.80}")


def chat_images(messages: list, images: list | None) -> tuple[list[dict], list]:
    """The chat's messages with every image entry bare (``{"type": "image"}``: the processor's
    chat template writes the image token there), and the chat's images in order: an entry's
    own ``"image"`` (a path or an image), else the next of ``images``. A content is a str or
    a list of ``{"type": "text", "text": str}`` and ``{"type": "image"}`` entries; anything
    else is a ValueError naming the message and entry."""
    if images is not None and not isinstance(images, (list, tuple)):
        raise TypeError(f"images must be a list of image paths or images, got {type(images).__name__}")
    check_messages(messages, entries_ok=True)
    given = list(images) if images is not None else []
    bare, found, taken = [], [], 0
    for i, message in enumerate(messages):
        content = message["content"]
        if isinstance(content, str):
            bare.append(message)
            continue
        entries = []
        for j, entry in enumerate(content):
            kind = entry.get("type") if isinstance(entry, dict) else None
            if kind == "text" and isinstance(entry.get("text"), str):
                entries.append({"type": "text", "text": entry["text"]})
            elif kind == "image":
                if entry.get("image") is not None:
                    found.append(entry["image"])
                elif taken < len(given):
                    found.append(given[taken])
                    taken += 1
                else:
                    raise ValueError(f"messages[{i}]['content'][{j}] is an image entry with no 'image' of its own "
                                     f"and images gives only {len(given)}: give one image per bare image entry")
                entries.append({"type": "image"})
            else:
                raise ValueError(f"messages[{i}]['content'][{j}] must be {{'type': 'text', 'text': str}} or "
                                 f"{{'type': 'image'}}, got {entry!r:.80}")
        bare.append({**message, "content": entries})
    if taken < len(given):
        raise ValueError(f"images gives {len(given)} image(s) but the messages hold {taken} bare image entries "
                         "({'type': 'image'}) to place them: add one per image to a message's content")
    return bare, found


def chat_inputs(processor, messages: list, images: list | None) -> tuple[torch.Tensor, dict]:
    """A chat with images through the processor's chat template (the assistant's turn
    opened), as Hugging Face's ``processor.apply_chat_template`` tokenizes it: the prompt's
    ids [1, T], its image placeholders written out, and the other tensors for the prefill."""
    from jinja2.exceptions import TemplateError  # transformers' chat templates are jinja

    bare, found = chat_images(messages, images)
    if not found:
        raise ValueError("a chat with images needs at least one image entry ({'type': 'image'}) in its messages")
    if not getattr(processor, "chat_template", None):
        raise ValueError(f"{type(processor).__name__} has no chat template, so it cannot format chat messages "
                         "with images: send plain text with the images instead (without --chat)")
    try:
        encoded = processor.apply_chat_template(bare, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                return_tensors="pt", processor_kwargs={"images": read_images(found)})
    except TemplateError as err:  # the template's own check, e.g. "roles must alternate"
        raise ValueError(f"the chat template refused these messages: {err}") from err
    model_inputs = {key: value for key, value in encoded.items()
                    if key not in ("input_ids", "attention_mask") and isinstance(value, torch.Tensor)}
    return encoded["input_ids"], model_inputs
