"""Nothing lost, nothing silently wrong: checkpoints and token caches under fault injection.

- **SIGKILL anywhere in a save.** A training job of 2 ranks (a tiny decoder, a checkpoint after
  each of 3 steps) is killed whole at 24 points chosen by a fixed seed: 18 named points of
  checkpoint.FAULT_POINTS (on rank 0 or 1, in save 1, 2 or 3: before the writes, between them,
  before, at and after the commit's rename) and 6 at a seeded delay after a save began, wherever
  DCP's writers then are. After each kill, every `step-N` directory holds all of its files; the
  newest is the last one committed before the kill (never a later, incomplete one); the same
  command resumes there with the losses of an uninterrupted run, bitwise; the next saves leave no
  debris. (tests/crash_driver.py: one process, the ranks of each job forked from it.)
- **A full disk.** The checkpoint directory on a small tmpfs: filled by the checkpoints themselves
  mid-save, or to the last byte at a chosen point of a save on one rank (before DCP's writes,
  before the RNG state's `torch.save`, which raises RuntimeError, before the training state).
  Every rank stops with the same CheckpointError naming the rank and the cause (exit code 74),
  the previous checkpoint stays the newest, and after space is freed the run resumes to the
  uninterrupted run's losses.
- **fsync before rename.** Every file of a checkpoint and of a token cache, and their
  directories, are fsync'ed before the rename that publishes them; the parent after it.
- **The token cache.** A tokenization killed at each point of its write is redone by the next
  reader, its leftovers removed; token files shorter than their meta.json says (a power loss
  before this rule) are tokenized again, never read.

The tmpfs tests need root (`mount -t tmpfs`) and skip without it; the mounts are always undone.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from ringattn.runtime import checkpoint as ckpt
from ringattn.runtime.outcome import EXIT_CHECKPOINT
from ringattn.train.hf.corpus import load_corpus
from workers_crash import fill_up

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TINY = {"model": "tiny", "dim": 32, "seq_len": 64, "keys": 3, "copies": 2, "steps": 3,
        "warmup": 1, "lr": 1e-2, "quiet": True, "checkpoint_every": 1, "nproc": 2,
        "cp": 2}  # fmt: skip
FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "order.json", "rng/rank0.pt",
         "rng/rank1.pt", "train_state.json"]  # fmt: skip
"""A complete checkpoint of 2 ranks."""
SEED = 34
COMMITTED = ("committed", "synced", "pruned", "end")
"""The points at which the new checkpoint is committed (rank 1 only reaches `end`)."""
RACING = ((1, "shared"),)
"""Rank 1's `shared` follows the barrier after which rank 0 commits alone: every file is written
by then, so the kill may land before or after rank 0's rename (under load, after), and either
newest is right. Only the files' completeness and the resume are checked there."""


def _kill_cases() -> list[dict]:
    rng = random.Random(SEED)
    points = {0: [p for p in ckpt.FAULT_POINTS if p != "aside"],  # no step is saved twice here
              1: ["start", "directory", "model", "rng", "shared", "end"]}  # fmt: skip
    named = [(r, s, p) for r in (0, 1) for p in points[r] for s in (1, 2, 3)]
    cases = [{"fault": {"rank": r, "save": s, "point": p}} for r, s, p in rng.sample(named, 18)]
    cases += [{"fault": {"rank": rng.randrange(2), "save": rng.randrange(1, 4),
                         "delay": round(rng.uniform(0.0, 0.4), 3)}} for _ in range(6)]  # fmt: skip
    for i, case in enumerate(cases):
        case["name"], case["keep"] = f"case{i:02d}", rng.choice([1, 2])
    return cases


def _check_complete(found: dict) -> None:
    for checkpoint in found["complete"]:
        assert checkpoint["files"] == FILES, checkpoint
    steps = [c["name"] for c in found["complete"]]
    assert [n for n in found["names"] if n.startswith("step-")] == sorted(steps)


