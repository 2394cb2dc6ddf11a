"""Tiled MLP (models/tiled.py, integrations/hf/levers/tiled.py) is exact and saves less.

- the core: a row-wise function over tiles that do not divide the rows equals the whole call in
  float64 (outputs, input and parameter gradients), with several row-aligned inputs (an int one
  among them) and under no_grad;
- our decoder (float32, within 1e-6) and transformers models (Llama, Qwen3-MoE, Jamba: a hybrid
  with MoE layers; float64, within 1e-12) at CP 1 and 2, three SGD steps: losses and gradients
  of tiled against untiled (in float32 the transformers models drift to ~1e-6 after a 0.5 step
  from the weight gradients' summation order alone, the one difference tiling makes);
- every class on the HF allow-list, in float64 on a tiny model of the family named beside it;
  a feed-forward off the list is refused by name;
- memory: the peak of live saved tensors (counted by torch.autograd.graph.saved_tensors_hooks)
  falls with the tile size.
"""

from __future__ import annotations

import copy
import weakref
from collections import Counter

import pytest
import torch

from ringattn.models import Transformer, model_config
from ringattn.models.decoder import FeedForward, set_tiled_mlp
from ringattn.models.tiled import tiled_rows
from tiers import stride

FP32_GATE = 1e-6
FP64_GATE = 1e-12


def _mlp(tile: int) -> FeedForward:
    torch.manual_seed(0)
    ffn = FeedForward(model_config("tiny")).double()
    ffn.tile = tile
    return ffn


@pytest.mark.parametrize("tile", [1, 7, 16, 64, 200])
def test_tiled_feed_forward_equals_untiled_fp64(tile):
    """Tiles of 1, 7 (not dividing 2 x 50 rows), 16, 64 and more than the rows."""
    ref, tiled = _mlp(0), _mlp(tile)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 50, 64, generator=gen, dtype=torch.float64)
    dout = torch.randn(2, 50, 64, generator=gen, dtype=torch.float64)
    grads = []
    for m in (ref, tiled):
        xin = x.clone().requires_grad_()
        out = m(xin)
        (out * dout).sum().backward()
        grads.append((out.detach(), xin.grad, [p.grad for p in m.parameters()]))
    (out0, dx0, dp0), (out1, dx1, dp1) = grads
    torch.testing.assert_close(out1, out0, atol=FP64_GATE, rtol=FP64_GATE)
    torch.testing.assert_close(dx1, dx0, atol=FP64_GATE, rtol=FP64_GATE)
    for a, b in zip(dp1, dp0, strict=True):
        torch.testing.assert_close(a, b, atol=FP64_GATE, rtol=FP64_GATE)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), ref(x), atol=FP64_GATE, rtol=FP64_GATE)


