"""`ringattn plan --lengths`: length distributions drawn into windows, static and dynamic CP
priced side by side (dynamic_cp/lengths.py, dynamic_cp/predict.py), the CLI flag end to end, and the
dynamic-CP bench's argument handling (scripts/bench/dynamic_cp.py, no run)."""

from __future__ import annotations

import importlib.util
import json
import os
from itertools import accumulate

import pytest

from ringattn.cli.main import build_parser, main
from ringattn.layout import get_layout
from ringattn.packing import place
from ringattn.plan import step_blocks
from ringattn.planner.calibrate import machine_key
from ringattn.planner.dynamic_cp import predict as dynamic
from ringattn.planner.dynamic_cp.documents import parse_documents
from ringattn.planner.dynamic_cp.lengths import FileLengths, parse_lengths, window_lengths
from ringattn.planner.dynamic_cp.pieces import PieceCosts, piece_seconds
from ringattn.planner.dynamic_cp.predict import FixedCosts, fixed_costs, predict_dynamic
from ringattn.planner.dynamic_cp.ringstep import measure_ring_step
from ringattn.planner.hardware import get_hardware
from ringattn.planner.models import get_model
from ringattn.planner.search import Job, search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQ = 65536
FIXED = FixedCosts(20e-6, 20e-6, 5e-6, "given")


def _predict(spec: str, seed: int = 0, fixed: FixedCosts = FIXED, steps: int = 4,
             cp: int = 8) -> dict:  # fmt: skip
    """llama3-8b on 8 H100s at dp 1 x cp 8, ring/zigzag, SEQ tokens per window."""
    model, hw = get_model("llama3-8b"), get_hardware("h100")
    job = Job(model, hw, 8, SEQ, 1, dp=8 // cp, cp=cp, tp=1, pp=1, strategy="ring",
              layout="zigzag")  # fmt: skip
    plan = search(job)[0]
    source = parse_lengths(spec, SEQ, seed)
    return predict_dynamic(model, hw, plan, source, SEQ, 1, "bf16", fixed, steps)


def test_lognormal_windows_are_trains_docs_windows():
    mine = parse_lengths("lognormal:1024,1.5,128,8192", 8192, seed=3)
    trains = parse_documents("docs:1024,1.5,128,8192", 8192, 3)
    for i in range(5):
        assert mine.lengths(i) == trains.lengths(i)
        assert sum(mine.lengths(i)) == 8192


