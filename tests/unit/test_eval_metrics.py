"""Held-out metrics from k samples per prompt: the pass@k estimator against hand
computations and its invariants, avg@k, maj@k's vote and tie rule, the tasks'
final answers, and the spec's `eval` section refusing what cannot work."""

from math import comb

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reflow.core.config import JobSpecError, parse_job_spec
from reflow.rollout.eval_metrics import PromptOutcome, majority_index, pass_at_k, summarize
from reflow.tasks.answers import canonical_answer
from reflow.tasks.base import AnswerTask, Prompt, TaskContext
from reflow.tasks.gym import ReasoningGymTask
from reflow.tasks.math import MathTask
from reflow.tasks.repeat import RepeatTask


def test_pass_at_k_matches_hand_computed_cases():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - comb(3, 2) / comb(5, 2))  # 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k: every draw of 3 holds a correct one
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - comb(7, 4) / comb(10, 4))
    # Large n: the product form stays exact where the binomials are huge integers.
    assert pass_at_k(200, 13, 100) == pytest.approx(1 - comb(187, 100) / comb(200, 100))


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="num_correct|k:"):
        pass_at_k(n, c, k)


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_a_probability_that_grows_with_k_and_with_c(case):
    n, c, k = case
    value = pass_at_k(n, c, k)
    assert 0.0 <= value <= 1.0
    assert value == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-9)
    if k < n:
        assert pass_at_k(n, c, k + 1) >= value - 1e-12
    if c < n:
        assert pass_at_k(n, c + 1, k) >= value - 1e-12
    # pass@1 is the share of correct samples.
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_majority_vote_ties_go_to_the_answer_given_first():
    assert majority_index(["7", "3", "3", "7"]) == 0  # 2-2: "7" came first
    assert majority_index(["3", "7", "7", "3"]) == 0
    assert majority_index([None, "5", "6", "6"]) == 2  # the winner's first sample
    assert majority_index(["1", None, "2", None, "2"]) == 2
    assert majority_index([None, None]) is None
    assert majority_index([]) is None


def test_summarize_averages_over_prompts():
    outcomes = [PromptOutcome(num_scored=4, num_correct=2, reward_sum=2.5, num_errors=0,
                              majority_correct=True),
                PromptOutcome(num_scored=3, num_correct=0, reward_sum=0.3, num_errors=1),
                PromptOutcome(num_scored=0, num_correct=0, reward_sum=0.0, num_errors=4)]
    m = summarize(outcomes, [1, 2, 4], voted=True)
    assert m["pass_at_1"] == pytest.approx((2 / 4 + 0 + 0) / 3)  # an error is no success
    assert m["pass_at_2"] == pytest.approx((1 - comb(2, 2) / comb(4, 2)) / 3)
    assert m["pass_at_4"] == pytest.approx(1 / 3)
    # avg@k: the prompts with a reward, each its mean (2.5/4 and 0.3/3).
    assert m["avg"] == pytest.approx((0.625 + 0.1) / 2)
    assert m["maj"] == pytest.approx(1 / 3)
    assert "maj" not in summarize(outcomes, [1], voted=False)
    with pytest.raises(ValueError, match="outcomes"):
        summarize([], [1], voted=False)


def test_canonical_answers_compare_equal_when_the_numbers_are():
    same = {canonical_answer(a) for a in ["0.5", "1/2", "\\frac{1}{2}", " $0.50$ ", "2/4"]}
    assert same == {"1/2"}
    assert canonical_answer("1,234.") == canonical_answer("1234") == "1234"
    assert canonical_answer("-\\dfrac{3}{6}") == "-1/2"
    assert canonical_answer("x + 1") == canonical_answer("x+1") == "x+1"
    assert canonical_answer("   ") is None


def test_tasks_with_final_answers_say_so(tmp_path):
    (tmp_path / "arith.jsonl").write_text('{"question": "1+1?", "answer": "2"}\n' * 20)
    math_task = MathTask(path="arith.jsonl", context=TaskContext(datasets_root=tmp_path))
    prompt = Prompt("e0", "1+1?", "2")
    assert isinstance(math_task, AnswerTask)
    assert math_task.final_answer(prompt, "so \\boxed{2.0}") == "2"
    assert math_task.final_answer(prompt, "it is 2") == "2"  # the last-number fallback
    assert math_task.final_answer(prompt, "no idea") is None
    gym = ReasoningGymTask(dataset="basic_arithmetic")
    assert gym.final_answer(prompt, "\\boxed{ 4 }") == "4"
    assert gym.final_answer(prompt, "4") is None  # no box, no vote
    repeat = RepeatTask()
    assert repeat.final_answer(prompt, " a  a\na ") == "a a a"
    assert repeat.final_answer(prompt, "") is None


