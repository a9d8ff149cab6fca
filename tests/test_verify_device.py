"""The verifier on the logits' device: uniforms from the user's generator there (a CUDA
generator with CUDA logits), a clear error for a generator elsewhere, one host transfer
per step. CUDA cases run where a GPU exists and say why they are skipped elsewhere."""
import contextlib
import math
import warnings

import pytest
import torch

from hasten.approx import TypicalAcceptance
from hasten.core import sampling as sampling_module
from hasten.core.sampling import Sampling, sample
from hasten.core.tree import TokenTree
from hasten.engine.verify import GreedyAcceptance, SpeculativeSampling

VOCAB = 50
TREE = TokenTree.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (1, 0)])  # siblings at depths 1 and 2
TREE_TOKENS = (3, 7, 3, 9, 1, 3)
CHAIN = TokenTree.chain(3)
CHAIN_TOKENS = (4, 2, 8)


def device_or_skip(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip(f"no CUDA device: torch.cuda.is_available() is False here (torch {torch.__version__}); "
                    "the CUDA generator path runs only on a machine with a GPU")
    return torch.device(name)


def step_inputs(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    tree_logits = (torch.randn(len(TREE) + 1, VOCAB, generator=g) * 2).to(device)
    chain_logits = (torch.randn(len(CHAIN) + 1, VOCAB, generator=g) * 2).to(device)
    chain_q = torch.softmax(torch.randn(len(CHAIN), VOCAB, generator=g), -1).to(device)
    return tree_logits, chain_logits, chain_q


def is_path(tree, path):
    return all(tree.parents[node] == (path[i - 1] if i else -1) for i, node in enumerate(path))


RULES = [
    ("greedy", GreedyAcceptance(), Sampling()),
    ("speculative", SpeculativeSampling(), Sampling(0.9, top_k=20, top_p=0.95)),
    ("typical", TypicalAcceptance(), Sampling(1.0)),
]


@pytest.mark.parametrize("device_name", ["cpu", "cuda"])
@pytest.mark.parametrize("name, rule, sampling", RULES, ids=[r[0] for r in RULES])
def test_rules_run_on_the_logits_device_with_a_generator_there(device_name, name, rule, sampling):
    device = device_or_skip(device_name)
    tree_logits, chain_logits, chain_q = step_inputs(device)
    cases = [(TREE, TREE_TOKENS, tree_logits, None), (CHAIN, CHAIN_TOKENS, chain_logits, chain_q),
             (TokenTree.chain(0), (), chain_logits[:1], None)]
    for tree, tokens, logits, q in cases:
        verdicts = [rule.verify(tree, tokens, logits, q, sampling, torch.Generator(device=device).manual_seed(seed))
                    for seed in (1, 2, 1)]
        assert verdicts[0] == verdicts[2], "same seed, same verdict"
        for verdict in verdicts:
            assert is_path(tree, verdict.accepted)
            assert isinstance(verdict.next_token, int) and 0 <= verdict.next_token < VOCAB


@pytest.mark.parametrize("device_name", ["cpu", "cuda"])
def test_first_token_law_on_the_device(device_name):
    """One step's first token follows p on the device too (top-p included: on an
    accelerator the nucleus comes from the sort search)."""
    device = device_or_skip(device_name)
    sampling = Sampling(0.9, top_p=0.95)
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5)) * 2).to(device)
    p = sampling.probs(logits)[0].cpu()
    q = sampling.probs(torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6)).to(device))
    rule, samples = SpeculativeSampling(), 4000
    counts = torch.zeros(VOCAB)
    for _ in range(samples):
        token = sample(q[0], g)  # drafted from q, as a draft model does
        verdict = rule.verify(TokenTree.chain(1), (token,), logits, q, sampling, g)
        counts[token if verdict.accepted else verdict.next_token] += 1
    tv = 0.5 * float((counts / samples - p).abs().sum())
    limit = 0.5 * float(torch.sqrt(p * (1 - p) / samples).sum()) + math.sqrt(math.log(1e4) / (2 * samples))
    assert tv < limit