def test_file_lengths_fill_windows_deterministically(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("300\n\n5000\n70\n")
    source = parse_lengths(str(path), 4096, seed=1)
    assert isinstance(source, FileLengths) and source.pool == (300, 5000, 70)
    for i in range(6):
        got = source.lengths(i)
        assert sum(got) == 4096 and got == source.lengths(i)
        assert all(n in (300, 5000, 70) for n in got[:-1])  # only the last is cut
    as_json = tmp_path / "lengths.json"
    as_json.write_text(json.dumps([300, 5000, 70]))
    assert parse_lengths(str(as_json), 4096, seed=1).lengths(2) == source.lengths(2)
    lengths, windows = window_lengths(source, 1, 3)  # step 1 of 3 windows: windows 3, 4, 5
    assert lengths == source.lengths(3) + source.lengths(4) + source.lengths(5)
    assert windows == sorted(windows) and set(windows) == {0, 1, 2}


@pytest.mark.parametrize(
    "spec, content, message",
    [
        ("lognormal:1024,1.5,8192,128", None, "need 1 <= MIN <= MAX, got MIN=8192, MAX=128"),
        ("lognormal:1024,0,128,8192", None, "SIGMA must be > 0, got 0"),
        ("lognormal:1024,-1,128,8192", None, "SIGMA must be > 0, got -1"),
        ("lognormal:0,1.5,128,8192", None, "MEAN must be > 0"),
        ("lognormal:1024,1.5,128", None, "expected lognormal:MEAN,SIGMA,MIN,MAX"),
        ("lognormal:1024,1.5,12.5,8192", None, "MIN and MAX integers"),
        ("nosuchfile.txt", None, "nor an existing file of lengths"),
        ("FILE", "", "no lengths in the file"),
        ("FILE", "128\nabc\n", "line 2: 'abc' is not an integer"),
        ("FILE", "128\n1.5\n", "line 2: '1.5' is not an integer"),
        ("FILE", "[128, 2.5]", "non-integers"),
        ("FILE", "[128, ", "not a JSON list"),
        ("FILE", "128\n0\n", "lengths must be >= 1, got [0]"),
    ],
)
def test_bad_lengths_are_refused_with_the_fix(tmp_path, spec, content, message):
    if content is not None:
        spec = str(tmp_path / "lengths.txt")
        with open(spec, "w") as f:
            f.write(content)
    with pytest.raises(ValueError, match="--lengths") as info:
        parse_lengths(spec, 8192)
    assert message in str(info.value)


def test_prediction_is_a_pure_function_of_the_seed():
    a, b = _predict("lognormal:1024,1.5,128,32768"), _predict("lognormal:1024,1.5,128,32768")
    assert a == b
    other = _predict("lognormal:1024,1.5,128,32768", seed=1)
    assert other["per_step"] != a["per_step"]
    assert sum(int(n) for n in a["cp_groups"].values()) == a["documents"]
    assert a["imbalance"]["max"] >= a["imbalance"]["mean"] >= 1.0
    assert len(a["per_step"]) == 4 and a["speedup"] == a["static_step_s"] / a["dynamic_step_s"]


def test_only_tiny_documents_predict_dynamic_faster(tmp_path):
    got = _predict("lognormal:200,0.5,128,512")
    assert got["cp_groups"] == {"1": got["documents"]}  # every document alone, no ring
    assert got["speedup"] > 1.0, got["speedup"]


def test_one_whole_window_document_predicts_no_change(tmp_path):
    """Each window one document of the window's length: both schedules are static CP's."""
    path = tmp_path / "one.txt"
    path.write_text(f"{SEQ}\n")
    got = _predict(str(path))
    assert got["cp_groups"] == {"8": 4}
    assert got["static_step_s"] == got["dynamic_step_s"]


def test_fixed_costs_weigh_against_the_whole_group_ring():
    """Static CP runs 2 x cp ring steps per layer for every window; with documents alone on
    their ranks dynamic CP runs none, so a dearer ring step widens the predicted gap."""
    cheap = _predict("lognormal:1024,1.5,128,32768", fixed=FixedCosts(0.0, 0.0, 0.0, "given"))
    dear = _predict("lognormal:1024,1.5,128,32768", fixed=FixedCosts(5e-3, 0.0, 0.0, "given"))
    assert dear["speedup"] > cheap["speedup"]
    step = dear["static_step_s"] - cheap["static_step_s"]
    assert step == pytest.approx(32 * 2 * 8 * 5e-3)  # layers x directions x cp steps


def test_fixed_costs_preset_given_and_refused():
    h100 = get_hardware("h100")
    preset = fixed_costs(h100, 8)
    assert preset.source == "preset" and preset.ring_step_s > preset.call_s > 0
    given = {"ring_step_s": 1e-3, "piece_s": 2e-4, "call_s": 1e-5}
    assert fixed_costs(h100, 8, given) == FixedCosts(1e-3, 2e-4, 1e-5, "given")
    some = fixed_costs(h100, 8, {"call_s": 1e-3, "piece_s": None})
    assert some.call_s == 1e-3 and some.ring_step_s == preset.ring_step_s
    assert some.source == "preset and given"
    with pytest.raises(ValueError, match="--ring-step-s must be >= 0"):
        fixed_costs(h100, 8, {"ring_step_s": -1.0})
    with pytest.raises(ValueError, match="--call-s must be >= 0"):
        fixed_costs(h100, 8, {"call_s": -1.0})


PLAN = ["plan", "--model", "llama3-8b", "--hardware", "h100", "--gpus", "8", "--cp", "8",
        "--seq-len", str(SEQ), "--strategy", "ring", "--layout", "zigzag"]  # fmt: skip


def test_cli_lengths_json_and_table(capsys):
    assert main([*PLAN, "--lengths", "lognormal:1024,1.5,128,32768", "--lengths-steps", "3",
                 "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    dynamic = out["dynamic_cp"]
    assert dynamic == {**_predict("lognormal:1024,1.5,128,32768", steps=3,
                                  fixed=fixed_costs(get_hardware("h100"), 8)),
                       "lengths": "lognormal:1024,1.5,128,32768"}  # fmt: skip
    for key in ("static_step_s", "dynamic_step_s", "speedup", "cp_groups", "imbalance", "terms"):
        assert key in dynamic
    assert main([*PLAN, "--lengths", "lognormal:1024,1.5,128,32768", "--lengths-steps", "3"]) == 0
    text = capsys.readouterr().out
    searched = [a for a in PLAN if a not in ("--strategy", "ring")]  # --lengths searches rings
    assert main([*searched, "--lengths", "lognormal:1024,1.5,128,32768", "--lengths-steps", "3",
                 "--json"]) == 0  # fmt: skip
    assert {p["strategy"] for p in json.loads(capsys.readouterr().out)["plans"]} == {"ring"}
    assert "dynamic CP for --lengths lognormal:1024,1.5,128,32768 at dp 1 x cp 8" in text
    assert f"{dynamic['speedup']:.2f}" in text and "documents per group size: 1:" in text


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--lengths", "lognormal:1024,1.5,512,128"], "need 1 <= MIN <= MAX"),
        (["--lengths", "lognormal:1024,1.5,128,512", "--tp", "2"], "runs without --tp"),
        (["--lengths", "lognormal:1024,1.5,128,512", "--pp", "2"], "runs without --pp"),
        (["--lengths", "lognormal:1024,1.5,128,512", "--lengths-steps", "0"], "must be >= 1"),
        (["--lengths", "lognormal:1024,1.5,128,512", "--ring-step-s", "-1"], "must be >= 0"),
    ],
)
def test_cli_bad_lengths_exit_2(capsys, extra, message):
    with pytest.raises(SystemExit) as info:
        main([*PLAN, *extra])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_lengths_prices_the_ring_only(capsys):
    searched = [a for a in PLAN if a not in ("--strategy", "ring")]
    with pytest.raises(SystemExit) as info:
        main([*searched, "--strategy", "ulysses", "--lengths", "lognormal:1024,1.5,128,512"])
    assert info.value.code == 2
    assert "--strategy ulysses is not priced" in capsys.readouterr().err
    assert main([*searched, "--lengths", "lognormal:1024,1.5,128,512", "--lengths-steps", "2",
                 "--json"]) == 0  # fmt: skip
    assert {p["strategy"] for p in json.loads(capsys.readouterr().out)["plans"]} == {"ring"}


def _bench():
    path = os.path.join(ROOT, "scripts", "bench", "dynamic_cp.py")
    spec = importlib.util.spec_from_file_location("dynamic_cp_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_two_hosts_arguments():
    bench = _bench()
    args = bench.parse_args(["--hosts", "2", "--rate", "100mbit", "--calibration", "C"])
    assert args.out == "results/dynamic_cp_cpu_2hosts_100mbit.json"
    argv = bench.plan_argv(args)
    assert argv[argv.index("--inter-bw") + 1] == "0.0125"
    assert argv[argv.index("--gpus-per-node") + 1] == "2"
    assert argv[argv.index("--lengths") + 1] == "lognormal:1024,1.5,128,8192"
    assert "--dynamic-cp" in bench.train_flags(args, True, "out")
    assert "--dynamic-cp" not in bench.train_flags(args, False, "out")
    one = bench.parse_args([])
    assert one.out == "results/dynamic_cp_cpu.json" and "--inter-bw" not in bench.plan_argv(one)
    fixed = bench.plan_argv(one, {"ring_step_s": 0.0025, "piece_s": 0.0, "call_s": 7.5e-4})
    assert fixed[-6:] == ["--ring-step-s", "0.0025", "--piece-s", "0", "--call-s", "0.00075"]
    assert build_parser().parse_args(fixed).call_s == 7.5e-4  # flags the plan takes
    assert bench.rate_gbs("1gbit") == 0.125


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hosts", "2"], "--hosts 2 needs --rate"),
        (["--hosts", "2", "--rate", "fast"], "give NNmbit or NNgbit"),
        (["--rate", "100mbit"], "give it with --hosts 2"),
        (["--hosts", "2", "--rate", "1gbit", "--cp", "1"], "needs an even dp x cp"),
        (["--hosts", "3"], "invalid choice"),
        (["--replan", "result.json"], "--replan needs --calibration"),
    ],
)
def test_bench_refuses_bad_arguments(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        _bench().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def _calls(lengths: list[int], size: int) -> list[int]:
    """Kernel calls of each rank of a group over its ring steps: exact blocks and tiles."""
    placement = place(get_layout("zigzag"), size, (0, *accumulate(lengths)))
    out = []
    for rank in range(size):
        blocks = [b for s in range(size) for b in step_blocks(placement, rank, s, True, None)]
        out.append(sum(len(b.tiles.spans) if b.tiles is not None else 1 for b in blocks))
    return out


@pytest.mark.parametrize("lengths, size", [([1000], 1), ([1000], 4), ([20] * 30, 1),
                                           ([20] * 30 + [3000], 4)])  # fmt: skip
def test_a_piece_pays_every_kernel_call_of_its_ring(lengths, size):
    """With every rate infinite but one second per kernel call, a rank's piece costs its ring
    steps' calls (tiles and exact blocks), forward and backward, in every attention layer."""
    model = get_model("llama3-8b")
    costs = PieceCosts(model, get_hardware("h100", tflops=1e30), size, "zigzag", "bf16", "cudnn",
                       0.0, 1e30, 0.0, 0, 0.0, 0.0, 1.0)  # fmt: skip
    got = piece_seconds(costs, lengths, size)
    calls = _calls(lengths, size)
    assert got == pytest.approx([model.attention_layers * 2 * c for c in calls], rel=1e-9)
    if lengths == [20] * 30:  # short documents share masked tiles: fewer calls than documents
        assert calls[0] < 30


def test_cpu_fixed_costs_are_measured_once_and_cached(tmp_path, monkeypatch):
    with open(os.path.join(ROOT, "results", "two_hosts_cpu_repeats.json")) as f:
        stored = json.load(f)["calibration"]
    stored.pop("ring_step", None)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(stored))
    measured = {"ring_step_s": 2e-3, "piece_s": 1e-4, "call_s": 7e-4}
    calls = []
    monkeypatch.setattr(dynamic, "measure_ring_step", lambda n: calls.append(n) or measured)
    hw = get_hardware("cpu", calibration=json.loads(path.read_text()))
    assert fixed_costs(hw, 4, {}, str(path)) == FixedCosts(**measured, source="measured")
    assert calls == [4] and json.loads(path.read_text())["ring_step"] == {"4": measured}
    again = get_hardware("cpu", calibration=json.loads(path.read_text()))  # a later plan
    assert fixed_costs(again, 4, {"call_s": 1e-3}, str(path)).call_s == 1e-3
    assert calls == [4]  # from the cache


