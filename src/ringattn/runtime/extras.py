"""The optional extras of `pip install ringattn[...]`, and the one-line refusal when one is missing.

    require("serve", "ringattn serve")
      -> MissingExtra: ringattn serve needs the serve extra: pip install 'ringattn[serve]'

A bare `pip install ringattn` (torch and numpy) runs every command that needs no extra; a command
or flag that needs one calls `require` before it starts any process, and the CLI prints the
message alone and exits 2. The packages are looked up with `importlib.util.find_spec`, which
imports nothing. The names below mirror pyproject.toml's [project.optional-dependencies].
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "MissingExtra", "missing", "require"]

EXTRAS: dict[str, tuple[str, ...]] = {
    "hf": ("transformers",),
    "serve": ("fastapi", "uvicorn", "pydantic", "transformers"),
    "tensorboard": ("tensorboard",),
    "data": ("pyarrow",),
    "plot": ("matplotlib",),
}


class MissingExtra(ValueError):
    """A command or flag needs an extra that is not installed (a user's set-up, not a bug)."""


def missing(extra: str) -> list[str]:
    """The packages of `extra` that cannot be imported here."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; choose from {', '.join(EXTRAS)}")
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]


def require(extra: str, what: str) -> None:
    """MissingExtra naming `what`, the extra and the install command, if `extra` is missing."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(
            f"{what} needs the {extra} extra: pip install 'ringattn[{extra}]' "
            f"(missing: {', '.join(absent)})"
        )
