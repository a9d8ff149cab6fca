"""zoo:vlm-tiny's recipe: procedural scenes (deterministic, described and questioned
consistently with their pixels), the LLaVA it builds (code-tiny's language model, 256 image
tokens per image), and a minuscule training run that lowers the held-out loss and saves a
directory that hasten.load opens and decodes with an image as Hugging Face generate does.
"""
import json

import numpy as np
import pytest
import torch
import transformers as tf

import hasten
import hasten.zoo
from hasten.zoo import scenes, vlm_recipe
from hasten.zoo.recipe import EOT

SEEDS = range(300)


def test_scenes_are_deterministic_by_seed():
    for seed in (0, 7, 123456):
        a, b = scenes.make_scene(seed), scenes.make_scene(seed)
        assert a == b
        assert np.array_equal(a.image(), b.image())
        assert a.description() == b.description() and a.questions() == b.questions()
    images = {scenes.make_scene(seed).image().tobytes() for seed in range(20)}
    assert len(images) == 20  # seeds give different scenes
    assert scenes.make_scene(0).image().shape == (scenes.IMAGE_SIZE, scenes.IMAGE_SIZE, 3)


def test_scenes_cover_the_vocabulary():
    """Over a few hundred seeds every kind, colour, size, cell and count 1..4 turns up."""
    shapes = [s for seed in SEEDS for s in scenes.make_scene(seed).shapes]
    assert {s.kind for s in shapes} == set(scenes.KINDS)
    assert {s.colour for s in shapes} == set(scenes.COLOURS)
    assert {s.size for s in shapes} == set(scenes.SIZES)
    assert {s.cell for s in shapes} == set(range(len(scenes.CELLS)))
    assert {len(scenes.make_scene(seed).shapes) for seed in SEEDS} == set(range(1, scenes.MAX_SHAPES + 1))


def cell_colours(image: np.ndarray) -> list[set[str]]:
    """The shape colours whose pixels appear in each of the 9 grid cells, read from the image."""
    edges = np.linspace(0, scenes.IMAGE_SIZE, 4).round().astype(int)
    found = []
    for cell in range(9):
        row, col = divmod(cell, 3)
        block = image[edges[row]:edges[row + 1], edges[col]:edges[col + 1]].reshape(-1, 3)
        found.append({name for name, rgb in scenes.COLOURS.items() if (block == rgb).all(axis=1).any()})
    return found


def test_each_shape_is_drawn_in_its_own_cell():
    """What the text says is where the pixels are: each shape's colour appears in its cell
    and in no cell without a shape of that colour."""
    for seed in SEEDS:
        scene = scenes.make_scene(seed)
        expected = [set() for _ in range(9)]
        for shape in scene.shapes:
            expected[shape.cell].add(shape.colour)
        assert cell_colours(scene.image()) == expected, seed


def test_descriptions_mention_every_shape_in_reading_order():
    for seed in SEEDS:
        scene = scenes.make_scene(seed)
        text = scene.description()
        sentences = [f"A {s.size} {s.colour} {s.kind} is in the {s.where}." for s in scene.shapes]
        positions = [text.index(sentence) for sentence in sentences]  # ValueError if one is missing
        assert positions == sorted(positions)
        assert [s.cell for s in scene.shapes] == sorted(s.cell for s in scene.shapes)
        n = len(scene.shapes)
        assert text.startswith("There is one shape." if n == 1 else f"There are {scenes.NUMBERS[n]} shapes.")
        assert text.count(".") == n + 1


