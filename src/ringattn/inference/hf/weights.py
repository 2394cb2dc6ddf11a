"""The output head's weight laid out for decoding on a CPU.

The head (`get_output_embeddings()`, vocab x hidden) is the largest matrix of a small model and
is read whole at every decode step: SmolLM2-135M's is 113 MB of its 540 MB. `nn.Linear`
computes `x @ W.T` with `W` stored (vocab, hidden), row-major; for the few rows of a decode step
(one per running sequence) the CPU's float32 GEMM is slower on that layout than on the same
matrix stored (hidden, vocab). On this project's CPU (a Xeon with AVX-512, one thread, torch
2.13), 8 rows through SmolLM2's head took 50-58 ms row-major, 36-40 ms column-major, and a
whole 8-row forward 222-234 ms against 201-215 ms (1.06-1.10x); one row 18.5 against 11.8 ms;
at 64 rows 78 against 62 ms. The other weights gain nothing measurable (a decode step's MLP
and attention projections: within the noise either way), so only the head changes.

The change is the order of the head's bytes in memory: the same tensor (shape, values,
Parameter object, and so its tie to the input embeddings) with strides (1, vocab), which
`F.linear` reads as a transposed contiguous matrix. A tied input embedding then gathers its rows
with a stride (8 tokens: +60 us; an 8k-token prompt: +0.14 s, against the tens of seconds its
prefill takes). Not for bfloat16 (its AMX path is 12-29 % slower transposed at 8 rows), not on a
GPU (cuBLAS reads both layouts at full speed), not for a DTensor (--tp) shard. The layout changes
the GEMM's summation order, so logits differ from the row-major model's in the last bits
(measured 4e-5 of logits ~10), as they do between batch sizes; every request of a server and
of `generate --hf` is computed on the same layout.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["lay_out_for_decode"]


def lay_out_for_decode(model: nn.Module, device: torch.device) -> bool:
    """Store the float32 output head's weight of `model` column-major when `device` is a CPU (in
    place, no copy kept); whether it was re-laid."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if device.type != "cpu" or not isinstance(head, nn.Linear) or not _plain_matrix(weight):
        return False
    if weight.stride() == (1, weight.shape[0]):  # already
        return False
    with torch.no_grad():
        weight.data = weight.data.t().contiguous().t()
    return True


def _plain_matrix(weight: object) -> bool:
    return (
        type(weight) in (torch.Tensor, nn.Parameter)  # not a DTensor (a --tp shard)
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.device.type == "cpu"
    )
