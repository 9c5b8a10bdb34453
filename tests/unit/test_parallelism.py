"""trainer.parallelism: fsdp is accepted with role flips (a flip moves shards,
trainer/reshard.py); `auto` picks fsdp for an elastic pool whose trainer group
has 2 or more ranks at start or may grow by flips, on a model of at least
FSDP_AUTO_MIN_PARAMETERS."""

from reflow.core.config import parse_job_spec
from reflow.trainer.fsdp import FSDP_AUTO_MIN_PARAMETERS, wants_fsdp

POOL = {"workers": 3, "trainer_workers": 2}


def _spec(parallelism="auto", placement=False, **cluster):
    return parse_job_spec({"model": {"path": "/m"}, "trainer": {"parallelism": parallelism},
                           "scheduler": {"placement": placement},
                           **({"cluster": cluster} if cluster else {})})


def test_fsdp_goes_with_role_flips():
    assert _spec("fsdp", placement=True, **POOL).trainer.parallelism == "fsdp"
    flips = [{"at_step": 2, "worker": 1, "role": "rollout"}]
    assert _spec("fsdp", flips=flips, **POOL).flips_roles
    assert _spec("fsdp", placement=True).trainer.parallelism == "fsdp"


def test_auto_shards_large_models_of_a_pool_with_a_group_of_several_ranks():
    big, small = FSDP_AUTO_MIN_PARAMETERS, FSDP_AUTO_MIN_PARAMETERS - 1
    assert wants_fsdp(_spec(**POOL), big)
    assert not wants_fsdp(_spec(**POOL), small)
    assert not wants_fsdp(_spec(workers=3, trainer_workers=1), big)  # one rank, for good
    assert wants_fsdp(_spec(placement=True, workers=3, trainer_workers=1), big)  # may grow
    assert wants_fsdp(_spec(placement=True, **POOL), big)
    assert not wants_fsdp(_spec(), big)  # fixed roles: one trainer process
    assert not wants_fsdp(_spec("replicate", **POOL), big)
    assert wants_fsdp(_spec("fsdp", **POOL), small)


def test_hsdp_holds_whole_replicas_and_says_what_it_needs():
    import pytest

    base = {"model": {"path": "/m"}, "scheduler": {"placement": False}}
    spec = parse_job_spec({**base, "trainer": {"parallelism": "hsdp", "shard_size": 2},
                           "cluster": {"workers": 5, "trainer_workers": 4}})
    assert wants_fsdp(spec, 1) and spec.trainer.shard_size == 2
    for trainer, cluster, match in [
            ({"parallelism": "hsdp"}, {"workers": 5, "trainer_workers": 4}, "shard_size"),
            ({"parallelism": "fsdp", "shard_size": 2}, {"workers": 3, "trainer_workers": 2},
             "shard_size"),
            ({"parallelism": "hsdp", "shard_size": 2}, {"workers": 4, "trainer_workers": 3},
             "multiple"),
            ({"parallelism": "hsdp", "shard_size": 2}, None, "cluster.workers")]:
        with pytest.raises(ValueError, match=match):
            parse_job_spec({**base, "trainer": trainer,
                            **({"cluster": cluster} if cluster else {})})
    # Algorithm 1 moves whole replicas (scheduler/placement/elastic.py); a scripted
    # flip of one worker alone would leave half of one.
    placed = parse_job_spec({"model": {"path": "/m"},
                             "trainer": {"parallelism": "hsdp", "shard_size": 2},
                             "cluster": {"workers": 5, "trainer_workers": 4}})
    assert placed.flips_roles
    with pytest.raises(ValueError, match=r"cluster.flips\[0\]: .*2 at a time"):
        parse_job_spec({**base, "trainer": {"parallelism": "hsdp", "shard_size": 2},
                        "cluster": {"workers": 5, "trainer_workers": 4, "flips": [
                            {"at_step": 2, "worker": 3, "role": "rollout"}]}})