def test_a_generator_on_another_device_is_refused():
    logits = torch.zeros(2, VOCAB, device="meta")  # any device but the generator's
    for rule, sampling in [(SpeculativeSampling(), Sampling(1.0)), (TypicalAcceptance(), Sampling(1.0))]:
        with pytest.raises(ValueError, match="generator is on cpu but the model's logits are on meta"):
            rule.verify(TokenTree.chain(1), (0,), logits, None, sampling, torch.Generator())
    with pytest.raises(ValueError, match="generator is on cpu"):
        sample(torch.zeros(VOCAB, device="meta"), torch.Generator())


def test_a_cpu_generator_with_cuda_logits_is_refused():
    device = device_or_skip("cuda")
    logits = torch.zeros(2, VOCAB, device=device)
    with pytest.raises(ValueError, match="generator is on cpu"):
        SpeculativeSampling().verify(TokenTree.chain(1), (0,), logits, None, Sampling(1.0), torch.Generator())
    with pytest.raises(ValueError, match="generator is on cuda"):
        SpeculativeSampling().verify(TokenTree.chain(1), (0,), logits.cpu(), None, Sampling(1.0),
                                     torch.Generator(device=device))


# ---- host transfers ---------------------------------------------------------------------------
TRANSFERS = ("tolist", "item", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


@contextlib.contextmanager
def counted_transfers(monkeypatch):
    """Count every Python-level way a tensor's value reaches the host."""
    calls: list[str] = []
    for name in TRANSFERS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    yield calls
    monkeypatch.undo()


STEPS = [
    ("chain with q", SpeculativeSampling(), Sampling(1.0), CHAIN, CHAIN_TOKENS, "chain"),
    ("tree of point masses", SpeculativeSampling(), Sampling(0.8, top_k=10), TREE, TREE_TOKENS, "tree"),
    ("tree, top-p", SpeculativeSampling(), Sampling(1.0, top_p=0.9), TREE, TREE_TOKENS, "tree"),
    ("no draft", SpeculativeSampling(), Sampling(1.0), TokenTree.chain(0), (), "empty"),
    ("greedy", GreedyAcceptance(), Sampling(), TREE, TREE_TOKENS, "tree"),
    ("typical", TypicalAcceptance(), Sampling(1.0), TREE, TREE_TOKENS, "tree"),
]


@pytest.mark.parametrize("name, rule, sampling, tree, tokens, logits_kind", STEPS, ids=[s[0] for s in STEPS])
def test_one_host_transfer_per_step(monkeypatch, name, rule, sampling, tree, tokens, logits_kind):
    # On the CPU the top-p search grows its candidate count by reading a flag (free there:
    # the data is on the host); an accelerator uses the sort search, which reads nothing.
    # Count the accelerator's path.
    monkeypatch.setattr(sampling_module, "_nucleus_by_topk", sampling_module._nucleus_by_sort)
    tree_logits, chain_logits, chain_q = step_inputs("cpu")
    inputs = {"tree": (tree_logits, None), "chain": (chain_logits, chain_q), "empty": (chain_logits[:1], None)}
    logits, q = inputs[logits_kind]
    g = torch.Generator().manual_seed(0)
    rule.verify(tree, tokens, logits, q, sampling, g)  # first sight of this tree: its index tensors are built
    with counted_transfers(monkeypatch) as calls:
        for _ in range(3):
            rule.verify(tree, tokens, logits, q, sampling, g)
    assert len(calls) == 3, f"{name}: host transfers in 3 steps: {calls}"


def test_one_synchronisation_per_step_on_cuda():
    """CUDA's own sync detector sees what Python-level counting cannot (syncs inside torch ops)."""
    device = device_or_skip("cuda")
    tree_logits, chain_logits, chain_q = step_inputs(device)
    g = torch.Generator(device=device).manual_seed(0)
    for tree, tokens, logits, q, sampling in [(TREE, TREE_TOKENS, tree_logits, None, Sampling(1.0, top_p=0.9)),
                                              (CHAIN, CHAIN_TOKENS, chain_logits, chain_q, Sampling(0.8, top_k=10))]:
        SpeculativeSampling().verify(tree, tokens, logits, q, sampling, g)  # builds the tree's index tensors
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                SpeculativeSampling().verify(tree, tokens, logits, q, sampling, g)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # torch also warns once that the debug mode "is a prototype feature": a notice, not a synchronisation
        syncs = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
        assert len(syncs) <= 1, syncs
