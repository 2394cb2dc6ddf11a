"""Which scheme each mixer layer runs: state, heads or whole (hooks.py runs them).

    state   this rank's own tokens from states passed between ranks (state.py): the class has a
            program there; any layout (striped through zigzag's runs, relayout.py), any W
    heads   1/W of the heads on the whole sequence (heads.py): W divides the head groups
    whole   the whole sequence on every rank: always

`auto` takes the first that can run exactly; a scheme asked for that cannot falls back in the
same order, so that a layer never runs wrong (`schemes(model)` says what each runs).
"""

from __future__ import annotations

from torch import nn

from ringattn.integrations.hf.mixers.heads import splits
from ringattn.integrations.hf.mixers.passing import has_state

__all__ = ["SCHEMES", "check_scheme", "choose"]

SCHEMES = ("auto", "state", "heads", "whole")
"""`mixer_scheme=` of ringattn.hf.parallelize (and --mixer-scheme, ContextParallelConfig)."""


def check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown mixer scheme {scheme!r}; choose one of {list(SCHEMES)}")


def choose(module: nn.Module, wanted: str, world_size: int) -> str:
    """The scheme `module` runs: `wanted` where it can run exactly, else the first that can of
    state (its class has a program in state.py; a striped layout's rows go through zigzag's
    runs, relayout.py), heads (W divides its head groups) and whole (always)."""
    can = {
        "state": has_state(module),
        "heads": splits(module, world_size),
        "whole": True,
    }
    order = ["state", "heads", "whole"]
    if wanted != "auto":
        order.remove(wanted)
        order.insert(0, wanted)
    return next(scheme for scheme in order if can[scheme])
