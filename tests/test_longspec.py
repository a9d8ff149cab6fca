"""LongSpec (drafters/longspec.py): greedy output equals Hugging Face greedy generate on
every tiny architecture with a rotary KV cache, with prompts longer than the drafter's
window, through the masked and the hybrid tree attention; sampled output keeps the
target's law with trees 3 deep; the drafter's queries are rotated exactly as the target's
cached keys; its windowed cache gives what one full pass gives; its memory does not grow
with the context; training lowers the loss and its weights are found beside the target."""
import math
from dataclasses import replace
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

import hasten
from hasten.drafters import create
from hasten.drafters.longspec import (
    LongSpec, LongSpecLayer, LongSpecTraining, LongSpecTrainOptions, TargetRotary, apply_rotary,
)
from hasten.training.trainer import TrainSettings, evaluate, train
from helpers import distill_tiny, hf_greedy, repetitive_prompt, tiny_model
from hasten.core.errors import HastenWarning
from hasten.models.compat import cache_argument
from test_gemma3 import tiny_gemma3
from test_sampling_distribution import DEEP_LAW_SAMPLING, TARGET, deep_tv

ROTARY_ARCHS = ["gpt_neox", "llama", "mistral", "phi3", "qwen2"]  # gpt_neox: partial rotary
WINDOW = 8
PROMPT_LEN = 48  # six windows: the window slides during the prompt's catch-up and while decoding
NEW = 24
LAW_SAMPLES = 800  # fewer than the suite's deep law tests (1500): the bound widens to match


class WatchedLongSpec(LongSpec):
    """Keeps the context of its last proposal, to look at the generation's state."""

    def draft(self, ctx):
        self.last = ctx
        return super().draft(ctx)


class RecordingLongSpec(LongSpec):
    """Keeps every level's draft log-probs of its proposals (root first)."""

    outputs: list

    def draft(self, ctx):
        self.outputs = []
        return super().draft(ctx)

    def _run(self, *args):
        self.outputs.append(super()._run(*args))
        return self.outputs[-1]


def untrained(**settings) -> LongSpec:
    return LongSpec(window=WINDOW, **settings)


