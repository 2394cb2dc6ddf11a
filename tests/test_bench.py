"""The benchmark's machinery on CPU: the emulated ring, `ringattn bench` and `--million`.

The emulated ring (emulate.py) is what the benchmark times, so it must be the ring: its per-rank
results equal the real ring's (a gloo pool running ringattn.attention on the same inputs) and the
float64 reference. The commands run a tiny configuration end to end and write their JSON.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from ringattn.bench import record
from ringattn.cli import main as cli
from ringattn.layout import get_layout
from ringattn.testing import emulated as emulate
from ringattn.testing.yardstick import (
    allclose_gate,
    compare,
    reference_attention,
    relative_gate,
    tolerance,
)

QUANTITIES = ("out", "lse", "dq", "dk", "dv")


def _inputs(hq, hkv, seq_len, head_dim, dtype=torch.float64, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2, hq, seq_len, head_dim), (2, hkv, seq_len, head_dim)] * 2
    q, k, dout, v = (torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, dout)]


def _emulated(layout, world_size, causal, q, k, v, dout, backend="auto"):
    shards = emulate.make_shards(get_layout(layout), world_size, q, k, v, dout)
    call = emulate.make_call(layout, world_size, shards.q[0], shards.kv[0, 0], causal, backend)
    return shards, emulate.run_ring(call, shards)


@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_emulated_ring_matches_float64_reference(layout, world_size, causal):
    q, k, v, dout = _inputs(6, 2, 12 * world_size, 20)
    shards, results = _emulated(layout, world_size, causal, q, k, v, dout)
    expected = reference_attention(q, k, v, dout, causal=causal)
    for rank, got in enumerate(results):
        for name in QUANTITIES:
            want = getattr(expected, name).index_select(2, shards.index[rank])
            passed, worst = allclose_gate(got[name], want, *tolerance(torch.float64, name))
            assert passed, (rank, name, worst)


@pytest.mark.parametrize("pool", [2, 3], indirect=True)
@pytest.mark.slow
def test_emulated_ring_equals_the_real_ring(pool):
    """Same schedule, kernels and merges as ring.py: out, lse, dq agree to the last bits (dk, dv
    add the W contributions in another order)."""
    world_size = pool.world_size
    q, k, v, dout = _inputs(4, 2, 8 * world_size, 16)
    for layout, causal in (("zigzag", True), ("striped", True), ("contiguous", False)):
        real = pool.run("workers_bench:ring_results", q, k, v, dout, layout=layout, causal=causal)
        _, emulated = _emulated(layout, world_size, causal, q, k, v, dout)
        for rank in range(world_size):
            for name in QUANTITIES:
                err = compare(emulated[rank][name], real[rank][name]).max
                assert err <= (1e-15 if name in ("out", "lse", "dq") else 1e-13), (
                    layout, rank, name, err,
                )  # fmt: skip


def test_emulated_ring_counts_its_transfers():
    """W - 1 K/V copies per forward share; backward adds one dK/dV message per step."""
    q, k, v, dout = _inputs(2, 1, 24, 8)
    shards = emulate.make_shards(get_layout("zigzag"), 3, q, k, v, dout)
    call = emulate.make_call("zigzag", 3, shards.q[0], shards.kv[0, 0], True)

    transport = emulate.LocalTransport(shards, None, 1)
    out, lse = emulate.forward_share(call, shards, 1, transport)
    assert transport.moved == [shards.kv[0].numel()] * 2
    partials = emulate.new_partials(shards)
    transport = emulate.LocalTransport(shards, partials, 1)
    emulate.backward_share(call, shards, 1, out, lse, partials, transport)
    assert sorted(transport.moved) == [shards.kv[0].numel()] * 5  # 2 K/V + 3 dK/dV


def _bench(tmp_path, *extra):
    path = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--heads", "2:1", "--head-dim", "16", "--warmup", "0",
            "--repeats", "1", "--json", str(path), *extra]  # fmt: skip
    return cli.main(argv), path


def test_bench_tiny_on_cpu(tmp_path, capsys):
    code, path = _bench(tmp_path, "--sizes", "2x32,3x16", "--plot", str(tmp_path / "b.png"))
    assert code == 0
    printed = capsys.readouterr().out
    assert "eff flash" in printed and "ring ms" in printed
    data = json.loads(path.read_text())
    assert {"machine", "date", "command", "config", "results"} <= data.keys()
    assert data["machine"]["torch"] == torch.__version__
    # the arguments main() got, not this process's (pytest's) sys.argv
    assert data["command"].startswith("ringattn bench --device cpu --heads 2:1 ")
    assert "-q" not in data["command"].split()
    rows = data["results"]
    assert len(rows) == 2 * 2 * 2  # masks x sizes x passes
    for row in rows:
        assert row["kernel"] == "cpu_flash" and row["dtype"] == "float32"
        assert math.isfinite(row["efficiency"]["flash"]) and row["efficiency"]["flash"] > 0
        assert row["out_max_diff"] < 1e-5  # the ring's out is the monolithic out
        assert 0 < row["memory_ratio"]
        assert set(row["ring_ms_by_rank"]) == {"0", str(row["world_size"] - 1)}
    plotted = (tmp_path / "b.png").exists()
    assert plotted or "matplotlib is not installed" in printed


def test_bench_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    """--plot needs the plot extra: one line naming it, exit 2, before anything is measured."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # find_spec / import -> missing
    with pytest.raises(SystemExit) as stop:
        _bench(tmp_path, "--sizes", "2x16", "--masks", "causal", "--passes", "fwd",
               "--plot", str(tmp_path / "none.png"))  # fmt: skip
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(
        "ringattn bench --plot needs the plot extra: pip install 'ringattn[plot]'"
    )
    assert captured.out == "" and not (tmp_path / "none.png").exists()


