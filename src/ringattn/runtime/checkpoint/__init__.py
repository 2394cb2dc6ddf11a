"""Training checkpoints: steps.py writes and reads them (DCP, every rank), durable.py is the
write-aside, fsync and rename-as-commit protocol they (and the token cache, and --export) are
published with. `from ringattn.runtime import checkpoint as ckpt` gives both modules' names."""

from ringattn.runtime.checkpoint.durable import (
    fsync_path,
    fsync_tree,
    publish,
    publish_into,
    recover,
    write_synced,
)
from ringattn.runtime.checkpoint.steps import (
    FAULT_POINTS,
    CheckpointError,
    NonFiniteWeights,
    complete_checkpoints,
    latest,
    load,
    read_state,
    save,
    step_of,
    sweep,
)

__all__ = ["FAULT_POINTS", "CheckpointError", "NonFiniteWeights", "complete_checkpoints",
           "fsync_path", "fsync_tree", "latest", "load", "publish", "publish_into", "read_state",
           "recover", "save", "step_of", "sweep", "write_synced"]  # fmt: skip
