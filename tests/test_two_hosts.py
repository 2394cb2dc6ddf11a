"""Two hosts on one machine (ringattn/testing/hosts.py): two network namespaces joined by a
shaped veth, `torchrun --nnodes 2` with 2 ranks on each, gloo on the veth.

- every strategy (ring, all-gather, Ulysses, hybrid with Ulysses inside a host) and dp x cp over
  the two hosts trains equal to one process;
- one host's agent SIGTERMed: both hosts checkpoint the same step and exit 75, and that
  checkpoint resumes on one process to the uninterrupted losses;
- a checkpoint from one process resumes over the two hosts; the link cut mid-run: every rank
  stops within the stall timeout naming the host and ranks it lost, and the newest checkpoint
  resumes on one process to the same losses;
- a frozen rank is named on both hosts and killed only by its own host (host_identity).

One namespace pair serves the whole module. Needs root, `ip` and `tc` and the right to make
network namespaces: the tests that use them skip otherwise, with the reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from patience import wait_until
from ringattn.runtime import checkpoint as ckpt
from ringattn.runtime import peer_heartbeat
from ringattn.runtime.outcome import EXIT_FROZEN_PEER, EXIT_PREEMPTED
from ringattn.testing.hosts import TwoHosts, unavailable
from ringattn.train.progress import read_log

TESTS = os.path.dirname(os.path.abspath(__file__))
TINY = {"model": "tiny", "dim": 32, "seq_len": 64, "keys": 3, "copies": 2, "warmup": 1,
        "lr": 1e-2, "quiet": True, "steps": 3, "checkpoint_every": 0}  # fmt: skip
FLAGS = ["-m", "ringattn", "train", "--model", "tiny", "--dim", "32", "--seq-len", "64",
         "--keys", "3", "--copies", "2", "--warmup", "1", "--lr", "1e-2", "--quiet",
         "--cp", "4"]  # fmt: skip


# what a machine without the capabilities says (a container without CAP_SYS_ADMIN / NET_ADMIN)
_NOT_ALLOWED = ("Operation not permitted", "Permission denied", "not supported")


@pytest.fixture(scope="module")
def hosts():
    why = unavailable()
    if why:
        pytest.skip(f"two hosts need root, ip and tc: {why}")
    two = TwoHosts(rate="1gbit")
    try:
        two.__enter__()
    except RuntimeError as err:
        if any(text in str(err) for text in _NOT_ALLOWED):
            pytest.skip(f"network namespaces are not allowed here: {err}")
        raise
    try:
        yield two
    finally:
        two.close()


def _losses_by_step(path: str) -> list[float]:
    """The log's loss of every step, the last record of a step winning (a rerun repeats the
    steps after the newest checkpoint)."""
    by_step = {r["step"]: r["loss"] for r in read_log(path) if "loss" in r}
    return [by_step[s] for s in sorted(by_step)]


def _wait_for_step(hosts, path: str, step: int, procs: list) -> None:
    """Until the log reaches `step`, however slowly (a hang fails: patience.py)."""

    def reached() -> bool:
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"a host ended before step {step}: {hosts.finish(procs, 5)}")
        return os.path.exists(path) and any(r.get("step", 0) >= step for r in read_log(path))

    wait_until(reached, hosts.pids, f"step {step}", poll_s=0.2)


def _run_to_the_end(hosts, flags: list[str]) -> list[tuple[int, str]]:
    """hosts.torchrun without its fixed timeout: both hosts to their end, however slowly."""
    procs = hosts.start_torchrun(flags)
    try:
        wait_until(lambda: all(p.poll() is not None for p in procs), hosts.pids, "both hosts")
    finally:
        results = hosts.finish(procs, 5)
    return results


@pytest.mark.slow
def test_every_strategy_across_two_hosts_equals_one_process(hosts, pools, tmp_path):
    """One torchrun job over both hosts trains five configurations in turn; each equals one
    process on the same samples (losses to 1e-5, parameters to 1e-4)."""
    configs = [
        {"cp": 4, "strategy": "ring"},
        {"cp": 4, "strategy": "allgather"},
        {"cp": 4, "strategy": "ulysses"},
        {"cp": 4, "strategy": "hybrid", "ulysses": 2},  # all-to-all inside a host, ring across
        {"dp": 2, "cp": 2, "strategy": "ring", "layout": "contiguous"},
    ]
    options = [{**TINY, **c, "out_dir": str(tmp_path / f"two-{i}")} for i, c in enumerate(configs)]
    out = tmp_path / "runs.json"
    script = os.path.join(TESTS, "workers_two_hosts.py")
    results = _run_to_the_end(hosts, [script, str(out), json.dumps(options)])
    for host, (code, output) in enumerate(results):
        assert code == 0, f"host {host} exited with {code}:\n{output[-4000:]}"
    data = json.loads(out.read_text())
    nodes = data["nodes"]  # each host holds two neighbouring ranks: hybrid's Ulysses pairs
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes
    refs = {}
    for bs in (1, 2):
        single = {**TINY, "batch_size": bs, "out_dir": str(tmp_path / f"one-{bs}")}
        refs[bs] = pools(1).run("workers_train:train", single)[0]
    for config, got in zip(configs, data["runs"]):
        want = refs[config.get("dp", 1)]
        assert got["dp_cp"] == [config.get("dp", 1), config["cp"]]
        torch.testing.assert_close(got["losses"], want["losses"], rtol=1e-5, atol=0,
                                   msg=lambda m, c=config: f"{c}: {m}")  # fmt: skip
        for name, value in want["params"].items():
            where = f"{config} {name}"
            torch.testing.assert_close(torch.tensor(got["params"][name]), value, rtol=1e-4,
                                       atol=1e-4, msg=lambda m, w=where: f"{w}: {m}")  # fmt: skip
    init_gap = abs(want["losses"][0] - want["losses"][-1])
    assert init_gap > 1e-3  # the runs moved: equal losses are not equal starting points


@pytest.mark.slow
def test_sigterm_to_one_hosts_agent_checkpoints_both_and_resumes_on_one_host(
    hosts, pools, tmp_path
):
    """Rank 3 SIGTERMs its own host's torchrun agent at step 2: the agent forwards it to its
    ranks, the step's all-reduce tells the other host's, every rank checkpoints the same step
    and exits 75; that checkpoint, written across both hosts, resumes on one process."""
    out = str(tmp_path / "run")
    flags = [*FLAGS, "--steps", "6", "--checkpoint-every", "0", "--out-dir", out,
             "--fail-at-step", "2", "--fail-rank", "3",
             "--fail-signal", "term-launcher"]  # fmt: skip
    results = _run_to_the_end(hosts, flags)
    text = "\n".join(o for _, o in results)
    assert all(code != 0 for code, _ in results), text[-4000:]
    match = re.search(r"every rank finished step (\d+)", text)
    assert match, text[-4000:]
    stop_step = int(match.group(1))
    assert ckpt.latest(os.path.join(out, "checkpoints")).endswith(f"step-{stop_step:08d}")
    # the host whose agent was not signalled reports its ranks' code
    assert any(f"exitcode: {EXIT_PREEMPTED}" in o for _, o in results), text[-4000:]
    options = {**TINY, "steps": 6, "checkpoint_every": -1}
    resumed = pools(1).run("workers_cluster:train_outcome", {**options, "out_dir": out})[0]
    reference = pools(1).run("workers_cluster:train_outcome",
                             {**options, "out_dir": str(tmp_path / "ref")})[0]  # fmt: skip
    assert resumed["start_step"] == stop_step
    want = [r["loss"] for r in reference["history"]]
    got = _losses_by_step(os.path.join(out, "train_log.jsonl"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_link_cut_is_named_on_both_hosts_and_the_newest_checkpoint_resumes(hosts, pools, tmp_path):
    """A checkpoint of one process resumes over the two hosts; the link goes down at step 4:
    host 0's ranks name the other node's silent ranks, host 1's the store they lost, all within
    the stall timeout; the newest checkpoint, written across the hosts until the cut, resumes
    (on one process: a checkpoint of two hosts resuming on two is the SIGTERM test's, and on
    one host its first part) and ends with the losses of one uninterrupted process."""
    out = str(tmp_path / "run")
    first = {**TINY, "steps": 8, "stop_at": 2, "checkpoint_every": 1, "out_dir": out}
    pools(1).run("workers_cluster:train_outcome", first)
    log = os.path.join(out, "train_log.jsonl")
    stall = 6
    flags = [*FLAGS, "--steps", "8", "--checkpoint-every", "1", "--out-dir", out,
             "--stall-timeout", str(stall)]  # fmt: skip
    procs = hosts.start_torchrun(flags)
    try:
        _wait_for_step(hosts, log, 4, procs)
        hosts.link(up=False)
        # the ranks end themselves (a hang fails here: patience.py); the cut-off host's
        # torchrun agent keeps trying its own rendezvous for minutes (torch's timeouts, not
        # ours): once the ranks are gone, it goes
        agents = {p.pid for p in procs}
        wait_until(lambda: not set(hosts.pids()) - agents, hosts.pids, "the ranks to end")
        results = hosts.finish(procs, 2)  # the ranks said it all; the agents add nothing
    finally:
        hosts.link(up=True)
    text = "\n".join(o for _, o in results)
    silent = re.findall(r"\[rank (\d)\] rank (\d) \(pid \d+ on node (\d), host [^)]*\) stopped "
                        r"responding: no heartbeat for (\d+) s[^\n]*node \d holds ranks ([\d, ]+);",
                        text)  # fmt: skip
    lost = re.findall(r"\[rank (\d)\] lost contact with the job's store at [\d.:]+ for (\d+) s: "
                      r"unreachable ranks ([\d, ]+) \(node (\d)", text)  # fmt: skip
    assert silent and lost, text[-5000:]
    assert f"exits with code {EXIT_FROZEN_PEER}" in text
    assert "it was killed" not in text  # no rank signals a pid of the other host
    watchers = {int(r) for r, *_ in silent} | {int(r) for r, *_ in lost}
    # each host's ranks name what they lost (ranks 0-1 share a host, 2-3 the other); a second
    # rank of a host may be ended by its agent's teardown first, once the first one exits 70
    assert watchers & {0, 1} and watchers & {2, 3}, text[-5000:]
    # named after the stall timeout, never before; how long after depends on the machine's load
    for _, _, _, seconds, mates in silent:
        assert int(seconds) >= stall and len(mates.split(",")) == 2
    for _, seconds, ranks, _ in lost:
        assert int(seconds) >= stall and len(ranks.split(",")) == 2
    newest = ckpt.latest(os.path.join(out, "checkpoints"))
    # step 4 is logged before it is checkpointed: the newest is 3 or 4, written by the two hosts
    assert newest is not None and int(newest.rsplit("-", 1)[1]) >= 3
    resumed = pools(1).run("workers_cluster:train_outcome", {**first, "stop_at": 0})[0]
    assert resumed["start_step"] == int(newest.rsplit("-", 1)[1]) and resumed["stopped"] is None
    reference = pools(1).run("workers_cluster:train_outcome",
                             {**TINY, "steps": 8, "out_dir": str(tmp_path / "ref")})[0]  # fmt: skip
    want = [r["loss"] for r in reference["history"]]
    torch.testing.assert_close(_losses_by_step(log), want, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_a_frozen_rank_is_named_on_both_hosts_and_killed_only_by_its_own(hosts, tmp_path):
    """Rank 3 stops itself at step 2: rank 2 (its host) kills it, rank 0 (the other host, same
    hostname, same pid space) names it with its node and never signals it."""
    out = tmp_path / "run"
    flags = [*FLAGS, "--steps", "50", "--checkpoint-every", "0", "--out-dir", str(out),
             "--fail-at-step", "2", "--fail-rank", "3", "--fail-signal", "stop",
             "--stall-timeout", "4"]  # fmt: skip
    results = _run_to_the_end(hosts, flags)  # however slowly: a hang fails (patience.py)
    text = "\n".join(o for _, o in results)
    found = {
        m.group(1): m.group(0)
        for m in re.finditer(
            r"\[rank (\d)\] rank 3 \(pid \d+ on node \d, host [^)]*\) stopped responding[^\n]*",
            text,
        )
    }
    assert found, text[-4000:]
    if "0" in found:  # the other host: named with its node and ranks, never signalled
        assert "killed" not in found["0"] and "holds ranks 2, 3" in found["0"], found
    if "2" in found:  # its own host
        assert "it was killed to end the job" in found["2"], found
    # the job ended because of the frozen rank, long before its 50 steps: not by running out
    steps = [r["step"] for r in read_log(str(out / "train_log.jsonl")) if "loss" in r]
    assert steps and max(steps) < 50, steps


@pytest.mark.slow
def test_host_identity_tells_the_namespaces_apart(hosts):
    """Same hostname, same boot, same pid space: the identities still differ."""
    code = "from ringattn.runtime.peer_heartbeat import host_identity; print(host_identity())"
    ids = []
    for host in (0, 1):
        proc = hosts.popen(host, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        ids.append(proc.communicate(timeout=120)[0].strip())
    ids.append(peer_heartbeat.host_identity())
    assert len(set(ids)) == 3, ids
    assert len({i.split("/")[0] for i in ids}) == 1  # one hostname: what used to be compared


def test_a_verdict_never_signals_another_hosts_pid(monkeypatch):
    """_PeerBeat.verdict kills a frozen peer's pid only when its host identity is this one's."""
    store = torch.distributed.HashStore()
    beat = peer_heartbeat._PeerBeat(store, 0, 2, stall_s=1.0)
    kills, exits = [], []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append((pid, sig)))

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    record = {"pid": 4242, "host": os.uname().nodename, "host_id": "elsewhere", "node": 1}
    with pytest.raises(SystemExit):
        beat.verdict(1, record, 5.0)
    assert kills == [] and exits == [EXIT_FROZEN_PEER]
    with pytest.raises(SystemExit):
        beat.verdict(1, {**record, "host_id": beat.host_id}, 5.0)
    assert kills == [(4242, signal.SIGKILL)]


_ASK = """
import json, sys, time, urllib.request
url, body = sys.argv[1], sys.argv[2].encode()
while True:  # until the server listens: the test's wait_until ends this if nothing progresses
    try:
        request = urllib.request.Request(url + "/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        print(json.load(urllib.request.urlopen(request))["choices"][0]["message"]["content"])
        break
    except OSError:
        time.sleep(0.5)
"""


def _host_of_rank(hosts, rank: int) -> int:
    """Which host (0 or 1) runs global rank `rank` (its RANK in the environment), however long
    torchrun takes to start it (a hang fails: patience.py)."""
    found: list[int] = []

    def located() -> bool:
        for pid in hosts.pids():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                where = subprocess.run(["ip", "netns", "identify", str(pid)],
                                       capture_output=True, text=True, check=False)  # fmt: skip
                found.append(hosts.names.index(where.stdout.strip()))
                return True
        return False

    wait_until(located, hosts.pids, f"rank {rank} to start")
    return found[0]


@pytest.mark.slow
def test_serve_over_two_hosts_answers_as_one_process(hosts, tmp_path):
    """`ringattn serve` under torchrun over both hosts (rank 0 listens on its host's loopback):
    a request answers what transformers' greedy generate gives on one process."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from serve_model import save_chat_model

    directory = tmp_path / "tiny"
    model, tok = save_chat_model(directory)
    prompt = "ring attention passes keys"
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}],
                                  add_generation_prompt=True, return_dict=False)  # fmt: skip
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=10,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    want = tok.decode(out[0, len(ids) :], skip_special_tokens=True)
    assert transformers is not None and want
    serve = ["-m", "ringattn", "serve", "--hf", str(directory), "--host", "127.0.0.1", "--port",
             "8321", "--model-name", "tiny"]  # fmt: skip
    procs = hosts.start_torchrun(serve)
    try:
        host = _host_of_rank(hosts, 0)
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": 10, "temperature": 0})  # fmt: skip
        ask = hosts.popen(host, [sys.executable, "-c", _ASK, "http://127.0.0.1:8321/v1", body],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        wait_until(lambda: ask.poll() is not None, lambda: [*hosts.pids(), ask.pid],
                   "the server's answer")  # fmt: skip
        answer = ask.stdout.read()
    finally:
        hosts.kill_all()
        outputs = hosts.finish(procs, 30)
    assert ask.returncode == 0, answer + "\n".join(o for _, o in outputs)[-4000:]
    assert answer.removesuffix("\n") == want
