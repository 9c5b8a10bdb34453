"""The train loop renews its batch's lease while it trains, and stops when done."""

import time

from reflow.core.config import parse_job_spec
from reflow.core.types import Batch
from reflow.trainer.loop import TrainLoop


class RenewLog:
    def __init__(self, still_there: bool = True):
        self.calls = []
        self.still_there = still_there

    def renew_lease(self, job_id, lease_id, lease_ttl_s):
        self.calls.append((job_id, lease_id, lease_ttl_s, time.monotonic()))
        return self.still_there


def _loop(replay) -> TrainLoop:
    spec = parse_job_spec({"model": {"path": "/m"}, "replay": {"lease_ttl_s": 0.3}})
    return TrainLoop("job", spec, replay, rollouts=[])


def test_a_long_step_keeps_renewing_its_lease_and_stops_after():
    replay = RenewLog()
    with _loop(replay)._lease_kept(Batch(lease_id="l1", trajectories=[], policy_version=0)):
        time.sleep(0.65)  # more than two TTLs
    renewed = len(replay.calls)
    assert renewed >= 4 and all(c[:3] == ("job", "l1", 0.3) for c in replay.calls)
    time.sleep(0.25)
    assert len(replay.calls) == renewed  # the keeper stopped with the step


def test_renewal_stops_once_the_lease_is_gone():
    replay = RenewLog(still_there=False)
    with _loop(replay)._lease_kept(Batch(lease_id="l2", trajectories=[], policy_version=0)):
        time.sleep(0.5)
    assert len(replay.calls) == 1
