"""eagle_vlm (EagleVLM / SpecVLM): the EAGLE drafter on vision-language targets, with the
elastic visual compressor.

Greedy output equals Hugging Face ``generate`` on tiny random LLaVA (CLIP and SigLIP towers)
and Idefics3 for every compressor branch and the gate; sampled output follows the exact law
of the first two tokens; the drafter reads the prompt at inference exactly as training lays it
out (same outputs); each branch keeps the inputs it says; the online scenes source and
``hasten train eagle_vlm`` produce weights the drafter loads.
"""
import json
import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

import hasten
from hasten.core.sampling import Sampling
from hasten.core.state import GrowingBuffer
from hasten.drafters.base import DraftContext, TargetView
from hasten.drafters.compress import BRANCHES, VisualCompressor, windows
from hasten.drafters.eagle_vlm import EagleVlm, EagleVlmLayer, drafter_inputs, image_runs
from hasten.drafters.nn import causal
from helpers import hf_greedy
from hasten.core.errors import HastenWarning
from test_verify_law import bound
from test_vlm import (
    FAMILIES, IMAGE, LAW_IMAGE, LAW_PROMPT, LAW_SAMPLES, LAW_SAMPLING, LAW_TARGET, exact_law, image_prompt, llava,
    pixels, tv,
)

NEW = 20
COMPRESSORS = ("elastic",) + BRANCHES


def scrambled_layer(model, seed=0) -> EagleVlmLayer:
    """A layer for ``model`` whose every weight is random (an untrained layer is the identity,
    which would leave the compressor and the gate untested)."""
    layer = EagleVlmLayer.for_target(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return layer.eval()


@pytest.fixture(scope="module")
def weights_of(tmp_path_factory):
    """model -> a directory holding scrambled eagle_vlm weights for it."""
    made = {}

    def make(model):
        if id(model) not in made:
            directory = tmp_path_factory.mktemp("eagle_vlm")
            scrambled_layer(model).save(directory)
            made[id(model)] = directory
        return str(made[id(model)])
    return make


@pytest.fixture(scope="module", params=["llava_clip", "llava_siglip", "idefics3"])
def setup(request):
    make, features, shape = FAMILIES[request.param]
    model = make()
    prompt, images = image_prompt(features), pixels(shape)
    return model, prompt, images, hf_greedy(model, prompt, NEW, pixel_values=images)


@pytest.mark.parametrize("compressor", COMPRESSORS)
def test_greedy_equality(setup, weights_of, compressor):
    model, prompt, images, reference = setup
    drafter = EagleVlm(weights=weights_of(model), compressor=compressor, depth=3, top_k=3, total_tokens=8)
    out = hasten.generate(model, prompt, pixel_values=images, drafter=drafter, max_new_tokens=NEW)
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.drafted_tokens > 0  # the drafter ran (and proposed trees) throughout


@pytest.fixture(scope="module", params=["qwen2_vl", "gemma3"])
def other_family(request):
    from test_vlm_families import FAMILIES as OTHER_FAMILIES

    make, inputs = OTHER_FAMILIES[request.param]
    model = make()
    prompt, model_inputs = inputs()
    return model, prompt, model_inputs, hf_greedy(model, prompt, NEW, **model_inputs)


@pytest.mark.parametrize("compressor", ["full", "pool", "elastic"])
def test_greedy_equality_on_qwen2_vl_and_gemma3(other_family, weights_of, compressor):
    """Images mid-prompt with 3D positions (Qwen2-VL) and bidirectional image blocks with
    scaled embeddings (Gemma 3): the drafter's own positions and inputs change nothing."""
    model, prompt, model_inputs, reference = other_family
    drafter = EagleVlm(weights=weights_of(model), compressor=compressor, depth=3, top_k=3, total_tokens=8)
    out = hasten.generate(model, prompt, **model_inputs, drafter=drafter, max_new_tokens=NEW)
    assert out.sequences.tolist() == reference.tolist()


def test_a_text_prompt_is_plain_eagle(weights_of):
    """No image: every pair is text, the drafter reads them all (no compression to do)."""
    model = llava("clip")
    prompt = torch.tensor([[1, 5, 9, 4, 5, 9, 4, 7]])
    reference = hf_greedy(model, prompt, NEW)
    drafter = EagleVlm(weights=weights_of(model), compressor="pool")
    assert hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW).sequences.tolist() == reference.tolist()


