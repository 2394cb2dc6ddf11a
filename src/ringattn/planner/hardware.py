"""Hardware the planner prices plans on: GPU presets from data sheets, and `cpu`, this machine as
measured by `ringattn plan --calibrate` (calibrate.py).

A device turns work into seconds through four rates:

    matmul      flops / (peak(dtype) x efficiency(tokens per call))   bf16, fp8, tf32 or fp32
                                                                       peak of the data sheet
    attention   flops / kernel rate(kernel, block length, mask, dtype) kernels.py: published
                                                                       curves per kernel
    elementwise bytes / memory bandwidth                               norms, RoPE, SwiGLU, merges
    transfer    latency + bytes / link bandwidth                      intra-node or inter-node

Matmul efficiency is a saturating curve eff_max * n / (n + n_half / 4): a GEMM of few rows cannot
fill the machine (eff_max 0.70: an 8192^3 bf16 GEMM reaches 0.80 on an H200, DESIGN.md section 6).
fp32 is what `ringattn train --dtype float32` runs: torch leaves TF32 off, so its matmuls run at
the plain fp32 peak; `tf32` prices torch.backends.cuda.matmul.allow_tf32 = True. On `cpu` the
rates are tables measured on this machine (calibrate.py) and interpolated in log space, and more
processes than cores share them at the measured oversubscription cost (oversubscribe.py).

`cpu` with --gpus-per-node G and --inter-bw B is a cluster of such machines, G processes each,
joined by one link of B GB/s per direction (testing/hosts.py makes one on this machine). Unlike
a GPU node's NIC per GPU, that link is the node's: transfers that cross it at once share it, so a
transfer is priced at B / load, `load` being how many of the node's processes send across at
once (a ring: 1 per node; hybrid's ring of groups: U; an all-to-all: G x (W - G) / (W - 1)).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from ringattn.planner.kernels import attention_tflops
from ringattn.planner.oversubscribe import oversubscription_cost

__all__ = ["HARDWARE", "Hardware", "get_hardware"]


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or one CPU process slot) and its links. Bandwidths in GB/s per device
    per direction, as NCCL's bus bandwidth sees them."""

    name: str
    bf16_tflops: float
    """Dense bf16 peak per device."""
    fp8_tflops: float
    """Dense fp8 peak; 0 when the device has no fp8 matmul units."""
    memory_gib: float
    """Memory per device (HBM; on cpu: RAM shared by the local processes)."""
    mem_bw_gbs: float
    intra_bw_gbs: float
    """Link inside a node (NVLink)."""
    inter_bw_gbs: float
    """Link between nodes, per device (one 400 Gb/s NIC per GPU = 50 GB/s)."""
    gpus_per_node: int
    arch: str = "hopper"
    """hopper, ampere or blackwell: which published kernel curves apply (kernels.py)."""
    tf32_tflops: float = 0.0
    """Dense TF32 tensor-core peak (0: none)."""
    fp32_tflops: float = 0.0
    """Plain fp32 (non-tensor-core) peak."""
    intra_latency_s: float = 10e-6
    inter_latency_s: float = 20e-6
    link_per_node: bool = False
    """cpu with --inter-bw: inter_bw_gbs is the node's one link, shared by its processes."""
    matmul_eff: float = 0.70
    """One 8192^3 bf16 GEMM reaches 0.80 of peak on an H200 (DESIGN.md §6); a training step's
    mix of shapes under power-limited clocks sustains less: 0.70 is taken (also for tf32, fp32)."""
    fp8_matmul_eff: float = 0.60
    n_half: int = 256
    """Tokens per matmul call (x 4) at which a GEMM reaches half its best efficiency."""
    usable_fraction: float = 0.92
    """Of memory_gib, what a job can allocate (CUDA context, NCCL buffers, fragmentation)."""
    host_memory_gib: float = 2048.0
    """Host RAM per node (DGX H100/H200: 2 TB), shared by its GPUs' offloaded tensors."""
    host_link_gbs: float = 50.0
    """Host <-> device copy rate per GPU per direction (PCIe Gen5 x16 in practice; A100: Gen4,
    25)."""
    calibration: dict | None = field(default=None, compare=False)
    """cpu: the measured tables (see calibrate.py); None on GPUs."""

    @property
    def is_cpu(self) -> bool:
        return self.calibration is not None

    def _rate(self, kind: str, threads: int) -> dict:
        """cpu: the table measured with `threads` threads, never slower than the 1-thread one
        (more threads cannot make a process slower; a 2-thread measurement that lost a core
        to another process would say so)."""
        tables = self.calibration[kind]
        return tables[str(threads)], tables["1"]

    def matmul_peak(self, dtype: str) -> tuple[float, float]:
        """(peak TFLOP/s, best efficiency) of matmuls in `dtype`."""
        if dtype == "fp8":
            return self.fp8_tflops, self.fp8_matmul_eff
        peak = {"bf16": self.bf16_tflops, "tf32": self.tf32_tflops, "fp32": self.fp32_tflops}
        return peak[dtype], self.matmul_eff

    def matmul_s(
        self, flops: float, tokens: int, width: int, dtype: str = "bf16", threads: int = 1
    ) -> float:
        """Seconds for matmuls of `flops` whose calls have `tokens` rows and inner size `width`."""
        if flops <= 0:
            return 0.0
        if self.is_cpu:
            many, one = self._rate("matmul", threads)
            return flops / (max(_interp(many, width), _interp(one, width)) * 1e9)
        peak, eff = self.matmul_peak(dtype)
        return flops / (peak * 1e12 * eff * tokens / (tokens + self.n_half / 4))

    def attention_s(
        self,
        flops: float,
        block: int,
        head_dim: int,
        causal: bool,
        backward: bool,
        threads: int,
        kernel: str = "cudnn",
        dtype: str = "bf16",
        fp8: bool = False,
        override: tuple[float, float] | None = None,
    ) -> float:
        """Seconds for attention kernels of `flops` (counted without masked-out pairs) on blocks
        of `block` keys, forward or backward, causal (square diagonal) or full; on GPUs at the
        published rate of `kernel` (kernels.py), fp8 forward with `fp8`."""
        if flops <= 0:
            return 0.0
        if self.is_cpu:
            key = f"{'bwd' if backward else 'fwd'}_{'causal' if causal else 'full'}"
            rates = []
            for table in self._rate("attention", threads):
                dims = sorted(int(d) for d in table[key])
                d = min(dims, key=lambda x: abs(math.log(x / head_dim)))
                rates.append(_interp(table[key][str(d)], block))
            return flops / (max(rates) * 1e9)
        tflops = attention_tflops(kernel, self.arch, self.bf16_tflops, self.tf32_tflops,
                                  block=block, causal=causal, backward=backward, dtype=dtype,
                                  fp8=fp8, rates_override=override)  # fmt: skip
        return flops / (tflops * 1e12 * min(1.0, head_dim / 128))

    def elementwise_s(self, nbytes: float, threads: int = 1) -> float:
        if self.is_cpu:
            return nbytes / (max(self._rate("elementwise_gbs", threads)) * 1e9)
        return nbytes / (self.mem_bw_gbs * 1e9 * 0.8)

    def transfer_s(self, nbytes: float, inter: bool, messages: int = 1, load: float = 1.0) -> float:
        """Seconds to move `nbytes` (per device) in `messages` dependent messages; `load`: how
        many of a node's devices cross its link at once (counts only for a per-node link)."""
        if nbytes <= 0:
            return 0.0
        if self.is_cpu:
            gloo = self.calibration["gloo"]
            bw = gloo["bandwidth_gbs"]
            if inter and self.inter_bw_gbs > 0:
                bw = min(bw, self.inter_bw_gbs / max(1.0, load))
            return messages * gloo["latency_s"] + nbytes / (bw * 1e9)
        bw, lat = (self.inter_bw_gbs, self.inter_latency_s) if inter else (
            self.intra_bw_gbs, self.intra_latency_s)  # fmt: skip
        return messages * lat + nbytes / (bw * 1e9)

    def threads_per_process(self, nproc: int) -> int:
        """cpu: OpenMP threads each local process gets (the launcher's rule, cores // nproc)."""
        if not self.is_cpu:
            return 1
        return max(1, self.calibration["cores"] // max(1, nproc))

    def slowdown(self, nproc: int) -> float:
        """cpu: more busy processes than cores share them: compute stretched by nproc / cores,
        times the measured cost of taking turns (oversubscribe.py) when there is one."""
        if not self.is_cpu:
            return 1.0
        cores = self.calibration["cores"]
        share = max(1.0, nproc * self.threads_per_process(nproc) / cores)
        return share * oversubscription_cost(self.calibration, nproc)


def _interp(table: dict, x: float) -> float:
    """Piecewise-linear interpolation of a {size: rate} table in log(size), clamped at the ends."""
    points = sorted((int(k), v) for k, v in table.items())
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            t = math.log(x / x0) / math.log(x1 / x0)
            return y0 + t * (y1 - y0)
    return points[-1][1]


# Data-sheet figures (dense, no sparsity): bf16, fp8, memory, bandwidths, GPUs per node, arch,
# TF32, fp32. Inter-node: one NIC per GPU (H800 clusters: 8 x 400 Gb/s InfiniBand per node, as
# DeepSeek-V3 describes; H800's NVLink is 400 GB/s bidirectional). B200: HGX B200 figures / 8.
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("h100", 989, 1979, 80, 3350, 450, 50, 8, "hopper", 494.5, 67),
        Hardware("h800", 989, 1979, 80, 3350, 200, 50, 8, "hopper", 494.5, 67),
        Hardware("h200", 989, 1979, 141, 4800, 450, 50, 8, "hopper", 494.5, 67),
        Hardware(
            "a100",
            312,
            0,
            80,
            2039,
            300,
            25,
            8,
            "ampere",
            156,
            19.5,
            host_memory_gib=1024,
            host_link_gbs=25,
        ),
        Hardware("b200", 2250, 4500, 180, 8000, 900, 50, 8, "blackwell", 1125, 75),
    )
}
HARDWARE_NAMES = (*HARDWARE, "cpu")


