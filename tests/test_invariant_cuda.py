"""The row-invariant Triton kernels for CUDA (kernels/cuda.py) and, on a GPU, the models that run
them (models/invariant.py): every position of a block gets a one-token step's logits, bit for bit.

Runs on a machine with CUDA and Triton (scripts/gpu-check's `invariance-on-device` step). With
``TRITON_INTERPRET=1`` and Triton installed, the kernel tests run on the CPU in Triton's
interpreter, which checks their arithmetic (float32 and float16: the interpreter mishandles
bfloat16), not the GPU's rounding; without either they skip."""
import os

import pytest
import torch
import torch.nn.functional as F

import hasten
from hasten.kernels import cuda, ops

GPU = torch.cuda.is_available() and cuda.available() is None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and cuda.available() is None
pytestmark = pytest.mark.skipif(not (GPU or INTERPRETED),
                                reason=f"needs CUDA with Triton, or TRITON_INTERPRET=1 ({cuda.available() or 'no GPU'})")
DEVICE = "cuda" if GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if GPU else [torch.float32, torch.float16]


def each_row_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features,out_features", [(576, 200), (1536, 64), (37, 70)])
def test_linear_rows_are_independent_of_their_block(dtype, in_features, out_features):
    torch.manual_seed(in_features)
    weight = (torch.randn(out_features, in_features) * 0.05).to(dtype).to(DEVICE)
    bias = (torch.randn(out_features) * 0.1).to(dtype).to(DEVICE)
    x = torch.randn(40, in_features).to(dtype).to(DEVICE)
    alone = each_row_alone(lambda rows: cuda.linear(rows, weight, bias), x)
    for rows in (1, 2, 3, 7, 16, 17, 40):  # within one tile of rows and across tiles
        assert torch.equal(cuda.linear(x[:rows], weight, bias), alone[:rows]), rows
    reference = F.linear(x.double(), weight.double(), bias.double())
    scale = (x.double().abs() @ weight.double().abs().T).max()
    assert (alone.double() - reference).abs().max() <= (1e-2 if dtype != torch.float32 else 1e-5) * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_and_tree_rows_get_what_lone_rows_get(dtype):
    torch.manual_seed(0)
    heads, kv_heads, dim, keys, rows = 6, 2, 24, 150, 12
    k = torch.randn(kv_heads, keys, dim).to(dtype).to(DEVICE)
    v = torch.randn(kv_heads, keys, dim).to(dtype).to(DEVICE)
    q = torch.randn(rows, heads, dim).to(dtype).to(DEVICE)
    out = cuda.attention(q, k, v, ops.KeyLists.causal(rows, keys, DEVICE), 0.2)
    alone = torch.cat([cuda.attention(q[r : r + 1], k, v, ops.KeyLists.causal(1, keys - rows + r + 1, DEVICE), 0.2)
                       for r in range(rows)])
    assert torch.equal(out, alone)
    mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
    reference = F.scaled_dot_product_attention(q.double().cpu().transpose(0, 1),
                                               k.double().cpu().repeat_interleave(3, 0),
                                               v.double().cpu().repeat_interleave(3, 0), attn_mask=mask, scale=0.2)
    assert (out.double().cpu() - reference.transpose(0, 1)).abs().max() < (2e-2 if dtype == torch.bfloat16 else 2e-3)
    visible = torch.ones(rows, keys, dtype=torch.bool)
    visible[3, 140:145] = False  # a tree row skips some block keys
    tree_rows = ops.KeyLists.from_mask(visible.to(DEVICE))
    tree = cuda.attention(q, k, v, tree_rows, 0.2, softcap=3.0)
    path = torch.cat([torch.arange(140), torch.arange(145, keys)])
    step = cuda.attention(q[3:4], k[:, path].contiguous(), v[:, path].contiguous(),
                          ops.KeyLists.causal(1, len(path), DEVICE), 0.2, softcap=3.0)
    assert torch.equal(tree[3], step[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_alone_and_transformers_formula(dtype):
    torch.manual_seed(1)
    x, weight = torch.randn(33, 576).to(dtype).to(DEVICE), torch.randn(576).to(dtype).to(DEVICE)
    out = cuda.rms_norm(x, weight, 1e-5)
    assert torch.equal(out, each_row_alone(lambda row: cuda.rms_norm(row, weight, 1e-5), x))
    h = x.float()
    written = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert (out.float() - written.float()).abs().max() <= 2 * (written.float().abs().max() * 2**-7)


# ---- models on the GPU ---------------------------------------------------------------------------
gpu_only = pytest.mark.skipif(not GPU, reason="models on CUDA need a GPU")


@gpu_only
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["float32", "bfloat16", "float16"])
def test_block_positions_equal_one_token_steps_on_cuda(family, dtype, monkeypatch):
    from hasten.core.tree import TokenTree
    from hasten.models import cache as kv
    from hasten.models import invariant
    from hasten.models.adapter import ModelAdapter
    from helpers import VOCAB, tiny_model

    monkeypatch.setenv("HASTEN_CUDA_INVARIANT", "1")  # opt-in until a GPU run has checked them (models/invariant.py)
    torch.manual_seed(0)
    model = tiny_model(family).to("cuda", dtype)
    assert invariant.prepare(model), invariant.unavailable(model)
    tree = TokenTree((-1, 0, 0, 1, 2, -1))
    generator = torch.Generator().manual_seed(3)
    for cached in (1, 40):
        prompt = torch.randint(3, VOCAB, (cached + 1,), generator=generator).tolist()
        tokens = torch.randint(3, VOCAB, (64,), generator=generator).tolist()
        block = [prompt[-1], *tokens]
        stepper = ModelAdapter(model)
        stepper.start(torch.tensor([prompt], device="cuda"))
        steps = torch.stack([stepper.forward([token], None).logits[0] for token in block])
        adapter = ModelAdapter(model)
        adapter.start(torch.tensor([prompt], device="cuda"))
        for size in (2, 7, 65):
            assert torch.equal(adapter.forward(block[:size], None).logits, steps[:size]), (cached, size)
            kv.crop(adapter.cache, cached)
        logits = adapter.forward([prompt[-1], tokens[0], tokens[1], 7, tokens[2], 9, 11], tree).logits
        assert torch.equal(logits[[0, 1, 2, 4]], steps[[0, 1, 2, 3]])  # nodes 0, 1, 3 lie on the chain
        kv.crop(adapter.cache, cached)


@gpu_only
def test_drafters_write_plain_decodings_text_in_bfloat16_on_cuda(monkeypatch):
    from hasten.drafters import Lookahead, PromptLookup
    from helpers import ScriptedDrafter, TreeScriptedDrafter, repetitive_prompt, tiny_model

    monkeypatch.setenv("HASTEN_CUDA_INVARIANT", "1")
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    prompt = repetitive_prompt(20, seed=1).to("cuda")
    reference = hasten.generate(model, prompt, max_new_tokens=24).sequences
    drafters = [PromptLookup(num_tokens=4), Lookahead()]
    drafters += [ScriptedDrafter(reference[0].tolist(), 4, mode) for mode in ("oracle", "adversarial", 2)]
    drafters += [TreeScriptedDrafter(reference[0].tolist(), 4, 3, 2, error) for error in (None, 0, 2)]
    for drafter in drafters:
        out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=24, draft_size="fixed")
        assert out.sequences.tolist() == reference.tolist(), type(drafter).__name__