def test_sampling_follows_the_vlm_law(tmp_path):
    law = exact_law(LAW_IMAGE)
    layer = scrambled_layer(LAW_TARGET, seed=3)
    layer.save(tmp_path)
    drafter = EagleVlm(weights=str(tmp_path), compressor="elastic", depth=2, top_k=2, total_tokens=4)
    g = torch.Generator().manual_seed(99)
    counts = dict.fromkeys(law, 0)
    drafted_2 = accepted_2 = 0  # depth-2 drafts, and how many of them were accepted
    for _ in range(LAW_SAMPLES):
        out = hasten.generate(LAW_TARGET, LAW_PROMPT, pixel_values=LAW_IMAGE, drafter=drafter, max_new_tokens=3,
                              eos_token_id=[], temperature=LAW_SAMPLING.temperature, top_k=LAW_SAMPLING.top_k,
                              generator=g)
        counts[tuple(out.sequences[0, LAW_PROMPT.shape[1]:][:2].tolist())] += 1
        drafted_2 += sum(out.stats.drafted_at_depth[1:2])
        accepted_2 += sum(out.stats.accepted_at_depth[1:2])
    assert 0 < accepted_2 < drafted_2  # depth-2 drafts were both accepted and rejected
    distance, limit = tv(law, {k: c / LAW_SAMPLES for k, c in counts.items()}), bound(law, LAW_SAMPLES)
    assert distance < limit, f"TV {distance:.3f} >= bound {limit:.3f}"


# ---- the prompt as the drafter reads it --------------------------------------------------------------
def context_for(model, tokens, features, prompt_embeds):
    buffer = GrowingBuffer()
    buffer.extend(features)
    row = types.SimpleNamespace(model=model, prompt_embeds=prompt_embeds, vocab_size=model.config.get_text_config().vocab_size,
                                encoder_decoder=False, kv_readable=False)
    target = TargetView(row, EagleVlm.needs)
    return DraftContext(list(tokens), 4, Sampling(0.0), None, target, feature_buffer=buffer)


@pytest.mark.parametrize("branch", BRANCHES)
@pytest.mark.parametrize("image_first", [True, False], ids=["image-first", "text-first"])
def test_inference_reads_the_prompt_as_training_lays_it_out(branch, image_first, tmp_path):
    """The drafter's output after the prompt, and after more committed tokens (catch-up with
    the shift), equals the training path's over the whole sequence (compose, then the block)."""
    model = llava("clip")
    scrambled_layer(model, seed=1).save(tmp_path)
    layer = EagleVlmLayer.load(tmp_path)  # as the drafter reads it (saved in float16)
    text = [5, 9, 4, 7, 11]
    prompt = ([IMAGE] * 16 + text) if image_first else ([1, 3] + [IMAGE] * 16 + text)
    continuation = [8, 6, 12, 13]
    sequence = torch.tensor([prompt + continuation])
    with torch.no_grad():
        out = model(sequence, pixel_values=pixels((1, 3, 32, 32)), output_hidden_states=True)
    hidden, embeds = out.hidden_states[-1], out.hidden_states[0]  # [1, T, H], [1, T, E]
    is_image = (sequence[0] == IMAGE).tolist()

    def training_path(length: int) -> torch.Tensor:  # the block's output at the last pair of the first `length` tokens
        with torch.no_grad():
            x, runs = drafter_inputs(layer, hidden[:, :length - 1], embeds[:, :length], is_image[:length])
            composed = layer.compose(x, runs, branch)
            positions = torch.arange(composed.shape[1])[None]
            return layer.block(composed, positions, causal(composed.shape[1]))[0, -1]

    drafter = EagleVlm(weights=str(tmp_path), compressor=branch)
    ctx = context_for(model, prompt, hidden[0, :len(prompt) - 1], embeds[0, :len(prompt) - 1])
    ctx.state = drafter.begin(ctx)
    drafter.propose(ctx)
    assert ctx.state.branch == branch
    assert ctx.state.visual_tokens == 16
    assert ctx.state.visual_inputs == {"full": 16, "text": 0, "resample": 16}.get(branch, 4)
    torch.testing.assert_close(ctx.state.newest, training_path(len(prompt)), atol=1e-5, rtol=1e-4)
    ctx.tokens.extend(continuation)
    ctx.feature_buffer.extend(hidden[0, len(prompt) - 1 : len(prompt) - 1 + len(continuation)])
    drafter.propose(ctx)
    torch.testing.assert_close(ctx.state.newest, training_path(len(prompt) + len(continuation)), atol=1e-5, rtol=1e-4)


