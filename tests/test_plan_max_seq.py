"""`ringattn plan --max-seq` (planner/max_seq/search.py): the longest sequence each plan trains.

The search is a bisection over a monotone memory model, so: the answer fits and one unit more
does not; each memory lever (chunked loss, checkpointing, tiled MLP, offload) lengthens it; the
tiled MLP's saving is the MLP intermediates less attention's buffers; offload is bounded
by the host's RAM and priced on the host link; the JSON contract gives "max_seq"; the published
longest lengths (ALST, FPDT) stay where docs/memory.md says they are; the memory total is the
larger of a step's two phases (the loss, a block's backward), not their sum.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from ringattn.cli.main import main
from ringattn.planner.cost import PlanSpec, step_time
from ringattn.planner.hardware import get_hardware
from ringattn.planner.max_seq.search import (
    _unit,
    by_technique,
    check_published_max_seq,
    fits,
    longest,
)
from ringattn.planner.memory import _mlp_elems, host_bytes, memory_bytes
from ringattn.planner.models import get_model

LLAMA = get_model("llama3-8b")
H100 = get_hardware("h100")


def _spec(**kw) -> PlanSpec:
    base = {"model": LLAMA, "hw": H100, "seq_len": 1 << 20, "batch_size": 1, "dp": 1, "cp": 8,
            "tp": 1, "pp": 1, "strategy": "ring", "layout": "zigzag",
            "activation_checkpointing": True}  # fmt: skip
    return PlanSpec(**{**base, **kw})


def test_longest_fits_and_one_unit_more_does_not():
    spec = _spec(tiled_mlp=4096, offload_activations=True)
    seq = longest(spec)
    assert seq > 0 and seq % _unit(spec) == 0
    assert fits(replace(spec, seq_len=seq))
    assert not fits(replace(spec, seq_len=seq + _unit(spec)))


def test_each_lever_lengthens_the_sequence():
    rows = by_technique(_spec(), tile=4096)
    names = [r["technique"] for r in rows]
    assert names == ["none", "chunked loss", "+ activation checkpointing", "+ tiled MLP",
                     "+ activation offload"]  # fmt: skip
    lengths = [r["max_seq"] for r in rows]
    assert all(a < b for a, b in itertools.pairwise(lengths)), lengths
    assert rows[-1]["host_gib"] > 0 and rows[-2]["host_gib"] == 0


def test_tiled_saving_is_the_mlp_intermediates_less_attentions_buffers():
    """Untiled, the block's peak is its MLP's backward (three of its intermediates and three
    gradients of their width, beside the rest of the block); tiled, attention's (the MLP's and
    the second norm's tensors freed, attention's buffers alive): planner/memory.py's moments,
    as the profiler saw them on CPU (scripts/bench/long_seq.py --breakdown)."""
    plain, tiled = _spec(), _spec(tiled_mlp=1024)
    tokens, e = plain.seq_len // plain.cp, plain.elem_bytes
    a, b = memory_bytes(plain), memory_bytes(tiled)
    assert a["attention_buffers"] == 0 < b["attention_buffers"]
    saved = a["total"] - b["total"]
    second_norm = (4 / e + 2) * LLAMA.dim  # its float32 input, normed and output
    assert saved == pytest.approx(
        (1.5 * _mlp_elems(plain) + second_norm) * tokens * e - b["attention_buffers"]
    )
    # without checkpointing a tiled block keeps no MLP intermediates at all
    a, b = _spec(activation_checkpointing=False), _spec(activation_checkpointing=False,
                                                        tiled_mlp=1024)  # fmt: skip
    kept = memory_bytes(a)["activations"] - memory_bytes(b)["activations"]
    assert kept == pytest.approx(LLAMA.n_layers * _mlp_elems(a) * tokens * a.elem_bytes)


def test_offload_is_bounded_by_host_ram_and_priced_on_the_link():
    spec = _spec(tiled_mlp=4096, offload_activations=True)
    seq = longest(spec)
    at = replace(spec, seq_len=seq)
    tokens = seq // spec.cp
    assert host_bytes(at) == LLAMA.n_layers * tokens * LLAMA.dim * 2  # every checkpoint, bf16
    small_host = replace(spec, hw=replace(H100, host_memory_gib=64))
    assert longest(small_host) < seq  # 8 GPUs' checkpoints no longer fit 90 % of 64 GiB
    kept = replace(at, offload_activations=False)
    assert step_time(at)["step_time_s"] == step_time(kept)["step_time_s"]  # PCIe hides here
    # at 8k tokens a rank, a layer's compute is short: a slow link shows in the step
    short = replace(spec, seq_len=65536)
    slow = replace(short, hw=replace(H100, host_link_gbs=0.5))
    short_kept = replace(short, offload_activations=False)
    assert step_time(short)["step_time_s"] == step_time(short_kept)["step_time_s"]
    assert step_time(slow)["step_time_s"] > step_time(short)["step_time_s"]


def test_cli_max_seq_json_contract(capsys):
    assert main(["plan", "--model", "llama3-8b", "--hardware", "h100", "--gpus", "8",
                 "--max-seq", "--activation-checkpointing", "--tiled-mlp",
                 "--offload-activations", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["max_seq"] == out["plans"][0]["max_seq"] > 1_000_000
    assert all("max_seq" in p and "host_gib_per_gpu" in p for p in out["plans"])
    assert all(p["tp"] == 1 for p in out["plans"])  # the trainer's --tiled-mlp runs at tp 1
    assert "--tiled-mlp 4096" in out["plans"][0]["train_command"]
    assert "--offload-activations" in out["plans"][0]["train_command"]
    assert out["by_technique"][-1]["max_seq"] == out["max_seq"]


def test_cli_max_seq_table_and_refusals(capsys):
    assert main(["plan", "--model", "llama3-8b", "--hardware", "h100", "--gpus", "8",
                 "--max-seq", "--activation-checkpointing", "--top", "3"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "what each lever buys" in text and "memory per GPU by kind" in text
    for flags, match in ((["--offload-activations"], "add --activation-checkpointing"),
                         (["--tiled-mlp", "-5"], "--tiled-mlp -5")):  # fmt: skip
        with pytest.raises(SystemExit) as exit_info:
            main(["plan", "--model", "llama3-8b", "--hardware", "h100", "--gpus", "8",
                  "--max-seq", *flags])  # fmt: skip
        assert exit_info.value.code == 2
        assert match in capsys.readouterr().err


def test_published_longest_sequences_stay_where_the_docs_say():
    """docs/memory.md's table: the planner (all levers, model-state offload) is within 25 % of
    ALST (12-14 % over) and 52 % short of FPDT, whose chunked attention offload it names as not
    priced."""
    rows = {r["name"]: r for r in check_published_max_seq()}
    expected = {"ALST Llama-8B, 1 x H100": 0.14, "ALST Llama-8B, 8 x H100": 0.13,
                "ALST Llama-8B, 32 x H100": 0.12, "FPDT 8B, 4 x A100-40GB": -0.52}  # fmt: skip
    for name, error in expected.items():
        assert rows[name]["error"] == pytest.approx(error, abs=0.01), rows[name]
        assert rows[name]["not_priced"], name
    assert "chunks of q, k, v" in rows["FPDT 8B, 4 x A100-40GB"]["not_priced"]


def test_the_total_is_the_larger_of_the_loss_and_the_block_phase():
    """A step's loss and a block's backward peak at different times (planner/memory.py,
    "Phases"): the total is the larger phase, whose kinds are reported (the other's are 0)."""
    short = _spec(seq_len=8 * 4096, loss_chunk=0)  # whole logits: the loss is the peak
    mem = memory_bytes(short)
    assert mem["loss"] > 0 and mem["backward_transient"] == mem["attention_buffers"] == 0
    # the block phase is smaller there, so tiling the MLP changes nothing
    assert memory_bytes(replace(short, tiled_mlp=1024))["total"] == mem["total"]
    long = _spec(tiled_mlp=4096)  # 128k tokens a rank: a block's backward is the peak
    mem = memory_bytes(long)
    assert mem["loss"] == 0 and mem["backward_transient"] > 0 and mem["attention_buffers"] > 0
    for m in (memory_bytes(short), mem):
        assert m["total"] == pytest.approx(sum(v for k, v in m.items() if k != "total"))
    summed = memory_bytes(replace(long, loss_chunk=512))
    assert summed["total"] == mem["total"]  # a loss chunk under the block's peak costs nothing
