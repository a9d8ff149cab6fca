"""Vision-language families whose prefill needs more than pixel_values: Qwen2-VL and
Qwen2.5-VL (3D M-RoPE positions) and Gemma 3 (bidirectional attention inside each image).

On tiny random models built by hand: greedy output equals Hugging Face
``generate(input_ids, pixel_values=..., <the processor's other tensors>)`` token for token
with no drafter, the training-free drafters, scripted chains and trees (oracle, adversarial,
planted errors) on both tree attention paths; the checks show that the images, the 3D
positions and the bidirectional image attention each change the output (so equality means
they were read); missing or inconsistent processor outputs fail naming the argument.
"""
import pytest
import torch
import transformers as tf

import hasten
from hasten.drafters import Lookahead, PromptLookup
from helpers import ScriptedDrafter, TreeScriptedDrafter, assert_scripted_stats, hf_greedy

VOCAB = 96
IMAGE = VOCAB - 1  # the image placeholder token
VISION_START, VISION_END = VOCAB - 3, VOCAB - 4  # Qwen2-VL's brackets around an image; Gemma 3's boi/eoi
NEW = 20
DRAFT_LEN = 4
# no EOS: every comparison covers NEW tokens
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, vocab_size=VOCAB, bos_token_id=1, eos_token_id=None, pad_token_id=0)


def qwen_vl(version: str):
    """Patches of 8 x 8 pixels over 2 frames, merged 2 x 2: an image of grid (1, h, w) gives
    h * w / 4 features and takes max(h, w) / 2 positions on the text axis."""
    configs = {"2": (tf.Qwen2VLTextConfig, tf.Qwen2VLVisionConfig, tf.Qwen2VLConfig,
                     tf.Qwen2VLForConditionalGeneration),
               "2.5": (tf.Qwen2_5_VLTextConfig, tf.Qwen2_5_VLVisionConfig, tf.Qwen2_5_VLConfig,
                       tf.Qwen2_5_VLForConditionalGeneration)}
    text, vision, config, model = configs[version]
    # head_dim 8: 4 rotary frequencies, split 2/1/1 over the temporal, height and width axes
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
    tower = dict(depth=2, hidden_size=32, num_heads=4, patch_size=8, spatial_merge_size=2, temporal_patch_size=2)
    tower.update(dict(embed_dim=32) if version == "2" else dict(intermediate_size=64, out_hidden_size=32,
                                                                 fullatt_block_indexes=[1], window_size=16))
    torch.manual_seed(0)
    built = model(config(text_config=text(**TEXT, rope_parameters=rope), vision_config=vision(**tower),
                         image_token_id=IMAGE, video_token_id=VOCAB - 2, vision_start_token_id=VISION_START,
                         vision_end_token_id=VISION_END)).eval()
    with torch.no_grad():  # sharp attention, so that positions change the output (random init is near uniform)
        for layer in built.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(10)
            layer.self_attn.k_proj.weight.mul_(10)
    return built


def gemma3(window: int = 8):
    """A SigLIP tower of 4 x 4 patches pooled to 4 features per image; one sliding-window
    layer (a window shorter than the prompt) and one global layer."""
    text = tf.Gemma3TextConfig(**{**TEXT, "hidden_size": 32}, head_dim=8, query_pre_attn_scalar=8,
                               sliding_window=window, layer_types=["sliding_attention", "full_attention"])
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   image_size=32, patch_size=8)
    torch.manual_seed(0)
    built = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=IMAGE,
        boi_token_index=VISION_START, eoi_token_index=VISION_END)).eval()
    with torch.no_grad():  # the projector starts at zero (images would be ignored) and attention near uniform
        projection = built.model.multi_modal_projector.mm_input_projection_weight
        projection.copy_(torch.randn(projection.shape, generator=torch.Generator().manual_seed(0)) * 0.2)
        for layer in built.model.language_model.layers:
            layer.self_attn.q_norm.weight.fill_(9)  # Gemma's norms scale by 1 + weight: queries x 10
    return built


