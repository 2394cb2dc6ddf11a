"""Rank functions for test_compile.py (harness.py): ringattn under torch.compile(fullgraph=True).

Every case compares the compiled context-parallel run with an independent reference on the full
sequence in one process (eager), and counts graph breaks with torch._dynamo.explain and graphs with
a counting backend (dynamo calls the backend once per graph it compiles, recompiles included).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch._dynamo.backends.registry import lookup_backend

import ringattn
import ringattn.hf
import workers_hf as hf
from ringattn.comm import group_cache
from ringattn.integrations.hf import attention as hf_attention
from ringattn.models.config import ModelConfig
from ringattn.models.decoder import Transformer, set_context_parallel


class Counting:
    """A torch.compile backend that counts the graphs it is given and hands them to a named
    backend: "inductor" (what users get; ~30 s per graph on the test machine) or "aot_eager"
    (the same forward and backward graphs through AOTAutograd, run without code generation)."""

    def __init__(self, compiler: str = "inductor") -> None:
        self.backend = lookup_backend(compiler)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return self.backend(gm, example_inputs)


def graph_breaks(fn, *args, **kwargs) -> tuple[int, list[str]]:
    """(graph break count, reasons) of tracing fn(*args, **kwargs) with torch._dynamo.explain."""
    torch._dynamo.reset()
    report = torch._dynamo.explain(fn)(*args, **kwargs)
    torch._dynamo.reset()
    return report.graph_break_count, [str(r.reason)[:300] for r in report.break_reasons]


def solo_group() -> dist.ProcessGroup:
    """A group of this rank alone: the one-process reference (None would mean the world)."""
    groups = [group_cache.new_group([r]) for r in range(dist.get_world_size())]  # collective
    return groups[dist.get_rank()]


def _summed_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient summed over the default group."""
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
        if dist.is_initialized():
            dist.all_reduce(g)
        grads[name] = g
    return grads


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def decoder_case(
    rank,
    world_size,
    *,
    layout="zigzag",
    strategy="ring",
    seq_len=32,
    compiler="inductor",
    explain=False,
):
    """Our decoder, CP over the world (for "hybrid" a 2-D mesh of it), compiled whole with
    fullgraph=True, against the same weights on the full sequence in one process: (graph
    breaks, reasons, loss error, worst gradient error relative to each tensor's largest entry,
    graphs compiled)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2)
    reference = Transformer(cfg)
    set_context_parallel(reference, solo_group(), layout="contiguous")
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (2, seq_len), generator=gen)
    labels = torch.randint(0, 64, (2, seq_len), generator=gen)
    loss, count, _ = reference(tokens, torch.arange(seq_len), labels)
    ref_loss = (loss / count).item()
    (loss / count).backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}

    model = Transformer(cfg)
    model.load_state_dict(reference.state_dict())
    model.loss_chunk = 16  # the chunked loss (checkpointed chunks) traces too
    group = _group(strategy) or dist.group.WORLD  # hybrid: a ("ring", "ulysses") mesh
    set_context_parallel(model, group, layout=layout, strategy=strategy)
    local = [ringattn.shard(x, 1, group=group, layout=layout) for x in (tokens, labels)]
    positions = ringattn.positions(seq_len, group=group, layout=layout)
    # fullgraph=True below fails on any graph break; explain (another whole trace) only if asked
    breaks, reasons = graph_breaks(model, local[0], positions, local[1]) if explain else (0, [])
    backend = Counting(compiler)
    compiled = (
        model if compiler == "none" else torch.compile(model, backend=backend, fullgraph=True)
    )
    loss, count, _ = compiled(local[0], positions, local[1])
    total = count.detach().clone()
    dist.all_reduce(total)
    (loss / total).backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    grads = _summed_grads(model)
    cp_loss = (summed / total).item()
    worst = max(_relative(grads[n], g) for n, g in ref_grads.items())
    return breaks, reasons, abs(cp_loss - ref_loss) / abs(ref_loss), worst, backend.graphs


def _packed_inputs(bounds, world_size, rank, layout, heads=(4, 2), dim=8, dtype=torch.float64):
    """Full q, k, v (seeded, the same on every rank) and this rank's shards for `bounds`."""
    gen = torch.Generator().manual_seed(len(bounds) * 1000 + bounds[-1])
    s = bounds[-1]
    q = torch.randn(1, heads[0], s, dim, generator=gen, dtype=dtype)
    k = torch.randn(1, heads[1], s, dim, generator=gen, dtype=dtype)
    v = torch.randn(1, heads[1], s, dim, generator=gen, dtype=dtype)
    cu = torch.tensor(bounds, dtype=torch.int64)
    local = [ringattn.shard(x, 2, layout=layout, cu_seqlens=cu).requires_grad_() for x in (q, k, v)]
    return (q, k, v), local, cu