@pytest.mark.slow
def test_a_job_killed_anywhere_in_a_save_resumes_from_the_newest_complete_checkpoint(tmp_path):
    cases = _kill_cases()
    spec = {"world_size": 2, "options": TINY, "root": str(tmp_path), "cases": cases}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    command = [sys.executable, os.path.join(TESTS_DIR, "crash_driver.py"),
               str(tmp_path / "spec.json"), str(tmp_path / "result.json")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    reference = result["reference"]
    assert reference["codes"] == [0, 0]
    want = reference["result"]["losses"]
    assert len(want) == 3
    killed_named = 0
    for case in result["cases"]:
        fault, found, name = case["fault"], case["found"], case["name"]
        newest = found["complete"][-1]["step"] if found["complete"] else 0
        if "point" in fault:
            assert case["killed"] == [-signal.SIGKILL] * 2, (name, case["killed"])
            committed = fault["point"] in COMMITTED
            if (fault["rank"], fault["point"]) in RACING:
                assert newest in (fault["save"] - 1, fault["save"]), (name, fault, found)
            else:
                assert newest == fault["save"] - (0 if committed else 1), (name, fault, found)
            killed_named += 1
        else:  # a delay: the kill lands anywhere in or after that save, in a later save on a
            # fast machine, or after the run: every save before that one is complete
            assert set(case["killed"]) <= {-signal.SIGKILL, 0}, (name, case["killed"])
            assert fault["save"] - 1 <= newest <= 3, (name, fault, found)
        _check_complete(found)
        resumed = case["resumed"]
        assert resumed["codes"] == [0, 0], (name, resumed)
        assert resumed["result"]["start_step"] == newest, name
        assert resumed["result"]["losses"] == want[newest:], name  # bitwise
        _check_complete(case["after"])
        after = [c["step"] for c in case["after"]["complete"]]
        assert case["after"]["names"] == [c["name"] for c in case["after"]["complete"]], name
        if newest < 3:  # the resumed run saved again: only the newest `keep` are left
            assert after == [1, 2, 3][-case["keep"] :], (name, after)
    assert killed_named == 18


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MiB tmpfs (two checkpoints of the tiny decoder fit, three do not), unmounted after."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield str(mount)
    finally:
        if subprocess.run(["umount", str(mount)], check=False).returncode:
            subprocess.run(["umount", "-l", str(mount)], check=True)


def _resize(mount: str, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", mount], check=True)


def _same_stop(got: list[dict], step: int) -> str:
    """Every rank stopped alike: checkpoint failed at `step`, exit 74; the message."""
    stopped = [g["stopped"] for g in got]
    assert stopped[0] is not None and all(s == stopped[0] for s in stopped), stopped
    assert stopped[0]["reason"] == "checkpoint failed" and stopped[0]["step"] == step
    assert stopped[0]["exit_code"] == EXIT_CHECKPOINT
    return stopped[0]["message"]


@pytest.fixture(scope="module")
def reference(pools, tmp_path_factory):
    """The uninterrupted run's losses (3 steps, a checkpoint after each)."""
    out = tmp_path_factory.mktemp("reference")
    return pools(2).run("workers_crash:train_filling", {**TINY, "out_dir": str(out)})[0]["losses"]


def test_a_checkpoint_directory_that_fills_up_mid_save(pools, tmpfs, tmp_path, reference):
    """Save 3 does not fit beside 1 and 2 (keep 2): every rank stops with the same error, step 2
    stays the newest; after the file system grows, the same command resumes to the same losses."""
    options = {**TINY, "out_dir": str(tmp_path / "run"), "checkpoint_dir": f"{tmpfs}/ckpt"}
    got = pools(2).run("workers_crash:train_filling", options)
    message = _same_stop(got, 3)
    assert re.search(r"could not write the checkpoint of step 3 .*ranks? [01].*No space", message)
    assert message.endswith("run the same command again to resume from it")
    assert f"newest complete checkpoint is {tmpfs}/ckpt/step-00000002" in message
    assert got[0]["losses"] == reference  # every step trained; only the last save failed
    assert [s for s, _ in ckpt.complete_checkpoints(f"{tmpfs}/ckpt")] == [1, 2]
    assert os.listdir(f"{tmpfs}/ckpt") == ["step-00000001", "step-00000002"] or sorted(
        os.listdir(f"{tmpfs}/ckpt")) == ["step-00000001", "step-00000002"]  # fmt: skip
    _resize(tmpfs, "8m")
    again = pools(2).run("workers_crash:train_filling", options)
    assert again[0]["start_step"] == 2 and again[0]["stopped"] is None
    assert again[0]["losses"] == reference[2:]


@pytest.mark.parametrize(
    "rank, point, cause",
    [
        (0, "directory", r"ranks? .*No space left"),  # DCP's shards
        (1, "model", r"ranks? (0, )?1: .*No space left"),  # torch.save of the RNG state
        (0, "rng", r"ranks? 0(, 1)?: OSError: \[Errno 28\] No space left"),  # training state
    ],
)
def test_a_disk_filled_at_a_point_of_a_save_stops_every_rank_alike(
    pools, tmpfs, tmp_path, reference, rank, point, cause
):
    options = {**TINY, "out_dir": str(tmp_path / "run"), "checkpoint_dir": f"{tmpfs}/ckpt"}
    fill = {"rank": rank, "save": 2, "point": point, "mount": tmpfs}
    got = pools(2).run("workers_crash:train_filling", options, fill)
    message = _same_stop(got, 2)
    assert re.search(rf"could not write the checkpoint of step 2 .*{cause}", message), message
    assert f"newest complete checkpoint is {tmpfs}/ckpt/step-00000001" in message
    assert os.listdir(f"{tmpfs}/ckpt") == ["step-00000001"]  # the temporary directory is gone
    os.remove(os.path.join(tmpfs, "filler"))
    again = pools(2).run("workers_crash:train_filling", options)
    assert again[0]["start_step"] == 1 and again[0]["losses"] == reference[1:]


def test_fill_up_fills_the_file_system(tmpfs):
    """The fault itself works: after fill_up not one more byte can be written."""
    fill_up(tmpfs)
    with (
        pytest.raises(OSError, match="No space left"),
        open(os.path.join(tmpfs, "more"), "wb", buffering=0) as f,
    ):
        f.write(b"x")


def _record_fsyncs_and_renames(monkeypatch) -> list[tuple]:
    """("fsync", path) and ("rename", src, dst), in the order they happen."""
    log: list[tuple] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        log.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:
        log.append(("rename", os.fspath(src), os.fspath(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    return log


def _assert_synced_before_published(log: list[tuple], final: str) -> None:
    """Every file and folder of `final` was fsync'ed under its temporary name before the rename
    that published it, and the parent after it."""
    commit = next(i for i, e in enumerate(log) if e[0] == "rename" and e[2] == final)
    tmp = log[commit][1]
    synced = set()
    for event in log[:commit]:  # a file fsync'ed, then renamed (DCP's .metadata.tmp), counts
        if event[0] == "fsync":
            synced.add(event[1])
        elif event[1] in synced:
            synced.add(event[2])
    for folder, _, names in os.walk(final):
        for path in [folder, *(os.path.join(folder, n) for n in names)]:
            assert tmp + path[len(final) :] in synced, f"{path} not fsync'ed before the rename"
    assert ("fsync", os.path.dirname(final)) in log[commit:], "the parent not fsync'ed after it"


def test_checkpoints_and_token_caches_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    log = _record_fsyncs_and_renames(monkeypatch)
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        path = ckpt.save(str(tmp_path / "ckpt"), 1, model, optimizer, {"step": 1})
    _assert_synced_before_published(log, path)
    log.clear()
    data = tmp_path / "corpus.txt"
    data.write_bytes(b"the quick brown fox. " * 40)
    corpus = load_corpus(str(data), None, 97, cache_dir=str(tmp_path / "tokens"))
    _assert_synced_before_published(log, corpus.directory)


def _corpus_file(tmp_path) -> str:
    data = tmp_path / "corpus.txt"
    data.write_bytes(bytes(range(32, 127)) * 50)
    return str(data)


def test_a_tokenization_killed_mid_write_is_redone_never_read_half_written(tmp_path):
    """Killed (SIGKILL) after a batch of tokens, after every file, after the fsyncs, after the
    rename: the next reader redoes the first three (their leftovers removed) and reuses the last."""
    data = _corpus_file(tmp_path)
    want = load_corpus(data, None, 97, cache_dir=str(tmp_path / "reference")).tokens.tolist()
    for point in ("batch", "files", "synced", "renamed"):
        cache = str(tmp_path / point)
        pid = os.fork()
        if pid == 0:  # the child tokenizes (no torch work: bytes mod vocab) and dies at `point`
            try:
                die = lambda p, at=point: p == at and os.kill(os.getpid(), signal.SIGKILL)
                load_corpus(data, None, 97, cache_dir=cache, fault=die)
            finally:
                os._exit(1)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == -signal.SIGKILL
        left = [n for n in os.listdir(cache) if not n.endswith(".lock")]
        assert any(".tmp" in n for n in left) == (point != "renamed"), (point, left)
        stamps = {n: os.stat(os.path.join(cache, n)).st_mtime_ns for n in left}
        corpus = load_corpus(data, None, 97, cache_dir=cache)
        assert corpus.tokens.tolist() == want, point
        after = [n for n in os.listdir(cache) if not n.endswith(".lock")]
        assert after == [os.path.basename(corpus.directory)], (point, after)
        if point == "renamed":  # complete: reused, not written again
            assert stamps == {after[0]: os.stat(corpus.directory).st_mtime_ns}


def test_token_files_shorter_than_their_meta_are_tokenized_again(tmp_path):
    """What a power loss could leave before the fsyncs (meta.json over truncated token files) is
    never read: the cache key is tokenized again."""
    data = _corpus_file(tmp_path)
    cache = str(tmp_path / "tokens")
    corpus = load_corpus(data, None, 97, cache_dir=cache)
    want = corpus.tokens.tolist()
    tokens = os.path.join(corpus.directory, "tokens.i32")
    del corpus
    with open(tokens, "r+b") as f:
        f.truncate(os.path.getsize(tokens) // 2)
    again = load_corpus(data, None, 97, cache_dir=cache)
    assert again.tokens.tolist() == want
    assert os.path.getsize(tokens) == 4 * len(want)


def test_an_export_is_fsynced_then_renamed_and_never_deletes_a_users_files(tmp_path, monkeypatch):
    """publish_into (train --hf --export): a new directory is renamed whole, after its files were
    fsync'ed; into an existing one each file is replaced and the user's other files stay."""
    log = _record_fsyncs_and_renames(monkeypatch)
    for name in ("new", "again"):
        tmp = tmp_path / f".tmp-{name}"
        (tmp / "sub").mkdir(parents=True)
        (tmp / "model.safetensors").write_bytes(name.encode())
        (tmp / "sub" / "tokenizer.json").write_text(name)
        ckpt.publish_into(str(tmp), str(tmp_path / "export"))
        assert not tmp.exists()
        if name == "new":
            _assert_synced_before_published(log, str(tmp_path / "export"))
            (tmp_path / "export" / "README.md").write_text("the user's")
    export = tmp_path / "export"
    assert sorted(os.listdir(export)) == ["README.md", "model.safetensors", "sub"]
    assert (export / "model.safetensors").read_bytes() == b"again"
    assert (export / "sub" / "tokenizer.json").read_text() == "again"
    assert (export / "README.md").read_text() == "the user's"
