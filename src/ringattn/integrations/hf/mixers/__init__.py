"""Hybrid models' recurrent and convolutional mixers under context parallelism.

hooks.py   the allow-list of mixer classes, the refusal of any other token mixer, and the
           two forward hooks that run each mixer exactly over the sharded sequence ("whole")
heads.py   head-parallel twins: gated DeltaNet and Nemotron-H's Mamba2 split by heads
comm.py    the rows in (all-gather) and out (reduce-scatter) of a mixer run on all tokens
"""

from ringattn.integrations.hf.mixers.hooks import (
    MIXERS,
    STATE_ATTR,
    MixerState,
    _known,
    find_mixers,
    has_mixers,
    install,
    schemes,
)

__all__ = ["MIXERS", "STATE_ATTR", "MixerState", "_known", "find_mixers", "has_mixers",
           "install", "schemes"]  # fmt: skip
