"""`ringattn train --compile`: the compiled run trains as the eager one-process run does.

The trainer compiles every block's forward with fullgraph=True when FSDP2 shards the model (its
hooks stay outside the graphs), the whole model otherwise (train/compile.py). Here dp 2 x cp 2
on 4 ranks (--tp is refused with --compile: see config.validate), with the "aot_eager" backend
(the same graphs as inductor, without its code generation; scripts/bench_compile.py measures
inductor), against one process in eager: the same losses and final parameters as
tests/test_train.py requires of eager runs.
"""

from __future__ import annotations

import pytest
import torch

from ringattn.cli.main import main
from ringattn.train.config import TrainConfig, validate

TINY = {
    "model": "tiny", "dim": 32, "seq_len": 64, "keys": 3, "copies": 2, "steps": 3, "warmup": 1,
    "lr": 1e-2, "quiet": True, "checkpoint_every": 0,
}  # fmt: skip


@pytest.mark.parametrize(("dp", "cp", "tp"), [(2, 2, 1)], ids=["dp2xcp2"])
def test_compiled_training_equals_one_process(pools, tmp_path, dp, cp, tp):
    # the same samples: batch_size is per dp row
    single = {**TINY, "out_dir": str(tmp_path / "one"), "batch_size": 2 * dp}
    want = pools(1).run("workers_train:train", single)[0]
    options = {**TINY, "out_dir": str(tmp_path / "compiled"), "dp": dp, "cp": cp, "tp": tp,
               "batch_size": 2, "compile": True, "compile_backend": "aot_eager"}  # fmt: skip
    got = pools(4).run("workers_train:train", options, timeout=600)[0]
    torch.testing.assert_close(
        torch.tensor(got["losses"], dtype=torch.float64),
        torch.tensor(want["losses"], dtype=torch.float64), rtol=1e-5, atol=0,
    )  # fmt: skip
    for name, value in want["params"].items():
        torch.testing.assert_close(got["params"][name], value, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def test_compile_flag_errors(tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--compile-backend", "tvm", "--out-dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"--compile does not cover pipeline stages"):
        validate(TrainConfig(compile=True, pp=2, layers=2, seq_len=64), 2)
    with pytest.raises(ValueError, match=r"--compile with --tp > 1 gives a wrong embedding"):
        validate(TrainConfig(compile=True, tp=2, seq_len=64), 2)
