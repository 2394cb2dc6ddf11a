"""Attention kernel rates on GPUs, per kernel, direction, mask, dtype and block length, from
published kernel benchmarks (sources in docs/plan-measured.md, "Kernel curves").

A kernel's rate is a table of TFLOP/s by sequence length (queries = keys = L, head dim 128) on an
H100 SXM5, read off the published figures:

    kernel     forward full / causal, backward          source
    flash2     FlashAttention-2 (SDPA's flash)          FlashAttention-3 paper, figs. 5-6 (FA2 bars)
    flash3     FlashAttention-3                         the same figures (FA3 bars)
    cudnn      cuDNN SDPA (SDPA's cudnn)                the same figures (cuDNN bars)
    flex       Triton-generated fused attention         the same figures' Triton bars (forward);
                                                        backward: no figure, taken as flash2's
    efficient  memory-efficient SDPA (cutlass)          DESIGN.md section 6 (one H200, 8k-128k)

FLOPs are counted as the figures count them: 4 * B * H * Sq * Sk * D forward (visible pairs only
with a causal mask), 2.5x that backward. A block of `block` keys is priced at the rate of the
table at L = block (log-linear between points, flat above the last); below the first point the
rate falls as block / (block + 256), the share of a short block's time spent filling the machine.
The backward figures are without a mask; a causal backward is scaled by the forward's causal /
full ratio at the same length.

Other hardware: H200 and H800 have the H100's SMs and clocks, so the same tables. A100: the
FlashAttention-2 rate as a fraction of peak is 2.00x (forward) and 1.94x (forward + backward) the
Hopper fraction, derived from ring-flash-attention's published single-GPU flash_attn rates on
8xA100 vs 8xH800 (the same shape); no stored figure gives cuDNN, flex or efficient on an A100:
they take the same factor, capped at FlashAttention-2's A100 rate (scaling cuDNN's Hopper lead
would put it above the A100's peak). B200: no stored figure; the Hopper fractions of peak are used.
FlashAttention-3 runs on Hopper only (refused elsewhere).

Dtypes, as the library's kernels take them: flash2, flash3, cudnn, flex take bf16/fp16 only;
efficient also takes fp32 (`auto` falls back to it in fp32, as kernels.select_kernel does). Its
fp32 rate has no published figure: it is taken as its bf16 fraction of peak times the TF32 peak
/ 3 (cutlass runs fp32 attention as three TF32 products on sm80+). fp8 attention (forward only,
`--fp8-attention`): flash3 and cudnn, from the FlashAttention-3 paper's fp8 figure (head dim 256,
the only stored one); the backward stays bf16.

`rates_override` (the CLI's --attention-tflops FWD[,BWD]) rescales the chosen kernel's curves so
their plateau is the given forward (and backward) TFLOP/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["KERNEL_NAMES", "KernelCurve", "attention_tflops", "check_kernel", "default_kernel"]

LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
H100_BF16 = 989.0  # the peak the published H100 figures are fractions of
A100_FACTOR = {"fwd": 2.00, "bwd": 1.94}
HALF_ONLY = ("bf16", "fp8")  # fp8 runs matmuls in fp8; attention inputs stay bf16


@dataclass(frozen=True)
class KernelCurve:
    """TFLOP/s on an H100 SXM5 at LENGTHS, head dim 128."""

    fwd_full: tuple[float, ...]
    fwd_causal: tuple[float, ...]
    bwd: tuple[float, ...]
    dtypes: tuple[str, ...]
    archs: tuple[str, ...] = ("hopper", "ampere", "blackwell")
    fp8_fwd: tuple[float, ...] | None = None
    """Forward fp8, no mask (head dim 256 figure)."""


_FA2_BWD = (214, 260, 291, 310, 318, 322)
CURVES: dict[str, KernelCurve] = {
    "flash2": KernelCurve(
        (309, 350, 362, 368, 370, 370), (191, 260, 298, 319, 333, 335), _FA2_BWD, HALF_ONLY
    ),
    "flash3": KernelCurve(
        (467, 565, 625, 638, 646, 648),
        (292, 423, 521, 579, 602, 616),
        (316, 424, 501, 542, 559, 561),
        HALF_ONLY,
        ("hopper",),
        fp8_fwd=(510, 744, 931, 966, 1151, 1171),
    ),
    "cudnn": KernelCurve(
        (497, 574, 617, 609, 600, 595),
        (315, 410, 484, 518, 529, 539),
        (305, 408, 465, 499, 518, 516),
        HALF_ONLY,
        fp8_fwd=(686, 878, 1001, 1087, 1122, 1139),
    ),
    "flex": KernelCurve(
        (323, 372, 389, 389, 392, 395), (146, 273, 323, 353, 369, 378), _FA2_BWD, HALF_ONLY
    ),
    # DESIGN.md section 6 (H200): 165-182 forward, 133-148 forward+backward -> ~135 backward;
    # flat from 8k, shorter lengths shaped like flash2's curve
    "efficient": KernelCurve(
        tuple(175 * f / 370 for f in (309, 350, 362, 368, 370, 370)),
        tuple(175 * f / 335 for f in (191, 260, 298, 319, 333, 335)),
        tuple(135 * f / 322 for f in _FA2_BWD),
        ("bf16", "fp8", "fp32", "tf32"),
    ),
}
KERNEL_NAMES = tuple(CURVES)


def default_kernel(arch: str, dtype: str) -> str:
    """What the library's `auto` picks on CUDA (kernels.AUTO_ORDER: cudnn, flash, efficient):
    cuDNN for half dtypes, the memory-efficient kernel for fp32."""
    return "cudnn" if dtype in HALF_ONLY else "efficient"


def check_kernel(kernel: str, arch: str, dtype: str, fp8_attention: bool = False) -> None:
    """ValueError (with the fix) when `kernel` cannot run `dtype` on this architecture."""
    if kernel not in CURVES:
        raise ValueError(f"unknown attention kernel {kernel!r}; choose one of "
                         f"{', '.join(KERNEL_NAMES)}")  # fmt: skip
    curve = CURVES[kernel]
    if arch not in curve.archs:
        raise ValueError(f"{kernel} runs on {', '.join(curve.archs)} GPUs only, not {arch}; "
                         "use cudnn or flash2")  # fmt: skip
    if dtype not in curve.dtypes:
        raise ValueError(
            f"{kernel} takes {'/'.join(curve.dtypes)}, not {dtype} (the library refuses it "
            "too); use --attention-kernel efficient or --dtype bf16"
        )
    if fp8_attention and curve.fp8_fwd is None:
        raise ValueError(f"{kernel} has no fp8 attention; --fp8-attention needs flash3 or cudnn")
    if fp8_attention and dtype != "fp8":
        raise ValueError("--fp8-attention needs --dtype fp8")


def _interp(table: tuple[float, ...], block: float) -> float:
    if block <= LENGTHS[0]:
        return table[0] * (block / (block + 256)) / (LENGTHS[0] / (LENGTHS[0] + 256))
    for i in range(1, len(LENGTHS)):
        if block <= LENGTHS[i]:
            t = math.log(block / LENGTHS[i - 1]) / math.log(LENGTHS[i] / LENGTHS[i - 1])
            return table[i - 1] + t * (table[i] - table[i - 1])
    return table[-1]


def _h100_rate(
    kernel: str, block: float, causal: bool, backward: bool, fp8: bool
) -> tuple[float, float]:
    """TFLOP/s of `kernel` on an H100, and the plateau of the table it came from."""
    curve = CURVES[kernel]
    if fp8 and not backward:
        full, causal_t = curve.fp8_fwd, None
    elif backward:
        full, causal_t = curve.bwd, None
    else:
        full, causal_t = curve.fwd_full, curve.fwd_causal
    rate = _interp(full, block)
    if causal:  # the forward's causal / full ratio when the figure has no causal bars
        rate = _interp(causal_t, block) if causal_t else rate * (
            _interp(curve.fwd_causal, block) / _interp(curve.fwd_full, block))  # fmt: skip
    return rate, full[-1]


def attention_tflops(
    kernel: str,
    arch: str,
    bf16_peak: float,
    tf32_peak: float,
    *,
    block: float,
    causal: bool,
    backward: bool,
    dtype: str = "bf16",
    fp8: bool = False,
    rates_override: tuple[float, float] | None = None,
) -> float:
    """TFLOP/s of `kernel` on blocks of `block` keys (see the module docstring)."""
    rate, plateau = _h100_rate(kernel, block, causal, backward, fp8)
    if rates_override:
        return rate * rates_override[1 if backward else 0] / plateau
    if arch == "ampere":  # no stored figure has any kernel beat FlashAttention-2 on an A100
        rate = min(rate, _h100_rate("flash2", block, causal, backward, False)[0])
        rate *= A100_FACTOR["bwd" if backward else "fwd"]
    fraction = rate / H100_BF16
    if dtype in ("fp32", "tf32"):  # efficient only (check_kernel): three TF32 products
        return fraction * tf32_peak / 3
    return fraction * bf16_peak