def test_bench_records_a_failed_size_and_goes_on(tmp_path, capsys, monkeypatch):
    """A size a kernel refuses (or out of memory) must not cost the rest of a GPU sweep."""
    from ringattn.bench import sweep as bench

    real = bench.bench_one

    def flaky(cfg, mask, hq, hkv, world_size, n, device):
        if n == 32:
            raise RuntimeError("simulated: no kernel for this size")
        return real(cfg, mask, hq, hkv, world_size, n, device)

    monkeypatch.setattr(bench, "bench_one", flaky)
    code, path = _bench(tmp_path, "--sizes", "2x32,2x16", "--masks", "causal")
    assert code == 1
    data = json.loads(path.read_text())
    assert data["failed"] == [
        {"config": "causal 2:1 W=2 n=32", "error": "simulated: no kernel for this size"}
    ]
    assert {row["tokens_per_rank"] for row in data["results"]} == {16}
    assert "causal 2:1 W=2 n=32: FAILED" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--sizes", "2x15"], "tokens per rank a multiple of 2"),
        (["--heads", "6:4"], "query heads must be a multiple of kv heads"),
        (["--sizes", "2x16", "--ranks", ","], "give ends, all or comma-separated"),
    ],
)
def test_bench_rejects_bad_flags(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        _bench(tmp_path, *flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_million_dry_run_on_cpu(tmp_path, capsys):
    """The 1M-token path, scaled down: every rank's share, every gate, the JSON."""
    path = tmp_path / "million.json"
    code = cli.main(["bench", "--million", "--device", "cpu", "--seq-len", "512", "--world-size",
                     "4", "--heads", "4:2", "--head-dim", "16", "--json", str(path)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads(path.read_text())
    assert data["passed"] and len(data["ring"]["ranks"]) == 4
    assert len(data["checks"]) == 3 + 5 and all(c["passed"] for c in data["checks"])
    assert data["monolithic"]["kernel"] == "cpu_flash"
    assert "PASS: emulated 4-way ring over 512 causal tokens" in printed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("causal", [True, False])
def test_emulated_ring_on_cuda_within_bf16_gates(hq, hkv, causal):
    """cuDNN (or the best CUDA kernel) blocks, the Triton merge, side-stream copies: every rank
    within the bf16 gates (error vs float64 at most 2.5x max / 2x mean of single-device SDPA)."""
    from ringattn.testing.yardstick import sdpa_attention

    q, k, v, dout = _inputs(hq, hkv, 4 * 256, 128, torch.bfloat16, device="cuda")
    shards, results = _emulated("zigzag", 4, causal, q, k, v, dout)
    expected = reference_attention(q, k, v, dout, causal=causal)
    baseline = sdpa_attention(q, k, v, dout, causal=causal, with_lse=True)
    for name in QUANTITIES:
        got = torch.cat([r[name] for r in results], dim=2)
        index = torch.cat(shards.index)
        want = getattr(expected, name).index_select(2, index)
        base = getattr(baseline, name).index_select(2, index)
        passed, worst = relative_gate(compare(got, want), compare(base, want))
        assert passed, (name, worst)


def test_a_bench_scripts_record_starts_with_its_command_machine_and_versions(
    tmp_path, capsys, monkeypatch
):
    """bench/record.py: the command reruns the script from the working directory with the same
    arguments (quoted), the versions name python, torch and each package asked for (null when
    not installed), and the bench's own keys follow."""
    monkeypatch.chdir(tmp_path)  # the repository root, as the docs run the benches
    script = str(tmp_path / "scripts" / "bench" / "memory.py")  # a bench's __file__
    path = str(tmp_path / "out" / "result.json")
    record.write(path, script, ["--seq-len", "64", "--note", "two words"], {"rows": [1, 2]},
                 packages=["torch", "surely-not-installed-pkg"])  # fmt: skip
    with open(path) as f:
        data = json.load(f)
    assert list(data)[:4] == ["command", "date", "machine", "versions"]
    assert data["command"] == "python scripts/bench/memory.py --seq-len 64 --note 'two words'"
    assert data["versions"]["torch"] == torch.__version__
    assert data["versions"]["surely-not-installed-pkg"] is None
    assert data["machine"]["cpus"] >= 1 and data["rows"] == [1, 2]
    assert f"wrote {path}" in capsys.readouterr().out
