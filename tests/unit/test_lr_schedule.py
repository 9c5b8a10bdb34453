"""The learning-rate schedule (trainer.lr_schedule, warmup_steps, min_lr_ratio):
Hugging Face's laws, taken from the step number alone, set on the optimizer
before each step."""

import math

import pytest
import torch

from reflow.core.config import parse_job_spec
from reflow.core.trainer_config import TrainerConfig
from reflow.core.types import Batch
from reflow.trainer.loop import TrainLoop
from reflow.trainer.schedule import learning_rate_at, set_learning_rate
from tests.unit.test_micro_batches import _trajectories


def _trainer(**fields) -> TrainerConfig:
    return TrainerConfig(learning_rate=0.01, num_steps=10, warmup_steps=4, **fields)


def test_warm_up_from_zero_then_each_law_at_hand_worked_steps():
    # Step s trains at k = s - 1: a warm-up of 4 gives 0, 1/4, 2/4, 3/4 of the rate.
    warm = [0.0, 0.0025, 0.005, 0.0075]
    constant = _trainer()
    assert [learning_rate_at(constant, s) for s in range(1, 5)] == pytest.approx(warm)
    assert [learning_rate_at(constant, s) for s in (5, 10)] == pytest.approx([0.01, 0.01])
    # linear: (N - k) / (N - W) after the warm-up, N = 10, W = 4.
    linear = _trainer(lr_schedule="linear")
    assert [learning_rate_at(linear, s) for s in range(1, 5)] == pytest.approx(warm)
    assert learning_rate_at(linear, 5) == pytest.approx(0.01)          # k 4: 6/6
    assert learning_rate_at(linear, 8) == pytest.approx(0.005)         # k 7: 3/6
    assert learning_rate_at(linear, 10) == pytest.approx(0.01 / 6)     # k 9: 1/6
    # cosine with a floor of 0.1: 0.1 + 0.9 (1 + cos(pi (k - 4) / 6)) / 2.
    cosine = _trainer(lr_schedule="cosine", min_lr_ratio=0.1)
    assert learning_rate_at(cosine, 5) == pytest.approx(0.01)
    assert learning_rate_at(cosine, 8) == pytest.approx(0.0055)        # k 7: cos(pi/2) = 0
    assert learning_rate_at(cosine, 10) == pytest.approx(
        0.01 * (0.1 + 0.9 * (1 + math.cos(5 * math.pi / 6)) / 2))
    # No warm-up: the first step trains at the full rate.
    assert learning_rate_at(TrainerConfig(learning_rate=0.01), 1) == 0.01
    with pytest.raises(ValueError, match="step"):
        learning_rate_at(constant, 0)


@pytest.mark.parametrize("schedule, floor, hf", [
    ("constant", 0.0, "get_constant_schedule_with_warmup"),
    ("linear", 0.0, "get_linear_schedule_with_warmup"),
    ("cosine", 0.0, "get_cosine_schedule_with_warmup"),
    ("cosine", 0.2, "get_cosine_with_min_lr_schedule_with_warmup"),
])
def test_every_step_s_rate_is_hugging_face_s(schedule, floor, hf):
    """So a TRL run mapped from the same spec (bench/trl_grpo.py) trains at the same
    rates: Hugging Face's scheduler, stepped after each optimizer step."""
    from transformers import optimization

    trainer = TrainerConfig(learning_rate=3e-4, num_steps=23, warmup_steps=5,
                            lr_schedule=schedule, min_lr_ratio=floor)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=3e-4)
    kwargs = {"num_warmup_steps": 5}
    if schedule != "constant":
        kwargs["num_training_steps"] = 23
    if floor:
        kwargs["min_lr_rate"] = floor
    scheduler = getattr(optimization, hf)(optimizer, **kwargs)
    for step in range(1, 24):
        assert learning_rate_at(trainer, step) == pytest.approx(
            optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15), step
        optimizer.step()
        scheduler.step()


def test_the_spec_refuses_a_warm_up_past_the_run_and_a_floor_without_decay():
    with pytest.raises(ValueError, match="trainer.warmup_steps: 11 is longer than the run"):
        TrainerConfig(num_steps=10, warmup_steps=11)
    with pytest.raises(ValueError, match="trainer.min_lr_ratio: 0.1 is the floor"):
        TrainerConfig(min_lr_ratio=0.1)
    TrainerConfig(num_steps=10, warmup_steps=10, lr_schedule="linear", min_lr_ratio=0.1)


class _Replay:
    def configure(self, job_id, config):
        pass


def test_the_optimizer_trains_each_step_at_the_schedule_s_rate_from_its_number(tiny_model):
    spec = parse_job_spec({"model": {"path": tiny_model},
                           "trainer": {"learning_rate": 0.01, "num_steps": 6, "warmup_steps": 2,
                                       "lr_schedule": "linear", "min_lr_ratio": 0.5}})
    loop = TrainLoop("job", spec, _Replay(), rollouts=[], device=torch.device("cpu"))
    loop.load()
    seen = []
    step = loop.optimizer.step

    def record_lr(*args, **kwargs):
        seen.append([g["lr"] for g in loop.optimizer.param_groups])
        return step(*args, **kwargs)

    loop.optimizer.step = record_lr
    batch = Batch(lease_id="l", trajectories=_trajectories(8, vocab=20))
    loop._train_step(batch)  # step 1: the warm-up's first, at 0
    # A trainer resumed at step 3 (its optimizer's rate whatever it last was)
    # trains step 4 at the schedule's rate: nothing of the schedule is kept.
    loop.step = 3
    loop._train_step(batch)
    trainer = spec.trainer
    assert seen == [[0.0] * len(seen[0]), [learning_rate_at(trainer, 4)] * len(seen[0])]
    assert learning_rate_at(trainer, 4) == pytest.approx(0.01 * (0.5 + 0.5 * 3 / 4))
    assert loop.learning_rate == learning_rate_at(trainer, 4)
    assert all(g["lr"] == loop.learning_rate for g in loop.optimizer.param_groups)


def test_set_learning_rate_sets_every_group_of_a_fresh_optimizer():
    """A replica, or an optimizer rebuilt over new shards (trainer/reshard.py), takes
    the step's rate from its number the same way."""
    trainer = _trainer(lr_schedule="cosine")
    optimizer = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2))]},
                                   {"params": [torch.nn.Parameter(torch.zeros(3))]}], lr=1.0)
    assert set_learning_rate(optimizer, trainer, 7) == learning_rate_at(trainer, 7)
    assert [g["lr"] for g in optimizer.param_groups] == [learning_rate_at(trainer, 7)] * 2
