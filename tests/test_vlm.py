"""Vision-language targets: image + text prefill, then text decoding in the one loop.

Tiny random LLaVA (a CLIP and a SigLIP vision tower), Idefics3 and SmolVLM: greedy output
equals Hugging Face ``generate(input_ids, pixel_values=...)`` token for token with no
drafter, the training-free drafters, and scripted chains and trees (oracle, adversarial,
planted errors); sampled output with a draft model follows the exact law of the first 2
new tokens, enumerated from the model itself; image files go through a processor, plain
prompts and chats (the processor's chat template); bad image inputs fail with errors naming
the argument. Qwen2-VL and Gemma 3 are in test_vlm_families.py.
"""
import pytest
import torch
import transformers as tf

import hasten
from hasten.core.sampling import Sampling
from hasten.drafters import DraftModel, Lookahead, PromptLookup
from hasten.models import vlm
from hasten.models.adapter import ModelAdapter
from hasten.models.compat import cache_argument
from helpers import (
    returned_cache,
    ScriptedDrafter, TreeScriptedDrafter, assert_scripted_stats, hf_greedy, tiny_model, tiny_tokenizer,
)
from test_verify_law import bound

VOCAB = 96
IMAGE = VOCAB - 1  # the image placeholder token
NEW = 20
DRAFT_LEN = 4


def text_config(vocab=VOCAB):
    return tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=512, vocab_size=vocab, bos_token_id=1,
                          eos_token_id=2, pad_token_id=0)


TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
             patch_size=8)  # 4 x 4 patches per 32 x 32 image


def llava(tower: str, vocab=VOCAB, seed=0):
    """CLIP's class token is dropped ("default"), SigLIP has none: 16 features per image either way."""
    vision, strategy = {"clip": (tf.CLIPVisionConfig(**TOWER), "default"),
                        "siglip": (tf.SiglipVisionConfig(**TOWER), "full")}[tower]
    config = tf.LlavaConfig(vision_config=vision, text_config=text_config(vocab), image_token_index=vocab - 1,
                            vision_feature_layer=-1, vision_feature_select_strategy=strategy)
    torch.manual_seed(seed)
    return tf.LlavaForConditionalGeneration(config).eval()


def idefics3(family: str):
    """Pixel shuffle by 2 turns 16 patches into 4 features per image."""
    vision, config, model = {
        "idefics3": (tf.Idefics3VisionConfig, tf.Idefics3Config, tf.Idefics3ForConditionalGeneration),
        "smolvlm": (tf.SmolVLMVisionConfig, tf.SmolVLMConfig, tf.SmolVLMForConditionalGeneration),
    }[family]
    torch.manual_seed(0)
    return model(config(vision_config=vision(**TOWER), text_config=text_config(), image_token_id=IMAGE,
                        scale_factor=2)).eval()


# family -> (model, features per image, pixel_values' shape for two images)
FAMILIES = {
    "llava_clip": (lambda: llava("clip"), 16, (2, 3, 32, 32)),
    "llava_siglip": (lambda: llava("siglip"), 16, (2, 3, 32, 32)),
    "idefics3": (lambda: idefics3("idefics3"), 4, (1, 2, 3, 32, 32)),
    "smolvlm": (lambda: idefics3("smolvlm"), 4, (1, 2, 3, 32, 32)),
}


def image_prompt(features: int, seed: int = 1) -> torch.Tensor:
    """Text, two images' placeholders, then text that repeats itself (for input-guided drafters)."""
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(3, IMAGE, (10,), generator=g).tolist()
    return torch.tensor([[1, *text[:3], *[IMAGE] * features, *text[3:5], *[IMAGE] * features, *text, *text]])


def pixels(shape, seed=0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request):
    make, features, shape = FAMILIES[request.param]
    model = make()
    prompt, images = image_prompt(features), pixels(shape)
    reference = hf_greedy(model, prompt, NEW, pixel_values=images)
    return model, prompt, images, reference


def check(model, prompt, images, reference, drafter, **kwargs):
    """Fixed sizing unless told otherwise: the scripted cases count steps against their own depth."""
    out = hasten.generate(model, prompt, pixel_values=images, drafter=drafter, max_new_tokens=NEW,
                          **{"draft_size": "fixed", **kwargs})
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.new_tokens == reference.shape[1] - prompt.shape[1]
    return out


