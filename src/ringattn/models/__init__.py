"""The model room: our Llama-style decoder and everything that knows its layers.

    config.py          ModelConfig, MODEL_SIZES presets, model_config(size, **overrides)
    decoder.py         Transformer (embedding, blocks, norm, output), Attention split into
                       project / attend / output, set_context_parallel
    rope.py, norm.py   RoPE from global positions, RMSNorm
    loss.py            IGNORE, chunked_cross_entropy (logits never whole)
    tensor_parallel.py the TP/SP plan (torch.distributed.tensor.parallel)
    pipeline.py        the PP plan: DecoderStage on torch.distributed.pipelining schedules
    parallelize.py     CP + TP + PP + FSDP2 on a runtime/mesh.py Mesh
    segments.py        attention piece by piece over the local rows (dynamic CP's pieces)

Used side by side by train/ (training), inference/ (decoding over a sharded KV cache) and
planner/ (shapes of the presets); none of those imports another's internals.
"""

from ringattn.models.config import MODEL_SIZES, ModelConfig, model_config
from ringattn.models.decoder import Transformer, set_context_parallel
from ringattn.models.loss import IGNORE, chunked_cross_entropy

__all__ = [
    "IGNORE",
    "MODEL_SIZES",
    "ModelConfig",
    "Transformer",
    "chunked_cross_entropy",
    "model_config",
    "set_context_parallel",
]