@pytest.mark.slow
def test_ring_step_measurement_runs():
    with pytest.raises(ValueError, match="at least 2 processes"):
        measure_ring_step(1)
    got = measure_ring_step(2, repeats=3)
    assert set(got) == {"ring_step_s", "piece_s", "call_s"}
    assert got["ring_step_s"] + got["call_s"] > 0 and min(got.values()) >= 0


@pytest.mark.slow
def test_bench_replan_prices_a_stored_result_again(tmp_path):
    """--replan: the stored run's arguments and fixed terms, another calibration, no runs."""
    bench = _bench()
    with open(os.path.join(ROOT, "results", "two_hosts_cpu_repeats.json")) as f:
        calibration = json.load(f)["calibration"]
    calibration.update(machine_key())  # as this machine's (the plan refuses another's)
    path_c = tmp_path / "calibration.json"
    path_c.write_text(json.dumps(calibration))
    args = vars(bench.parse_args(["--steps", "4", "--warmup-steps", "1"]))
    terms = {"ring_step_s": 1e-3, "piece_s": 0.0, "call_s": 5e-4}
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"args": args, "ratio_median": 1.5,
                                "predicted": {"ratio": 1.1, "terms": terms}}))  # fmt: skip
    assert bench.main(["--replan", str(path), "--calibration", str(path_c)]) == 0
    got = json.loads(path.read_text())
    again = got["replanned"]
    assert got["predicted"] == {"ratio": 1.1, "terms": terms}  # the first prediction is kept
    assert len(again["per_step"]) == 4 and again["calibration"] == calibration
    assert {k: again["terms"][k] for k in terms} == terms
    assert again["ratio"] == again["static_s"] / again["dynamic_s"]
