"""Greedy output is token-identical to Hugging Face greedy generate, for every drafter."""
import pytest
import torch

import hasten
from hasten.drafters import DraftModel, Lookahead, PromptLookup, Suffix
from helpers import (
    CAUSAL_CONFIGS, DEVICE, SEQ2SEQ_CONFIGS, ScriptedDrafter, TreeScriptedDrafter, hf_greedy, repetitive_prompt,
    tiny_model,
)

ARCHS = sorted(CAUSAL_CONFIGS) + sorted(SEQ2SEQ_CONFIGS)
NEW = 24
DRAFT_LEN = 4


@pytest.fixture(scope="module", params=ARCHS)
def setup(request):
    arch = request.param
    model = tiny_model(arch)
    prompt = repetitive_prompt(20, seed=1)
    reference = hf_greedy(model, prompt, NEW)
    return arch, model, prompt, reference


def check(model, prompt, reference, drafter, **kwargs):
    """Fixed sizing unless told otherwise: the scripted cases count steps against their own depth."""
    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=NEW, **{"draft_size": "fixed", **kwargs})
    assert out.sequences.tolist() == reference.tolist()
    new = reference.shape[1] - (1 if model.config.is_encoder_decoder else prompt.shape[1])
    assert out.stats.new_tokens == new
    return out


def test_plain_decoding(setup):
    _, model, prompt, reference = setup
    out = check(model, prompt, reference, None)
    assert out.stats.mean_accepted == 1.0


@pytest.mark.parametrize("mode", ["oracle", "adversarial", *range(DRAFT_LEN)])
def test_scripted_drafts(setup, mode):
    _, model, prompt, reference = setup
    drafter = ScriptedDrafter(reference[0].tolist(), DRAFT_LEN, mode)
    out = check(model, prompt, reference, drafter)
    if mode == "oracle":
        # every step commits the whole draft plus the bonus token
        assert out.stats.steps == -(-out.stats.new_tokens // (DRAFT_LEN + 1))
    elif mode == "adversarial":
        assert out.stats.accepted_tokens == 0 and out.stats.mean_accepted == 1.0
    else:
        assert 0 < out.stats.mean_accepted <= mode + 1


@pytest.mark.parametrize("mode", ["oracle", "adversarial", *range(DRAFT_LEN)])
@pytest.mark.parametrize("right_sibling", [0, 2])
def test_scripted_trees(setup, mode, right_sibling):
    """Causal targets verify the whole tree; encoder-decoders verify its main chain (the
    first child at every level), which holds the right tokens only when right_sibling is 0."""
    arch, model, prompt, reference = setup
    error_at = {"oracle": None, "adversarial": 0}.get(mode, mode)
    drafter = TreeScriptedDrafter(reference[0].tolist(), DRAFT_LEN, 3, right_sibling, error_at)
    out = check(model, prompt, reference, drafter)
    right_path_verified = not model.config.is_encoder_decoder or right_sibling == 0
    if mode == "oracle" and right_path_verified:
        assert out.stats.steps == -(-out.stats.new_tokens // (DRAFT_LEN + 1))
    elif mode == "adversarial" or not right_path_verified:
        assert out.stats.accepted_tokens == 0
    if model.config.is_encoder_decoder:
        assert out.stats.drafted_tokens <= DRAFT_LEN * out.stats.steps  # chains: one node per level


# one pooled drafter (lookahead, suffix) serves every architecture and test here: its pool holds
# every earlier generation's output (other vocabularies too) when it drafts
@pytest.mark.parametrize("drafter", [PromptLookup(num_tokens=DRAFT_LEN), PromptLookup(num_tokens=DRAFT_LEN, match="earliest"),
                                     Lookahead(), Lookahead(draft_tokens=4, branch_length=2),
                                     Lookahead(shared=False), Suffix(), Suffix(tree_spec=False), Suffix(shared=False)],
                         ids=["prompt_lookup", "prompt_lookup_earliest", "lookahead", "lookahead_small",
                              "lookahead_per_request", "suffix", "suffix_path", "suffix_per_request"])
def test_input_guided_drafters(setup, drafter):
    _, model, prompt, reference = setup
    check(model, prompt, reference, drafter)
    check(model, prompt, reference, drafter)  # again, the pool now holding this very answer


@pytest.mark.parametrize("make", [Lookahead, Suffix], ids=["lookahead", "suffix"])
def test_pooled_drafters_draft_the_answer_they_learned(setup, make):
    """The second generation of the same prompt drafts from the first one's output: every draft
    accepted up to the pool's limits, the text still the plain model's."""
    _, model, prompt, reference = setup
    drafter = make()
    first = check(model, prompt, reference, drafter)
    second = check(model, prompt, reference, drafter)
    if first.stats.new_tokens > 3:  # (some tiny models end at once)
        assert second.stats.steps < first.stats.steps and second.stats.accepted_tokens > 0


@pytest.mark.parametrize("adaptive", [False, True])
def test_draft_model(setup, adaptive):
    arch, model, prompt, reference = setup
    for draft in (tiny_model(arch, seed=7), model):  # a stranger, and the target itself (all accepted)
        out = check(model, prompt, reference, DraftModel(draft, num_tokens=DRAFT_LEN, adaptive=adaptive))
    assert out.stats.accepted_tokens == out.stats.drafted_tokens


def test_eos_inside_accepted_draft():
    model = tiny_model("llama")
    prompt = repetitive_prompt(16)
    free = hf_greedy(model, prompt, NEW, eos_token_id=None)[0].tolist()
    eos = free[prompt.shape[1] + 5]  # the 6th new token becomes the stop token
    reference = hf_greedy(model, prompt, NEW, eos_token_id=eos)
    assert reference.shape[1] <= prompt.shape[1] + 6
    out = hasten.generate(
        model, prompt, drafter=ScriptedDrafter(free, 8, "oracle"), max_new_tokens=NEW, eos_token_id=eos, draft_size="fixed"
    )
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.steps == 1  # the stop token sat inside the first accepted draft


@pytest.mark.parametrize("budget", [1, 2, 5, 9])
def test_max_new_tokens_inside_draft(budget):
    model = tiny_model("qwen2")
    prompt = repetitive_prompt(16)
    reference = hf_greedy(model, prompt, budget, eos_token_id=None)
    drafter = ScriptedDrafter(hf_greedy(model, prompt, 40, eos_token_id=None)[0].tolist(), 8, "oracle")
    out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=budget, eos_token_id=[])
    assert out.sequences.shape[1] == prompt.shape[1] + budget
    assert out.sequences.tolist() == reference.tolist()


def test_zero_new_tokens_returns_prompt():
    model = tiny_model("llama")
    prompt = repetitive_prompt(8)
    out = hasten.generate(model, prompt, drafter=PromptLookup(), max_new_tokens=0)
    assert out.sequences.tolist() == prompt.tolist() and out.stats.steps == 0  # the model may sit on another device


def test_drafter_reused_across_generations_and_prompts():
    model = tiny_model("mistral")
    drafter = DraftModel(tiny_model("mistral", seed=3), num_tokens=3, adaptive=True)
    for seed in range(3):
        prompt = repetitive_prompt(12 + 2 * seed, seed=seed)
        reference = hf_greedy(model, prompt, 16)
        out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=16)
        assert out.sequences.tolist() == reference.tolist()


def test_single_token_prompt():
    model = tiny_model("gpt2")
    prompt = torch.tensor([[5]], device=DEVICE)
    assert hasten.generate(model, prompt, drafter=PromptLookup(), max_new_tokens=12).sequences.tolist() == hf_greedy(model, prompt, 12).tolist()