def test_the_images_change_the_output(setup):
    """Otherwise the equality tests below could not tell images read from images ignored:
    without images (placeholders embedded as text) and with other images, HF's greedy
    output differs from the reference."""
    model, prompt, images, reference = setup
    assert hf_greedy(model, prompt, NEW).tolist() != reference.tolist()
    others = [hf_greedy(model, prompt, NEW, pixel_values=pixels(images.shape, seed)).tolist() for seed in (3, 4, 5)]
    assert any(other != reference.tolist() for other in others)


@pytest.mark.parametrize("drafter", [None, PromptLookup(num_tokens=DRAFT_LEN), Lookahead()],
                         ids=["plain", "prompt_lookup", "lookahead"])
def test_plain_and_training_free_drafters(setup, drafter):
    model, prompt, images, reference = setup
    out = check(model, prompt, images, reference, drafter)
    if drafter is None:
        assert out.stats.mean_accepted == 1.0


@pytest.mark.parametrize("mode", ["oracle", "adversarial", *range(DRAFT_LEN)])
def test_scripted_chains(setup, mode):
    model, prompt, images, reference = setup
    out = check(model, prompt, images, reference, ScriptedDrafter(reference[0].tolist(), DRAFT_LEN, mode))
    assert_scripted_stats(out.stats, mode, DRAFT_LEN)


@pytest.mark.parametrize("mode", ["oracle", "adversarial", 2])
def test_scripted_trees(setup, mode):
    """The right token is the last of 3 siblings, so only tree verification finds it."""
    model, prompt, images, reference = setup
    error_at = {"oracle": None, "adversarial": 0}.get(mode, mode)
    drafter = TreeScriptedDrafter(reference[0].tolist(), DRAFT_LEN, 3, right_sibling=2, error_at=error_at)
    out = check(model, prompt, images, reference, drafter)
    assert_scripted_stats(out.stats, mode, DRAFT_LEN)


def test_processor_outputs_pass_through():
    """What a processor returns goes in as keywords: an all-ones attention_mask for the one
    prompt, and Idefics3's pixel_attention_mask (here marking every pixel real)."""
    make, features, shape = FAMILIES["idefics3"]
    model, prompt, images = make(), image_prompt(features), pixels(shape)
    reference = hf_greedy(model, prompt, NEW, pixel_values=images)
    pixel_mask = torch.ones(shape[0], shape[1], *shape[-2:], dtype=torch.bool)  # [batch, images, height, width]
    out = hasten.generate(model, prompt, attention_mask=torch.ones_like(prompt), pixel_values=images,
                          pixel_attention_mask=pixel_mask, drafter=PromptLookup(), max_new_tokens=NEW)
    assert out.sequences.tolist() == reference.tolist()


def test_prefill_features_are_the_text_models():
    """Drafters that read target features get them for image positions too: the language
    model's last layer over the merged image + text prompt, all but the root."""
    make, features, shape = FAMILIES["llava_clip"]
    model, prompt, images = make(), image_prompt(features), pixels(shape)
    tokens, prefilled = ModelAdapter(model).start(prompt, hidden=True, pixel_values=images)
    full = model(prompt, pixel_values=images, output_hidden_states=True).hidden_states[-1][0]  # [T, hidden]
    assert tokens == prompt[0].tolist()
    torch.testing.assert_close(prefilled, full[:-1], rtol=1e-4, atol=1e-4)


