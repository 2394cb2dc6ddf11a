"""The only code that calls torch.distributed: groups.py, ring.py, collectives.py, rows.py.

    resolve_group(group)  a ProcessGroup, a 1-D DeviceMesh or None -> GroupInfo(group, rank, size)
                          (a 2-D "ulysses" x "ring" mesh -> MeshInfo, the flattened world)
    RingComm              send to rank+1, receive from rank-1, batched isend/irecv, non-blocking
    RingTransport         the ring strategy's transport seam (K/V and dK/dV messages) on RingComm
    all_gather_cat        concatenation of every rank's tensor along a dim
    all_gather_json       every rank's JSON value (agreement checks: data, never pickles)
    broadcast_json        rank src's JSON value on every rank (the server's requests)
    all_gather_async      every rank's tensor stacked, posted without waiting (all-gather strategy)
    reduce_scatter        rank r gets the sum of every rank's r-th slice (NCCL native, else a ring)
    all_to_all            per-destination lists of tensors of any dtypes, as one all_to_all_single
    exchange_counts       rows for each rank -> rows from each rank (the dispatch's host sync)
    exchange_rows         variable row counts to every rank, differentiable (expert parallelism)

With one rank (or no initialised process group) nothing here communicates: gloo cannot send to
itself, and a single process needs no transport at all.

Ring exchanges are posted with `batch_isend_irecv` and waited on only when the data is needed, so
the transfer overlaps the compute in between. On NCCL `wait()` only orders the current CUDA stream
after the transfer; it does not block the host.
"""

from ringattn.comm.collectives import (
    all_gather_async,
    all_gather_cat,
    all_gather_ints,
    all_gather_json,
    all_reduce,
    all_to_all,
    broadcast_json,
    reduce_scatter,
)
from ringattn.comm.groups import (
    MESH_DIMS,
    GroupInfo,
    MeshInfo,
    backend_device,
    resolve_group,
    resolve_mesh,
    single_group,
)
from ringattn.comm.ring import DKV_TAG, KV_TAG, RingComm, RingTransport, wait
from ringattn.comm.rows import exchange_counts, exchange_rows

__all__ = [
    "DKV_TAG",
    "KV_TAG",
    "MESH_DIMS",
    "GroupInfo",
    "MeshInfo",
    "RingComm",
    "RingTransport",
    "all_gather_async",
    "all_gather_cat",
    "all_gather_ints",
    "all_gather_json",
    "all_reduce",
    "all_to_all",
    "backend_device",
    "broadcast_json",
    "exchange_counts",
    "exchange_rows",
    "reduce_scatter",
    "resolve_group",
    "resolve_mesh",
    "single_group",
    "wait",
]
