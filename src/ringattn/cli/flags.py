"""Command-line flags declared once: a config dataclass's fields, their types and docstrings.

    @dataclass
    class TrainConfig:
        seq_len: int = 4096
        \"\"\"tokens per sequence (split over the cp ranks)\"\"\"

    add_flags(group, TrainConfig(), ["seq_len", ...], choices={"layout": LAYOUTS})
      == group.add_argument("--seq-len", type=int, default=4096,
                            help="tokens per sequence (split over the cp ranks)")
    cfg = from_args(TrainConfig, args)          # every field that has a flag, back from the flags

The flag is the field's name in kebab-case (or `spelled[name]`, with the field as its dest), its
type the field's annotation (int, float, str; `X | None` an optional X), its default the value
in the `defaults` instance given (so `ringattn demo` shows the demo's), its help the field's
docstring. A `bool` field is a switch: `--name` (store_true), or `--name/--no-name` when it is in
`negatable`. So a flag's name, type, default and help live in one place, the config the library
reads, and `--help` shows what the docstring says.
"""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields

__all__ = ["add_flags", "field_docs", "from_args"]

_TYPES = {"int": int, "float": float, "str": str}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field: its docstring, on one line} for the string statements after a class's fields."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for field, after in itertools.pairwise(body):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):  # fmt: skip
            docs[field.target.id] = " ".join(after.value.value.split())
    return docs


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    defaults: object,
    names: Iterable[str],
    *,
    choices: Mapping[str, Sequence[str]] | None = None,
    metavars: Mapping[str, str] | None = None,
    spelled: Mapping[str, str] | None = None,
    negatable: Iterable[str] = (),
    hidden: Iterable[str] = (),
    required: Iterable[str] = (),
    types: Mapping[str, Callable[[str], object]] | None = None,
) -> None:
    """One flag per field of `names` on `parser` (module docstring). `hidden` flags work but are
    left out of --help (testing switches); `required` ones must be given; `types` parses the
    fields no annotation can (a list written "1024,4096")."""
    cls = type(defaults)
    declared = {f.name: f.type for f in fields(cls)}
    docs = field_docs(cls)
    choices, metavars, spelled, parsers = choices or {}, metavars or {}, spelled or {}, types or {}
    negatable, hidden, required = set(negatable), set(hidden), set(required)
    for name in names:
        if name not in declared:
            raise ValueError(f"{cls.__name__} has no field {name!r} to make a flag of")
        if name not in docs and name not in hidden:
            raise ValueError(f"{cls.__name__}.{name} has no docstring to be its flag's help")
        flag = spelled.get(name, "--" + name.replace("_", "-"))
        kwargs: dict = {"dest": name, "default": getattr(defaults, name)}
        # argparse %-formats help (for %(default)s): a docstring's own "%" must be doubled
        kwargs["help"] = argparse.SUPPRESS if name in hidden else docs[name].replace("%", "%%")
        if name in required:
            kwargs["required"] = True
        annotation = declared[name]
        annotation = annotation if isinstance(annotation, str) else annotation.__name__
        annotation = annotation.removesuffix(" | None")
        if annotation == "bool":
            kwargs["action"] = (argparse.BooleanOptionalAction if name in negatable
                                else "store_true")  # fmt: skip
        elif annotation in _TYPES or name in parsers:
            kwargs["type"] = parsers.get(name) or _TYPES[annotation]
            if name in choices:
                kwargs["choices"] = tuple(choices[name])
            if name in metavars:
                kwargs["metavar"] = metavars[name]
        else:
            raise ValueError(f"{cls.__name__}.{name}: no flag for a field of type {annotation}")
        parser.add_argument(flag, **kwargs)


def from_args(cls: type, args: argparse.Namespace) -> object:
    """`cls` built from the parsed flags: every field that has one (the rest keep defaults)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
