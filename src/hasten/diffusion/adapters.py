"""Where the cacheable pieces of a model are: its transformer blocks and their attention / feed-forward parts.

A *unit* is one module whose forward the cache may skip. At ``granularity="block"`` the units are
whole transformer blocks; at ``"submodule"`` they are the attention and feed-forward modules inside
each block (the block's own norms, gates and residual additions still run).

Model differences live here and nowhere else: a table maps a model class to the attributes holding
its block lists, and a block class to its sub-modules and to the inputs its outputs are residuals
of. Anything not in the tables gets the generic rule (every ``nn.ModuleList`` of two or more
modules of one class), or the caller passes ``blocks=`` explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from torch import nn

Inputs = Callable[[tuple, dict], list]  # (args, kwargs) of a unit's forward -> tensors aligned with its outputs

GRANULARITIES = ("block", "submodule")


@dataclass(frozen=True, eq=False)
class Unit:
    """One cacheable module. ``index`` is its position in forward order; ``block`` its block's."""

    name: str
    module: nn.Module
    kind: str  # "block" | "attn" | "ff"
    index: int
    block: int
    inputs: Inputs | None  # None: the outputs are cached as they are, not as residuals


def _first_input(args: tuple, kwargs: dict) -> list:
    """The block's hidden states: first positional argument, or a usual keyword."""
    if args:
        return [args[0]]
    for key in ("hidden_states", "x", "sample", "input"):
        if key in kwargs:
            return [kwargs[key]]
    return []


def _flux_inputs(args: tuple, kwargs: dict) -> list:
    """Flux blocks take (hidden_states, encoder_hidden_states) and return them in the other order."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    context = args[1] if len(args) > 1 else kwargs.get("encoder_hidden_states")
    return [context, hidden]


@dataclass(frozen=True)
class BlockSpec:
    submodules: tuple[tuple[str, str], ...]  # (attribute, kind) in forward order
    inputs: Inputs = _first_input


BLOCKS: dict[str, BlockSpec] = {
    # diffusers' DiT and PixArt blocks; attn2 is absent (None) in DiT
    "BasicTransformerBlock": BlockSpec((("attn1", "attn"), ("attn2", "attn"), ("ff", "ff"))),
    "FluxTransformerBlock": BlockSpec((("attn", "attn"), ("ff", "ff"), ("ff_context", "ff")), _flux_inputs),
    # proj_mlp is the feed-forward branch (its activation is cheap); proj_out mixes both branches
    "FluxSingleTransformerBlock": BlockSpec((("attn", "attn"), ("proj_mlp", "ff")), _flux_inputs),
}

MODELS: dict[str, tuple[str, ...]] = {
    "DiTTransformer2DModel": ("transformer_blocks",),
    "PixArtTransformer2DModel": ("transformer_blocks",),
    "FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
}

_ATTN_WORDS = ("attn", "attention")
_FF_WORDS = ("ff", "ffn", "mlp", "feed_forward", "feedforward")


class NoBlocksFound(ValueError):
    pass


def _homogeneous_lists(model: nn.Module) -> list[nn.ModuleList]:
    """ModuleLists of >= 2 modules of one class holding parameters, outermost only, in registration order."""
    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(m) for m in module}) != 1 or not any(True for _ in module.parameters()):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue  # a list inside a block of a list already found
        found.append((name, module))
    return [lst for _, lst in found]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks in forward order (registration order for the generic rule)."""
    attrs = MODELS.get(type(model).__name__)
    if attrs is not None:
        return [block for attr in attrs for block in getattr(model, attr)]
    lists = _homogeneous_lists(model)
    if not lists:
        raise NoBlocksFound(
            f"no list of transformer blocks found in {type(model).__name__}; pass them explicitly, "
            "e.g. enable_cache(model, policy, blocks=model.my_blocks)"
        )
    return [block for lst in lists for block in lst]


def _submodules(block: nn.Module) -> list[tuple[str, nn.Module, str]]:
    spec = BLOCKS.get(type(block).__name__)
    if spec is not None:
        pairs = [(attr, kind) for attr, kind in spec.submodules]
    else:
        pairs = []
        for attr, _ in block.named_children():
            low = attr.lower()
            if any(word in low for word in _ATTN_WORDS):
                pairs.append((attr, "attn"))
            elif low in _FF_WORDS or low.startswith(("ff", "mlp")):
                pairs.append((attr, "ff"))
    return [(attr, getattr(block, attr), kind) for attr, kind in pairs if getattr(block, attr, None) is not None]


def find_units(model: nn.Module, granularity: str, blocks: Sequence[nn.Module] | None = None) -> list[Unit]:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    blocks = list(find_blocks(model) if blocks is None else blocks)
    if not blocks or not all(isinstance(b, nn.Module) for b in blocks):
        raise NoBlocksFound("blocks= must be a non-empty list (or nn.ModuleList) of modules, e.g. blocks=model.my_blocks")
    names = {id(m): n for n, m in model.named_modules()}
    units: list[Unit] = []
    for block_index, block in enumerate(blocks):
        block_name = names.get(id(block), f"block{block_index}")
        if granularity == "block":
            spec = BLOCKS.get(type(block).__name__)
            inputs = spec.inputs if spec is not None else _first_input
            units.append(Unit(block_name, block, "block", len(units), block_index, inputs))
            continue
        subs = _submodules(block)
        if not subs:
            raise NoBlocksFound(
                f"block {block_name} ({type(block).__name__}) has no attention or feed-forward child "
                "that granularity='submodule' could cache; use granularity='block'"
            )
        for attr, module, kind in subs:
            units.append(Unit(f"{block_name}.{attr}", module, kind, len(units), block_index, None))
    return units
