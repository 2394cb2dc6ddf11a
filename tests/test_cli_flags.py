"""Flags declared once (cli/flags.py): each `train` and `generate` flag is a config field whose
type, default and docstring are the flag's type, default and help."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import pytest

from ringattn.cli.flags import add_flags, field_docs, from_args
from ringattn.cli.main import build_parser
from ringattn.inference.generate import GenerateConfig
from ringattn.serve.config import ServeConfig
from ringattn.train.config import TrainConfig
from ringattn.train.demo import demo_config


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command, cls, defaults", [
    ("train", TrainConfig, TrainConfig()),
    ("demo", TrainConfig, demo_config()),
    ("generate", GenerateConfig, GenerateConfig()),
])  # fmt: skip
def test_no_flags_give_the_config_defaults(command, cls, defaults):
    args = _subparser(command).parse_args([])
    assert from_args(cls, args) == defaults


def test_serve_flags_are_its_config(monkeypatch):
    monkeypatch.delenv("RINGATTN_API_KEY", raising=False)
    args = _subparser("serve").parse_args(["--hf", "model", "--max-queue", "3"])
    assert from_args(ServeConfig, args) == ServeConfig(hf="model", max_queue=3)
    monkeypatch.setenv("RINGATTN_API_KEY", "secret")  # the key's default: the environment
    args = _subparser("serve").parse_args(["--hf", "model"])
    assert from_args(ServeConfig, args).api_key == "secret"
    with pytest.raises(SystemExit):  # --hf is required
        _subparser("serve").parse_args([])


def test_eval_flags_are_its_config():
    from ringattn.evals.worker import EvalConfig

    niah = _subparser("eval")._subparsers._group_actions[0].choices["niah"]
    args = niah.parse_args(["--hf", "m", "--lengths", "256,512", "--depths", "50,", "--chat"])
    assert from_args(EvalConfig, args) == EvalConfig(hf="m", lengths=[256, 512], depths=[50.0],
                                                     chat=True)  # fmt: skip
    assert vars(niah.parse_args(["--hf", "m"]))["depths"] == EvalConfig().depths


def test_every_train_field_is_a_flag_with_its_docstring_as_help():
    parser = _subparser("train")
    actions = {a.dest: a for a in parser._actions}
    docs = field_docs(TrainConfig)
    for f in fields(TrainConfig):
        assert f.name in actions, f"TrainConfig.{f.name} has no flag"
        if actions[f.name].help != argparse.SUPPRESS:
            assert actions[f.name].help == docs[f.name].replace("%", "%%")


def test_flags_parse_to_typed_fields():
    args = _subparser("train").parse_args(
        ["--seq-len", "128", "--lr", "0.5", "--no-resume", "--timeout", "7", "--quiet"]
    )
    cfg = from_args(TrainConfig, args)
    assert (cfg.seq_len, cfg.lr, cfg.resume, cfg.timeout_s, cfg.quiet) == (128, 0.5, False, 7.0,
                                                                           True)  # fmt: skip
    gen = from_args(GenerateConfig, _subparser("generate").parse_args(["--eos-id", "3"]))
    assert gen.eos_id == 3 and gen.hf is None


@dataclass
class _Toy:
    size: int = 1
    """how big"""
    undocumented: int = 0
    ratio: list[int] | None = None
    """not a flag type"""


def test_a_field_without_a_docstring_or_a_flag_type_is_refused():
    assert field_docs(_Toy) == {"size": "how big", "ratio": "not a flag type"}
    with pytest.raises(ValueError, match="no docstring"):
        add_flags(argparse.ArgumentParser(), _Toy(), ["undocumented"])
    with pytest.raises(ValueError, match="no flag for a field of type list"):
        add_flags(argparse.ArgumentParser(), _Toy(), ["ratio"])
    with pytest.raises(ValueError, match="no field 'missing'"):
        add_flags(argparse.ArgumentParser(), _Toy(), ["missing"])


def test_every_command_prints_its_help():
    """argparse %-formats each help string: a docstring's bare "%" once crashed `train --help`."""
    pending, seen = [("ringattn", build_parser())], []
    while pending:
        name, parser = pending.pop()
        assert parser.format_help().startswith("usage:"), name
        seen.append(name)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending += [(f"{name} {n}", p) for n, p in action.choices.items()]
    assert {"ringattn train", "ringattn serve", "ringattn eval niah"} <= set(seen)
    assert "%" in _subparser("train").format_help()
