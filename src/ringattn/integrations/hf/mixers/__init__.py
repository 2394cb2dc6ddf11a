"""Hybrid models' recurrent and convolutional mixers under context parallelism.

hooks.py   the allow-list of mixer classes, the refusal of any other token mixer, the choice
           of scheme, and the two forward hooks that run each mixer exactly over the sharded
           sequence
state.py   the "state" scheme: each rank its own runs, from states passed between ranks
runs.py    the runs each rank holds, their halos, and the exchange and fold of their states
heads.py   head-parallel twins: gated DeltaNet and Nemotron-H's Mamba2 split by heads
comm.py    the rows in (all-gather) and out (reduce-scatter) of a mixer run on all tokens
"""

from ringattn.integrations.hf.mixers.hooks import (
    MIXERS,
    SCHEMES,
    STATE_ATTR,
    MixerState,
    _known,
    check_scheme,
    find_mixers,
    has_mixers,
    install,
    schemes,
)

__all__ = ["MIXERS", "SCHEMES", "STATE_ATTR", "MixerState", "_known", "check_scheme",
           "find_mixers", "has_mixers", "install", "schemes"]  # fmt: skip
