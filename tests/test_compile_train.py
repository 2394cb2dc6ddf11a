"""`ringattn train --compile`: the compiled run trains as the eager one-process run does.

The trainer compiles every block's forward with fullgraph=True when FSDP2 shards the model (its
hooks stay outside the graphs), the whole model otherwise (train/compile.py). Here on 4 ranks,
mostly with the "aot_eager" backend (the same graphs as inductor, without its code generation;
scripts/bench/compile.py measures inductor), against one process in eager: the same losses and
final parameters as tests/test_train.py requires of eager runs, for
- dp 2 x cp 2;
- cp 2 x tp 2: the row-parallel embedding hands the first compiled block an
  AsyncCollectiveTensor, whose gradient torch 2.13's AOTAutograd drops unless the trainer waits
  on it first (train/compile.py);
- pp 2 x tp 2: each stage's blocks compiled, the pipeline schedule eager;
- tp 2 on 2 ranks with inductor (one block, two steps: inductor's code generation is the cost).
"""

from __future__ import annotations

import pytest
import torch

from ringattn.cli.main import main
from ringattn.train.config import TrainConfig, validate

TINY = {
    "model": "tiny", "dim": 32, "seq_len": 64, "keys": 3, "copies": 2, "steps": 3, "warmup": 1,
    "lr": 1.0, "optimizer": "sgd", "quiet": True, "checkpoint_every": 0,  # SGD: weights exact
}  # fmt: skip
GLOBAL_BATCH = 4  # sequences per step over all dp rows


@pytest.mark.parametrize(
    ("pp", "dp", "cp", "tp", "backend", "extra"),
    [
        (1, 2, 2, 1, "aot_eager", {}),
        (1, 1, 2, 2, "aot_eager", {}),
        (2, 1, 1, 2, "aot_eager", {"microbatches": 2}),
        # inductor's code generation costs ~30 s per graph here: one block, forward + backward
        (1, 1, 1, 2, "inductor", {"layers": 1, "steps": 2}),
    ],
    ids=["dp2xcp2", "cp2xtp2", "pp2xtp2", "tp2-inductor"],
)
@pytest.mark.slow
def test_compiled_training_equals_one_process(pools, tmp_path, pp, dp, cp, tp, backend, extra):
    model = {k: v for k, v in extra.items() if k in ("layers", "steps")}  # both runs
    extra = {k: v for k, v in extra.items() if k not in model}
    single = {**TINY, **model, "out_dir": str(tmp_path / "one"), "batch_size": GLOBAL_BATCH}
    want = pools(1).run("workers_train:train", single)[0]
    options = {**TINY, **model, "out_dir": str(tmp_path / "compiled"), "pp": pp, "dp": dp,
               "cp": cp, "tp": tp, "batch_size": GLOBAL_BATCH // dp, "compile": True,
               "compile_backend": backend, **extra}  # fmt: skip
    results = pools(pp * dp * cp * tp).run(
        "workers_train_4d:train_all_parameters", options, timeout=600
    )
    assert results[0]["degrees"] == (pp, dp, cp, tp)
    got = {}
    for r in results:  # under pp each rank holds its stage's parameters
        got.update(r["params"])
    torch.testing.assert_close(
        torch.tensor(results[0]["losses"], dtype=torch.float64),
        torch.tensor(want["losses"], dtype=torch.float64), rtol=1e-5, atol=0,
    )  # fmt: skip
    assert got.keys() == want["params"].keys()
    for name, value in want["params"].items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
    assert want["losses"][0] != want["losses"][-1]  # the steps trained


def test_compile_flag_errors(tmp_path):
    with pytest.raises(SystemExit):
        main(["train", "--compile-backend", "tvm", "--out-dir", str(tmp_path)])
    with pytest.raises(ValueError, match=r"unknown --compile-backend 'tvm'"):
        validate(TrainConfig(compile=True, compile_backend="tvm", seq_len=64), 2)
