"""Flag types and choices shared by the subcommands' parsers."""

from __future__ import annotations

import argparse

from ringattn.api import STRATEGIES as _STRATEGIES
from ringattn.layout import LAYOUTS as _LAYOUTS

# the core's registries, in their own order (one list of names, not a copy of it)
LAYOUTS = tuple(_LAYOUTS)
STRATEGIES = tuple(_STRATEGIES)


def int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def name_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        return list(choices) if text == "all" else [p.strip() for p in text.split(",") if p.strip()]

    return parse
