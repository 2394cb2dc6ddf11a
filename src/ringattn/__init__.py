"""ringattn: exact context-parallel attention for PyTorch.

A sequence too long for one device is split along its token dimension across the ranks of a
process group; `attention` computes exact attention over the whole sequence, forward and backward,
while each rank holds only its own tokens. See README.md and the module docstrings: layout (who
holds which token), kernels (one block of attention), merge (online softmax), comm (the transport),
ring (the strategy) and api (the public functions).
"""

from ringattn.api import attention, positions, shard, unshard
from ringattn.integrations.context_parallel import context_parallel
from ringattn.kernels import BACKENDS
from ringattn.layout import LAYOUTS

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "__version__",
    "attention",
    "context_parallel",
    "positions",
    "shard",
    "unshard",
]
