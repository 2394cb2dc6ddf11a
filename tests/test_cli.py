"""The `ringattn` command: flags, `check` and `attention-demo` end to end on small sizes, exit
codes. (`ringattn demo`, the training demo, is tested in test_train.py.)"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from ringattn.cli import check
from ringattn.cli.main import build_parser, main


@pytest.mark.slow
def test_module_entry_point_help():
    done = subprocess.run(
        [sys.executable, "-m", "ringattn", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    for command in ("demo", "train", "generate", "attention-demo", "check"):
        assert command in done.stdout


def test_flags_parse():
    args = build_parser().parse_args(
        ["check", "--world-sizes", "1,3", "--layouts", "all", "--dtypes", "float32"]
    )
    assert args.world_sizes == [1, 3]
    assert args.layouts == ["contiguous", "zigzag", "striped"]
    assert args.dtypes == ["float32"]
    args = build_parser().parse_args(["attention-demo", "--no-causal", "--seq-len", "512"])
    assert args.causal is False and args.seq_len == 512


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "--layouts", "zig"], "unknown layout 'zig'; choose from"),
        (["check", "--dtypes", "float8"], "unknown dtype 'float8'"),
        (["attention-demo", "--nproc", "3", "--seq-len", "1000"], "use 1002"),
        (["attention-demo", "--heads", "3", "--kv-heads", "2"], "--heads 3 must be a multiple of"),
        (["train", "--nproc", "3", "--seq-len", "1000"], "use 1002"),
        (["train", "--nproc", "4", "--dp", "3"], "dp x cp x tp must equal the number of processes"),
        (["train", "--model", "tiny", "--heads", "3"], "not divisible by 3 heads"),
        (["train", "--seq-len", "64"], "seq_len 64 is too short for 12 keys"),
        (["demo", "--nproc", "3", "--seq-len", "1000"], "use 1002"),
    ],
)
def test_bad_values_exit_2_before_launching(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_check_small_matrix_passes(capfd):
    argv = ["check", "--world-sizes", "1,2", "--dtypes", "float64,bfloat16", "--layouts", "zigzag"]
    assert main(argv) == 0
    out = capfd.readouterr().out
    rows = [line for line in out.splitlines() if line.lstrip().startswith(("1 ring", "2 ring"))]
    assert len(rows) == 2 * 2 * 3 * 2  # W x causal x heads x dtypes
    assert all(" PASS " in row for row in rows), rows
    assert "24 passed, 0 failed, 0 skipped" in out


def _as_torchrun_rank_zero(monkeypatch) -> None:
    """Make `check` run in this process as rank 0 of a 1-rank torchrun world (so patches apply)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.delenv("RINGATTN_LAUNCHED", raising=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    "error, summary",
    [
        (NotImplementedError("not built"), "3 passed, 0 failed, 3 skipped"),
        (ValueError("heads do not split"), "3 passed, 0 failed, 0 skipped, 3 not applicable"),
    ],
)
def test_check_reports_refusals_without_failing(monkeypatch, capfd, error, summary):
    """A case every rank refuses is reported (SKIP: not built, N/A: unsupported), not failed."""
    real = check.attention

    def attention(*args, **kwargs):
        if kwargs["causal"]:
            raise error
        return real(*args, **kwargs)

    _as_torchrun_rank_zero(monkeypatch)
    monkeypatch.setattr(check, "attention", attention)
    argv = ["check", "--dtypes", "float64", "--layouts", "zigzag"]
    try:
        code = main(argv)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = capfd.readouterr().out
    assert summary in out
    assert f": {type(error).__name__}: {error}" in out  # the reason, once, in the summary
    assert code == 0


@pytest.mark.slow
def test_demo_small(tmp_path, capfd):
    path = tmp_path / "demo.json"
    argv = ["attention-demo", "--nproc", "2", "--seq-len", "512", "--heads", "4", "--kv-heads", "2"]
    assert main([*argv, "--head-dim", "24", "--json", str(path)]) == 0
    out = capfd.readouterr().out
    assert "PASS: ring attention on 2 rank(s) vs 1 process" in out
    result = json.loads(path.read_text())
    assert result["passed"] is True
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert all(r["tokens"] == 256 and r["fwd_s"] > 0 for r in result["ranks"])
    assert {e["quantity"] for e in result["errors"]} == {"out", "dq", "dk", "dv"}
