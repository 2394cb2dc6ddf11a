"""Hybrid models' recurrent and convolutional mixers under context parallelism.

hooks.py   the allow-list of mixer classes, the refusal of any other token mixer, and the
           two forward hooks that run each mixer exactly over the sharded sequence
choice.py  which scheme each layer runs: state, heads or whole
passing.py the "state" scheme's entry: which classes have a program, running one
state.py   its programs for Mamba2, gated DeltaNet and short convolutions (state_more.py:
           Mamba1, lightning attention, KDA), each rank its own runs from passed states
runs.py    the runs each rank holds, their halos, and the exchange and fold of their states
relayout.py  striped rows into zigzag's runs and back, for the state scheme
heads.py   head-parallel twins: gated DeltaNet and Nemotron-H's Mamba2 split by heads
comm.py    the rows in (all-gather) and out (reduce-scatter) of a mixer run on all tokens
"""

from ringattn.integrations.hf.mixers.choice import SCHEMES, check_scheme
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

__all__ = ["MIXERS", "SCHEMES", "STATE_ATTR", "MixerState", "_known", "check_scheme",
           "find_mixers", "has_mixers", "install", "schemes"]  # fmt: skip
