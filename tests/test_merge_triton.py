"""The fused Triton merge: exact -inf cases and agreement with merge.merge_, without a GPU.

- Under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors), in a subprocess: the variable is
  read when Triton decorates the kernel, so it must be set before anything in the process builds
  it. The interpreter imports numpy, which ringattn does not need: when numpy is not importable
  here, the subprocess gets the side directory scripts/setup.sh fills (.venv/triton-interp).
- Compiled ahead of time for an H100/H200 (sm_90) by Triton's real compiler: catches what the
  interpreter forgives (types, int64 offsets) with no GPU present.
- On CPU, `merge_fused_` is `merge_` itself (bitwise). On a GPU (marked gpu) the same cases run on
  CUDA tensors, and the dispatcher picks the kernel.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

import merge_triton_cases as cases
from ringattn.kernels.triton_merge import merge_fused_, use_triton
from ringattn.merge import merge_

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
OVERLAY = os.path.join(sys.prefix, "triton-interp")  # numpy for the interpreter (setup.sh)
HAVE_TRITON = importlib.util.find_spec("triton") is not None
CASE_NAMES = [case.__name__ for case in cases.CASES]


def _numpy_path() -> str | None:
    """'' when numpy imports here, the overlay when it holds numpy, else None."""
    if importlib.util.find_spec("numpy") is not None:
        return ""
    return OVERLAY if os.path.isdir(os.path.join(OVERLAY, "numpy")) else None


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Run every case once under the interpreter; {case: "ok" or traceback}."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed (scripts/setup.sh installs it when it can)")
    numpy_path = _numpy_path()
    if numpy_path is None:
        pytest.skip("Triton's interpreter needs numpy: run scripts/setup.sh (it fills "
                    f"{OVERLAY}) or install numpy")  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="1")
    paths = [TESTS_DIR, numpy_path, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    proc = subprocess.run(
        [sys.executable, os.path.join(TESTS_DIR, "merge_triton_cases.py")],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.slow
def test_triton_merge_under_interpreter(interpreted, name):
    assert interpreted[name] == "ok", interpreted[name]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("int_type", ["i32", "i64"])
def test_triton_merge_compiles_for_sm90(int_type):
    """Triton's real compiler, no GPU: the kernel lowers to a cubin for compute capability 9.0
    with 32-bit and 64-bit sizes/strides (Triton picks i64 for ints >= 2**31 at launch)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from ringattn.kernels.triton_merge import _kernel

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the kernel is an interpreted function")
    _, kernel = _kernel()
    params = list(inspect.signature(kernel.fn).parameters)
    block_out_dtype = "*bf16"
    signature = {
        name: "constexpr" if name.startswith("BLOCK") else
        (block_out_dtype if name == "bout_ptr" else "*fp32") if name.endswith("_ptr") else int_type
        for name in params
    }  # fmt: skip
    source = triton.compiler.ASTSource(
        fn=kernel, signature=signature, constexprs={"BLOCK_S": 32, "BLOCK_D": 128}
    )
    options = {"num_warps": 4, "enable_fp_fusion": True}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert len(compiled.asm["cubin"]) > 1000


def test_fused_merge_is_merge_on_cpu():
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(1, 2, 6, 8, generator=gen)
    lse = torch.randn(1, 2, 6, generator=gen)
    lse[0, 0, 0] = float("-inf")
    block = (torch.randn(1, 2, 3, 8, generator=gen), torch.randn(1, 2, 3, generator=gen))
    want_out, want_lse = out.clone(), lse.clone()
    merge_(want_out.narrow(2, 0, 3), want_lse.narrow(2, 0, 3), *block)
    assert not use_triton(out, block[0])
    merge_fused_(out.narrow(2, 0, 3), lse.narrow(2, 0, 3), *block)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", CASE_NAMES)
def test_triton_merge_on_cuda(name):
    getattr(cases, name)(device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_dispatcher_takes_the_kernel_on_cuda():
    out = torch.zeros(1, 2, 4, 64, device="cuda")
    assert use_triton(out, out.bfloat16()), "the probe rejected the Triton merge on this GPU"