def _reference(q, k, v, bounds, index):
    """fp64 attention, causal within each document, on the full tensors; rows at `index`."""
    doc = torch.repeat_interleave(
        torch.arange(len(bounds) - 1), torch.tensor(bounds).diff()
    )  # (S,)
    pos = torch.arange(bounds[-1])
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vv
    return out, (q, k, v)


def packed_case(
    rank, world_size, *, layouts, layout="zigzag", strategy="ring", compiler="aot_eager"
):
    """Packed documents through one compiled function, for several document layouts and
    lengths in turn: (graph breaks, graphs compiled after each call, worst out error, worst
    gradient error), fp64 against the full-sequence reference."""

    def attend(q, k, v, cu):
        out = ringattn.attention(
            q, k, v, causal=True, layout=layout, strategy=strategy, cu_seqlens=cu
        )
        return out * 2.0  # something around the op, as in a model

    _, local, cu = _packed_inputs(layouts[0], world_size, rank, layout)
    breaks, _ = graph_breaks(attend, *local, cu)
    backend = Counting(compiler)
    compiled = torch.compile(attend, backend=backend, fullgraph=True)
    out_error = grad_error = 0.0
    graphs = []
    for bounds in layouts:
        full, local, cu = _packed_inputs(bounds, world_size, rank, layout)
        index = ringattn.positions(bounds[-1], layout=layout, cu_seqlens=cu)
        out = compiled(*local, cu)
        dout = torch.randn(
            out.shape, generator=torch.Generator().manual_seed(rank), dtype=out.dtype
        )
        out.backward(dout)
        ref_out, ref_inputs = _reference(*full, bounds, index)
        # the reference gradient of this rank's rows, summed over ranks by all-reducing dout
        real = index >= 0
        full_dout = torch.zeros_like(ref_out)
        full_dout[:, :, index[real]] = dout[:, :, real]
        dist.all_reduce(full_dout)
        (ref_out * 2.0).backward(full_dout)
        out_error = max(out_error, (out[:, :, real] - 2.0 * ref_out[:, :, index[real]]).abs().max())
        for mine, ref in zip(local, ref_inputs):
            error = (mine.grad[:, :, real] - ref.grad[:, :, index[real]]).abs().max()
            grad_error = max(grad_error, error)
        graphs.append(backend.graphs)
    return breaks, graphs, float(out_error), float(grad_error)


def disagreeing_ranks(rank, world_size):
    """Rank 0 holds 8 tokens, the others 4: the compiled call must raise on every rank."""
    q, k, v = (torch.randn(1, 2, 8 if rank == 0 else 4, 8) for _ in range(3))
    attend = torch.compile(lambda q, k, v: ringattn.attention(q, k, v), backend="aot_eager",
                           fullgraph=True)  # fmt: skip
    attend(q, k, v)


def hf_case(rank, world_size, *, kinds, compiler="aot_eager", layout="zigzag", strategy="ring"):
    """A Hugging Face Llama after parallelize + shard_batch, compiled with fullgraph=True, against
    transformers' eager attention on the full sequence in one process. One row per data kind:
    (kind, graph breaks, reasons, loss relative error, worst gradient error, graphs compiled)."""
    rows = []
    for kind in kinds:
        model = ringattn.hf.parallelize(
            copy.deepcopy(hf.build("llama")), layout=layout, strategy=strategy
        )
        batch = ringattn.hf.shard_batch(hf.data(kind), layout=layout)
        breaks, reasons = graph_breaks(model, **batch)
        backend = Counting(compiler)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        out = compiled(**batch)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = _summed_grads(model)
        ref_loss, ref_grads = hf.reference("llama", kind)
        worst = max(_relative(grads[n], g) for n, g in ref_grads.items())
        rows.append((kind, breaks, reasons, abs(loss.item() - ref_loss) / ref_loss, worst,
                     backend.graphs))  # fmt: skip
    return rows


