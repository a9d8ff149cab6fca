"""The zoo's shipped form (hasten.zoo.packing): int8 rows + lzma in the package, float16 Hugging
Face files in the cache; what ships is packed, and the tracked tree fits a GPU transfer."""
import json
import lzma
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hasten import zoo
from hasten.loading import load_model
from hasten.zoo import pack as pack_cli
from hasten.zoo import packing

ROOT = Path(__file__).resolve().parents[1]
TREE_LIMIT = 48 * 2**20  # docs/gpu.md: the tree and a model part must fit one 64 MiB transfer (parts of 16+ MiB)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    matrix = torch.randn(64, 96, generator=g).half()
    matrix[3] = 0  # a row of zeros has scale 0
    return {"layer.weight": matrix, "norm.weight": torch.randn(96, generator=g).half(),
            "conv.weight": torch.randn(32, 4, 8, 8, generator=g).half(), "small": torch.randn(4, 4, generator=g).half(),
            "positions": torch.arange(10)}


def test_matrices_come_back_within_half_a_step_of_their_row_and_the_rest_exactly():
    original = tensors()
    back = packing.unpacked_tensors(packing.packed_bytes(original))
    assert back.keys() == original.keys()
    for name in ("layer.weight", "conv.weight"):
        rows, got = original[name].float().flatten(1), back[name].float().flatten(1)
        step = rows.abs().amax(1, keepdim=True) / 127
        assert back[name].dtype == torch.float16 and back[name].shape == original[name].shape
        assert ((got - rows).abs() <= step / 2 + 1e-3 * rows.abs() + 1e-6).all()
        assert not torch.equal(got, rows)  # quantised, not stored
    assert (back["layer.weight"][3] == 0).all()
    for name in ("norm.weight", "small", "positions"):
        assert torch.equal(back[name], original[name])


def test_packing_the_same_tensors_gives_the_same_bytes():
    assert packing.packed_bytes(tensors()) == packing.packed_bytes(tensors())


def test_a_file_that_is_no_packed_file_is_refused():
    with pytest.raises(ValueError, match="not a hasten-q8-rows"):
        packing.dequantise({}, {})


def model_dir(root: Path) -> Path:
    """A directory shaped like a zoo model: weights, tokenizer, config, a drafter module below."""
    directory = root / "tiny-model"
    (directory / "eagle").mkdir(parents=True)
    save_file(tensors(), directory / "model.safetensors")
    save_file({"fc.weight": torch.randn(48, 48).half()}, directory / "eagle" / "weights.safetensors")
    (directory / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(500)}}}))
    (directory / "config.json").write_text('{"model_type": "llama"}')
    return directory


def test_pack_replaces_weights_and_tokenizer_and_leaves_the_rest(tmp_path):
    directory = model_dir(tmp_path)
    tokenizer = (directory / "tokenizer.json").read_bytes()
    written = packing.pack(directory)
    names = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    assert names == ["config.json", "eagle/weights.q8.safetensors.xz", "model.q8.safetensors.xz", "tokenizer.json.xz"]
    assert sorted(written) == sorted(directory / n for n in names if n.endswith(".xz"))
    assert lzma.decompress((directory / "tokenizer.json.xz").read_bytes()) == tokenizer


def test_unpacked_writes_the_original_files_once_into_the_cache(tmp_path):
    directory = model_dir(tmp_path)
    original = load_file(directory / "model.safetensors")
    tokenizer = (directory / "tokenizer.json").read_bytes()
    packing.pack(directory)
    copy = packing.unpacked(directory, tmp_path / "cache")
    assert copy.name == directory.name and copy.is_relative_to(tmp_path / "cache")
    assert (copy / "tokenizer.json").read_bytes() == tokenizer and (copy / "config.json").is_file()
    assert (copy / "eagle" / "weights.safetensors").is_file()
    back = load_file(copy / "model.safetensors")
    assert back.keys() == original.keys() and torch.equal(back["norm.weight"], original["norm.weight"])
    written = (copy / "model.safetensors").stat().st_mtime_ns
    assert packing.unpacked(directory, tmp_path / "cache") == copy
    assert (copy / "model.safetensors").stat().st_mtime_ns == written  # found, not rewritten


def test_changed_packed_files_get_a_new_copy(tmp_path):
    directory = model_dir(tmp_path)
    packing.pack(directory)
    first = packing.unpacked(directory, tmp_path / "cache")
    packing.write_packed({"layer.weight": torch.ones(8, 8)}, directory / "model.safetensors")
    second = packing.unpacked(directory, tmp_path / "cache")
    assert second != first and load_file(second / "model.safetensors").keys() == {"layer.weight"}


def test_plain_directories_are_used_where_they_are(tmp_path):
    directory = model_dir(tmp_path)
    assert packing.unpacked(directory, tmp_path / "cache") == directory
    assert not (tmp_path / "cache").exists()


def test_read_tensors_reads_a_plain_or_a_packed_file(tmp_path):
    directory = model_dir(tmp_path)
    plain = packing.read_tensors(directory / "model.safetensors")
    packing.pack(directory)
    assert packing.has_tensors(directory / "model.safetensors")
    assert packing.read_tensors(directory / "model.safetensors").keys() == plain.keys()
    with pytest.raises(FileNotFoundError, match="model.q8.safetensors.xz"):
        packing.read_tensors(tmp_path / "model.safetensors")


def test_the_command_packs_and_unpacks_in_place(tmp_path, capsys):
    directory = model_dir(tmp_path)
    pack_cli.main([str(directory)])
    assert "3 files packed" in capsys.readouterr().out
    pack_cli.main(["--unpack", str(directory)])
    names = sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())
    assert names == ["config.json", "eagle/weights.safetensors", "model.safetensors", "tokenizer.json"]


def test_a_packed_zoo_model_loads_through_hasten():
    model = load_model("zoo:code-tiny-draft")
    assert next(model.parameters()).dtype == torch.float32 and model.config.vocab_size == 4096


def test_what_ships_is_packed():
    """A module or model trained into the zoo ships after `python -m hasten.zoo.pack DIR`."""
    roots = [zoo.WEIGHTS_DIR, Path(packing.__file__).parents[1] / "diffusion" / "weights"]
    unpacked = [p for root in roots for p in root.rglob("*")
                if p.name.endswith(".safetensors") or p.name in packing.TEXT_FILES]
    assert not unpacked, f"run `python -m hasten.zoo.pack` on the directories of {unpacked}"


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed.decode().split("\0") if name]


def test_the_tracked_tree_fits_a_gpu_transfer_with_room_for_a_model_part():
    sizes = {path: path.stat().st_size for path in tracked_files() if path.is_file()}
    largest = sorted(sizes, key=sizes.get)[-5:]
    assert sum(sizes.values()) < TREE_LIMIT, (
        f"the tracked files total {sum(sizes.values()):,} bytes, over {TREE_LIMIT:,} (docs/gpu.md); largest: "
        + ", ".join(f"{p.relative_to(ROOT)} {sizes[p]:,}" for p in largest))