def prompt_with(image_features: list[int], seed: int = 1) -> torch.Tensor:
    """Text, each image's placeholders between its brackets, then text that repeats itself
    (for input-guided drafters)."""
    text = torch.randint(3, VISION_END, (10,), generator=torch.Generator().manual_seed(seed)).tolist()
    images = [[VISION_START, *[IMAGE] * n, VISION_END] for n in image_features]
    return torch.tensor([[1, *text[:3], *images[0], *text[3:5], *images[1], *text, *text]])


def qwen_inputs(seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Two images of different shapes (grids 1 x 4 x 4 and 1 x 4 x 8: 4 and 8 features), so
    their height and width positions differ."""
    grids = torch.tensor([[1, 4, 4], [1, 4, 8]])
    prompt = prompt_with([4, 8])
    pixels = torch.randn(int(grids.prod(-1).sum()), 3 * 2 * 8 * 8, generator=torch.Generator().manual_seed(seed))
    return prompt, dict(pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=(prompt == IMAGE).int())


def gemma_inputs(seed: int = 0) -> tuple[torch.Tensor, dict]:
    prompt = prompt_with([4, 4])
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return prompt, dict(pixel_values=pixels, token_type_ids=(prompt == IMAGE).long())


FAMILIES = {
    "qwen2_vl": (lambda: qwen_vl("2"), qwen_inputs),
    "qwen2_5_vl": (lambda: qwen_vl("2.5"), qwen_inputs),
    "gemma3": (gemma3, gemma_inputs),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request):
    make, inputs = FAMILIES[request.param]
    model = make()
    prompt, model_inputs = inputs()
    reference = hf_greedy(model, prompt, NEW, **model_inputs)
    return request.param, model, prompt, model_inputs, reference


def check(setup, drafter, **kwargs):
    """Fixed sizing unless told otherwise: the scripted cases count steps against their own depth
    (auto sizing's depths follow measured timings, so an oracle's step count would vary)."""
    _, model, prompt, model_inputs, reference = setup
    out = hasten.generate(model, prompt, **model_inputs, drafter=drafter, max_new_tokens=NEW,
                          **{"draft_size": "fixed", **kwargs})
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.new_tokens == reference.shape[1] - prompt.shape[1]
    return out


def test_the_images_and_their_layout_change_the_output(setup):
    """Equality below could not tell read inputs from ignored ones otherwise: other images
    change HF's greedy output, and so does reading them without the family's extra: Qwen's
    text positions (no mm_token_type_ids: one position per token), Gemma's causal attention
    inside the images (no token_type_ids)."""
    family, model, prompt, model_inputs, reference = setup
    assert reference.shape[1] - prompt.shape[1] == NEW  # no early EOS: every comparison covers NEW tokens
    inputs = FAMILIES[family][1]
    others = [hf_greedy(model, prompt, NEW, **inputs(seed)[1]).tolist() for seed in (3, 4, 5)]
    assert any(other != reference.tolist() for other in others)
    types = "mm_token_type_ids" if family.startswith("qwen") else "token_type_ids"
    without = {key: value for key, value in model_inputs.items() if key != types}
    assert hf_greedy(model, prompt, NEW, **without).tolist() != reference.tolist()


@pytest.mark.parametrize("drafter", [None, PromptLookup(num_tokens=DRAFT_LEN), Lookahead()],
                         ids=["plain", "prompt_lookup", "lookahead"])
def test_plain_and_training_free_drafters(setup, drafter):
    out = check(setup, drafter)
    if drafter is None:
        assert out.stats.mean_accepted == 1.0


@pytest.mark.parametrize("mode", ["oracle", "adversarial", *range(DRAFT_LEN)])
def test_scripted_chains(setup, mode):
    reference = setup[-1]
    out = check(setup, ScriptedDrafter(reference[0].tolist(), DRAFT_LEN, mode))
    assert_scripted_stats(out.stats, mode, DRAFT_LEN)


@pytest.mark.parametrize("attention", ["mask", "hybrid"])
@pytest.mark.parametrize("mode", ["oracle", "adversarial", 2])
def test_scripted_trees(setup, mode, attention):
    """The right token is the last of 3 siblings, so only tree verification finds it; tree
    nodes take positions by depth, after the prompt's shifted 3D positions."""
    reference = setup[-1]
    error_at = {"oracle": None, "adversarial": 0}.get(mode, mode)
    drafter = TreeScriptedDrafter(reference[0].tolist(), DRAFT_LEN, 3, right_sibling=2, error_at=error_at)
    out = check(setup, drafter, tree_attention=attention)
    assert_scripted_stats(out.stats, mode, DRAFT_LEN)


def test_gemma3_with_a_window_wider_than_the_prompt():
    """Gemma 3's bidirectional image blocks also hold where the sliding window hides nothing."""
    model = gemma3(window=512)
    prompt, model_inputs = gemma_inputs()
    reference = hf_greedy(model, prompt, NEW, **model_inputs)
    drafter = TreeScriptedDrafter(reference[0].tolist(), DRAFT_LEN, 3, right_sibling=1, error_at=2)
    out = hasten.generate(model, prompt, **model_inputs, drafter=drafter, max_new_tokens=NEW)
    assert out.sequences.tolist() == reference.tolist()


# ---- errors naming the argument -----------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2_vl():
    return qwen_vl("2")


def generate_with(model, prompt, **kwargs):
    return hasten.generate(model, prompt, max_new_tokens=4, **kwargs)


@pytest.mark.parametrize("missing", ["mm_token_type_ids", "image_grid_thw"])
def test_qwen_inputs_missing(qwen2_vl, missing):
    prompt, model_inputs = qwen_inputs()
    del model_inputs[missing]
    with pytest.raises(ValueError, match=f"Qwen2VLForConditionalGeneration needs {missing} with pixel_values"):
        generate_with(qwen2_vl, prompt, **model_inputs)


def test_type_ids_not_marking_the_placeholders(qwen2_vl):
    prompt, model_inputs = qwen_inputs()
    shifted = torch.roll(model_inputs["mm_token_type_ids"], 1, dims=1)
    with pytest.raises(ValueError, match=f"mm_token_type_ids must be 1 exactly at input_ids' image placeholder "
                                         f"tokens \\(id {IMAGE}\\)"):
        generate_with(qwen2_vl, prompt, **{**model_inputs, "mm_token_type_ids": shifted})
    with pytest.raises(ValueError, match="mm_token_type_ids must have input_ids' shape"):
        generate_with(qwen2_vl, prompt, **{**model_inputs, "mm_token_type_ids": shifted[:, 1:]})


def test_gemma3_without_token_type_ids():
    prompt, model_inputs = gemma_inputs()
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration needs token_type_ids with pixel_values.* "
                                         "both ways"):
        generate_with(gemma3(), prompt, pixel_values=model_inputs["pixel_values"])


def test_qwen_pixel_values_of_the_wrong_rank(qwen2_vl):
    prompt, model_inputs = qwen_inputs()
    with pytest.raises(ValueError, match="pixel_values must have 2 dims \\[patches, features\\]"):
        generate_with(qwen2_vl, prompt, **{**model_inputs, "pixel_values": model_inputs["pixel_values"][None]})


def test_a_family_hasten_does_not_decode_is_refused_by_name():
    """PaliGemma's text prefix attends both ways too, which hasten does not build: refused."""
    config = tf.PaliGemmaConfig(text_config=tf.GemmaConfig(**TEXT, head_dim=8),
                                vision_config=tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                                                    num_hidden_layers=1, num_attention_heads=4,
                                                                    image_size=32, patch_size=8),
                                image_token_index=IMAGE)
    model = tf.PaliGemmaForConditionalGeneration(config).eval()
    prompt = torch.tensor([[*[IMAGE] * 16, 1, 5, 6]])
    with pytest.raises(ValueError, match="of type 'paligemma', which hasten does not decode yet"):
        generate_with(model, prompt, pixel_values=torch.randn(1, 3, 32, 32))
