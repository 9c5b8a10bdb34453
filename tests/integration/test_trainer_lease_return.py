"""A trainer that stops (or fails) in the middle of a step gives its leased batch
back to the buffer at once, on a real Redis: the samples are not lost for the
lease's TTL, and they are not counted as trained."""

import uuid

import pytest

from reflow.core.config import parse_job_spec
from reflow.replay.client import InprocReplayClient
from reflow.replay.store import ReplayStore
from reflow.trainer.loop import JobStopped, TrainLoop
from tests.integration.samples import make_group


@pytest.mark.parametrize("error", [JobStopped, RuntimeError])
def test_a_step_cut_short_returns_its_lease(redis_server, error):
    store = ReplayStore.from_url(redis_server.url)
    job = uuid.uuid4().hex[:12]
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "fully_async",
                           "trainer": {"batch_size": 8}, "rollout": {"group_size": 4},
                           "replay": {"lease_ttl_s": 600}})
    store.configure(job, spec.replay)
    store.put(job, make_group("g1") + make_group("g2"))
    loop = TrainLoop(job, spec, InprocReplayClient(store), rollouts=[])

    def cut_short(batch):
        assert store.stats(job).outstanding_leases == 1
        raise error("stopped mid-step")

    loop._train_step = cut_short
    with pytest.raises(error):
        loop.run()
    s = store.stats(job)
    assert (s.outstanding_leases, s.leased_samples, s.unused_samples) == (0, 0, 8)
    assert s.trained_total == 0
    loop.close()
