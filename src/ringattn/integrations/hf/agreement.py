"""Every rank of a CP group must give `shard_batch` the same full sequence: a digest compared.

A rank handed another sequence of the same length would raise nothing: every shape agrees, and
attention silently mixes one sequence's keys with another's queries. So every call of
`shard_batch` reduces its inputs to a few integers and gathers them over the CP group, one small
all-gather per batch (none with one rank):

    field f (input_ids, labels, position_ids,    x_0 .. x_{n-1}, flattened to int64
    the document bounds, image inputs)           (a float tensor by its bits)
    digest(f) = (n,  sum_i v_i a_i mod p,  sum_i v_i b_i mod p)      v_i = x_i mod p
    a_i = (i + 1) 48271 mod p,  b_i = (i + 1)^2 16807 mod p,  p = 2^31 - 1

Each product is below p^2 < 2^62 and a sum of n < 2^32 of them stays below 2^63: int64 never
overflows, on any device. The a_i are distinct and nonzero mod p, so a change at one position,
or two swapped tokens, always changes the first sum (token ids are below p); anything else
collides with chance about 1/p^2. The sums run where the tensors are; one host copy of the
3 x fields integers, then `comm.all_gather_ints`.
"""

from __future__ import annotations

import torch

from ringattn.comm import GroupInfo, MeshInfo, all_gather_ints, resolve_group

__all__ = ["check_same_batch", "digest"]

_P = 2_147_483_647  # 2^31 - 1, prime
_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ABSENT = (-1, 0, 0)


def digest(x: torch.Tensor) -> torch.Tensor:
    """(3,) int64 on x's device: the length and two weighted sums mod p (module docstring)."""
    flat = x.detach().reshape(-1)
    if flat.is_floating_point():
        flat = flat.view(_INT[flat.element_size()])  # the bits: equal tensors give equal digests
    v = torch.remainder(flat.to(torch.int64), _P)
    j = torch.remainder(torch.arange(1, v.numel() + 1, device=v.device, dtype=torch.int64), _P)
    a = torch.remainder(j * 48271, _P)
    b = torch.remainder(torch.remainder(j * j, _P) * 16807, _P)
    sums = torch.stack([torch.remainder(v * a, _P).sum(), torch.remainder(v * b, _P).sum()])
    return torch.cat([torch.tensor([v.numel()], device=v.device), sums])


def _field(value: object, device: torch.device) -> torch.Tensor:
    """A field's digest on `device`: computed where the tensor is, a list made a tensor there."""
    if value is None:
        return torch.tensor(_ABSENT, device=device)
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, device=device)
    return digest(value).to(device)


def _global_ranks(info: GroupInfo, ranks: list[int]) -> list[int]:
    """Global ranks of a group's ranks (a mesh's flattened ranks as they are)."""
    if info.group is None or isinstance(info, MeshInfo):
        return ranks
    import torch.distributed as dist

    return [dist.get_global_rank(info.group, r) for r in ranks]


def check_same_batch(fields: dict[str, object], group: object, device: torch.device) -> None:
    """ValueError on every rank of `group` unless all pass equal `fields` (name -> tensor or
    None); one all-gather of 3 x len(fields) int64, skipped for one rank."""
    info = resolve_group(group, allow_2d=True)
    if info.world_size == 1:
        return
    local = torch.cat([_field(value, device) for value in fields.values()]).tolist()  # one sync
    rows = all_gather_ints(local, info, device)
    if all(row == rows[0] for row in rows):
        return
    names = list(fields)
    differ = [r for r, row in enumerate(rows) if row != rows[0]]
    which = sorted({names[i // 3] for r in differ for i in range(len(local))
                    if rows[r][i] != rows[0][i]})  # fmt: skip
    same = [r for r in range(len(rows)) if r not in differ]
    raise ValueError(
        f"shard_batch: the ranks of the CP group were given different sequences: ranks "
        f"{_global_ranks(info, differ)} differ from ranks {_global_ranks(info, same)} in "
        f"{which}; every rank of a CP group must pass the same full sequence (the CP ranks "
        f"split one sequence's tokens): give them the same batch, e.g. sample by data-parallel "
        f"rank, not by rank"
    )