def quietly(function, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no longspec weights found": untrained on purpose
        return function(*args, **kwargs)


# ---- greedy equality -------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["mask", "hybrid"])
@pytest.mark.parametrize("arch", ROTARY_ARCHS)
def test_greedy_output_is_the_targets(arch, attention):
    model = tiny_model(arch)
    prompt = repetitive_prompt(PROMPT_LEN, seed=1)
    drafter = WatchedLongSpec(window=WINDOW, depth=4, top_k=3, total_tokens=10)
    out = quietly(hasten.generate, model, prompt, drafter=drafter, max_new_tokens=NEW, tree_attention=attention)
    assert out.sequences.tolist() == hf_greedy(model, prompt, NEW).tolist()
    assert out.stats.drafted_tokens > 0
    assert drafter.last.state.cache.committed <= 2 * WINDOW


def test_one_token_prompt():
    """Nothing is cached by the target before the first step: the first draft is empty."""
    model = tiny_model("llama")
    prompt = torch.tensor([[5]])
    out = quietly(hasten.generate, model, prompt, drafter=untrained(), max_new_tokens=12)
    assert out.sequences.tolist() == hf_greedy(model, prompt, 12).tolist()


def test_gemma3_local_and_global_layers_stay_exact():
    """Gemma 3's rotary module serves local and global layers: the last layer's kind is used."""
    model = tiny_gemma3()
    prompt = repetitive_prompt(40, seed=1)
    out = quietly(hasten.generate, model, prompt, drafter=untrained(), max_new_tokens=16)
    assert out.sequences.tolist() == hf_greedy(model, prompt, 16).tolist()


def test_refuses_targets_without_rotary_keys():
    with pytest.raises(ValueError, match="rotary positions"):
        quietly(hasten.generate, tiny_model("gpt2"), repetitive_prompt(12), drafter=untrained(), max_new_tokens=4)


def test_refuses_encoder_decoders():
    with pytest.raises(ValueError, match="encoder-decoder"):
        quietly(hasten.generate, tiny_model("t5"), repetitive_prompt(12), drafter=untrained(), max_new_tokens=4)


def test_refuses_batched_rows():
    model = tiny_model("llama")
    prompts = [repetitive_prompt(12, seed=1)[0], repetitive_prompt(14, seed=2)[0]]
    with pytest.raises(ValueError, match="one at a time"):
        quietly(hasten.generate, model, prompts, drafter=untrained(), max_new_tokens=4)


# ---- what the drafter reads of the target ------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("offset", [0, 300])
def test_queries_rotate_like_the_cached_keys(arch, offset):
    """The target's last-layer keys before rotation, rotated by the drafter's rule at the
    same (anchor-offset) positions, are exactly the keys the target cached."""
    model = tiny_model(arch)
    ids = repetitive_prompt(20, seed=2)
    positions = torch.arange(20)[None]
    positions[:, 2:] += offset  # two anchors, the rest shifted, as in training
    cache = DynamicCache()
    with torch.no_grad():
        hidden = model(ids, position_ids=positions, **cache_argument(model, cache), use_cache=True,
                       output_hidden_states=True).hidden_states[-2]  # [1, T, H] the last layer's input
        layer = model.model.layers[-1]
        keys = layer.self_attn.k_proj(layer.input_layernorm(hidden)).view(1, 20, -1, layer.self_attn.head_dim)
        rotated = apply_rotary(keys.transpose(1, 2), *TargetRotary(model)(hidden, positions))
    torch.testing.assert_close(rotated, cache.layers[-1].keys, rtol=1e-5, atol=1e-5)


def full_pass_logp(drafter: LongSpec, model, tokens: list[int], path: list[int] = ()) -> torch.Tensor:
    """[1 + len(path), V] the drafts after ``tokens`` (the root) and after each prefix of a
    draft ``path``, computed as training does: one pass over the whole sequence with a
    window mask; the target has cached all tokens but the root, and a position sees the
    entries before it, the draft's positions all of them."""
    module, cached = drafter.module, len(tokens) - 1
    sequence = list(tokens) + list(path)
    length = len(sequence)
    ids, positions = torch.tensor([sequence]), torch.arange(length)[None]
    cache = DynamicCache()
    model(ids[:, :cached], **cache_argument(model, cache), use_cache=True)
    target_kv = cache.layers[-1].keys, cache.layers[-1].values
    x, own = module.own_kv(model.get_input_embeddings()(ids), positions)
    index = torch.arange(length)
    behind = index[:, None] - index[None, :]
    own_visible = (behind >= 0) & (behind < module.config.window)
    cross_visible = torch.arange(cached)[None, :] < index.clamp(max=cached)[:, None]  # [T, cached]
    cross_visible[0, 0] = True  # the first row sees nothing yet; it is not compared
    out = module(x, positions, own, own_visible[None], target_kv, cross_visible[None],
                 TargetRotary(model)(target_kv[0], positions))
    return model.get_output_embeddings()(out[0, cached:]).float().log_softmax(-1)


def opinionated(model, path, window: int) -> str:
    """A LongSpec layer for ``model`` with random weights large enough that it attends and
    drafts (an untrained one passes its input through), saved in ``path``."""
    torch.manual_seed(3)
    module = LongSpecLayer.for_target(model, window=window)
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.ndim == 2:
                torch.nn.init.normal_(parameter, std=1.0 / math.sqrt(parameter.shape[1]))
    module.save(path)
    return str(path)


@torch.no_grad()
def test_window_cache_gives_what_one_full_pass_gives(tmp_path):
    """After a generation whose window slid many times, the drafter's cached rows give the
    root's draft exactly as one pass over the whole sequence (the training path) does, and
    so do the tree's scratch rows deeper down (a chain: top_k=1, each level its argmax)."""
    model = tiny_model("llama")
    weights = opinionated(model, tmp_path, WINDOW)
    drafter = WatchedLongSpec(weights=weights, depth=3, top_k=2, total_tokens=5)
    out = hasten.generate(model, repetitive_prompt(PROMPT_LEN, seed=3), drafter=drafter, max_new_tokens=30)
    ctx = drafter.last
    assert ctx.tokens == out.sequences[0].tolist()  # the loop's list: grown since the last proposal
    torch.testing.assert_close(drafter.root_logp(ctx), full_pass_logp(drafter, model, ctx.tokens)[0],
                               rtol=1e-4, atol=1e-4)
    chain = RecordingLongSpec(weights=weights, depth=4, top_k=1, total_tokens=4)
    draft = chain.draft(replace(ctx, max_depth=4, state=chain.begin(ctx)))
    assert draft.tree.is_chain and len(draft) == 4
    full = full_pass_logp(chain, model, ctx.tokens, list(draft.tokens[:-1]))  # [4, V]
    torch.testing.assert_close(torch.cat(chain.outputs), full, rtol=1e-4, atol=1e-4)
    assert full.argmax(-1).tolist() == list(draft.tokens)


def test_drafter_memory_does_not_grow_with_the_context():
    model = tiny_model("llama")
    drafter = WatchedLongSpec(window=WINDOW)
    sizes = []
    for length in (40, 200):
        quietly(hasten.generate, model, repetitive_prompt(length, seed=5), drafter=drafter, max_new_tokens=8)
        sizes.append(drafter.cache_bytes(drafter.last.state))
    assert sizes[0] == sizes[1] > 0


# ---- sampling --------------------------------------------------------------------------------------------
def test_sampled_continuations_follow_the_target_with_trees_3_deep(tmp_path):
    drafter = LongSpec(weights=opinionated(TARGET, tmp_path, 4), depth=3, top_k=2, total_tokens=6)
    tv, limit = deep_tv(drafter, DEEP_LAW_SAMPLING, samples=LAW_SAMPLES)
    assert tv < limit, f"TV {tv:.3f} >= bound {limit:.3f}"


# ---- training ---------------------------------------------------------------------------------------------
def peaky(model):
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # a random tiny model is nearly uniform: give the drafter a law to learn
    return model


def test_training_lowers_the_loss_and_the_weights_are_found_beside_the_target(tmp_path):
    model = peaky(tiny_model("llama"))
    data = distill_tiny(model, tmp_path / "work")
    options = LongSpecTrainOptions(window=4, max_lag=3, max_offset=400)
    training = LongSpecTraining(model, options)
    _, held_out = data.split()
    every_row = torch.arange(len(data))
    torch.manual_seed(0)
    before = evaluate(training, training.build(), data, every_row, 8, "cpu")
    result = train(training, data, TrainSettings(steps=30, lr=3e-3, warmup_steps=1, batch_size=4), tmp_path / "work",
                   progress=False)
    torch.manual_seed(0)  # the same anchors and offsets as before training
    after = evaluate(training, result.module, data, every_row, 8, "cpu")
    assert after["loss"] < 0.7 * before["loss"], (before, after)  # KL from the target's law
    assert {"lag1_top1", "lag2_top1", "lag3_top1"} <= set(after)

    # saved beside the target, found by create(), and still exact
    target_dir = tmp_path / "target"
    model.save_pretrained(target_dir)
    training.save(result.module, target_dir / "longspec", {"target": "test", **result.report})
    loaded = LongSpecLayer.load(target_dir / "longspec")
    assert loaded.config.window == 4 and loaded.config.target == "test"
    for name, tensor in result.module.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.half().float())
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompt = repetitive_prompt(20, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HastenWarning)  # an "untrained" warning would mean the weights were not found
        out = hasten.generate(target, prompt, drafter=create("longspec"), max_new_tokens=NEW)
    assert out.sequences.tolist() == hf_greedy(target, prompt, NEW).tolist()
