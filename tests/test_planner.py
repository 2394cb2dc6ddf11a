"""`ringattn plan`: JSON contract, search, the modelled effects, errors, and the CPU calibration.

No training runs here: the check of predictions against runs is scripts/bench/plan_check.py (in
BENCHMARKS.md). The calibration test measures the kernels at a few sizes, with the gloo and
trainer-floor steps stubbed out (plan_check.py runs them for real).
"""

from __future__ import annotations

import json
import math

import pytest

from ringattn.cli.main import main
from ringattn.planner import calibrate as calib_mod
from ringattn.planner.command import train_command
from ringattn.planner.cost import PlanSpec, step_time
from ringattn.planner.hardware import get_hardware
from ringattn.planner.models import get_model
from ringattn.planner.work import allgather_work, group_ring_steps

KEYS = {"dp", "cp", "tp", "pp", "strategy", "layout", "step_time_s", "tokens_per_s_per_gpu",
        "memory_gib_per_gpu", "fits", "breakdown"}  # fmt: skip


def plan(capsys, *args: str) -> list[dict]:
    assert main(["plan", *args, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object on one line
    return json.loads(out)["plans"]


def one(capsys, **kw) -> dict:
    base = {"model": "llama3-8b", "hardware": "h100", "gpus": "8", "seq-len": "65536",
            "batch-size": "1", "dp": "1", "cp": "8", "tp": "1", "pp": "1", "strategy": "ring",
            "layout": "zigzag"}  # fmt: skip
    base.update({k.replace("_", "-"): str(v) for k, v in kw.items()})
    args = [a for k, v in base.items() for a in ((f"--{k}",) if v == "True" else (f"--{k}", v))]
    plans = plan(capsys, *args)
    assert len(plans) == 1
    return plans[0]


def test_json_shape_order_and_degrees(capsys):
    plans = plan(capsys, "--model", "llama3-8b", "--hardware", "h100", "--gpus", "16",
                 "--seq-len", "131072", "--batch-size", "1")  # fmt: skip
    assert len(plans) > 10
    for p in plans:
        assert KEYS <= set(p)
        assert p["dp"] * p["cp"] * p["tp"] * p["pp"] == 16
        assert p["fits"] is True  # non-fitting plans are listed only when nothing fits
        b = p["breakdown"]
        assert {"compute_s", "exposed_comm_s", "memory_gib"} <= set(b)
        assert math.isclose(sum(b["memory_gib"].values()), p["memory_gib_per_gpu"], rel_tol=1e-9)
        assert b["compute_s"] > 0 and b["exposed_comm_s"] >= 0
        tokens = p["dp"] * 131072
        assert math.isclose(p["tokens_per_s_per_gpu"], tokens / p["step_time_s"] / 16)
    rates = [p["tokens_per_s_per_gpu"] for p in plans]
    assert rates == sorted(rates, reverse=True)
    assert {p["strategy"] for p in plans} == {"ring", "allgather", "ulysses", "hybrid"}
    assert {p["layout"] for p in plans} == {"zigzag", "striped", "contiguous"}


def test_fixed_degrees_are_kept_and_the_rest_searched(capsys):
    plans = plan(capsys, "--model", "llama3-8b", "--hardware", "h200", "--gpus", "32",
                 "--seq-len", "65536", "--batch-size", "2", "--cp", "4", "--strategy",
                 "ring")  # fmt: skip
    assert {p["cp"] for p in plans} == {4} and {p["strategy"] for p in plans} == {"ring"}
    assert len({(p["dp"], p["tp"], p["pp"]) for p in plans}) > 3


def test_memory_grows_with_length_and_falls_with_cp(capsys):
    mems = [one(capsys, seq_len=s)["memory_gib_per_gpu"] for s in (16384, 65536, 262144)]
    assert mems[0] < mems[1] < mems[2]
    by_cp = [one(capsys, gpus=c, cp=c)["memory_gib_per_gpu"] for c in (2, 4, 8)]
    assert by_cp[0] > by_cp[1] > by_cp[2]
    ac = one(capsys, activation_checkpointing=True)
    assert ac["memory_gib_per_gpu"] < one(capsys)["memory_gib_per_gpu"]


def test_modelled_effects(capsys):
    zigzag = one(capsys)
    contiguous = one(capsys, layout="contiguous")
    assert contiguous["step_time_s"] > 1.2 * zigzag["step_time_s"]  # causal imbalance
    # a short shard cannot hide its K/V hop across nodes (1 GPU per node): exposed comm grows
    short = one(capsys, seq_len=8192, gpus_per_node=1)["breakdown"]
    long = one(capsys, seq_len=262144, gpus_per_node=1)["breakdown"]
    assert short["exposed_cp_comm_s"] / short["attention_s"] > long["exposed_cp_comm_s"] / long[
        "attention_s"]  # fmt: skip
    assert long["exposed_cp_comm_s"] < 0.05 * long["attention_s"]
    fp8 = one(capsys, dtype="fp8")
    assert fp8["step_time_s"] < zigzag["step_time_s"]
    # attention stays bf16: fp8 gains less at long sequences (attention-bound) than at shorter
    # ones (at 8k the FSDP all-gathers of an 8B model are longer than the compute: no gain)
    gain = [one(capsys, seq_len=s)["step_time_s"] / one(capsys, seq_len=s, dtype="fp8")[
        "step_time_s"] for s in (32768, 262144)]  # fmt: skip
    assert gain[0] > gain[1] > 1.0
    ac = one(capsys, activation_checkpointing=True)
    assert ac["step_time_s"] > zigzag["step_time_s"]  # the recomputed forward


def test_work_from_layout_schedules():
    ring = group_ring_steps("contiguous", 4, 1)
    assert [s.area for s in ring] == [0.5, 1.0, 1.0, 1.0]
    assert all(s.area == 0.5 for s in group_ring_steps("zigzag", 4, 1))
    assert allgather_work("contiguous", 4).area == 3.5
    assert allgather_work("striped", 4).area == pytest.approx(2.0, rel=1e-3)
    ulysses = group_ring_steps("contiguous", 4, 4)
    assert len(ulysses) == 1 and ulysses[0].area == pytest.approx(8.0)  # 4^2 / 2


def test_text_output(capsys):
    assert main(["plan", "--model", "llama3-70b", "--hardware", "b200", "--gpus", "64",
                 "--seq-len", "131072", "--batch-size", "1"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[:4] == ["dp", "cp", "tp", "pp"]
    assert "wins" in lines[-2]
    assert lines[-1].startswith("run it: torchrun --nnodes=8 --nproc-per-node=8 -m ringattn train")


def test_hf_config_json(tmp_path, capsys):
    cfg = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
           "head_dim": 64, "tie_word_embeddings": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = get_model(str(tmp_path / "config.json"))
    assert (spec.dim, spec.n_layers, spec.n_kv_heads, spec.d_head) == (2048, 16, 8, 64)
    assert spec.params() == pytest.approx(1.236e9, rel=0.01)  # Llama-3.2-1B
    assert plan(capsys, "--model", str(tmp_path), "--hardware", "a100", "--gpus", "4",
                "--seq-len", "32768")  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "gpt5"], "choose one of tiny, small"),
        (["--hardware", "tpu"], "choose one of h100, h800, h200, a100, b200, cpu"),
        (["--dp", "3", "--cp", "2"], "degrees must multiply to 8"),
        (["--dp", "2", "--cp", "2", "--tp", "1", "--pp", "1"], "degrees must multiply to 8"),
        (["--tp", "3", "--gpus", "6"], "not divisible by tp=3"),
        (
            [
                "--model",
                "llama3-8b",
                "--gpus",
                "3",
                "--cp",
                "3",
                "--tp",
                "1",
                "--seq-len",
                "24576",
                "--strategy",
                "ulysses",
            ],
            "ulysses needs",
        ),
        (["--seq-len", "1000", "--cp", "8", "--layout", "zigzag"], "pad it to a multiple of 16"),
        (["--hardware", "a100", "--dtype", "fp8"], "no fp8"),
    ],
)
def test_bad_flags(capsys, args, message):
    base = {"--model": "llama2-7b", "--hardware": "h100", "--gpus": "8", "--seq-len": "32768"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *[a for kv in base.items() for a in kv]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "ringattn plan: error:" in err and message in err, err


def _fake_calibration(cores=2) -> dict:
    table = {"128": 50.0, "2048": 100.0}
    attn = {k: {"32": table} for k in ("fwd_full", "fwd_causal", "bwd_full", "bwd_causal")}
    return {"cores": cores, "memory_gib": 8.0,
            "matmul": {"1": {"64": 100.0}, "2": {"64": 180.0}},
            "attention": {"1": attn, "2": attn}, "elementwise_gbs": {"1": 10.0, "2": 15.0},
            "gloo": {"latency_s": 5e-5, "bandwidth_gbs": 3.0}}  # fmt: skip


def test_cpu_oversubscription_and_overrides():
    cpu = get_hardware("cpu", calibration=_fake_calibration())
    assert (cpu.threads_per_process(1), cpu.threads_per_process(4)) == (2, 1)
    assert (cpu.slowdown(2), cpu.slowdown(4)) == (1.0, 2.0)
    h = get_hardware("h100", tflops=500, inter_bw=25, gpus_per_node=4)
    assert (h.bf16_tflops, h.inter_bw_gbs, h.gpus_per_node) == (500, 25, 4)
    assert h.fp8_tflops == pytest.approx(1000, rel=1e-3)  # the peaks keep their ratios
    assert h.fp32_tflops == pytest.approx(67 * 500 / 989)
    with pytest.raises(ValueError, match="must be > 0"):
        get_hardware("h100", intra_bw=-1)


def test_calibration_cache_is_reused(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(calib_mod, "WIDTHS", (32, 64))
    monkeypatch.setattr(calib_mod, "HEAD_DIMS", (16,))
    monkeypatch.setattr(calib_mod, "BLOCKS", (64, 128))
    monkeypatch.setattr(calib_mod, "_gloo", lambda repeats: calls.append(1) or {
        "latency_s": 1e-4, "bandwidth_gbs": 2.0})  # fmt: skip
    monkeypatch.setattr(calib_mod, "_step_floor", lambda: 0.01)  # a real trainer run: plan_check
    monkeypatch.setattr(calib_mod, "_oversubscription", lambda cores: {"cost": {"4": 1.2}})
    best = calib_mod._best_s
    monkeypatch.setattr(calib_mod, "_best_s", lambda fn, repeats: best(fn, 1, min_sample_s=0.0))
    path = str(tmp_path / "calib.json")
    args = ["--model", "tiny", "--hardware", "cpu", "--gpus", "2", "--seq-len", "1024",
            "--calibration", path]  # fmt: skip
    assert main(["plan", *args, "--json"]) == 0  # no cache yet: measured once, by itself
    out, err = capsys.readouterr()
    assert calls == [1] and "calibrating now" in err
    first = json.loads(out)["plans"]
    stamp = json.loads((tmp_path / "calib.json").read_text())["measured_at"]
    again = plan(capsys, *args)  # reads the cache: nothing measured
    assert calls == [1]
    assert json.loads((tmp_path / "calib.json").read_text())["measured_at"] == stamp
    assert first == again
    stale = json.loads((tmp_path / "calib.json").read_text())
    stale["cores"] = 999
    (tmp_path / "calib.json").write_text(json.dumps(stale))
    plan(capsys, *args)  # another machine's cache is not used: measured again
    assert calls == [1, 1]
    plan(capsys, *args, "--calibrate")  # --calibrate always measures
    assert calls == [1, 1, 1]
    other = tmp_path / "results.json"  # a file that is not a calibration is never overwritten
    other.write_text('{"rows": []}')
    with pytest.raises(SystemExit):
        main(["plan", *args[:-1], str(other)])
    assert "not a calibration file" in capsys.readouterr().err
    assert other.read_text() == '{"rows": []}'


def test_cpu_hosts_joined_by_a_shared_link():
    """`--hardware cpu --gpus-per-node 2 --inter-bw B`: hosts of 2 processes joined by one link
    of B GB/s (scripts/bench/two_hosts.py measures this). A ring crosses it once per direction,
    hybrid's ring of Ulysses pairs with both ranks of a host at once: on a slow link hybrid
    moves fewer bytes over fewer hops and wins; on one machine nothing changes."""
    calibration = _fake_calibration()
    one_machine = get_hardware("cpu", calibration=calibration)
    slow = get_hardware("cpu", calibration=calibration, gpus_per_node=2, inter_bw=20e6 / 8 / 1e9)
    assert slow.link_per_node and not one_machine.link_per_node
    assert slow.transfer_s(1e6, inter=True) == pytest.approx(5e-5 + 1e6 / 2.5e6)
    assert slow.transfer_s(1e6, inter=True, load=2) == pytest.approx(5e-5 + 2e6 / 2.5e6)
    assert slow.transfer_s(1e6, inter=False) == one_machine.transfer_s(1e6, inter=True)
    model = get_model("tiny")

    def step(hw, strategy, ulysses=1):
        spec = PlanSpec(model, hw, 2048, 1, 1, 4, 1, 1, strategy, "zigzag", "fp32",
                        ulysses=ulysses)  # fmt: skip
        return step_time(spec)

    ring, hybrid = step(slow, "ring"), step(slow, "hybrid", 2)
    assert hybrid["exposed_cp_comm_s"] < ring["exposed_cp_comm_s"]
    assert hybrid["step_time_s"] < ring["step_time_s"]
    assert step(one_machine, "ring")["step_time_s"] < ring["step_time_s"]
    spec = PlanSpec(model, slow, 2048, 1, 1, 4, 1, 1, "hybrid", "zigzag", "fp32", ulysses=2)
    assert train_command(spec)[0].startswith("torchrun --nnodes=2 --nproc-per-node=2 -m ringattn")
    one = PlanSpec(model, one_machine, 2048, 1, 1, 4, 1, 1, "ring", "zigzag", "fp32")
    assert train_command(one)[0].startswith("ringattn train --nproc 4 ")
    with pytest.raises(ValueError, match="apply to GPU presets"):
        get_hardware("cpu", calibration=calibration, tflops=10)
