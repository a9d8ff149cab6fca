"""EasySpec: layer-parallel drafting with KV calibration (Wu, Gao, Li & Wu, *EasySpec:
Layer-Parallel Speculative Decoding for Efficient Multi-GPU Utilization*, 2025).

A draft model runs its layers one after another, so while it drafts, devices that the
target spreads over sit idle. EasySpec breaks that order inside *groups* of consecutive
layers: every layer's attention in a group reads the group's input instead of the previous
layer's output, so the group's attentions can run at once (on several devices, CUDA streams
or CPU threads). The result is a *fuzzy* forward: cheaper in latency, slightly off.

Merge rule (the paper's): only the attention sublayers run in parallel. Their outputs are
then added to the residual stream in layer order, and each layer's MLP runs on the stream
as it stands after that layer's attention output was added, exactly as in the sequential
model. With one layer per group this *is* the sequential model, so the fuzzy error comes
only from attention inputs that skipped their predecessors' updates. ``parallel_mlp=True``
also runs each member's MLP on the group's input (the member's whole layer is one parallel
branch and the branches' residual updates are summed): more parallel work, larger error;
docs/easyspec.md measures both.

KV calibration ("bonus calibration"): fuzzy passes write fuzzy keys and values. Before the
next proposal the draft cache is cut back to the last exactly computed position and the
tokens committed since (the accepted ones and the bonus token) go through one exact,
sequential forward. That forward also yields the first draft token, so calibration costs
one longer block, not an extra pass, and the first draft token is exactly the draft
model's. Every later draft token comes from a fuzzy pass, and its ``q`` is the softmax of
that fuzzy pass: the distribution the token was drawn from, so acceptance stays exact.

The draft is an unmodified Hugging Face model of the Llama family (pre-norm attention then
MLP per layer: Llama, Qwen2, Mistral, ...; Gemma's extra sublayer-output norms, per-kind
rotary tables and logit soft-capping too); its decoder layers are driven by hand. At
construction the hand-driven sequential forward is checked against the model's own
forward, so an architecture that computes something else is refused, not approximated.
"""
from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from ..core.settings import option
from ..models import cache as kv
from ..models.compat import cache_argument
from ..models.layers import UnsupportedArchitecture, attention_mask, decoder_layers, llama_family_parts, model_name
from .base import Draft, DraftContext, EMPTY_DRAFT, register
from .draft_model import DraftModel, DraftModelSettings, draft_chain

CONCURRENCY = ("serial", "threads", "streams")
Groups = tuple[tuple[int, ...], ...]


