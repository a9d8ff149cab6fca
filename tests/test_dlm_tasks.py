"""hasten.dlm.tasks: the function-completion task of ``hasten dlm bench`` on hand-written strings."""
from __future__ import annotations

import pytest

from hasten.dlm.tasks import completes_function, exact_match, function_splits, trim_function

HEAD = '    def area(self):\n        """The area."""'  # a method: the def line is indented 4


def test_trim_stops_at_the_first_line_no_deeper_than_the_def():
    completion = "\n        w = self.w\n\n        return w * self.h\n\n    def perimeter(self):\n        return 0\n"
    assert trim_function(HEAD, completion) == "\n        w = self.w\n\n        return w * self.h\n\n"
    assert trim_function(HEAD, "\n        return 1\nx = 2\n") == "\n        return 1\n"  # a shallower line too
    assert trim_function(HEAD, "\n        return (1 +\n                2)\n") == "\n        return (1 +\n" \
        "                2)\n"  # never ends: all of it
    assert trim_function(HEAD, "\n    # a comment at the def's depth ends it\n") == "\n"


def test_trim_continues_the_line_the_head_left_open():
    # The head ends mid-line (no newline): the completion's first piece belongs to that line, whatever its indent.
    assert trim_function("def f(a,", " b):\n    return a\nprint(1)\n") == " b):\n    return a\n"
    assert trim_function("def f():\n", "    return 1\ny = 0\n") == "    return 1\n"  # head ends at a line start


def test_a_completion_is_valid_when_the_dedented_function_parses():
    assert completes_function(HEAD, "\n        return self.w * self.h\n\n    def other(self):\n        pass\n")
    assert not completes_function(HEAD, "\n        return self.w * (self.h\n\n    def other(self):\n")
    assert not completes_function(HEAD, "\n    def other(self):\n        pass\n")  # adds nothing to the function
    assert not completes_function(HEAD, "\n        # only a comment\n\n    x = 1\n")  # nor does a comment
    assert not completes_function(HEAD, "\n      return 1\n        x = 2\n")  # inconsistent indentation
    assert completes_function("def f():\n    x = 1", "\n    return x\n\x00")  # past the end is never read
    assert not completes_function("def f():\n    x = 1", "\n    return '\x00'\n")  # a NUL inside: no crash, invalid


def test_exact_match_ignores_trailing_whitespace_and_what_follows_the_function():
    reference = "\n        return self.w * self.h"
    assert exact_match(HEAD, "\n        return self.w * self.h\n\n\n    def x(self):\n", reference)
    assert not exact_match(HEAD, "\n        return self.h * self.w\n", reference)


def test_function_splits_cut_after_the_docstring_or_the_first_statement():
    text = ('import os\n\n\nclass Box:\n    def area(self):\n        """The area."""\n        w = self.w\n'
            '        return w * self.h\n\n    def one(self): return 1\n\n    def two(self):\n        a = 1\n'
            '        b = 2\n        return a + b\n\n\ndef lone():\n    """Only a docstring."""\n')
    splits = {text[s.start:text.index("\n", s.start)]: s for s in function_splits(text)}
    assert sorted(splits) == ["    def area(self):", "    def two(self):"]  # one-liners and bodiless ones left out
    area, two = splits["    def area(self):"], splits["    def two(self):"]
    assert text[area.start:area.split] == '    def area(self):\n        """The area."""'
    assert text[area.split:area.end] == "\n        w = self.w\n        return w * self.h"
    assert text[two.start:two.split] == "    def two(self):\n        a = 1"
    assert text[two.split:two.end] == "\n        b = 2\n        return a + b"
    assert function_splits("def broken(:\n") == []


@pytest.mark.parametrize("completion, valid", [("\n    return 2\n", True), ("\n    return 2 +\n", False),
                                               ("\n        return 2\n", False)])  # deeper than the docstring
def test_metric_on_a_split_of_real_text(completion, valid):
    text = 'def g(x):\n    """Twice."""\n    return 2 * x\n'
    (split,) = function_splits(text)
    head = text[split.start:split.split]
    assert completes_function(head, text[split.split:])  # the real continuation always parses
    assert completes_function(head, completion) is valid


def test_heldout_modules_parse_and_offer_functions_to_complete():
    from hasten.dlm.heldout import SOURCES

    for name, text in SOURCES.items():  # the agreement check's prompts (docs/dlm.md) draw from these
        splits = function_splits(text)
        assert len(splits) >= 8, name
        assert all(text[split.split] == "\n" and split.start < split.split < split.end for split in splits)
