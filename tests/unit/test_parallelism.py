"""trainer.parallelism: fsdp is refused where the trainer membership can change
(role flips), naming the fields; `auto` picks fsdp only for a fixed group of 2
or more ranks on a model of at least FSDP_AUTO_MIN_PARAMETERS."""

import pytest

from reflow.core.config import JobSpecError, parse_job_spec
from reflow.trainer.fsdp import FSDP_AUTO_MIN_PARAMETERS, wants_fsdp

POOL = {"workers": 3, "trainer_workers": 2}


def _spec(parallelism="auto", placement=False, **cluster):
    return parse_job_spec({"model": {"path": "/m"}, "trainer": {"parallelism": parallelism},
                           "scheduler": {"placement": placement},
                           **({"cluster": cluster} if cluster else {})})


def test_fsdp_with_role_flips_is_refused_by_the_fields_to_change():
    with pytest.raises(JobSpecError, match="trainer.parallelism: fsdp keeps the trainer group"):
        _spec("fsdp", placement=True, **POOL)
    with pytest.raises(JobSpecError, match="scheduler.placement: false and no cluster.flips"):
        _spec("fsdp", flips=[{"at_step": 2, "worker": 1, "role": "rollout"}], **POOL)
    assert _spec("fsdp", **POOL).trainer.parallelism == "fsdp"
    # Fixed roles (no pool) flip nothing.
    assert _spec("fsdp", placement=True).trainer.parallelism == "fsdp"


def test_auto_shards_large_models_over_a_fixed_group_only():
    big, small = FSDP_AUTO_MIN_PARAMETERS, FSDP_AUTO_MIN_PARAMETERS - 1
    assert wants_fsdp(_spec(**POOL), big)
    assert not wants_fsdp(_spec(**POOL), small)
    assert not wants_fsdp(_spec(workers=3, trainer_workers=1), big)  # one rank
    assert not wants_fsdp(_spec(placement=True, **POOL), big)  # roles flip
    assert not wants_fsdp(_spec(), big)  # fixed roles: one trainer process
    assert not wants_fsdp(_spec("replicate", **POOL), big)
    assert wants_fsdp(_spec("fsdp", **POOL), small)
