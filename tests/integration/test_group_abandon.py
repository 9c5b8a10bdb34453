"""A trainer group member that is gone without its sockets saying so (its host
frozen: a real peer process, SIGSTOPped inside the group) holds the leader's
collective until the group's timeout; abandoning the group ends that wait now,
with GroupBroken, and closing the abandoned group does not block its caller."""

import signal
import subprocess
import sys
import threading

import pytest
import torch

from reflow.procs import free_port
from reflow.trainer.dp import GroupBroken, TrainerGroup
from reflow.weightsync import new_rendezvous_key

PEER = """
import sys, time, torch
from reflow.trainer.dp import TrainerGroup
group = TrainerGroup.build("127.0.0.1", int(sys.argv[1]), 1, 2, 1, torch.device("cpu"), 120.0,
                           rendezvous_key=sys.argv[2])
print("joined", flush=True)
time.sleep(600)
"""


def test_an_abandoned_group_ends_the_collective_waiting_for_a_frozen_member():
    port, key = free_port(), new_rendezvous_key()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port), key], stdout=subprocess.PIPE,
                            text=True)
    try:
        # The group's timeout is far past the test's: only abandoning it ends the wait.
        leader = TrainerGroup.build("127.0.0.1", port, 0, 2, 1, torch.device("cpu"), 120.0,
                                    rendezvous_key=key)
        assert peer.stdout.readline().strip() == "joined"
        peer.send_signal(signal.SIGSTOP)
        threading.Timer(1.0, leader.abandon, args=("replica 127.0.0.1:1 unreachable",)).start()
        with pytest.raises(GroupBroken, match="all-reduce abandoned: replica 127.0.0.1:1"):
            leader._all_reduce(torch.ones(4))
        leader.abort()  # on its own thread: gloo's destructor waits for the frozen peer
        with pytest.raises(GroupBroken):
            leader.send_command("train", 1)
    finally:
        peer.kill()
        peer.wait()