# ---- text and image files through a processor ------------------------------------------------------
# A chat template that writes <image> for each image entry of a content list
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for entry in message['content'] %}"
    "{% if entry['type'] == 'image' %}<image>\n{% else %}{{ entry['text'] }}{% endif %}{% endfor %}{% endif %}"
    "\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def processor_and_model():
    """A LlavaProcessor over the tests' tokenizer with an added <image> token (id 96) and a
    chat template, for a LLaVA whose vocabulary has room for it."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    images = tf.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = tf.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                  chat_template=CHAT_TEMPLATE)
    return processor, llava("clip", vocab=len(tokenizer))


def image_file(path, seed=0):
    from PIL import Image

    pixels_hwc = torch.randint(0, 256, (40, 48, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    Image.fromarray(pixels_hwc.numpy()).save(path)
    return path


def test_image_files_through_the_processor(processor_and_model, tmp_path):
    """What ``Engine.generate(prompt, images=[...])`` does: a prompt without the image token
    gets one per image in front; the result decodes as Hugging Face decodes the processor's
    own output for that text."""
    processor, model = processor_and_model
    paths = [image_file(tmp_path / "a.png"), image_file(tmp_path / "b.png", seed=1)]
    input_ids, model_inputs = vlm.processor_inputs(processor, "def add(a, b):", paths)
    assert sorted(model_inputs) == ["pixel_values"] and list(model_inputs["pixel_values"].shape) == [2, 3, 32, 32]
    assert int((input_ids == 96).sum()) == 32  # 16 placeholders per image
    encoded = processor(text="<image>\n<image>\ndef add(a, b):", images=vlm.read_images(paths), return_tensors="pt")
    reference = model.generate(**encoded, do_sample=False, max_new_tokens=NEW, pad_token_id=0)
    out = hasten.generate(model, input_ids, **model_inputs, drafter=PromptLookup(), max_new_tokens=NEW)
    assert out.sequences.tolist() == reference.tolist()


def test_unreadable_image_files(processor_and_model, tmp_path):
    processor, _ = processor_and_model
    (tmp_path / "notes.png").write_text("not an image")
    good = image_file(tmp_path / "a.png")
    with pytest.raises(ValueError, match="images\\[1\\] '.*missing.png' could not be read as an image: No such file"):
        vlm.processor_inputs(processor, "hi", [good, tmp_path / "missing.png"])
    with pytest.raises(ValueError, match="images\\[0\\] '.*notes.png' could not be read as an image"):
        vlm.read_images([tmp_path / "notes.png"])
    with pytest.raises(ValueError, match="images is an empty list"):
        vlm.read_images([])
    with pytest.raises(TypeError, match="images must be a list of image paths or images, got str"):
        vlm.read_images(str(good))


# ---- the sampling law on a tiny LLaVA ----------------------------------------------------------
# The first 2 new tokens of 3 with a draft model proposing 2 (so the law covers acceptance at
# depths 1 and 2, the residual max(p - q, 0) after a rejection at either, and the bonus token).
# Trees are tested on text targets (test_sampling_distribution.py); what a VLM adds is the image
# prefill, and every sample here runs it.
LAW_VOCAB = 8
LAW_SAMPLES = 1000
LAW_SAMPLING = Sampling(1.0, top_k=3)  # 9 outcomes of 2 tokens, so 1000 samples give a tight bound
LAW_PROMPT = torch.tensor([[1, 3, *[LAW_VOCAB - 1] * 16, 5, 1, 3, 5]])


def peaky(model):
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # a random tiny model is nearly uniform; make it opinionated
    return model


LAW_TARGET = peaky(llava("clip", vocab=LAW_VOCAB))
LAW_IMAGE = pixels((1, 3, 32, 32))


@torch.no_grad()
def next_probs(image, continuation: tuple[int, ...]) -> torch.Tensor:
    """The target's next-token law after the prompt (read with its image) and a continuation
    (text: a sampled placeholder id is a token like any other, so it runs without pixel_values
    over the prompt's cache, as in Hugging Face generate)."""
    prefill = LAW_TARGET(LAW_PROMPT, pixel_values=image, use_cache=True)
    if not continuation:
        return LAW_SAMPLING.probs(prefill.logits[0, -1])
    out = LAW_TARGET(torch.tensor([continuation]), **cache_argument(LAW_TARGET, returned_cache(prefill)), use_cache=True)
    return LAW_SAMPLING.probs(out.logits[0, -1])


def exact_law(image, length: int = 2) -> dict[tuple[int, ...], float]:
    law = {(): 1.0}
    for _ in range(length):
        law = {prefix + (token,): weight * float(probs[token])
               for prefix, weight in law.items()
               for probs in [next_probs(image, prefix)] for token in range(LAW_VOCAB)}
    return law


def tv(law, other) -> float:
    return 0.5 * sum(abs(law[k] - other.get(k, 0.0)) for k in law)


def test_sampling_follows_the_vlm_law():
    law = exact_law(LAW_IMAGE)
    drafter = DraftModel(peaky(tiny_model("llama", seed=5, vocab_size=LAW_VOCAB)), num_tokens=2)
    g = torch.Generator().manual_seed(1234)
    counts = dict.fromkeys(law, 0)
    for _ in range(LAW_SAMPLES):
        out = hasten.generate(LAW_TARGET, LAW_PROMPT, pixel_values=LAW_IMAGE, drafter=drafter, max_new_tokens=3,
                              eos_token_id=[], temperature=LAW_SAMPLING.temperature, top_k=LAW_SAMPLING.top_k,
                              generator=g)
        counts[tuple(out.sequences[0, LAW_PROMPT.shape[1]:][:2].tolist())] += 1
    distance, limit = tv(law, {k: c / LAW_SAMPLES for k, c in counts.items()}), bound(law, LAW_SAMPLES)
    assert distance < limit, f"TV {distance:.3f} >= bound {limit:.3f}"


def test_the_law_depends_on_the_image():
    """A sampler that ignored the image would be caught: another image's law, and the law
    with no image (placeholders read as text), are farther from this one than the bound."""
    law, limit = exact_law(LAW_IMAGE), bound(exact_law(LAW_IMAGE), LAW_SAMPLES)
    assert tv(law, exact_law(pixels((1, 3, 32, 32), seed=9))) > limit
    assert tv(law, exact_law(None)) > limit


# ---- errors naming the argument -----------------------------------------------------------------
@pytest.fixture(scope="module")
def clip_llava():
    return llava("clip")


def generate_with(model, prompt, **kwargs):
    return hasten.generate(model, prompt, max_new_tokens=4, **kwargs)


def test_pixel_values_for_a_text_only_model():
    with pytest.raises(ValueError, match="pixel_values given, but model .* is a text-only model"):
        generate_with(tiny_model("llama"), torch.tensor([[1, 5, 6]]), pixel_values=pixels((1, 3, 32, 32)))


def test_a_misspelt_keyword_for_a_text_only_model():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_new_token'"):
        hasten.generate(tiny_model("llama"), torch.tensor([[1, 5, 6]]), max_new_token=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_new_token'"):
        hasten.generate(tiny_model("llama"), [torch.tensor([1, 5, 6])] * 2, max_new_token=4)


def test_keywords_given_as_none_are_absent():
    """As in Hugging Face: ``**processor(text=...)`` of a text-only call may hold pixel_values=None."""
    model, prompt = tiny_model("llama"), torch.tensor([[1, 5, 6]])
    out = hasten.generate(model, prompt, pixel_values=None, max_new_tokens=4)
    assert out.sequences.tolist() == hf_greedy(model, prompt, 4).tolist()


def test_prompt_without_placeholders(clip_llava):
    with pytest.raises(ValueError, match=f"input_ids holds no image placeholder token \\(id {IMAGE}\\)"):
        generate_with(clip_llava, torch.tensor([[1, 5, 6, 7]]), pixel_values=pixels((1, 3, 32, 32)))


@pytest.mark.parametrize("family, count", [("llava_clip", 15), ("llava_clip", 16), ("llava_clip", 48),
                                           ("idefics3", 7), ("idefics3", 9)])
def test_placeholder_count_not_matching_the_images(family, count):
    """Two images give 32 features on LLaVA, 8 on Idefics3."""
    make, features, shape = FAMILIES[family]
    prompt = torch.tensor([[1, 5, *[IMAGE] * count, 6, 7]])
    with pytest.raises(ValueError, match=f"input_ids holds {count} image placeholder tokens \\(id {IMAGE}\\) but "
                                         f"pixel_values gives {2 * features} visual features"):
        generate_with(make(), prompt, pixel_values=pixels(shape))


def test_placeholders_without_pixel_values(clip_llava):
    with pytest.raises(ValueError, match="16 image placeholder token\\(s\\) .* but no pixel_values"):
        generate_with(clip_llava, image_prompt(8)[:, :30])


def test_prompt_ending_with_a_placeholder(clip_llava):
    with pytest.raises(ValueError, match="input_ids ends with an image placeholder token"):
        generate_with(clip_llava, torch.tensor([[1, 5, *[IMAGE] * 16]]), pixel_values=pixels((1, 3, 32, 32)))


@pytest.mark.parametrize("family, shape, rank", [("llava_clip", (3, 32, 32), 4), ("llava_clip", (1, 1, 3, 32, 32), 4),
                                                 ("idefics3", (2, 3, 32, 32), 5)])
def test_pixel_values_of_the_wrong_rank(family, shape, rank):
    make, features, _ = FAMILIES[family]
    with pytest.raises(ValueError, match=f"pixel_values must have {rank} dims .* got shape \\{list(shape)}"):
        generate_with(make(), image_prompt(features), pixel_values=pixels(shape))


def test_pixel_values_of_several_prompts():
    make, features, _ = FAMILIES["idefics3"]
    with pytest.raises(ValueError, match="pixel_values holds the images of 2 prompts"):
        generate_with(make(), image_prompt(features), pixel_values=pixels((2, 2, 3, 32, 32)))


def test_pixel_values_not_a_tensor(clip_llava):
    with pytest.raises(TypeError, match="pixel_values must be a torch.Tensor"):
        generate_with(clip_llava, image_prompt(16), pixel_values=pixels((2, 3, 32, 32)).tolist())


def test_unknown_keyword(clip_llava):
    with pytest.raises(TypeError, match="unexpected keyword argument 'pixel_valus'"):
        generate_with(clip_llava, image_prompt(16), pixel_valus=pixels((2, 3, 32, 32)))


def test_images_with_a_batch(clip_llava):
    prompt = image_prompt(16)
    with pytest.raises(ValueError, match="pixel_values given with a batch of prompts"):
        generate_with(clip_llava, [prompt[0], prompt[0]], pixel_values=pixels((2, 3, 32, 32)))
    with pytest.raises(ValueError, match="attention_mask must be all ones"):
        mask = torch.ones_like(prompt)
        mask[0, 0] = 0
        generate_with(clip_llava, prompt, attention_mask=mask, pixel_values=pixels((2, 3, 32, 32)))


def test_engine_and_cli_with_image_files(processor_and_model, tmp_path):
    """hasten.load on a saved LLaVA finds its processor; Engine.generate(prompt, images=[...])
    and `hasten generate --image` decode as Hugging Face does; a missing file is named."""
    import contextlib
    import io
    import json

    from hasten.cli import main

    processor, model = processor_and_model
    model.save_pretrained(tmp_path / "llava")
    processor.save_pretrained(tmp_path / "llava")
    path = str(image_file(tmp_path / "a.png"))
    encoded = processor(text="<image>\ndef add(a, b):", images=vlm.read_images([path]), return_tensors="pt")
    reference = model.generate(**encoded, do_sample=False, max_new_tokens=NEW, pad_token_id=0)
    new = reference[0, encoded["input_ids"].shape[1]:].tolist()
    engine = hasten.load(tmp_path / "llava", "prompt_lookup")
    assert engine.generate("def add(a, b):", images=[path], max_new_tokens=NEW).token_ids == new
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["generate", "--model", str(tmp_path / "llava"), "--prompt", "def add(a, b):", "--image", path,
                     "--max-new-tokens", str(NEW), "--json"]) == 0
    assert json.loads(printed.getvalue())["token_ids"] == new
    with pytest.raises(ValueError, match="images\\[0\\] '.*missing.png' could not be read as an image"):
        engine.generate("hi", images=[str(tmp_path / "missing.png")])
    text_only = hasten.load(tiny_model("llama"), tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match="images given, but LlamaForCausalLM is a text-only model"):
        text_only.generate("hi", images=[path])


# ---- chats with images --------------------------------------------------------------------------
def chat_messages(image_entry: dict) -> list[dict]:
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [image_entry, {"type": "text", "text": "def add(a, b):"}]}]


