import torch

from reflow.core.types import Segment, Trajectory
from reflow.report import summarize
from reflow.trainer.loop import collate


def test_collate_aligns_logprobs_with_predicted_tokens():
    t1 = Trajectory("a", "g", [5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], [1, 1, 1], [Segment(0, 3)],
                    advantage=1.5)
    t2 = Trajectory("b", "g", [5], [7], [-0.5], [1], [Segment(0, 1)], advantage=-1.5)
    tb = collate([t1, t2], pad_id=0, device=torch.device("cpu"))
    assert tb.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert tb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    # Position j predicts token j+1: the first response token of t1 (7, at index 2)
    # is predicted from position 1.
    assert tb.loss_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    torch.testing.assert_close(tb.old_logprobs[0], torch.tensor([0.0, -0.1, -0.2, -0.3]))
    torch.testing.assert_close(tb.old_logprobs[1], torch.tensor([-0.5, 0.0, 0.0, 0.0]))
    assert tb.advantages.tolist() == [1.5, -1.5]


def test_summary_compares_first_and_last_windows():
    records = [
        {"step": i + 1, "policy_version": i + 1, "reward_mean": 0.1 if i < 10 else 0.6,
         "trained_tokens": 100, "step_time_s": 1.0, "trainer_tokens_per_s": 100.0,
         "trainer_idle_ratio": 0.1, "rollout_idle_ratio": 0.0, "max_staleness": 1,
         "wall_time_s": float(i + 1)}
        for i in range(30)
    ]
    s = summarize(records)
    assert s["steps"] == 30 and s["trained_tokens"] == 3000
    assert s["reward_gain"] == 0.5 or abs(s["reward_gain"] - 0.5) < 1e-9