def test_the_gate_chooses_per_input(tmp_path):
    """With a gate that scores branches from the text alone, two prompts that differ in their
    text get different branches (the choice is per input, not fixed)."""
    model = llava("clip")
    layer = scrambled_layer(model, seed=2)
    drafter = EagleVlm(compressor="elastic")
    drafter.module = layer
    drafter.lm_head, drafter.embed = model.get_output_embeddings(), model.get_input_embeddings()
    x = torch.randn(8, 30, layer.config.hidden_size, generator=torch.Generator().manual_seed(0))
    choices = {drafter.choose(x[i : i + 1], [(0, 16)]) for i in range(8)}
    assert len(choices) > 1
    assert choices <= set(BRANCHES)


# ---- the compressor ---------------------------------------------------------------------------------------
def test_windows_of_a_grid_are_its_2x2_blocks():
    x = torch.arange(16.0).view(1, 16, 1)  # a 4 x 4 grid, value = index
    blocks = windows(x)[0, :, :, 0]  # [4, 4]
    assert blocks.tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]
    pooled = F.avg_pool2d(torch.arange(16.0).view(1, 1, 4, 4), 2).flatten()
    assert torch.equal(windows(x).mean(2)[0, :, 0], pooled)


def test_windows_of_other_runs_are_consecutive_fours():
    x = torch.arange(6.0).view(1, 6, 1)
    assert windows(x)[0, :, :, 0].tolist() == [[0, 1, 2, 3], [4, 5, 5, 5]]


@pytest.mark.parametrize("n", [16, 10])
@pytest.mark.parametrize("branch", BRANCHES)
def test_each_branch_keeps_what_it_says(branch, n):
    compressor = VisualCompressor(32, 1, queries=5)
    x = torch.randn(2, n, 32)
    out = compressor.compress(branch, x)
    assert out.shape == (2, compressor.kept(branch, n), 32)
    if branch == "conv":  # starts as the window mean
        torch.testing.assert_close(out, windows(x).mean(2))


def test_prune_keeps_the_best_scored_inputs_in_order():
    compressor = VisualCompressor(8, 1, queries=2)
    with torch.no_grad():
        compressor.score.weight.zero_()
        compressor.score.weight[0, 0] = 1.0  # score = first coordinate
        compressor.score.bias.zero_()
    x = torch.zeros(1, 8, 8)
    x[0, [6, 1], 0] = torch.tensor([5.0, 3.0])  # the two best: positions 1 and 6
    kept = compressor.compress("prune", x)
    assert kept[0, :, 0].tolist() == pytest.approx([3.0 * 2 * torch.sigmoid(torch.tensor(3.0)).item(),
                                                     5.0 * 2 * torch.sigmoid(torch.tensor(5.0)).item()])


def test_image_runs():
    assert image_runs([True, True, False, True, False, False, True]) == [(0, 2), (3, 4), (6, 7)]
    assert image_runs([False, False]) == []


def test_a_bad_compressor_name():
    with pytest.raises(ValueError, match="compressor must be one of"):
        EagleVlm(compressor="squeeze")


# ---- online distillation ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm_tiny():
    from hasten.loading import load_model, resolve_path

    return load_model("zoo:vlm-tiny"), resolve_path("zoo:vlm-tiny")