def _packed_batch(docs: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """DataCollatorWithFlattening's form of documents of these lengths (seeded by them)."""
    gen = torch.Generator().manual_seed(sum(docs) * 31 + len(docs))
    ids = torch.randint(0, 100, (1, sum(docs)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
    labels = ids.clone()
    labels[:, [sum(docs[:i]) for i in range(len(docs))]] = -100  # no prediction across documents
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def hf_layouts_case(
    rank, world_size, *, batches, compiler="aot_eager", layout="zigzag", explain=True
):
    """One parallelized Llama, compiled with fullgraph=True, fed batches of new lengths and
    document layouts in turn, against transformers' eager attention on the full sequence in one
    process. Returns the graph breaks of the first batch (explain) and per batch (graphs
    compiled so far, loss relative error, worst gradient error relative to each tensor's max)."""
    reference = hf.build("llama")
    model = ringattn.hf.parallelize(copy.deepcopy(reference), layout=layout)
    first = ringattn.hf.shard_batch(_packed_batch(batches[0]), layout=layout)
    # fullgraph=True below fails on any graph break; explain is a second whole trace
    breaks, reasons = graph_breaks(model, **first) if explain else (0, [])
    backend = Counting(compiler)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    rows = []
    for docs in batches:
        full = _packed_batch(docs)
        reference.zero_grad(set_to_none=True)
        ref = reference(**full, use_cache=False)
        ref.loss.backward()
        model.zero_grad(set_to_none=True)
        out = compiled(**ringattn.hf.shard_batch(full, layout=layout))
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        grads = _summed_grads(model)
        worst = max(_relative(grads[n], p.grad) for n, p in reference.named_parameters())
        rows.append((backend.graphs, abs(loss.item() - ref.loss.item()) / ref.loss.item(), worst))
    return breaks, reasons, rows


def _group(strategy: str):
    """The default group, or for "hybrid" a 2-D ("ring", "ulysses") mesh of the world."""
    if strategy != "hybrid":
        return None
    shape = (dist.get_world_size() // 2, 2)
    return group_cache.device_mesh("cpu", shape, ("ring", "ulysses"))  # once per pool process


def padding_mask_case(rank, world_size, *, strategy="ring", zero_on_rank=-1, compiled=False):
    """A 2-D attention_mask passed to a parallelized Llama: (gathers in the first forward,
    gathers in the second, loss with the mask, loss without it). A zero on rank `zero_on_rank`
    must raise on every rank; under torch.compile any mask is refused at trace time."""
    group = _group(strategy)
    model = ringattn.hf.parallelize(
        copy.deepcopy(hf.build("llama")), group=group, strategy=strategy
    )
    batch = ringattn.hf.shard_batch(hf.data("packed"), group=group)
    mask = torch.ones_like(batch["input_ids"])
    if rank == zero_on_rank:
        mask[0, -1] = 0
    gathers = []
    real = hf_attention.all_gather_ints

    def counting(*args, **kwargs):
        gathers.append(1)
        return real(*args, **kwargs)

    hf_attention.all_gather_ints = counting
    try:
        if compiled:
            torch.compile(model, backend="aot_eager", fullgraph=True)(**batch, attention_mask=mask)
        with torch.no_grad():
            masked = model(**batch, attention_mask=mask).loss.item()
            first = len(gathers)
            masked_again = model(**batch, attention_mask=mask).loss.item()
            second = len(gathers) - first
    finally:
        hf_attention.all_gather_ints = real
    with torch.no_grad():
        plain = model(**batch).loss.item()
    assert masked == masked_again
    return first, second, masked, plain
