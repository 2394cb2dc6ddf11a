"""FLOPs of one training step of a Llama-style decoder, and the peak they are compared against.

The count is the model's (what MFU means: recomputation and communication are not work):

    per token, forward    2 x (matmul parameters of the blocks + the output projection)
    per sequence, layer   attention 4 x heads x head_dim x S^2, halved when causal
    per token, mixer      hybrids: its recurrence (planner.work.MixerShape), as a matmul's 2x
    backward              2 x the matmuls, 2.5 x the attention (the convention of cost.py and
                          DESIGN.md: flash backward recomputes the scores)

The embedding lookup and the norms are not matmuls and are not counted. MFU = counted FLOPs per
second / (peak per device x devices). The peak: a GPU preset of hardware.py whose name is in the
CUDA device name (dense bf16: what MFU is usually quoted against), the matmul rate that
`ringattn plan --calibrate` measured on this CPU, or a figure the caller gives.
"""

from __future__ import annotations

import torch

from ringattn.planner.calibrate import DEFAULT_PATH, load_calibration
from ringattn.planner.cost import PlanSpec
from ringattn.planner.hardware import HARDWARE
from ringattn.planner.models import ModelSpec

__all__ = ["model_flops_per_token", "peak_flops_per_device", "train_step_flops"]


def train_step_flops(model: ModelSpec, seq_len: int, sequences: int, causal: bool = True) -> float:
    """Model FLOPs of one optimizer step over `sequences` sequences of `seq_len` tokens."""
    tokens = seq_len * sequences
    block_matmul = model.layer_params() - 2 * model.dim  # the two norm weights are not matmuls
    matmul = 2 * tokens * (model.n_layers * block_matmul + model.dim * model.vocab_size)
    pairs = seq_len * seq_len * (0.5 if causal else 1.0)
    attention = model.attention_layers * sequences * 4 * model.n_heads * model.d_head * pairs
    if model.mixer_layers:  # hybrids: the recurrence (its projections are matmul parameters)
        matmul += tokens * model.mixer_layers * model.mixer.recurrence_flops() / 2
    return 3 * matmul + 3.5 * attention


def model_flops_per_token(spec: PlanSpec) -> float:
    """Training FLOPs per token as MFU counts them: 6 x the matmul parameters (blocks and the
    output projection) plus the attention matmuls, visible (causal) pairs only: 6 S q_dim per
    layer (forward 2 S q_dim: QK^T and PV over S / 2 keys on average; backward twice that);
    mixer layers: 3 x their recurrence (the gather scheme's replicated work is not the model's)."""
    m = spec.model
    matmul = m.n_layers * (m.active_layer_params() - 2 * m.dim) + m.vocab_size * m.dim
    flops = 6 * matmul + 6 * m.attention_layers * spec.seq_len * m.q_dim
    if m.mixer_layers:
        flops += 3 * m.mixer_layers * m.mixer.recurrence_flops()
    return flops


def peak_flops_per_device(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """FLOP/s one device (one rank) can do at best, or None when unknown.

    `override_tflops` > 0 wins. CUDA: the preset named in the device's name. CPU: the best
    matmul rate of the cached calibration at the threads each of the local ranks gets.
    """
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower()
        for key, hw in HARDWARE.items():
            if key in name:
                return hw.bf16_tflops * 1e12
        return None
    try:
        rates = load_calibration(DEFAULT_PATH)["matmul"]
    except (ValueError, KeyError, OSError):
        return None
    threads = str(torch.get_num_threads())
    table = rates.get(threads) or rates.get("1") or {}
    return max(table.values()) * 1e9 if table else None
