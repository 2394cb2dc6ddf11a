"""The peer heartbeat's exit (runtime/peer_heartbeat.py) on a store that no longer answers.

The whole path (torchrun, two hosts, a cut link) runs in test_two_hosts.py and
test_cluster_torchrun.py; here, one process and a store whose operations block forever, as a
TCPStore's do on a cut link until the kernel gives the connection up (about 15 minutes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from ringattn.runtime.outcome import EXIT_FROZEN_PEER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RANK = textwrap.dedent(
    """
    import threading
    from ringattn.runtime.peer_heartbeat import _PeerBeat

    class CutStore:  # every operation blocks, as on a link that went down
        def set(self, key, value):
            threading.Event().wait()

    peer = _PeerBeat(CutStore(), rank=1, world_size=2, stall_s=0.5)
    peer.finish()  # what atexit runs when the main thread failed on the cut link
    print("finish returned")
    """
)


def test_the_last_beat_on_a_cut_link_ends_the_rank_instead_of_hanging_in_atexit():
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), "OMP_NUM_THREADS": "1",
           "MASTER_ADDR": "10.213.0.1", "MASTER_PORT": "29500"}  # fmt: skip
    # before: finish() blocked in the store forever (here; 17 minutes on a real cut link)
    result = subprocess.run([sys.executable, "-c", _RANK], capture_output=True, text=True,
                            env=env, timeout=300, check=False)  # fmt: skip
    assert result.returncode == EXIT_FROZEN_PEER, result
    assert "finish returned" not in result.stdout
    assert result.stderr.startswith("[rank 1] lost contact with the job's store at "
                                    "10.213.0.1:29500 for "), result.stderr  # fmt: skip