def _eval(section):
    return parse_job_spec({"model": {"path": "/m"}, "eval": section}).eval


def test_the_eval_section_chooses_sampling_from_k():
    assert not _eval({}).sampled  # one greedy sample, as before k
    assert _eval({"k": 4}).sampled
    assert _eval({"temperature": 0.6}).sampled
    assert not _eval({"greedy": True}).sampled
    assert _eval({"k": 8, "pass_k": [2, 4], "greedy": False}).pass_k == [2, 4]


@pytest.mark.parametrize("section, field", [
    ({"k": 4, "greedy": True}, "eval.greedy: k > 1 needs sampling"),
    ({"greedy": True, "temperature": 0.5}, "eval.temperature: greedy"),
    ({"k": 4, "pass_k": [2, 5]}, "eval.pass_k: 5"),
    ({"k": 0}, "eval.k"),
    ({"k": 64, "num_prompts": 4096}, "eval.k: 4096 prompts x 64"),
    ({"temperature": 0.0}, "eval.temperature"),
    ({"correct_threshold": float("nan")}, "eval.correct_threshold"),
])
def test_eval_settings_that_cannot_work_name_their_field(section, field):
    with pytest.raises(JobSpecError, match=field.replace(".", r"\.").replace("[", r"\[")):
        _eval(section)


def _records():
    base = {"policy_version": 1, "reward_mean": 0.2, "trained_tokens": 10, "step_time_s": 1.0,
            "trainer_tokens_per_s": 10.0, "trainer_idle_ratio": 0.0, "rollout_idle_ratio": 0.0,
            "max_staleness": 0}
    records = [{**base, "step": s, "wall_time_s": float(s)} for s in (1, 2, 3)]
    records[0].update(eval_reward=0.1, eval_policy_version=0, eval_k=4, eval_pass_at_1=0.1,
                      eval_pass_at_k=0.3, eval_avg_at_k=0.1, eval_maj_at_k=0.2)
    records[2].update(eval_reward=0.4, eval_policy_version=2, eval_k=4, eval_pass_at_1=0.4,
                      eval_pass_at_k=0.7, eval_avg_at_k=0.4, eval_maj_at_k=0.5)
    return records


def test_the_summary_carries_the_last_evaluations_metrics():
    from reflow.report import summarize as run_summary

    s = run_summary(_records())
    assert (s["eval_k"], s["eval_pass_at_1_last"], s["eval_pass_at_k_last"]) == (4, 0.4, 0.7)
    assert (s["eval_avg_at_k_last"], s["eval_maj_at_k_last"]) == (0.4, 0.5)
    assert s["eval_reward_last"] == 0.4
    plain = _records()
    for r in plain:  # a task without answers: no maj@k, and none in the summary
        r.pop("eval_maj_at_k", None)
    assert "eval_maj_at_k_last" not in run_summary(plain)


def test_the_plot_draws_pass_and_maj_curves_beside_the_held_out_reward(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from reflow.report import plot

    closed = []
    monkeypatch.setattr(plt, "close", closed.append)
    plot(_records(), tmp_path / "report.png")
    labels = [t.get_text() for t in closed[0].axes[0].get_legend().get_texts()]
    assert labels == ["batch mean", "held-out (eval)", "held-out pass@1", "held-out pass@4",
                      "held-out maj@4"]
    assert (tmp_path / "report.png").stat().st_size > 0


@pytest.mark.parametrize("kwargs, field", [
    ({"num_prompts": 0}, "num_prompts"),
    ({"num_prompts": 4, "k": 2}, "greedy"),
    ({"num_prompts": 4, "greedy": False, "k": 300}, "k:"),
    ({"num_prompts": 4, "greedy": False, "temperature": -1.0}, "temperature"),
    ({"num_prompts": 4, "correct_threshold": float("nan")}, "correct_threshold"),
])
def test_a_worker_refuses_an_evaluation_request_naming_the_field(kwargs, field):
    from reflow.rollout.evaluation import EvalPlan

    with pytest.raises(ValueError, match=field):
        EvalPlan(**kwargs)
