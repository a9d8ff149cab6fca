"""Forward compatibility with transformers' renamed keywords, and warnings told apart by origin."""
import sys
import warnings

import pytest
import torch
import transformers
from torch import nn

import hasten
from hasten.arguments import WarningPrinter, readable_warnings, warning_origin
from hasten.core.errors import HastenWarning
from hasten.drafters import PromptLookup
from hasten.models.compat import NEW_CACHE_KEYWORD, OLD_CACHE_KEYWORD, cache_argument, cache_keyword
from helpers import CAUSAL_CONFIGS, SEQ2SEQ_CONFIGS, TreeScriptedDrafter, hf_greedy, repetitive_prompt, tiny_model


class OldStyle(nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False):
        return past_key_values


class NewStyle(nn.Module):
    def forward(self, input_ids, cache=None, use_cache=False):
        return cache


def test_the_cache_keyword_is_read_from_the_forward_signature():
    assert cache_keyword(OldStyle) == OLD_CACHE_KEYWORD and cache_keyword(NewStyle) == NEW_CACHE_KEYWORD
    marker = object()
    for module in (OldStyle(), NewStyle()):
        assert module(None, **cache_argument(module, marker)) is marker


def test_the_installed_transformers_gets_the_keyword_its_llama_declares():
    import inspect

    declared = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
    expected = NEW_CACHE_KEYWORD if NEW_CACHE_KEYWORD in declared else OLD_CACHE_KEYWORD
    assert cache_keyword(transformers.LlamaForCausalLM) == expected


@pytest.mark.parametrize("arch", sorted(CAUSAL_CONFIGS) + sorted(SEQ2SEQ_CONFIGS))
def test_no_future_warning_from_hasten_forwards(arch):
    """Plain, chain and tree steps on every tiny architecture raise no FutureWarning (a
    deprecated keyword passed by hasten would, on the releases that renamed it)."""
    model = tiny_model(arch)
    prompt = repetitive_prompt(16, seed=2)
    reference = hf_greedy(model, prompt, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        for drafter in (None, PromptLookup(num_tokens=3), TreeScriptedDrafter(reference[0].tolist(), 3, 2, 1, 1)):
            out = hasten.generate(model, prompt, drafter=drafter, max_new_tokens=12)
            assert out.sequences.tolist() == reference.tolist()


def _raise(category, text, filename, lineno=7):
    warnings.warn_explicit(text, category, filename, lineno, module="fake")


def test_dependency_warnings_pass_through_once_with_their_origin(capsys, tmp_path):
    site = tmp_path / "site-packages"
    (site / "somelib").mkdir(parents=True)
    sys.path.insert(0, str(site))
    try:
        with readable_warnings():
            for _ in range(3):
                _raise(FutureWarning, "old  keyword\nis deprecated", str(site / "somelib" / "mod.py"))
            _raise(HastenWarning, "no medusa weights found", __file__)
    finally:
        sys.path.remove(str(site))
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["FutureWarning from somelib/mod.py:7: old keyword is deprecated",
                     "hasten: warning: no medusa weights found"]


def test_a_warning_outside_any_path_entry_names_its_file(tmp_path):
    assert warning_origin("/nowhere/x.py", 3).endswith("x.py:3")


def test_the_printer_relabels_nothing(capsys):
    printer = WarningPrinter()
    printer(UserWarning("a user warning"), UserWarning, "/nowhere/x.py", 1)
    err = capsys.readouterr().err
    assert err.startswith("UserWarning from ") and "hasten:" not in err