def test_the_scenes_source(vlm_tiny):
    from hasten.training.online import OnlineSettings, SceneStream
    from hasten.zoo.vlm_recipe import HELDOUT_SEEDS

    model, directory = vlm_tiny
    source = SceneStream(model, directory, OnlineSettings(eval_scenes=3))
    train_rows, held_out = source.split()
    assert len(train_rows) == HELDOUT_SEEDS and held_out.tolist() == [HELDOUT_SEEDS + i for i in range(3)]
    batch = source.batch(torch.tensor([4, 7]), model)
    again = source.batch(torch.tensor([4, 7]), model)
    assert torch.equal(batch.ids, again.ids) and torch.equal(batch.hidden, again.hidden)  # seeds decide all
    image = batch.ids == model.config.image_token_id
    assert int(image[0].sum()) == model.config.image_seq_length
    token_embeds = model.get_input_embeddings()(batch.ids)
    assert not torch.allclose(batch.embeds[image], token_embeds[image])  # visual features, not placeholders
    torch.testing.assert_close(batch.embeds[~image], token_embeds[~image])
    assert batch.label_mask.any(1).all() and not (batch.label_mask & image).any()


def test_hasten_train_eagle_vlm(vlm_tiny, tmp_path):
    """Two steps of online distillation through the CLI write weights the drafter loads, and
    decoding with them stays greedy-identical."""
    from hasten.cli import main
    from hasten.models.vlm import processor_inputs
    from hasten.zoo import scenes
    from transformers import AutoProcessor

    model, directory = vlm_tiny
    out = tmp_path / "eagle_vlm"
    code = main(["train", "eagle_vlm", "--model", "zoo:vlm-tiny", "--out", str(out), "--steps", "2",
                 "--batch-size", "2", "--eval-scenes", "2", "--warmup-steps", "1", "--threads", "1"])
    assert code in (0, None)
    assert (out / "eagle_vlm.json").is_file() and (out / "training.json").is_file()
    ids, inputs = processor_inputs(AutoProcessor.from_pretrained(directory), "Describe the image.",
                                   [scenes.make_scene(5).image()])
    reference = hasten.generate(model, ids, max_new_tokens=24, **inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HastenWarning)  # the weights are found: no "untrained" warning
        drafted = hasten.generate(model, ids, drafter=EagleVlm(weights=str(out)), max_new_tokens=24, **inputs)
    assert drafted.sequences.tolist() == reference.sequences.tolist()
    assert drafted.stats.drafted_tokens > 0
    report = json.loads((out / "training.json").read_text())
    assert report["distill"]["online"] and report["steps"] == 2 and math.isfinite(report["eval"]["loss"])


def test_the_shipped_drafter_for_vlm_tiny(vlm_tiny):
    """zoo:vlm-tiny ships eagle_vlm weights beside it: found without a warning, identical
    output, and on a held-out caption it drafts well (several tokens accepted per forward)."""
    from hasten.bench.vlm import items
    from hasten.models.vlm import processor_inputs
    from hasten.zoo import scenes
    from transformers import AutoProcessor

    model, directory = vlm_tiny
    task, seed, line = items(1)[0]
    assert task == "caption"
    ids, inputs = processor_inputs(AutoProcessor.from_pretrained(directory), line, [scenes.make_scene(seed).image()])
    reference = hasten.generate(model, ids, max_new_tokens=48, **inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HastenWarning)
        out = hasten.generate(model, ids, drafter=EagleVlm(), max_new_tokens=48, draft_size="fixed", **inputs)  # tau at the drafter's depth
    assert out.sequences.tolist() == reference.sequences.tolist()
    assert out.stats.mean_accepted > 3


def test_hasten_train_eagle_vlm_on_a_text_model(tmp_path, capsys):
    from hasten.cli import main

    code = main(["train", "eagle_vlm", "--model", "zoo:code-tiny", "--out", str(tmp_path / "out"), "--steps", "1"])
    assert code == 2
    assert "needs a vision-language target" in capsys.readouterr().err
