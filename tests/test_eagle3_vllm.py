"""The EAGLE-3 round trip through real vLLM (``-m vllm``; vLLM's CPU build from ``make vllm``):
hasten trains an EAGLE-3 layer, exports it, vLLM drafts with it; vLLM's greedy output is its
plain decoding's, and it accepts at each of the 3 draft positions what hasten's own chain of 3
accepts on the same prompts (a concat-order or layer-offset mistake shows as acceptance near
zero in vLLM only). One test trains a layer for a tiny Llama vLLM can load (a minute); the other
runs SmolLM2's trained layer (HASTEN_EAGLE3_SMOLLM2=DIR: what `hasten train eagle3`
wrote) on Spec-Bench questions (`make real` for SmolLM2). scripts/eagle3_vllm.py does the measuring."""
import os
import sys
from pathlib import Path

import pytest

from hasten.bench import vllm_cpu

from helpers import TRAIN_TEXT, repetitive_prompt, tiny_model, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from eagle3_vllm import roundtrip  # noqa: E402

pytestmark = pytest.mark.vllm
SMOLLM2 = Path.home() / ".cache/hasten/gguf/SmolLM2-135M-Instruct.Q4_1-1ea2bc427672"


def needs_vllm():
    if vllm_cpu.vllm_python() is None:
        pytest.skip("vLLM's environment is not installed: make vllm")


def assert_same_acceptance(runs: dict, tolerance: float) -> None:
    ours, theirs = runs["hasten_eagle3"], runs["vllm_eagle3"]
    assert runs["vllm_eagle3"]["identical"] == runs["hasten"]["identical"] == len(runs["vllm"]["tokens"])
    assert len(theirs["accepted"]) == len(ours["accepted"]) == 3
    assert ours["accepted"][0] > 0.05 * ours["drafted"][0]  # a trained layer: a broken export would show
    for position, (mine, vllms) in enumerate(zip(ours["acceptance_by_position"], theirs["acceptance_by_position"])):
        assert abs(mine - vllms) <= tolerance, (position, ours["acceptance_by_position"], theirs["acceptance_by_position"])


def test_vllm_drafts_with_hastens_exported_eagle3_as_hasten_does(tmp_path):
    needs_vllm()
    from hasten.drafters.eagle3 import Eagle3Training, Eagle3TrainOptions
    from hasten.loading import load_model
    from hasten.training.distill import DistillSettings, distill
    from hasten.training.trainer import TrainSettings, train

    path = tmp_path / "tiny"  # vLLM's CPU attention takes head sizes of 32 and up; 4 layers: features of 1, 2, 3
    tiny_model("llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
               num_hidden_layers=4).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    model = load_model(str(path))
    data = distill(model, tiny_tokenizer(), TRAIN_TEXT, DistillSettings(samples=24, prompt_tokens=8, gen_tokens=40),
                   tmp_path / "work", source="test", progress=False)
    training = Eagle3Training(model, Eagle3TrainOptions(draft_vocab=64))
    result = train(training, data, TrainSettings(steps=150, lr=3e-3, warmup_steps=10), tmp_path / "work", progress=False)
    training.save(result.module, tmp_path / "eagle3", {"target": "tiny", **result.report})
    prompts = [repetitive_prompt(24, seed=seed)[0].tolist() for seed in (1, 2)]
    runs = roundtrip(model, str(path), str(tmp_path / "eagle3"), prompts, 32, max_model_len=256)
    assert_same_acceptance(runs, tolerance=0.1)


def test_vllm_runs_a_trained_smollm2_eagle3_as_hasten_does():
    """Spec-Bench questions, one per category, 64 tokens each."""
    needs_vllm()
    drafter = os.environ.get("HASTEN_EAGLE3_SMOLLM2")
    if not drafter:
        pytest.skip("HASTEN_EAGLE3_SMOLLM2 names no trained layer: `hasten train eagle3 --model zoo:smollm2-135m ...` "
                    "(docs/scale-out.md) writes one")
    if not SMOLLM2.is_dir():
        pytest.skip("SmolLM2 is not in the cache: make real")
    from transformers import AutoTokenizer

    from hasten.bench.spec_bench import spec_bench_tasks
    from hasten.loading import load_model

    tokenizer = AutoTokenizer.from_pretrained(SMOLLM2)
    prompts = [tokenizer(task.prompt, add_special_tokens=False)["input_ids"]
               for task in spec_bench_tasks(tokenizer, 1)]
    runs = roundtrip(load_model(str(SMOLLM2)), str(SMOLLM2), drafter, prompts, 64)
    assert_same_acceptance(runs, tolerance=0.1)