def get_hardware(
    name: str,
    *,
    tflops: float | None = None,
    intra_bw: float | None = None,
    inter_bw: float | None = None,
    gpus_per_node: int | None = None,
    calibration: dict | None = None,
) -> Hardware:
    """The preset `name` with the given overrides; `cpu` needs the calibration tables."""
    if name == "cpu":
        if calibration is None:
            raise ValueError("hardware 'cpu' needs a calibration; run `ringattn plan --calibrate`")
        # one machine: every local process is in the same "node", all links are gloo's
        hw = Hardware("cpu", 0, 0, calibration["memory_gib"], 0, 0, 0, 1 << 20,
                      calibration=calibration)  # fmt: skip
    elif name in HARDWARE:
        hw = HARDWARE[name]
    else:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE_NAMES)}")
    for flag, value in (("--tflops", tflops), ("--intra-bw", intra_bw), ("--inter-bw", inter_bw),
                        ("--gpus-per-node", gpus_per_node)):  # fmt: skip
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if hw.is_cpu and (tflops or intra_bw):
        raise ValueError(
            "--tflops/--intra-bw apply to GPU presets; cpu is measured (its "
            "--inter-bw is the link between hosts of --gpus-per-node processes)"
        )
    if hw.is_cpu and inter_bw:
        hw = replace(hw, link_per_node=True)
    changes = {"bf16_tflops": tflops, "intra_bw_gbs": intra_bw, "inter_bw_gbs": inter_bw,
               "gpus_per_node": gpus_per_node}  # fmt: skip
    if tflops:  # the other peaks keep their ratio to bf16
        for key in ("fp8_tflops", "tf32_tflops", "fp32_tflops"):
            changes[key] = getattr(hw, key) * tflops / hw.bf16_tflops
    return replace(hw, **{k: v for k, v in changes.items() if v is not None})