def test_answers_agree_with_the_pixels():
    """Count answers equal the counts read from the image (colours per cell), colour and
    where answers name the colour found in the named cell."""
    words = {f"{word.capitalize()}.": n for n, word in enumerate(scenes.NUMBERS)}
    cells = {f"{name.capitalize()}.": i for i, name in enumerate(scenes.CELLS)}
    kinds_seen = set()
    for seed in SEEDS:
        scene = scenes.make_scene(seed)
        found = cell_colours(scene.image())
        for kind, question, answer in scene.questions():
            kinds_seen.add(kind)
            if question == "How many shapes are there?":
                assert words[answer] == sum(bool(colours) for colours in found)
            elif kind == "count" and question.split()[2] in scenes.COLOURS:
                assert words[answer] == sum(question.split()[2] in colours for colours in found)
            elif kind == "count":
                plural = question.split()[2]
                assert words[answer] == sum(scenes.PLURALS[s.kind] == plural for s in scene.shapes)
            elif kind == "colour":
                (shape,) = [s for s in scene.shapes if s.kind == question.split()[-1].rstrip("?")]
                assert found[shape.cell] == {answer.rstrip(".").lower()}
            elif kind == "where":
                named = question.removeprefix("Where is the ").rstrip("?").split()  # [colour,] kind
                colour = named[0] if len(named) == 2 else None
                (shape,) = [s for s in scene.shapes if s.kind == named[-1] and colour in (None, s.colour)]
                assert shape.cell == cells[answer] and found[cells[answer]] == {shape.colour}
            else:
                where = question.removeprefix("What shape is in the ").rstrip("?")
                colour = answer.split()[2]
                assert found[scenes.CELLS.index(where)] == {colour}
    assert kinds_seen == {"count", "colour", "where", "shape"}


# ---- the model -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer():
    return vlm_recipe.make_tokenizer()


def test_the_model_sees_256_image_tokens_and_starts_from_code_tiny(tokenizer):
    processor = vlm_recipe.make_processor(tokenizer)
    model = vlm_recipe.build_model(tokenizer).eval()
    image_id = tokenizer.convert_tokens_to_ids(vlm_recipe.IMAGE_TOKEN)
    assert image_id == len(tokenizer) - 1 == model.config.image_token_id
    inputs = processor(text="<image>\nDescribe the image.", images=[scenes.make_scene(0).image()],
                       return_tensors="pt")
    assert int((inputs["input_ids"] == image_id).sum()) == model.config.image_seq_length >= 256
    with torch.no_grad():
        features = model.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True).pooler_output
    assert sum(f.reshape(-1, f.shape[-1]).shape[0] for f in features) >= 256
    code_tiny = tf.AutoModelForCausalLM.from_pretrained(hasten.zoo.resolve("code-tiny"), dtype=torch.float32)
    embed = model.model.language_model.embed_tokens.weight
    assert torch.equal(embed[:-1], code_tiny.model.embed_tokens.weight)
    assert torch.equal(model.model.language_model.layers[3].mlp.down_proj.weight,
                       code_tiny.model.layers[3].mlp.down_proj.weight)
    assert model.lm_head.weight.data_ptr() == embed.data_ptr()  # tied, as in code-tiny


def test_training_prompts_are_tokenized_as_the_processor_does(tokenizer):
    """Loss only on answers, and the first prompt line's ids are what inference feeds."""
    processor = vlm_recipe.make_processor(tokenizer)
    scene = scenes.make_scene(3)
    question, answer = scene.questions()[0][1:]
    ids, labels = vlm_recipe.encode(tokenizer, [(question, answer), (vlm_recipe.DESCRIBE, scene.description())], 256)
    prompt = processor(text=f"<image>\n{question}", images=[scene.image()], return_tensors="pt")["input_ids"][0]
    assert ids[:len(prompt)] == prompt.tolist()
    eot = tokenizer.convert_tokens_to_ids(EOT)
    supervised = [token for token, label in zip(ids, labels) if label != -100]
    assert [label for label in labels if label != -100] == supervised
    assert tokenizer.decode(supervised).replace(EOT, "|") == f" {answer}| {scene.description()}|"
    assert supervised.count(eot) == 2


MINUSCULE_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        image_size=32, patch_size=8)  # the processor shrinks scenes to 32 x 32: 16 tokens


def minuscule_model(tokenizer):
    text = tf.LlamaConfig(vocab_size=len(tokenizer) - 1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                          tie_word_embeddings=True)
    torch.manual_seed(0)
    return vlm_recipe.build_model(tokenizer, tf.LlamaForCausalLM(text), MINUSCULE_VISION)