def _parse_groups(value) -> Groups | None:
    """``"0,1;2,3"`` (command line) or nested sequences -> ((0, 1), (2, 3))."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return tuple(tuple(int(i) for i in part.split(",")) for part in value.split(";"))
        except ValueError:
            raise ValueError(f"EasySpecSettings.groups must look like '0,1;2,3' (layers of a group joined by "
                             f"commas, groups by semicolons), got {value!r}") from None
    try:
        groups = tuple(tuple(group) for group in value)
    except TypeError:
        raise ValueError(f"EasySpecSettings.groups must be a sequence of layer-index sequences, "
                         f"got {value!r}") from None
    if not all(isinstance(i, int) and not isinstance(i, bool) for group in groups for i in group):
        raise ValueError(f"EasySpecSettings.groups must hold layer indices (ints), got {value!r}")
    return groups


def _parse_devices(value) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = tuple(part.strip() for part in value.split(",")) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(name, str) and name for name in names):
        raise ValueError(f"EasySpecSettings.devices must be device names such as 'cuda:0,cuda:1', got {value!r}")
    return names


def check_device(name: str) -> torch.device:
    """The device ``name`` stands for, or ValueError if this machine does not have it."""
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"EasySpecSettings.devices: {name!r} is not a device name ({err})") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ValueError(f"EasySpecSettings.devices: {name!r} does not exist here "
                             f"({count} CUDA device{'s' if count != 1 else ''} visible)")
        return torch.device("cuda", index)
    try:  # other backends (mps, xpu, ...): a device exists if it can hold a tensor
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as err:
        raise ValueError(f"EasySpecSettings.devices: {name!r} is not usable here ({err})") from None
    return device


@dataclass(frozen=True)
class EasySpecSettings(DraftModelSettings):
    group_size: int = option(2, "consecutive draft layers whose attentions run in parallel (the last group "
                                "may be shorter); ignored when groups is given")
    groups: Groups | None = option(None, "explicit layer groups covering every draft layer once, in order, "
                                         "e.g. '0,1;2,3'")
    concurrency: str = option("serial", "how a group's members run: serial (the reference), threads "
                                        "(a CPU thread each) or streams (a CUDA stream each)")
    devices: tuple[str, ...] | None = option(None, "devices a group's members are spread over, member j on "
                                                   "devices[j % len(devices)], e.g. 'cuda:0,cuda:1'; "
                                                   "unset: the draft model's device")
    parallel_mlp: bool = option(False, "also run each member's MLP on the group input (the paper keeps MLPs "
                                       "sequential)")

    def __post_init__(self) -> None:
        super().__post_init__()
        # groups and devices arrive as text from the command line (their hints are not scalars)
        object.__setattr__(self, "groups", _parse_groups(self.groups))
        object.__setattr__(self, "devices", _parse_devices(self.devices))
        if self.group_size < 1:
            raise ValueError(f"EasySpecSettings.group_size must be >= 1, got {self.group_size}")
        if self.groups is not None and (not self.groups or not all(self.groups)):
            raise ValueError(f"EasySpecSettings.groups must be non-empty groups of layers, got {self.groups}")
        if self.concurrency not in CONCURRENCY:
            raise ValueError(f"EasySpecSettings.concurrency must be one of {', '.join(CONCURRENCY)}, "
                             f"got {self.concurrency!r}")
        for name in self.devices or ():
            check_device(name)

    def layer_groups(self, num_layers: int) -> Groups:
        """The groups for a draft of ``num_layers`` layers (ValueError if ``groups`` does not
        list every layer exactly once, in order)."""
        if self.groups is None:
            return tuple(tuple(range(start, min(start + self.group_size, num_layers)))
                         for start in range(0, num_layers, self.group_size))
        if [i for group in self.groups for i in group] != list(range(num_layers)):
            text = ";".join(",".join(map(str, group)) for group in self.groups)
            raise ValueError(f"EasySpecSettings.groups {text!r} must list every layer of the draft "
                             f"(0..{num_layers - 1}) exactly once, in order")
        return self.groups


class LayerDriver:
    """Runs a Llama-family causal LM layer by hand over one KV cache, with its layers
    grouped: within a group every attention reads the group's input. Singleton groups give
    the model's own (exact) forward. Configuration and weights only: the cache is passed in."""

    def __init__(self, model: PreTrainedModel, groups: Groups, devices: tuple[torch.device, ...],
                 concurrency: str, parallel_mlp: bool):
        self.model, self.groups, self.parallel_mlp = model, groups, parallel_mlp
        try:
            self.parts = llama_family_parts(model)
        except UnsupportedArchitecture as err:
            raise UnsupportedArchitecture(f"easyspec drives the draft's decoder layers by hand: {err}") from None
        self.layers, self.sandwich, self.layer_types = self.parts.layers, self.parts.sandwich, self.parts.layer_types
        self.home = model.device
        self._place_attention(devices)
        width = max(len(group) for group in groups)
        self.concurrency = concurrency
        if concurrency == "streams":
            if any(self.place[i].type != "cuda" for i in self.place):
                raise ValueError(f"concurrency='streams' needs every group member on a CUDA device; the draft "
                                 f"{model_name(model)!r} is on {self.home} (set devices=cuda:0,... or use "
                                 f"'threads' or 'serial')")
            self.streams = [torch.cuda.Stream(device=devices[j % len(devices)] if devices else self.home)
                            for j in range(width)]
        self.pool = ThreadPoolExecutor(max_workers=width - 1) if concurrency == "threads" and width > 1 else None
        self._check_against_model()

    def _place_attention(self, devices: tuple[torch.device, ...]) -> None:
        """A layer keeps its place in every pass, exact or fuzzy, since its KV cache lives
        there: member j of a group runs on devices[j % len]; a layer away from the model's
        device gets a copy of its input norm and attention there."""
        self.place: dict[int, torch.device] = {}
        self.attention: dict[int, tuple[torch.nn.Module, ...]] = {}  # input norm, attention, output norm
        for group in self.groups:
            for member, index in enumerate(group):
                device = devices[member % len(devices)] if devices else self.home
                layer = self.layers[index]
                modules = (layer.input_layernorm, layer.self_attn,
                           layer.post_attention_layernorm if self.sandwich else torch.nn.Identity())
                if device != self.home:
                    modules = tuple(copy.deepcopy(m).to(device) for m in modules)
                self.place[index], self.attention[index] = device, modules

    # ---- one pass ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, cache: Cache, tokens: list[int], exact: bool) -> torch.Tensor:
        """Run ``tokens`` after the cached ones, writing their keys and values; returns the
        last position's logits [vocab] (float32). ``exact``: every layer in sequence."""
        hidden, inputs = self.start(cache, tokens)
        groups = tuple((i,) for i in range(len(self.layers))) if exact else self.groups
        for group in groups:
            hidden = self._group(group, hidden, inputs)
        return self.logits(hidden)

    def start(self, cache: Cache, tokens: list[int]) -> tuple[torch.Tensor, "PassInputs"]:
        """The embedded ``tokens`` ([1, Q, hidden]) and what every layer of their pass shares."""
        past = kv.length(cache)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.home)  # [1, Q]
        hidden = self.model.get_input_embeddings()(ids)  # [1, Q, hidden]
        positions = torch.arange(past, past + len(tokens), device=self.home)[None]  # [1, Q]
        rotary_emb = self.parts.rotary
        if self.parts.rotary_by_kind:  # one (cos, sin) per layer kind, each [1, Q, head_dim]
            rotary = {kind: rotary_emb(hidden, positions, kind) for kind in set(self.layer_types)}
        else:
            rotary = rotary_emb(hidden, positions)
        causal = torch.ones(len(tokens), past + len(tokens), dtype=torch.bool, device=self.home).tril(past)[None]
        key_positions = torch.arange(past + len(tokens), device=self.home)[None]  # [1, past + Q]
        masks = attention_mask(self.model, causal, positions, key_positions)  # [1, 1, Q, past + Q] or by layer kind
        return hidden, PassInputs(cache, rotary, masks, {})

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, Q, hidden] after the last layer -> the last position's logits [vocab] (float32)."""
        last = self.parts.final_norm(hidden[:, -1:])  # [1, 1, hidden]
        logits = self.model.get_output_embeddings()(last)[0, -1].float()  # [vocab]
        cap = self.parts.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _group(self, group: tuple[int, ...], hidden: torch.Tensor, inputs: "PassInputs") -> torch.Tensor:
        """One group: attentions on the group's input ``hidden`` [1, Q, hidden] at once, then
        the residual updates in layer order (the MLPs sequential unless ``parallel_mlp``)."""
        if self.parallel_mlp and len(group) > 1:
            deltas = self._run_members(group, hidden, inputs, with_mlp=True)
            return hidden + sum(deltas)
        attended = self._run_members(group, hidden, inputs, with_mlp=False)
        for index, update in zip(group, attended):
            hidden = hidden + update
            hidden = hidden + self.feed_forward(index, hidden)
        return hidden

    def member_update(self, index: int, hidden: torch.Tensor, inputs: "PassInputs",
                      with_mlp: bool = False) -> torch.Tensor:
        """Layer ``index``'s residual update from ``hidden`` (its attention's, plus its MLP's
        when ``with_mlp``), computed on the layer's device and returned on the model's."""
        with torch.no_grad():  # no_grad is per thread: worker threads need their own
            device = self.place[index]
            norm, attention, out_norm = self.attention[index]
            kind = self.layer_types[index]
            update, _ = attention(hidden_states=norm(hidden.to(device)),
                                  position_embeddings=inputs.rotary_for(kind, device),
                                  attention_mask=inputs.mask_for(kind, device), **cache_argument(attention, inputs.cache))
            update = out_norm(update).to(self.home)
            if with_mlp:
                update = update + self.feed_forward(index, hidden + update)
            return update

    def feed_forward(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        layer = self.layers[index]
        if self.sandwich:
            return layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
        return layer.mlp(layer.post_attention_layernorm(hidden))

    def _run_members(self, group, hidden, inputs, with_mlp: bool) -> list[torch.Tensor]:
        if len(group) == 1 or self.concurrency == "serial":
            return [self.member_update(i, hidden, inputs, with_mlp) for i in group]
        if self.concurrency == "threads":
            # the first member runs here while the pool runs the others; each writes its own cache layer
            futures = [self.pool.submit(self.member_update, i, hidden, inputs, with_mlp) for i in group[1:]]
            first = self.member_update(group[0], hidden, inputs, with_mlp)
            return [first, *(f.result() for f in futures)]
        return self._run_on_streams(group, hidden, inputs, with_mlp)

    def _run_on_streams(self, group, hidden, inputs, with_mlp: bool) -> list[torch.Tensor]:
        main = torch.cuda.current_stream(self.home)
        updates = []
        for stream, index in zip(self.streams, group):
            # every stream first waits for the work queued so far, so memory freed on the main
            # stream is never reused on a side stream while still being read
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                updates.append(self.member_update(index, hidden, inputs, with_mlp))
        for stream in self.streams[: len(group)]:
            main.wait_stream(stream)
        return updates

    def _check_against_model(self) -> None:
        """The hand-driven exact forward must reproduce the model's own logits."""
        probe = [i % self.model.config.get_text_config().vocab_size for i in (1, 5, 9, 13)]
        mine = self.forward(kv.new_cache(False), probe, exact=True)  # [vocab]
        with torch.no_grad():
            theirs = self.model(torch.tensor([probe], device=self.home), use_cache=False).logits[0, -1].float()
        tolerance = 1e-4 if self.model.dtype == torch.float32 else 2e-2
        if not torch.allclose(mine, theirs, rtol=tolerance, atol=tolerance * (1 + float(theirs.abs().max()))):
            raise UnsupportedArchitecture(
                f"easyspec drives the draft's decoder layers by hand (Llama family: pre-norm attention then MLP); "
                f"that does not reproduce {model_name(self.model)!r} ({type(self.model).__name__}), so it cannot "
                "be used as an easyspec draft")


@dataclass
class PassInputs:
    """What every member of one pass shares; masks are copied to each device once."""

    cache: Cache
    rotary: tuple[torch.Tensor, torch.Tensor] | dict[str, tuple[torch.Tensor, torch.Tensor]]  # by layer kind
    masks: torch.Tensor | dict[str, torch.Tensor]  # by layer kind
    moved: dict

    def mask_for(self, kind: str | None, device: torch.device) -> torch.Tensor:
        return self._on(("mask", kind, device), self.masks[kind] if isinstance(self.masks, dict) else self.masks,
                        device)

    def rotary_for(self, kind: str | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary[kind] if isinstance(self.rotary, dict) else self.rotary
        return self._on(("cos", kind, device), cos, device), self._on(("sin", kind, device), sin, device)

    def _on(self, key, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if tensor.device == device:
            return tensor
        if key not in self.moved:  # a race here only copies twice
            self.moved[key] = tensor.to(device)
        return self.moved[key]


@dataclass
class EasySpecState:
    """One generation's draft cache: its first ``exact`` entries came from exact forwards
    (committed tokens); anything after them was written by fuzzy passes and is replaced at
    the next proposal."""

    cache: Cache
    exact: int
    length: int  # current draft length (changes when adaptive)


@register
class EasySpec(DraftModel):
    """``draft_model`` with fuzzy (layer-parallel) passes after the first draft token."""

    name = "easyspec"
    Settings = EasySpecSettings
    encoder_decoder_ok = False

    def __init__(self, model: PreTrainedModel, settings: EasySpecSettings | None = None, **kwargs):
        if not isinstance(model, PreTrainedModel):  # its layers are driven by hand: a PyTorch draft only
            raise TypeError(f"easyspec drives its draft model's decoder layers and needs a transformers "
                            f"PreTrainedModel draft, got {type(model).__name__}; use draft_model for other drafts")
        super().__init__(model, settings, **kwargs)
        s = self.settings
        groups = s.layer_groups(len(decoder_layers(model)))
        devices = tuple(check_device(name) for name in s.devices) if s.devices else ()
        self.driver = LayerDriver(model, groups, devices, s.concurrency, s.parallel_mlp)

    def begin(self, ctx: DraftContext) -> EasySpecState:
        cache = kv.new_cache(False)
        if len(ctx.tokens) > 1:
            self.driver.forward(cache, ctx.tokens[:-1], exact=True)
        return EasySpecState(cache, len(ctx.tokens) - 1, self.settings.num_tokens)

    def propose(self, ctx: DraftContext) -> Draft:
        state = ctx.state
        count = min(state.length, ctx.max_depth)
        if count < 1:
            return EMPTY_DRAFT
        tokens = ctx.tokens
        # calibration: forget the fuzzy entries, then one exact forward over every token
        # committed since the last exact one (the root included), which drafts token 1
        kv.crop(state.cache, state.exact)
        block = tokens[state.exact:]
        drafted, q = draft_chain(lambda block, i: self.driver.forward(state.cache, block, exact=i == 0), block, count,
                                 ctx)
        state.exact = len(tokens)
        return Draft.chain(drafted, q)
