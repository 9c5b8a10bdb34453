import statistics

import pytest

from reflow.core.types import Segment, Trajectory, group_advantages
from reflow.tasks import Prompt, TaskContext
from reflow.tasks.repeat import RepeatTask


def test_group_advantages_are_normalised_and_zero_for_flat_groups():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5])
    assert sum(adv) == pytest.approx(0.0, abs=1e-9)
    assert statistics.pstdev(adv) == pytest.approx(1.0, rel=1e-4)
    assert group_advantages([0.3, 0.3, 0.3]) == [0.0, 0.0, 0.0]


def test_trajectory_rejects_misaligned_fields_and_tracks_oldest_version():
    t = Trajectory("s", "g", [1], [2, 3, 4], [-1.0] * 3, [1, 1, 1],
                   [Segment(4, 2), Segment(5, 1)])
    assert t.oldest_version == 4 and t.num_tokens == 3
    with pytest.raises(ValueError, match="equal lengths"):
        Trajectory("s", "g", [1], [2, 3], [-1.0], [1, 1], [Segment(0, 2)])
    with pytest.raises(ValueError, match="segments"):
        Trajectory("s", "g", [1], [2, 3], [-1.0, -1.0], [1, 1], [Segment(0, 1)])


def test_repeat_task_rewards():
    task = RepeatTask(max_count=48, num_symbols=6, context=TaskContext(seed=0))
    prompt = Prompt("p", "c x 3 =", "c:3")
    assert task.reward(prompt, "c c c") == 1.0
    assert task.reward(prompt, "") == 0.0
    assert task.reward(prompt, "a a a") == 0.0
    # Right symbol, twice too long: length match 3/6.
    assert task.reward(prompt, "c c c c c c") == pytest.approx(0.5)
    # One wrong symbol of three: 2/3.
    assert task.reward(prompt, "c b c") == pytest.approx(2 / 3)


def test_repeat_task_lengths_are_long_tailed():
    task = RepeatTask(max_count=48, num_symbols=6, context=TaskContext(seed=1))
    prompts = task.prompts()
    counts = [int(next(prompts).answer.split(":")[1]) for _ in range(4000)]
    median = statistics.median(counts)
    p95 = sorted(counts)[int(0.95 * len(counts))]
    assert median <= 8 and p95 >= 30, (median, p95)