def test_a_minuscule_training_run_learns_and_saves_a_loadable_model(tokenizer, tmp_path):
    from PIL import Image

    processor = vlm_recipe.make_processor(tokenizer, MINUSCULE_VISION)
    model = minuscule_model(tokenizer)
    settings = vlm_recipe.VlmSettings(minutes=5.0, max_steps=60, batch_size=4, lr=1e-2, vision_lr=1e-2,
                                      warmup_steps=1, eval_scenes=4)
    out = tmp_path / "vlm"
    report = vlm_recipe.train(model, processor, out, tmp_path / "ckpt", settings,
                              evaluation={"captions": 1, "qa_pairs": 4})
    assert report["steps"] == 60
    assert report["heldout"][-1]["heldout_loss"] < report["heldout"][0]["heldout_loss"] - 0.5
    assert report["config"]["image_tokens"] == 16
    assert sum(kind["asked"] for kind in report["evaluation"]["qa_accuracy"].values()) == 4
    assert (out / "training.json").is_file() and (tmp_path / "ckpt" / "checkpoint.json").is_file()
    assert all(v.dtype == torch.float16 for v in _saved_tensors(out))

    path = tmp_path / "scene.png"
    Image.fromarray(scenes.make_scene(vlm_recipe.HELDOUT_SEEDS).image()).save(path)
    saved = tf.LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32).eval()
    saved_processor = tf.AutoProcessor.from_pretrained(out)
    encoded = saved_processor(text="<image>\nDescribe the image.", images=[Image.open(path).convert("RGB")],
                              return_tensors="pt")
    reference = saved.generate(**encoded, do_sample=False, max_new_tokens=40)[0, encoded["input_ids"].shape[1]:]
    engine = hasten.load(out, "prompt_lookup")
    new = engine.generate("Describe the image.", images=[str(path)], max_new_tokens=40).token_ids
    assert new == reference.tolist()  # both end with <|endoftext|> where the model stops
    assert len(set(new)) >= 3  # trained on descriptions: not one token repeated


def _saved_tensors(out):
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors").values()


def test_the_shipped_vlm_tiny_decodes_an_image_prompt_as_hugging_face_does(tmp_path):
    """zoo:vlm-tiny resolves, has 256 image tokens, a training report, and hasten's lossless
    decoding of a held-out scene equals model.generate's."""
    from PIL import Image

    path = hasten.zoo.resolve("zoo:vlm-tiny")
    report = json.loads((path / "training.json").read_text())
    assert report["config"]["image_tokens"] == 256
    assert report["heldout"][-1]["heldout_loss"] < report["heldout"][0]["heldout_loss"]
    image = tmp_path / "scene.png"
    Image.fromarray(scenes.make_scene(vlm_recipe.HELDOUT_SEEDS + 7).image()).save(image)
    model = tf.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = tf.AutoProcessor.from_pretrained(path)
    encoded = processor(text="<image>\nDescribe the image.", images=[Image.open(image).convert("RGB")],
                        return_tensors="pt")
    reference = model.generate(**encoded, do_sample=False, max_new_tokens=24)[0, encoded["input_ids"].shape[1]:]
    new = hasten.load("zoo:vlm-tiny", "prompt_lookup").generate("Describe the image.", images=[str(image)],
                                                                max_new_tokens=24).token_ids
    assert new == reference.tolist()


def test_scenes_written_as_png_files(tmp_path, capsys):
    """``python -m hasten.zoo.scenes SEED --out DIR``: the file holds the scene's pixels and the
    printed line its description."""
    import numpy as np
    from PIL import Image

    from hasten.zoo import scenes as scene_module

    assert scene_module.main(["7", "--out", str(tmp_path)]) == 0
    scene = scene_module.make_scene(7)
    assert np.array_equal(np.asarray(Image.open(tmp_path / "scene-7.png")), scene.image())
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'scene-7.png'}: {scene.description()}"
