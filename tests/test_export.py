"""``hasten export``: a trained drafter in the layout vLLM loads, checked name by name.

The default suite checks the layout against vLLM's Medusa module (written out here from
vllm/model_executor/models/medusa.py: blocks of ``x + SiLU(W x + b)``, then an LM head) by
recomputing vLLM's forward from the exported tensors alone; the ``vllm`` marker runs vLLM's CPU
build on the export (``make test-vllm``)."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from hasten.drafters.eagle import EagleLayer
from hasten.drafters.medusa import MedusaHeads
from hasten.export import ExportError, export
from hasten.export.layout import check

from helpers import repetitive_prompt, tiny_model


def trained_heads(model, share: bool, num_heads: int = 3, seed: int = 0) -> MedusaHeads:
    """Heads with random weights (trained ones are not zero): what a training run leaves."""
    heads = MedusaHeads.for_target(model, num_heads, share_lm_head=share)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return heads


def vllm_medusa_logits(config: dict, tensors: dict, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa forward and compute_logits, from the exported files alone: [N, H] -> [K, N, V]."""
    out = []
    for h in range(config["num_heads"]):
        x = hidden
        for layer in range(config["num_hidden_layers"]):
            weight = tensors[f"blocks.{h}.layers.{layer}.weight"]
            bias = tensors.get(f"blocks.{h}.layers.{layer}.bias") if config["medusa_fc_bias"] else None
            x = x + F.silu(F.linear(x, weight, bias))
        head = tensors["lm_head.weight"] if config.get("original_lm_head") else tensors[f"lm_heads.{h}.weight"]
        out.append(F.linear(x, head))
    return torch.stack(out)


@pytest.mark.parametrize("share", [True, False], ids=["shared-lm-head", "own-lm-heads"])
def test_exported_medusa_computes_in_vllms_layout_what_hasten_computes(tmp_path, share):
    model = tiny_model("llama")
    heads = trained_heads(model, share)
    heads.save(tmp_path / "heads")
    model.save_pretrained(tmp_path / "target")
    exported = export(tmp_path / "heads", "vllm", tmp_path / "out", target=str(tmp_path / "target"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert config == exported.config
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["num_heads"], config["original_lm_head"]) == (3, share)
    lm_heads = {"lm_head.weight"} if share else {f"lm_heads.{h}.weight" for h in range(3)}
    assert set(tensors) == {f"blocks.{h}.layers.0.{p}" for h in range(3) for p in ("weight", "bias")} | lm_heads
    hidden = torch.randn(5, model.config.hidden_size)  # [N, H] target features
    saved = MedusaHeads.load(tmp_path / "heads")  # what hasten runs: the float16 files, in float32
    with torch.no_grad():
        ours = saved(hidden, model.get_output_embeddings())  # [K, N, V]
    torch.testing.assert_close(vllm_medusa_logits(config, tensors, hidden), ours, rtol=1e-5, atol=1e-5)


def test_the_strict_check_names_every_difference():
    expected = {"a.weight": (2, 2), "b.weight": (3,)}
    check({"a.weight": torch.zeros(2, 2), "b.weight": torch.zeros(3)}, expected, "an engine")  # exact: passes
    with pytest.raises(ExportError) as err:
        check({"a.weight": torch.zeros(2, 3), "c.weight": torch.zeros(1), "b.weight": torch.zeros(3, dtype=torch.long)},
              {**expected, "d.bias": (1,)}, "an engine")
    message = str(err.value)
    for part in ("missing: d.bias", "unexpected: c.weight", "wrong shape: a.weight (2, 3) (expected (2, 2))",
                 "not floating: b.weight torch.int64", "what an engine loads"):
        assert part in message


def test_export_refuses_what_no_engine_loads_naming_what_is_missing(tmp_path):
    model = tiny_model("llama")
    EagleLayer.for_target(model).save(tmp_path / "eagle")
    with pytest.raises(ExportError, match=r"cannot export eagle to vllm: .*SwiGLU.*EAGLE-3"):
        export(tmp_path / "eagle", "vllm", tmp_path / "out")
    trained_heads(model, share=True).save(tmp_path / "heads")
    with pytest.raises(ExportError, match="cannot export medusa to speculators: hasten exports medusa as vllm"):
        export(tmp_path / "heads", "speculators", tmp_path / "out")
    with pytest.raises(ExportError, match="no drafter's config"):
        export(tmp_path, "vllm", tmp_path / "out")
    with pytest.raises(ExportError, match="unknown format 'onnx'"):
        export(tmp_path / "heads", "onnx", tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written by a refusal


def test_shared_heads_need_their_target(tmp_path):
    model = tiny_model("llama")
    heads = trained_heads(model, share=True)
    heads.config = type(heads.config)(**{**heads.config.__dict__, "target": ""})  # trained on a model from memory
    heads.save(tmp_path / "heads")
    with pytest.raises(ExportError, match="give --target MODEL"):
        export(tmp_path / "heads", "vllm", tmp_path / "out")


def test_cli_exports_and_says_how_vllm_loads_it(tmp_path, capsys):
    from hasten.cli import main

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "target")
    trained_heads(model, share=True).save(tmp_path / "heads")
    assert main(["export", str(tmp_path / "heads"), "--format", "vllm", "--out", str(tmp_path / "out"),
                 "--target", str(tmp_path / "target"), "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert f'"method": "medusa", "model": "{tmp_path / "out"}", "num_speculative_tokens": 3' in out
    assert {t.dtype for t in load_file(tmp_path / "out" / "model.safetensors").values()} == {torch.bfloat16}
    assert main(["export", str(tmp_path / "heads"), "--format", "sglang", "--out", str(tmp_path / "o2")]) == 2
