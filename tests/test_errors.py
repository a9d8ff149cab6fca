"""Bad input gets a clear error naming the argument, and nothing else breaks."""
import pytest
import torch
import transformers as tf

import hasten
from hasten.drafters import DraftModel, PromptLookup, create
from hasten.models.cache import CacheRollbackError
from helpers import repetitive_prompt, tiny_model

MODEL = tiny_model("llama")
PROMPT = repetitive_prompt(10)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "empty"),
        (dict(input_ids=torch.tensor([[1, 999]])), ValueError, "999.*vocabulary"),
        (dict(input_ids=torch.tensor([[1, -1]])), ValueError, "-1.*vocabulary"),
        (dict(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4)), ValueError, "shape"),
        (dict(input_ids=torch.ones(5, dtype=torch.long)), ValueError, r"\[1, T\]"),
        (dict(input_ids=[[1, 2]]), TypeError, "input_ids"),
        (dict(input_ids=torch.ones(1, 3)), TypeError, "LongTensor"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=2.5), ValueError, "max_new_tokens"),
        (dict(temperature=-0.1), ValueError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(drafter="prompt_lookup"), TypeError, "drafter"),
        (dict(generator=123), TypeError, "generator"),
        (dict(eos_token_id="x"), TypeError, "eos_token_id"),
    ],
)
def test_generate_rejects_bad_input(kwargs, error, match):
    args = dict(input_ids=PROMPT, max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        hasten.generate(MODEL, args.pop("input_ids"), **args)
    # nothing else broke: the same model still generates
    assert hasten.generate(MODEL, PROMPT, max_new_tokens=3).stats.new_tokens == 3


def test_draft_model_with_another_vocabulary_is_refused():
    other = tiny_model("llama", vocab_size=50)
    with pytest.raises(ValueError, match="vocabulary of 50"):
        hasten.generate(MODEL, PROMPT, drafter=DraftModel(other), max_new_tokens=4)


def test_draft_model_needs_a_model():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        DraftModel("path/to/model")


def test_model_whose_cache_cannot_roll_back_is_named():
    torch.manual_seed(0)
    mamba = tf.MambaForCausalLM(tf.MambaConfig(vocab_size=96, hidden_size=16, num_hidden_layers=1, state_size=4)).eval()
    with pytest.raises(CacheRollbackError, match="cannot be rolled back"):
        hasten.generate(mamba, PROMPT, drafter=PromptLookup(), max_new_tokens=4)
    assert issubclass(CacheRollbackError, ValueError)


def test_settings_are_validated_on_construction():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(min_ngram=0)
    with pytest.raises(ValueError, match="max_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="num_tokens"):
        DraftModel(MODEL, num_tokens=0)
    with pytest.raises(TypeError, match="no setting"):
        PromptLookup(bogus=1)
    with pytest.raises(ValueError, match="unknown drafter 'nope'.*prompt_lookup"):
        create("nope")


def test_missing_model_path():
    with pytest.raises(ValueError, match="could not be loaded"):
        hasten.load("/no/such/model/dir", method="autoregressive")


# ---- positions: the prompt and the new tokens must fit the model ---------------------------------------
@pytest.mark.parametrize("arch, limit_name", [("llama", "max_position_embeddings"), ("gpt2", "n_positions")])
def test_max_new_tokens_beyond_the_positions_is_refused(arch, limit_name):
    model = tiny_model(arch, **{limit_name: 16})  # gpt2's learned positions really end there
    prompt = PROMPT  # 10 tokens
    assert hasten.generate(model, prompt, max_new_tokens=6).stats.new_tokens == 6  # exactly fits
    with pytest.raises(ValueError, match="max_new_tokens=7 does not fit: the prompt has 10 tokens and the model 16 "
                                         "positions, room for at most 6 new tokens"):
        hasten.generate(model, prompt, max_new_tokens=7)
    with pytest.raises(ValueError, match="the prompt has 17 tokens, more than the model's context of 16 positions"):
        hasten.generate(model, repetitive_prompt(17 + 1)[:, :17], max_new_tokens=0)


def test_encoder_decoder_positions():
    bart = tiny_model("bart", max_position_embeddings=16)
    assert hasten.generate(bart, PROMPT, max_new_tokens=15, eos_token_id=[]).stats.new_tokens == 15
    with pytest.raises(ValueError, match="max_new_tokens=16 does not fit: the model's decoder has 16 positions"):
        hasten.generate(bart, PROMPT, max_new_tokens=16)
    with pytest.raises(ValueError, match="the prompt has 17 tokens, more than the model's context of 16"):
        hasten.generate(bart, repetitive_prompt(18)[:, :17], max_new_tokens=1)


def test_models_without_a_position_limit_pass():
    t5 = tiny_model("t5")  # relative positions: no limit in its config
    long_prompt = repetitive_prompt(600)
    assert hasten.generate(t5, long_prompt, max_new_tokens=2, eos_token_id=[]).stats.new_tokens == 2