def test_chat_with_images(processor_and_model, tmp_path):
    """A chat whose user turn holds an image goes through the processor's chat template:
    the prompt holds the template's text and the image's 16 placeholders, and Engine.chat
    (the image given by images= or in the entry itself) and `hasten generate --chat --image`
    decode as Hugging Face generates from processor.apply_chat_template's own output."""
    import contextlib
    import io
    import json

    from hasten.cli import main

    processor, model = processor_and_model
    model.save_pretrained(tmp_path / "llava")
    processor.save_pretrained(tmp_path / "llava")
    path = str(image_file(tmp_path / "a.png", seed=2))
    encoded = processor.apply_chat_template(chat_messages({"type": "image", "image": vlm.read_images([path])[0]}),
                                            add_generation_prompt=True, tokenize=True, return_dict=True,
                                            return_tensors="pt")
    reference = model.generate(**encoded, do_sample=False, max_new_tokens=NEW, pad_token_id=0)
    new = reference[0, encoded["input_ids"].shape[1]:].tolist()
    engine = hasten.load(tmp_path / "llava", "prompt_lookup")
    input_ids, model_inputs = engine.encode_chat_images(chat_messages({"type": "image"}), [path])
    assert input_ids.tolist() == encoded["input_ids"].tolist()
    assert int((input_ids == 96).sum()) == 16
    assert engine.chat(chat_messages({"type": "image"}), images=[path], max_new_tokens=NEW).token_ids == new
    assert engine.chat(chat_messages({"type": "image", "image": path}), max_new_tokens=NEW).token_ids == new
    assert "".join(engine.chat_stream(chat_messages({"type": "image"}), images=[path], max_new_tokens=NEW)) == \
        engine.chat(chat_messages({"type": "image"}), images=[path], max_new_tokens=NEW).text
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["generate", "--model", str(tmp_path / "llava"), "--prompt", "def add(a, b):", "--chat",
                     "--system", "be brief", "--image", path, "--max-new-tokens", str(NEW), "--json"]) == 0
    assert json.loads(printed.getvalue())["token_ids"] == new


