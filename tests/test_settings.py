"""One converter from settings dataclasses to typed values and flags, with one rule set,
for every drafter's settings and every ``hasten train`` settings class."""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

import hasten  # noqa: F401  (registers every built-in drafter)
from hasten.arguments import Parser
from hasten.core import settings as settings_io
from hasten.core.settings import Settings, option
from hasten.drafters import REGISTRY
from hasten.training.distill import DistillSettings
from hasten.training.trainer import TrainSettings


def all_settings_classes() -> dict[str, type]:
    classes = {f"{name}.Settings": cls.Settings for name, cls in sorted(REGISTRY.items())}
    for name, cls in sorted(REGISTRY.items()):
        if cls.Training is not None:
            classes[f"{name}.Training.Options"] = cls.Training.Options
    return {**classes, "DistillSettings": DistillSettings, "TrainSettings": TrainSettings}


CLASSES = all_settings_classes()
IDS = sorted(CLASSES)


def fields_of_kind(settings_cls: type, wanted: type) -> list[str]:
    return [name for name, (kind, _) in settings_io.field_kinds(settings_cls).items() if kind is wanted]


def as_text(value) -> str:
    """A value as a user would type it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def test_every_method_and_training_class_is_covered():
    assert {"prompt_lookup.Settings", "draft_model.Settings", "medusa.Settings", "eagle.Settings",
            "medusa.Training.Options", "DistillSettings", "TrainSettings"} <= set(CLASSES)


@pytest.mark.parametrize("name", IDS)
def test_settings_inherit_the_one_rule_set(name):
    settings_cls = CLASSES[name]
    assert issubclass(settings_cls, Settings), f"{name} does not inherit hasten.core.settings.Settings"
    assert dataclasses.is_dataclass(settings_cls) and settings_cls.__dataclass_params__.frozen


@pytest.mark.parametrize("name", IDS)
def test_bool_is_refused_for_int_fields_and_nan_for_float_fields(name):
    settings_cls = CLASSES[name]
    for field in fields_of_kind(settings_cls, int):
        with pytest.raises(ValueError, match=rf"{settings_cls.__name__}\.{field} must be an integer"):
            settings_cls(**{field: True})
    for field in fields_of_kind(settings_cls, float):
        with pytest.raises(ValueError, match=rf"{settings_cls.__name__}\.{field} must be a finite number"):
            settings_cls(**{field: math.nan})
    for field in fields_of_kind(settings_cls, bool):
        with pytest.raises(ValueError, match=rf"{settings_cls.__name__}\.{field} must be true or false"):
            settings_cls(**{field: 1})


@pytest.mark.parametrize("name", IDS)
def test_defaults_round_trip_through_pairs_and_flags(name):
    settings_cls = CLASSES[name]
    default = settings_cls()
    fields = dataclasses.fields(settings_cls)
    pairs = [f"{f.name}={as_text(getattr(default, f.name))}" for f in fields]
    assert settings_cls(**settings_io.from_pairs(settings_cls, pairs)) == default

    parser = argparse.ArgumentParser()
    settings_io.add_flags(parser, settings_cls)
    argv = []
    for f in fields:
        value, flag = getattr(default, f.name), settings_io.flag_name(f.name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv.append(f"{flag}={as_text(value)}")
    assert settings_io.from_args(settings_cls, parser.parse_args(argv)) == default
    assert settings_io.from_args(settings_cls, parser.parse_args([])) == default  # absent flags: defaults


@pytest.mark.parametrize("name", IDS)
def test_numbers_arrive_typed_even_where_the_default_is_none(name):
    """The old ``--method-arg`` typed values by the default, so ``X | None = None`` got strings."""
    settings_cls = CLASSES[name]
    for field, (kind, optional) in settings_io.field_kinds(settings_cls).items():
        if kind in (int, float):
            value = settings_io.parse_value(settings_cls, field, "3")
            assert value == 3 and type(value) is kind, field
            with pytest.raises(ValueError, match=rf"{settings_cls.__name__}\.{field}"):
                settings_io.parse_value(settings_cls, field, "three")
            if optional:
                assert settings_io.parse_value(settings_cls, field, "None") is None
        if kind is int:
            for text in ("true", "2.5", "nan"):
                with pytest.raises(ValueError, match=rf"{settings_cls.__name__}\.{field} must be an integer"):
                    settings_io.parse_value(settings_cls, field, text)
        if kind is float:
            for text in ("nan", "inf", "-inf"):
                with pytest.raises(ValueError, match=rf"{settings_cls.__name__}\.{field} must be a finite number"):
                    settings_io.parse_value(settings_cls, field, text)


def test_train_settings_none_default_fields():
    values = settings_io.from_pairs(TrainSettings, ["steps=7", "minutes=0.5"], flag="--train")
    assert values == {"steps": 7, "minutes": 0.5} and type(values["steps"]) is int
    assert TrainSettings(**values).steps == 7
    assert settings_io.from_pairs(TrainSettings, ["steps=none"]) == {"steps": None}


TREE_CLASSES = [name for name in IDS if "tree" in settings_io.field_kinds(CLASSES[name])]


def test_some_method_takes_tree_paths():
    assert TREE_CLASSES, "no settings class has a tree field"


@pytest.mark.parametrize("name", TREE_CLASSES)
def test_tree_paths_given_as_text(name):
    settings_cls = CLASSES[name]
    values = settings_io.from_pairs(settings_cls, ["tree=[(0,), (0, 0), (1,)]"])
    assert settings_cls(**values).tree == ((0,), (0, 0), (1,))
    assert settings_cls(**settings_io.from_pairs(settings_cls, ["tree=none"])).tree is None
    with pytest.raises(ValueError, match="(?i)tree"):
        settings_cls(**settings_io.from_pairs(settings_cls, ["tree=[(0, 0)]"]))  # (0,) missing
    with pytest.raises(ValueError, match="tree must be a list of paths"):
        settings_cls(**settings_io.from_pairs(settings_cls, ["tree=[(0,"]))


# ---- the converter on a settings class of every kind of field ----------------------------------------
@dataclass(frozen=True)
class Knobs(Settings):
    count: int = option(2, "how many")
    limit: int | None = option(None, "at most this many")
    scale: float = option(1.0, "how much")
    ratio: float | None = None
    greedy: bool = option(False, "take the best")
    label: str = "x"
    folder: Path | None = None
    paths: tuple[tuple[int, ...], ...] | None = None  # parses its own text

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.count < 1:
            raise ValueError(f"count must be >= 1, got {self.count}")


def test_type_rules():
    assert Knobs(scale=2).scale == 2  # an int is a number
    assert Knobs(limit=None, ratio=None, folder=None).limit is None
    assert Knobs(folder="a/b").folder == "a/b" and Knobs(folder=Path("a")).folder == Path("a")
    for bad, match in [({"count": True}, "Knobs.count must be an integer, got True"),
                       ({"count": "3"}, "Knobs.count must be an integer, got '3'"),
                       ({"count": 2.0}, "Knobs.count must be an integer"),
                       ({"limit": False}, "Knobs.limit must be an integer"),
                       ({"scale": math.inf}, "Knobs.scale must be a finite number"),
                       ({"scale": True}, "Knobs.scale must be a finite number"),
                       ({"ratio": "0.5"}, "Knobs.ratio must be a finite number"),
                       ({"greedy": 0}, "Knobs.greedy must be true or false"),
                       ({"label": 3}, "Knobs.label must be a string"),
                       ({"count": 0}, "count must be >= 1")]:
        with pytest.raises(ValueError, match=match):
            Knobs(**bad)


def test_text_to_values():
    pairs = ["count=4", "limit=9", "scale=0.25", "ratio=none", "greedy=yes", "label=a=b", "folder=out/x",
             "paths=((0,),)"]
    values = settings_io.from_pairs(Knobs, pairs)
    assert values == {"count": 4, "limit": 9, "scale": 0.25, "ratio": None, "greedy": True, "label": "a=b",
                      "folder": Path("out/x"), "paths": "((0,),)"}
    assert [settings_io.parse_value(Knobs, "greedy", t) for t in ("1", "On", "no", "FALSE")] == [True, True, False,
                                                                                                 False]
    assert settings_io.parse_value(Knobs, "label", "none") == "none"  # not optional: just text
    for pair, match in [("count", "expected KEY=VALUE"), ("speed=3", "no setting 'speed'"),
                        ("greedy=maybe", "Knobs.greedy must be true or false, got 'maybe'"),
                        ("count=", "Knobs.count must be an integer")]:
        with pytest.raises(ValueError, match=match):
            settings_io.from_pairs(Knobs, [pair])


def test_build():
    assert settings_io.build(Knobs, count=3) == Knobs(count=3)
    ready = Knobs(count=5)
    assert settings_io.build(Knobs, ready) is ready
    with pytest.raises(TypeError, match="no setting"):
        settings_io.build(Knobs, speed=1)
    with pytest.raises(TypeError, match="either settings= or keyword"):
        settings_io.build(Knobs, ready, count=1)
    with pytest.raises(TypeError, match="must be a Knobs"):
        settings_io.build(Knobs, TrainSettings())


def test_flags(capsys):
    parser = Parser(prog="knobs")
    settings_io.add_flags(parser, Knobs)
    args = parser.parse_args(["--count", "3", "--greedy", "--ratio", "0.5", "--folder", "f"])
    assert settings_io.from_args(Knobs, args) == Knobs(count=3, greedy=True, ratio=0.5, folder=Path("f"))
    assert settings_io.from_args(Knobs, parser.parse_args(["--no-greedy"])).greedy is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--limit LIMIT" not in text and "--limit INT" in text and "at most this many (default: unset)" in text
    assert "--greedy, --no-greedy" in text and "--scale FLOAT" in text
    for bad, match in [(["--count", "true"], "argument --count: Knobs.count must be an integer, got 'true'"),
                       (["--scale", "nan"], "argument --scale: Knobs.scale must be a finite number")]:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(bad)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and match in err and len(err.strip().splitlines()) == 1
    # a range error shows when the dataclass is built (the CLI prints it as one line)
    with pytest.raises(ValueError, match="count must be >= 1"):
        settings_io.from_args(Knobs, parser.parse_args(["--count", "0"]))


def test_one_flag_sets_every_class_that_has_the_field():
    parser = argparse.ArgumentParser()
    added: set[str] = set()
    settings_io.add_flags(parser, DistillSettings, added)
    settings_io.add_flags(parser, TrainSettings, added)  # both have seed: one --seed flag
    args = parser.parse_args(["--seed", "5"])
    assert settings_io.from_args(DistillSettings, args).seed == settings_io.from_args(TrainSettings, args).seed == 5


# ---- the command line: one line, exit status 2 ------------------------------------------------------


@pytest.mark.parametrize("args, match", [
    (["generate", "--prompt", "x", "--method", "prompt_lookup", "--method-arg", "num_tokens=abc"], "PromptLookupSettings.num_tokens must be an"),
    (["generate", "--prompt", "x", "--method", "prompt_lookup", "--method-arg", "num_tokens=true"], "PromptLookupSettings.num_tokens must be an"),
    (["generate", "--prompt", "x", "--method", "prompt_lookup", "--method-arg", "num_tokens=0"], "num_tokens must be >= 1"),
    (["generate", "--prompt", "x", "--method", "prompt_lookup", "--method-arg", "num_tokens"], "expected KEY=VALUE"),
    (["generate", "--prompt", "x", "--method", "autoregressive", "--method-arg", "a=1"], "takes no --method-arg"),
    (["generate", "--prompt", "x", "--method", "draft_model", "--method-arg", "adaptive=maybe"],
     "DraftModelSettings.adaptive must be true or false"),
    (["bench", "--method-arg", "prompt_lookup.num_tokens=x"], "PromptLookupSettings.num_tokens must be an"),
    (["bench", "--methods", "prompt_lookup", "--method-arg", "max_ngram=1.5"], "max_ngram must be an integer"),
    (["train", "medusa", "--data", "d.txt", "--out", "o", "--batch-size", "true"],
     "argument --batch-size: TrainSettings.batch_size must be an integer, got 'true'"),
    (["train", "medusa", "--data", "d.txt", "--out", "o", "--lr", "inf"], "TrainSettings.lr must be a finite number"),
])
def test_cli_setting_errors_are_one_line_before_any_model_loads(args, match, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(*args, "--model", str(tmp_path / "missing"))
    assert code == 2, err
    assert match in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
