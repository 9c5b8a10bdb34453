"""Multi-turn tasks: the calculator and its tool calls, the guessing game, the
episode seeds of EnvTask, and the chat scaffolding of ChatRenderer."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from reflow.rollout.episode import EpisodeLimits
from reflow.tasks.base import TaskContext
from reflow.tasks.calculator import (
    MAX_ABS_VALUE,
    CalculatorEnv,
    CalculatorError,
    CalculatorTask,
    ToolCall,
    calculate,
    evaluate,
    parse_tool_calls,
)
from reflow.tasks.chat import ChatRenderer
from reflow.tasks.env import episode_seed
from reflow.tasks.games import GuessNumberEnv, GuessNumberTask, parse_guess
from tests.unit.chat_tokenizer import build_chat_tokenizer


def tool_call(expression, name="calculator"):
    body = json.dumps({"name": name, "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


# -- the calculator -------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", 14), ("(2 + 3) * 4", 20), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 // 2", -4),
    ("7 % 3", 1), ("2 ** 10", 1024), ("2 ** -2", 0.25), ("-3 + +5", 2), ("--4", 4),
    ("sqrt(16)", 4.0), ("abs(-2.5)", 2.5), ("max(1, 5, 3)", 5), ("min(4, -1)", -1),
    ("round(3.14159, 2)", 3.14), ("round(2.5)", 2), ("floor(2.7) + ceil(2.1)", 5),
    ("1e3", 1000.0), ("1_000 * 3", 3000), ("  12 * 34  ", 408),
])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


def test_calculator_knows_pi_and_formats_results():
    assert evaluate("2 * pi") == pytest.approx(2 * math.pi)
    assert calculate("6 / 3") == "2"
    assert calculate("1 / 3") == "0.333333333333"
    assert calculate("0.1 + 0.2") == "0.3"
    assert calculate("12 * 34") == "408"


@pytest.mark.parametrize("expression", [
    "__import__('os').system('ls')", "x + 1", "(1).real", "math.sqrt(4)", "open('f')",
    "[1, 2]", "'text'", "lambda: 1", "True + 1", "1 if 1 else 2", "sqrt(x=4)", "f(1)",
    "1j", "1 < 2", "(lambda x: x)(1)", "sqrt(*[4])", "a := 1", "print(1)", "{}", "...",
    "", "1 +", "sqrt()", "max()", "round(1.5, 0.5)", "sqrt(-1)",
])
def test_calculator_refuses_anything_but_arithmetic(expression):
    with pytest.raises(CalculatorError):
        evaluate(expression)
    assert calculate(expression).startswith("error: ")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("expression", [
    "9**9**9", "10 ** 16", "2 ** 1001", "99999999999999999 * 99", "1e308 * 10",
    "1e999", "10 ** 15 * 10", "(-8) ** 0.5", "0.5 ** -60", "9 ** 9 ** 9 ** 9",
    "2 ** 2 ** 2 ** 2 ** 2", "(10 ** 15) ** 1000", "1e15 // 1e-15", "round(1, 99)",
])
def test_calculator_refuses_huge_or_unreal_results_without_computing_them(expression):
    result = calculate(expression)
    assert result.startswith("error: ")


@pytest.mark.parametrize("expression", ["1 / 0", "1 // 0", "1 % 0", "1 / (2 - 2)", "0 ** -1",
                                        "5.0 % 0.0"])
def test_division_by_zero_is_an_error_text(expression):
    assert calculate(expression) == "error: division by zero"


def test_long_or_large_expressions_are_refused():
    assert "longer than" in calculate("1+" * 150 + "1")
    assert "more than" in calculate("1+" * 40 + "1")  # 81 characters, over 64 nodes
    assert "longer than" in calculate("(" * 150 + "1" + ")" * 150)
    assert calculate("-" * 199 + "1").startswith("error: ")
    assert calculate("1" * 17).startswith("error: ")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_the_calculator_never_raises_on_any_text(text):
    assert isinstance(calculate(text), str)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="0123456789+-*/%().e ,", max_size=60))
def test_the_calculator_answers_arithmetic_noise_with_a_bounded_number_or_an_error(text):
    result = calculate(text)
    if not result.startswith("error: "):
        assert abs(float(result)) <= MAX_ABS_VALUE


# -- tool calls -----------------------------------------------------------------------


def test_tool_calls_parse_strictly():
    text = "Let me compute.\n" + tool_call("12 * 34")
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "12 * 34"})]
    # OpenAI-style arguments, a JSON string.
    as_string = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'
    assert parse_tool_calls(as_string + "</tool_call>")[0].arguments == {"expression": "1+1"}
    assert parse_tool_calls("The answer is \\boxed{3}.") == []
    two = parse_tool_calls(tool_call("1+1") + " and " + tool_call("2+2"))
    assert [c.arguments["expression"] for c in two] == ["1+1", "2+2"]


@pytest.mark.parametrize("text, error", [
    ("<tool_call>{calculator: 1+1}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>["calculator"]</tool_call>', '"name"'),
    ('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": "1+1"}</tool_call>', "JSON object"),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "without"),
    ("<tool_call>" + "[" * 600 + "]" * 600 + "</tool_call>", "longer than"),
    ("<tool_call>" + "[" * 400 + "]" * 400 + "</tool_call>", "name"),
])
def test_malformed_tool_calls_are_error_entries(text, error):
    (call,) = parse_tool_calls(text)
    assert error in call.error


def test_tool_calls_per_turn_are_bounded():
    calls = parse_tool_calls(tool_call("1") * 9)
    assert len(calls) == 5 and "more than 4" in calls[-1].error


def test_calculator_env_runs_tools_then_scores_the_final_answer_exactly():
    env = CalculatorEnv("What is 12 * 34?", 408)
    assert env.reset() == "What is 12 * 34?"
    step = env.step("I will use the tool.\n" + tool_call("12 * 34"))
    assert (step.observation, step.role, step.tool_calls, step.done) == ("408", "tool", 1, False)
    assert step.tool_seconds >= 0.0 and step.reward == 0.0
    assert env.step("<think>maybe \\boxed{1}</think>It is \\boxed{408}.").reward == 1.0
    final = env.step("So the total is 407.")
    assert (final.reward, final.done) == (0.0, True)
    assert env.step("\\boxed{408.0}").reward == 1.0
    assert CalculatorEnv("q", 1234).step("\\boxed{1,234}").reward == 1.0
    assert CalculatorEnv("q", 3).step("I do not know").reward == 0.0


@pytest.mark.parametrize("text, observation", [
    ("<tool_call>not json</tool_call>", "error: tool call is not JSON"),
    (tool_call("1+1", name="search"), "error: unknown tool 'search'"),
    ('<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
     'error: the calculator needs {"expression": "<text>"}'),
    (tool_call("1/0"), "error: division by zero"),
    (tool_call("open('x')"), "error: unknown function"),
])
def test_bad_tool_calls_get_an_error_observation_and_the_episode_goes_on(text, observation):
    step = CalculatorEnv("q", 2).step(text)
    assert step.observation.startswith(observation)
    assert step.role == "tool" and not step.done and step.reward == 0.0


def test_calculator_task_problems_are_seeded_and_exact():
    task = CalculatorTask(context=TaskContext(seed=5))
    stream = task.prompts()
    prompts = [next(stream) for _ in range(40)]
    assert prompts == [p for p, _ in zip(CalculatorTask(context=TaskContext(seed=5)).prompts(),
                                         range(40))]
    for prompt in prompts:
        env = task.environment(prompt)
        assert env.reset() == prompt.text
        assert env.answer == json.loads(prompt.answer)["result"]
        # The problem's own numbers, through the calculator, reach the exact answer.
        assert env.step(f"\\boxed{{{env.answer}}}").reward == 1.0
    assert task.tools[0]["function"]["name"] == "calculator"
    assert "\\boxed" in task.system_prompt and task.multi_turn


# -- the guessing game ----------------------------------------------------------------


@pytest.mark.parametrize("text, guess", [
    ("I guess 42", 42), ("\\boxed{17}", 17), ("between 1 and 100, maybe 60", 60),
    ("\\boxed{ 1,000 }", 1000), ("<think>99?</think> 12", 12), ("-3", -3), ("12.0", 12),
    ("\\boxed{42 apples} or 7", 42),
    ("no idea", None), ("\\boxed{x}", None), ("3.5", None), ("9" * 40, None),
])
def test_guesses_are_parsed_from_the_last_number_or_box(text, guess):
    assert parse_guess(text) == guess


def play(env, guesses):
    env.reset()
    steps = []
    for guess in guesses:
        steps.append(env.step(guess))
        if steps[-1].done:
            break
    return steps


def test_a_policy_that_guesses_badly_still_plays_every_turn():
    task = GuessNumberTask(max_number=100)
    prompt = next(task.prompts())
    for policy in (["I don't know"] * 20, ["\\boxed{0}"] * 20, ["101"] * 20):
        steps = play(task.environment(prompt), policy)
        assert len(steps) == task.args.max_turns >= 3
        assert all(not s.done for s in steps[:-1]) and steps[-1].done
        assert sum(s.reward for s in steps) == 0.0
        assert "\\boxed{50}" in steps[0].observation


def test_feedback_says_higher_or_lower():
    env = GuessNumberEnv(secret=37, max_number=100, max_turns=5, intro="go")
    steps = play(env, ["10", "90", "\\boxed{37}"])
    assert "higher" in steps[0].observation and "4 guesses left" in steps[0].observation
    assert "lower" in steps[1].observation
    assert steps[2].done and "Correct" in steps[2].observation and steps[2].info["solved"]


def test_rewards_favour_solving_and_solving_fast():
    T = 4
    slow = play(GuessNumberEnv(37, 100, T, "go"), ["10", "20", "30", "37"])
    assert [s.reward for s in slow] == pytest.approx([0.025, 0.025, 0.025, 0.025 + 0.225])
    fast = play(GuessNumberEnv(37, 100, T, "go"), ["37"])
    assert fast[0].reward == pytest.approx(0.9 + 0.1 / T)
    miss = play(GuessNumberEnv(37, 100, T, "go"), ["10", "20", "30", "40"])
    assert sum(s.reward for s in miss) == pytest.approx(0.1) and miss[-1].done
    assert "it was 37" in miss[-1].observation
    sloppy = play(GuessNumberEnv(37, 100, T, "go"), ["hmm", "20", "30", "37"])
    assert sum(s.reward for s in sloppy) == pytest.approx(0.075 + 0.225)
    assert 0.1 < sum(s.reward for s in slow) < sum(s.reward for s in fast) <= 1.0


def test_group_members_get_the_same_episode():
    task = GuessNumberTask(context=TaskContext(seed=1))
    prompt = next(task.prompts())
    a, b = task.environment(prompt), task.environment(prompt)
    assert a.reset() == b.reset() == prompt.text
    assert a.secret == b.secret == json.loads(prompt.answer)["secret"]


def test_eval_split_is_fixed_and_disjoint_from_training():
    task = GuessNumberTask(context=TaskContext(seed=9))
    other = GuessNumberTask(context=TaskContext(seed=10))
    assert task.eval_prompts(50) == task.eval_prompts(50) == other.eval_prompts(50)
    assert task.eval_prompts(3) == task.eval_prompts(50)[:3]
    stream = task.prompts()
    train = {episode_seed(next(stream)) for _ in range(500)}
    held_out = {episode_seed(p) for p in task.eval_prompts(200)}
    assert not train & held_out
    assert {p.prompt_id[0] for p in task.eval_prompts(5)} == {"e"}
    assert next(other.prompts()) != next(task.prompts())


def test_env_task_args_are_bounded_and_give_the_limits():
    args = GuessNumberTask.Args(max_number=50, max_turns=5, turn_timeout_s=2.0)
    task = GuessNumberTask(**args.model_dump(), context=TaskContext(seed=2))
    assert task.limits == EpisodeLimits(max_turns=5, max_episode_tokens=4096,
                                        turn_timeout_s=2.0, episode_timeout_s=600.0)
    for bad in ({"max_turns": 2}, {"max_number": 1}, {"turn_timeout_s": 0}, {"colour": "red"},
                {"max_episode_tokens": 0}):
        with pytest.raises(ValidationError):
            GuessNumberTask.Args(**bad)
    with pytest.raises(ValidationError):
        CalculatorTask(max_operand=5)
    assert all(f.description for f in GuessNumberTask.Args.model_fields.values())
    assert all(f.description for f in CalculatorTask.Args.model_fields.values())


def test_a_prompt_that_names_no_episode_is_refused():
    task = GuessNumberTask()
    prompt = next(task.prompts())
    with pytest.raises(ValueError, match="episode seed"):
        task.environment(type(prompt)(prompt_id="x", text="t", answer="42"))


# -- chat scaffolding -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return build_chat_tokenizer()


def full_ids(tokenizer, messages, tools=None):
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


CONVERSATION = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 12 * 34?"}]


def test_prompt_ids_are_the_templates_own(tokenizer):
    renderer = ChatRenderer(tokenizer)
    tools = CalculatorTask.tools
    assert renderer.prompt_ids(CONVERSATION, tools) == full_ids(tokenizer, CONVERSATION, tools)
    assert "calculator" in tokenizer.decode(renderer.prompt_ids(CONVERSATION, tools))


@pytest.mark.parametrize("role", ["user", "tool"])
@pytest.mark.parametrize("policy_stopped", [True, False])
def test_continuation_rebuilds_the_whole_conversation(tokenizer, role, policy_stopped):
    """Prompt + the policy's own tokens + the continuation is exactly the template's
    rendering of the longer conversation: token-in/token-out changes nothing."""
    renderer = ChatRenderer(tokenizer)
    turn = tool_call("12 * 34")
    policy = tokenizer.encode(turn, add_special_tokens=False)
    if policy_stopped:
        policy.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    assert renderer.ends_turn(policy) == policy_stopped
    observation = {"role": role, "content": "408"}
    ids = (renderer.prompt_ids(CONVERSATION) + policy
           + renderer.continuation_ids(observation, policy_stopped))
    longer = [*CONVERSATION, {"role": "assistant", "content": turn}, observation]
    assert ids == full_ids(tokenizer, longer)
    text = tokenizer.decode(renderer.continuation_ids(observation, policy_stopped))
    assert text.endswith("<|im_start|>assistant\n") and "408" in text
    assert text.startswith("<|im_end|>") != policy_stopped


def test_fallback_template_when_the_tokenizer_has_none():
    tokenizer = build_chat_tokenizer(chat_template=None)
    renderer = ChatRenderer(tokenizer)
    prompt = tokenizer.decode(renderer.prompt_ids(CONVERSATION, CalculatorTask.tools))
    assert prompt.startswith("<|im_start|>system\nBe brief.")
    assert '"name": "calculator"' in prompt and "<tool_call>" in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 12 * 34?<|im_end|>\n<|im_start|>assistant\n")
    tool = tokenizer.decode(renderer.continuation_ids({"role": "tool", "content": "408"}, True))
    assert tool == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    assert renderer.end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_a_template_without_a_tool_role_gets_tool_results_as_user_messages():
    template = ("{%- for m in messages -%}{%- if m['role'] == 'tool' -%}"
                "{{- raise_exception('roles must be user or assistant') -}}{%- endif -%}"
                "{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}"
                "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
                "{%- endif -%}")
    tokenizer = build_chat_tokenizer(chat_template=template)
    renderer = ChatRenderer(tokenizer)
    text = tokenizer.decode(renderer.continuation_ids({"role": "tool", "content": "7"}, False))
    assert text == "<|im_end|>\n<|im_start|>user\n7<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_assistant_content_is_refused():
    template = ("{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] | "
                "upper + '<|im_end|>\n' -}}{%- endfor -%}")
    with pytest.raises(ValueError, match="verbatim"):
        ChatRenderer(build_chat_tokenizer(chat_template=template))


def test_decode_leaves_special_tokens_out(tokenizer):
    renderer = ChatRenderer(tokenizer)
    ids = tokenizer.encode("\\boxed{408}<|im_end|>", add_special_tokens=False)
    assert renderer.decode(ids) == "\\boxed{408}"
    assert renderer.ends_turn(ids) and not renderer.ends_turn([]) and not renderer.ends_turn(ids[:1])
