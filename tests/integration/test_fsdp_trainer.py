"""The FSDP trainer group (trainer/fsdp.py) over real gloo groups of 2 and 3
processes: after the same steps on the same batches its parameters are the
single unsharded trainer's (which the replicated group matches exactly,
test_trainer_group.py), each rank holds about 1/N of the state, weights are
gathered a bucket at a time, and a checkpoint written by 2 ranks loads into 3."""

import json
import subprocess
import sys

import pytest
import torch

from reflow.procs import free_port

pytestmark = pytest.mark.slow

# fp32 on CPU; reduce-scatter sums in another order than one process's backward.
TOLERANCE = 1e-5


def _group(tiny_model, out_dir, world, *extra):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "tests.integration.fsdp_rank", tiny_model,
                               str(out_dir / f"rank{r}.json"), str(port), str(r), str(world),
                               *extra])
             for r in range(world)]
    for p in procs:
        assert p.wait(timeout=300) == 0
    reports = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    print(world, "ranks:", json.dumps(reports))
    return reports


@pytest.fixture(scope="module")
def two_ranks(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    reports = _group(tiny_model, out, 2, "--save", str(out / "ckpt"))
    return out, reports


def test_fsdp_at_two_ranks_trains_the_single_trainers_weights_holding_half(two_ranks, tiny_model):
    out, reports = two_ranks
    for r in reports:
        assert r["max_abs_diff"] is not None and r["max_abs_diff"] < TOLERANCE, r
        # The sync check's probe forward between steps changed nothing in them, and
        # left the parameters sharded.
        assert r["probe_max_abs_diff"] < TOLERANCE and r["probe_leaves_shards"], r
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    whole = sum(p.numel() * 4 for p in model.parameters()) * 3  # params + two AdamW moments
    for r in reports:
        assert r["held_bytes"] <= 0.6 * whole, (r["held_bytes"], whole)
        # One bucket of gathered weights at a time (a parameter larger than a bucket alone).
        assert r["peak_bucket_bytes"] <= max(r["bucket_bytes"], r["largest_param_bytes"])
        # Weight sync from shards: the engine gets the trained weights, and the send
        # holds one bucket and one gathered parameter at most (rank 0), one
        # parameter elsewhere.
        bound = max(r["bucket_bytes"], r["largest_param_bytes"]) + r["largest_param_bytes"]
        assert 0 < r["sync_peak_extra_bytes"] <= bound, r
    assert reports[0]["engine_has_trained_weights"] is True


def test_a_checkpoint_written_by_two_ranks_resumes_at_three_and_trains_uneven_batches(
        two_ranks, tiny_model, tmp_path):
    out, _ = two_ranks
    reports = _group(tiny_model, tmp_path, 3, "--resume", str(out / "ckpt"))
    # Steps on from the checkpoint at 3 ranks (13 samples: uneven shares) equal the
    # unsharded trainer's from the same checkpoint.
    assert all(r["max_abs_diff"] < TOLERANCE for r in reports), reports
    saved = torch.load(out / "rank0.json.pt")
    loaded = torch.load(tmp_path / "rank0.json.pt")
    assert saved["params"].keys() == loaded["params"].keys() and saved["params"]
    for name, t in saved["params"].items():
        assert torch.equal(t, loaded["params"][name]), name
    assert saved["exp_avg"].keys() == loaded["exp_avg"].keys() and saved["exp_avg"]
    for name, t in saved["exp_avg"].items():
        assert torch.equal(t, loaded["exp_avg"][name]), name


def test_fsdp_trains_lora_adapters_as_the_single_trainer_and_syncs_only_them(
        tiny_model, tmp_path):
    reports = _group(tiny_model, tmp_path, 2, "--lora")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    whole = sum(p.numel() * 4 for p in model.parameters())
    for r in reports:
        # The adapters after 3 steps are the unsharded trainer's, and they alone went
        # to the engine (a fraction of the model's bytes).
        assert r["max_abs_diff"] is not None and r["max_abs_diff"] < TOLERANCE, r
        assert r["probe_max_abs_diff"] < TOLERANCE, r
        # Each rank holds half the frozen weights, and AdamW state for adapters only.
        assert r["held_bytes"] < 0.75 * whole, r
    assert reports[0]["engine_has_trained_weights"] is True
    assert reports[0]["largest_param_bytes"] < whole / 20
