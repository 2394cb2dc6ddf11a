"""The founding example of ringattn's issue 3, on CPU: PyTorch's context_parallel example, with
only the `context_parallel` import changed (and "cuda" -> "cpu", "nccl" -> "gloo", no set_device).

    torchrun --standalone --nproc-per-node=2 examples/context_parallel_example.py

On torch 2.13 the same code with `torch.distributed.tensor.experimental.context_parallel` fails
("cannot resize variables that require grad"; on CPU also NotImplementedError for the flash op).
Each rank computes attention for its shard of the 4096 tokens (zigzag layout), its own loss on it,
and the gradients of the sum of all ranks' losses; see docs/context_parallel.md for what the
buffers and their .grad hold afterwards. `--save DIR` writes each rank's tensors there (the test
compares them with single-device attention).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel

from ringattn import context_parallel


def run(world_size: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The founding example itself; returns the buffers (restored) and this rank's output."""
    mesh = init_device_mesh("cpu", (world_size,))
    qkv = [
        torch.randn(1, 4, 4096, 64, device="cpu", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    ]
    with (
        sdpa_kernel(SDPBackend.FLASH_ATTENTION),
        context_parallel(mesh, buffers=tuple(qkv), buffer_seq_dims=(2, 2, 2)),
    ):
        output = F.scaled_dot_product_attention(*qkv, is_causal=True)
    output.float().square().mean().backward()
    return qkv, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", help="directory to write each rank's tensors to (rank<r>.pt)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    qkv, output = run(world_size)
    grads = [x.grad for x in qkv]
    print(
        f"rank {rank}: output {tuple(output.shape)} {output.dtype}, "
        f"buffers {tuple(qkv[0].shape)}, grads {tuple(grads[0].shape)}, "
        f"|output| {output.float().norm():.4f}, |dq| {grads[0].float().norm():.4f}"
    )
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        tensors = {"q": qkv[0], "k": qkv[1], "v": qkv[2], "output": output}
        tensors.update({f"d{name}": g for name, g in zip("qkv", grads)})
        torch.save({n: t.detach() for n, t in tensors.items()}, f"{args.save}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
