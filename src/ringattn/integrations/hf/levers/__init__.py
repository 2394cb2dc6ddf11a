"""Memory levers for transformers models: the tiled MLP (tiled.py: `parallelize(tiled_mlp=)`) and
activation offload (offload.py: the checkpointed layer inputs in host memory)."""

from ringattn.integrations.hf.levers.offload import offload_activations
from ringattn.integrations.hf.levers.tiled import DENSE, EXPERTS, install_tiled_mlp, tiled_modules

__all__ = ["DENSE", "EXPERTS", "install_tiled_mlp", "offload_activations", "tiled_modules"]