def test_chat_image_errors(processor_and_model, tmp_path):
    processor, model = processor_and_model
    path = str(image_file(tmp_path / "a.png"))
    engine = hasten.Engine(model, processor.tokenizer, None, "plain", processor=processor)
    with pytest.raises(ValueError, match="images gives 2 image\\(s\\) but the messages hold 1 bare image entries"):
        engine.chat(chat_messages({"type": "image"}), images=[path, path])
    with pytest.raises(ValueError, match="messages\\[1\\]\\['content'\\]\\[0\\] is an image entry with no 'image'"):
        engine.chat(chat_messages({"type": "image"}))
    with pytest.raises(ValueError, match="messages\\[1\\]\\['content'\\]\\[0\\] must be .*got \\{'type': 'video'"):
        engine.chat(chat_messages({"type": "video"}), images=[path])
    with pytest.raises(ValueError, match="images\\[0\\] '.*missing.png' could not be read as an image"):
        engine.chat(chat_messages({"type": "image", "image": str(tmp_path / "missing.png")}))
    with pytest.raises(ValueError, match="images gives 1 image\\(s\\) but the messages hold 0 bare image entries"):
        engine.chat([{"role": "user", "content": "hi"}], images=[path])
    no_template = tf.LlavaProcessor(image_processor=processor.image_processor, tokenizer=processor.tokenizer,
                                    patch_size=8, vision_feature_select_strategy="default",
                                    num_additional_image_tokens=1)
    bare = hasten.Engine(model, processor.tokenizer, None, "plain", processor=no_template)
    with pytest.raises(ValueError, match="LlavaProcessor has no chat template"):
        bare.chat(chat_messages({"type": "image"}), images=[path])
    text_only = hasten.load(tiny_model("llama"), tokenizer=tiny_tokenizer())
    with pytest.raises(ValueError, match="images given, but LlamaForCausalLM is a text-only model"):
        text_only.chat(chat_messages({"type": "image"}), images=[path])
    with pytest.raises(TypeError, match="images go with a text prompt; a chat takes its images"):
        next(engine.steps(torch.tensor([[1, 5, 6]]), hasten.DecodeStats(), images=[path]))
