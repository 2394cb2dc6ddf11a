"""ringattn.hf under torch.compile(fullgraph=True), and the padding-mask check (once per forward).

A Llama after `parallelize` + `shard_batch`, compiled whole, at W = 2: a dense sequence,
then packed documents of new lengths and layouts through the same compiled model. Each batch's
loss and gradients (summed over the ranks) equal transformers' eager attention on the full
sequence in one process; explain finds no graph break (W = 2; fullgraph=True fails on any); the
graphs compiled go 1, 2, 2, 2: the first new length makes dynamo's shapes dynamic (automatic
dynamic shapes: the sequence dim and the number of documents), and no later batch recompiles,
since the document bounds are data of ringattn's op. (W = 2 only: the compiled graph holds
ringattn's op, opaque to dynamo, so it is the same graph at any world size; W = 4 under compile
is test_compile_train.py's, and the Llama at W = 4 in eager test_hf.py's and test_check_hf.py's.)

`ringattn train --hf --compile` on cp 2 compiles each decoder layer (FSDP2's hooks between):
dynamo makes `layer_idx` symbolic at the second layer, which the attention's messages must not
format while tracing; the compiled run trains as the eager one does.

A 2-D attention_mask given to the model itself is checked once per forward (one all-gather,
not one per layer), also over a 2-D mesh (strategy="hybrid"); under torch.compile it is refused
at trace time, since `shard_batch` checks it once per batch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_train_hf import _options, tiny_llama_dir

LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
BATCHES = [(37,), (11, 1, 18, 7), (5, 20, 9), (3, 3, 9, 2, 30)]  # dense, then packed


@pytest.mark.slow
def test_llama_compiled_equals_one_process(pools):
    results = pools(2).run(
        "workers_compile:hf_layouts_case",
        batches=BATCHES,
        explain=True,
        timeout=600,  # compiling on a loaded 2-core machine: generous
    )
    for breaks, reasons, rows in results:
        assert breaks == 0, reasons
        assert [graphs for graphs, _, _ in rows] == [1, 2, 2, 2]
        for docs, (_, loss_error, grad_error) in zip(BATCHES, rows):
            assert loss_error <= LOSS_RTOL, (docs, loss_error)
            assert grad_error <= GRAD_RTOL, (docs, grad_error)


@pytest.mark.slow
def test_train_hf_compiled_equals_eager(pools, tmp_path):
    model_dir, docs = tiny_llama_dir(tmp_path)
    runs = {}
    for compiled in (False, True):
        options = _options(model_dir, docs, tmp_path / f"run-{compiled}", cp=2, compile=compiled,
                           compile_backend="aot_eager")  # fmt: skip
        runs[compiled] = pools(2).run("workers_train:train", options, timeout=600)[0]
    assert runs[True]["losses"] == pytest.approx(runs[False]["losses"], rel=1e-6)
    for name, value in runs[False]["params"].items():
        torch.testing.assert_close(runs[True]["params"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


@pytest.mark.parametrize(("world_size", "strategy"), [(2, "ring"), (4, "hybrid")])
@pytest.mark.slow
def test_padding_mask_is_checked_once_per_forward(pools, world_size, strategy):
    """All ones: one all-gather per forward of the 2-layer model, the loss of no mask."""
    results = pools(world_size).run("workers_compile:padding_mask_case", strategy=strategy)
    for first, second, masked, plain in results:
        assert (first, second) == (1, 1)
        assert masked == plain


def test_padding_mask_with_zeros_raises_on_every_rank_hybrid(pools):
    pools(4).run_expect_error(
        "workers_compile:padding_mask_case", strategy="hybrid", zero_on_rank=0,
        match="attention_mask has zeros", exc_type=ValueError,
    )  # fmt: skip


@pytest.mark.slow
def test_padding_mask_under_compile_is_refused(pools):
    """fullgraph=True turns the trace-time ValueError into dynamo's Unsupported (a
    RuntimeError) that carries the message."""
    pools(2).run_expect_error(
        "workers_compile:padding_mask_case", compiled=True,
        match="under torch.compile, give the attention_mask to ringattn.hf.shard_batch",
        exc_type=RuntimeError,
    )  # fmt: skip