def test_tiled_rows_with_several_inputs_and_an_int_one():
    """An experts-like call: hidden rows, int indices and float weights, all split by rows."""
    gen = torch.Generator().manual_seed(2)
    table = torch.randn(5, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    h = torch.randn(23, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, 5, (23, 2), generator=gen)
    w = torch.randn(23, 2, generator=gen, dtype=torch.float64, requires_grad=True)

    def fn(h, idx, w):
        return torch.tanh(h * table[idx[:, 0]]) * w[:, :1] + h * table[idx[:, 1]] * w[:, 1:]

    dout = torch.randn(23, 8, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad((fn(h, idx, w) * dout).sum(), [table, h, w])
    out = tiled_rows(fn, [h, idx, w], 4, [table])
    got = torch.autograd.grad((out * dout).sum(), [table, h, w])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=FP64_GATE, rtol=FP64_GATE)


@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("world_size", [1, 2])
def test_decoder_tiled_equals_untiled_over_three_steps(pools, world_size, checkpoint):
    rows = pools(world_size).run("workers_tiled:decoder_case", tile=7, checkpoint=checkpoint)[0]
    assert len(rows) == 3
    for step, row in enumerate(rows):
        assert row["loss_rel"] <= FP32_GATE and row["grad_rel"] <= FP32_GATE, (step, row)
    assert rows[2]["loss"] < rows[0]["loss"]  # the steps did train


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe", "jamba"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.slow
def test_hf_tiled_equals_untiled_over_three_steps(pools, world_size, model_type):
    rows = pools(world_size).run("workers_tiled:hf_case", model_type=model_type, tile=5)[0]
    assert len(rows) == 3
    for step, row in enumerate(rows):
        assert row["loss_rel"] <= FP64_GATE and row["grad_rel"] <= FP64_GATE, (step, row)
    assert rows[2]["loss"] < rows[0]["loss"]


def test_hf_tiled_with_activation_checkpointing_at_cp2(pools):
    """Tiles inside transformers' own checkpointed layers (non-reentrant): the recompute of a
    layer runs the tiled function again, whose backward recomputes each tile."""
    rows = pools(2).run("workers_tiled:hf_case", model_type="qwen3_moe", tile=3, checkpoint=True)
    for step, row in enumerate(rows[0]):
        assert row["loss_rel"] <= FP64_GATE and row["grad_rel"] <= FP64_GATE, (step, row)


def _families() -> list[str]:
    from ringattn.integrations.hf.levers.tiled import DENSE, EXPERTS

    return sorted(set(DENSE.values()) | set(EXPERTS.values()))


@pytest.mark.parametrize("model_type", stride(_families(), 7, str))
def test_every_listed_class_is_row_wise_fp64(model_type):
    """Each class on the allow-lists is tiled in its family's tiny model (found and wrapped) and
    every feed-forward unit there equals its untiled twin in float64."""
    pytest.importorskip("transformers")
    from ringattn.integrations.hf.levers.tiled import DENSE, EXPERTS
    from workers_tiled import family_case

    row = family_case(model_type)
    listed = {c for c, f in (DENSE | EXPERTS).items() if f == model_type}
    assert listed <= set(row["classes"]), (listed, row)
    assert row["out_rel"] <= FP64_GATE and row["grad_rel"] <= FP64_GATE, row


def _survey():
    import sys

    sys.path.insert(0, "scripts/tools")
    import family_survey

    return family_survey


def test_feed_forward_off_the_list_is_refused_by_name():
    """GPT-2's MLP holds a dropout (its recompute would draw other numbers): refused by name,
    before anything changes; so is a bad tile size."""
    pytest.importorskip("transformers")
    import ringattn.hf

    model = _survey().build("gpt2")
    with pytest.raises(ValueError, match=r"GPT2MLP \(transformer\.h\.0\.mlp\).*allow-list"):
        ringattn.hf.parallelize(model, tiled_mlp=64)
    assert model.config._attn_implementation != "ringattn"  # refused before any change
    with pytest.raises(ValueError, match="tiled_mlp=-1"):
        ringattn.hf.parallelize(_survey().build("llama"), tiled_mlp=-1)


def test_experts_off_the_list_are_refused_by_name():
    pytest.importorskip("transformers")
    import ringattn.hf

    with pytest.raises(ValueError, match=r"JetMoeParallelExperts .*allow-list"):
        ringattn.hf.parallelize(_survey().build("jetmoe"), tiled_mlp=16)


class SavedBytes:
    """Live bytes of the tensors autograd saves (each storage once; parameters left out), and
    their peak, through torch.autograd.graph.saved_tensors_hooks. A saved tensor is live from
    its pack until autograd drops it (after its node's backward)."""

    def __init__(self, exclude: list[torch.Tensor]):
        self.skip = {p.untyped_storage().data_ptr() for p in exclude}
        self.refs: Counter[int] = Counter()
        self.now = self.peak = 0

    class _Held:
        def __init__(self, t: torch.Tensor):
            self.t = t

    def pack(self, t: torch.Tensor) -> object:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        held = self._Held(t)
        if key in self.skip:
            return held
        if self.refs[key] == 0:
            self.now += size
            self.peak = max(self.peak, self.now)
        self.refs[key] += 1
        weakref.finalize(held, self._release, key, size)
        return held

    def _release(self, key: int, size: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= size

    def unpack(self, held: object) -> torch.Tensor:
        return held.t


def _peak_saved(tile: int, rows: int = 512) -> int:
    torch.manual_seed(0)
    ffn = FeedForward(model_config("tiny"))  # dim 64, intermediate 192
    ffn.tile = tile
    counter = SavedBytes(list(ffn.parameters()))
    x = torch.randn(1, rows, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        ffn(x).sum().backward()
    assert counter.now == 0  # everything saved was released by the end of backward
    return counter.peak


def test_peak_saved_activations_fall_with_the_tile_size():
    """Untiled, a SwiGLU MLP keeps its input and ~4 x rows x intermediate floats; tiled, only its
    input plus one tile's intermediates, recomputed in backward."""
    untiled, t128, t32, t8 = (_peak_saved(t) for t in (0, 128, 32, 8))
    row = 64 * 4  # bytes of one input row
    assert untiled > t128 > t32 > t8, (untiled, t128, t32, t8)
    assert untiled >= 512 * row + 3 * 512 * 192 * 4  # input + w1, w3, silu outputs (at least)
    # tiled: the saved input (the rows) plus at most a few tiles' intermediates
    assert t8 <= 512 * row + 8 * (row + 5 * 192 * 4), t8


def test_decoder_tiled_mlp_flag_and_refusals():
    model = Transformer(model_config("tiny"))
    set_tiled_mlp(model, 256)
    assert {m.tile for m in model.modules() if isinstance(m, FeedForward)} == {256}
    with pytest.raises(ValueError, match="tiled_mlp=-3"):
        set_tiled_mlp(copy.deepcopy(model), -3)
