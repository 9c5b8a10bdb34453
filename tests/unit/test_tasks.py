"""The tasks registry and the built-in single-turn tasks: names and arguments
checked at the edge, datasets confined under their root with their columns
checked, held-out splits that stay put, answers extracted and scored."""

from __future__ import annotations

import json

import pytest

from reflow.core.config import JobSpecError, parse_job_spec
from reflow.tasks import Prompt, TaskContext, build_task, check_task
from reflow.tasks.answers import extract_answer, last_boxed
from reflow.tasks.gym import ReasoningGymTask
from reflow.tasks.math import MathTask


def _spec(task: dict):
    return parse_job_spec({"model": {"path": "m"}, "task": task})


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def datasets(tmp_path):
    root = tmp_path / "datasets"
    root.mkdir()
    _jsonl(root / "arith.jsonl", [{"question": f"What is {i} + {i}?", "answer": str(2 * i)}
                                  for i in range(40)])
    return root


def test_unknown_task_names_and_bad_arguments_are_refused_naming_the_field():
    with pytest.raises(JobSpecError, match="task.name: unknown task 'nope'"):
        _spec({"name": "nope"})
    with pytest.raises(JobSpecError, match="module paths are not accepted"):
        _spec({"name": "os:system"})
    with pytest.raises(JobSpecError, match="task.args.max_count"):
        _spec({"name": "repeat", "args": {"max_count": 0}})
    with pytest.raises(JobSpecError, match="task.args.colour: 'repeat' takes no such argument"):
        _spec({"name": "repeat", "args": {"colour": "red"}})
    with pytest.raises(JobSpecError, match="task.args.path"):
        _spec({"name": "math"})
    with pytest.raises(JobSpecError, match="task.args.dataset: no reasoning-gym generator"):
        _spec({"name": "reasoning_gym", "args": {"dataset": "no_such_generator"}})
    with pytest.raises(JobSpecError, match="task.args.config_json"):
        _spec({"name": "reasoning_gym", "args": {"dataset": "basic_arithmetic",
                                                 "config_json": "[1, 2"}})


def test_a_dataset_outside_the_datasets_root_or_missing_a_column_is_refused(datasets, tmp_path):
    outside = _jsonl(tmp_path / "outside.jsonl", [{"question": "q", "answer": "1"}])
    (datasets / "link.jsonl").symlink_to(outside)
    for path in (str(outside), "../outside.jsonl", "link.jsonl"):
        with pytest.raises(ValueError, match="task.args.path: .* outside the allowed root"):
            check_task(_spec({"name": "math", "args": {"path": path}}), datasets)
    with pytest.raises(ValueError, match="task.args.path: .* is not a file"):
        check_task(_spec({"name": "math", "args": {"path": "missing.jsonl"}}), datasets)
    with pytest.raises(ValueError, match="task.args.answer_column: row 0 has no column 'solution'"):
        check_task(_spec({"name": "math", "args": {"path": "arith.jsonl",
                                                   "answer_column": "solution"}}), datasets)
    (datasets / "bad.jsonl").write_text('{"question": "q", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match="task.args.path: line 2 is not JSON"):
        check_task(_spec({"name": "math", "args": {"path": "bad.jsonl"}}), datasets)
    (datasets / "nested.jsonl").write_text('{"question": {"a": 1}, "answer": "1"}\n')
    with pytest.raises(ValueError, match="task.args.prompt_column: row 0 holds an object"):
        check_task(_spec({"name": "math", "args": {"path": "nested.jsonl"}}), datasets)
    check_task(_spec({"name": "math", "args": {"path": "arith.jsonl"}}), datasets)


def test_parquet_datasets_read_their_named_columns(datasets):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"problem": ["1 + 1?", "2 + 3?"], "solution": ["2", "5"]}),
                   datasets / "tiny.parquet")
    spec = _spec({"name": "math", "args": {"path": "tiny.parquet", "prompt_column": "problem",
                                           "answer_column": "solution", "eval_fraction": 0.0}})
    check_task(spec, datasets)
    prompt = next(build_task(spec, datasets).prompts())
    assert prompt.text.split("\n")[0] in ("1 + 1?", "2 + 3?")
    bad = _spec({"name": "math", "args": {"path": "tiny.parquet"}})
    with pytest.raises(ValueError, match="task.args.prompt_column: no column 'question'"):
        check_task(bad, datasets)


def test_math_splits_are_disjoint_seeded_and_stable(datasets):
    spec = _spec({"name": "math", "args": {"path": "arith.jsonl", "eval_fraction": 0.25}})
    task = build_task(spec, datasets)
    held_out = task.eval_prompts(100)
    assert len(held_out) == 10 and held_out == build_task(spec, datasets).eval_prompts(100)
    stream = task.prompts()
    train = {next(stream).answer for _ in range(30)}
    assert len(train) == 30 and not train & {p.answer for p in held_out}
    # Same seed, same order: the dispatcher of a resumed job draws the same stream.
    first, again = build_task(spec, datasets).prompts(), build_task(spec, datasets).prompts()
    assert [next(first).prompt_id for _ in range(5)] == [next(again).prompt_id for _ in range(5)]
    messages = task.prompt_messages(held_out[0])
    assert messages[-1]["role"] == "user" and "\\boxed{}" in messages[-1]["content"]


def test_answers_come_from_the_last_balanced_box_or_the_fallback():
    assert last_boxed("so \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None
    assert extract_answer("the answer is 1,234.") == "1234"
    assert extract_answer("no digits here") is None
    assert extract_answer("it is 7", fallback="none") is None


def test_math_reward_checks_the_answer_with_math_verify(datasets):
    task = MathTask(path="arith.jsonl", context=TaskContext(datasets_root=datasets))
    prompt = Prompt("p0", "What is 1/4 + 1/4?", "\\frac{1}{2}")
    assert task.reward(prompt, "Adding: \\boxed{0.5}") == 1.0
    assert task.reward(prompt, "I think it is \\boxed{1/2}") == 1.0
    assert task.reward(prompt, "\\boxed{3}") == 0.0
    assert task.reward(prompt, "no answer") == 0.0
    assert task.reward(Prompt("p1", "3 + 4?", "7"), "3 + 4 = 7") == 1.0


def test_reasoning_gym_prompts_are_rebuilt_and_scored_by_the_generator():
    args = {"dataset": "basic_arithmetic", "config_json": '{"min_terms": 2, "max_terms": 2}',
            "size": 50, "eval_size": 5}
    spec = _spec({"name": "reasoning_gym", "args": args})
    check_task(spec)
    dispatcher_side, worker_side = build_task(spec), build_task(spec)
    prompt = next(dispatcher_side.prompts())
    split, index = prompt.answer.split(":")
    entry = worker_side._dataset(split)[int(index)]
    assert entry["question"] in prompt.text
    assert worker_side.reward(prompt, f"so \\boxed{{{entry['answer']}}}") == 1.0
    assert worker_side.reward(prompt, "\\boxed{nonsense}") == 0.0
    held_out = dispatcher_side.eval_prompts(5)
    assert len(held_out) == 5 and all(p.answer.startswith("eval:") for p in held_out)
    with pytest.raises(ValueError, match="beyond the train split"):
        worker_side.reward(Prompt("x", "q", "train:999"), "1")
    bad = _spec({"name": "reasoning_gym", "args": {**args, "config_json": '{"min_terms": -3}'}})
    with pytest.raises(ValueError, match="task.args.config_json: basic_arithmetic refuses"):
        check_task(bad)
    with pytest.raises(ValueError):
        ReasoningGymTask(dataset="basic_arithmetic", config_json='{"seed": 3}')
