"""Agent programs written against the `openai` client, run as processes by an
agent runner and by a rollout worker, against a scripted engine: what trains
(the engine's tokens and logprobs, the agent's additions masked), what is
refused (an edited history), what the agent sees of the worker's environment,
and an agent that hangs (killed with every process it started at the episode
timeout; the worker goes on). What an agent can reach of the host is
test_agent_isolation.py's."""

import asyncio
import json
import os
import textwrap
import time

import pytest

from reflow.core.config import parse_job_spec
from reflow.rollout.agent_episode import AgentRunner
from reflow.rollout.engine import SamplingSpec, TokenDelta
from reflow.rollout.multiturn import EpisodeRunner
from reflow.rollout.worker import RolloutWorker
from reflow.sandbox.isolate import SCRATCH_DIR
from reflow.tasks import build_task
from reflow.tasks.agent import AGENTS_DIR_ENV, AgentTask
from reflow.tasks.base import TaskContext
from reflow.tasks.chat import ChatRenderer
from reflow.tasks.rewards import RewardResult
from tests.unit.chat_tokenizer import build_chat_tokenizer
from tests.unit.fake_engines import PausableEngine

TOKENIZER = build_chat_tokenizer()
RENDERER = ChatRenderer(TOKENIZER)
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
SAMPLING = SamplingSpec(max_tokens=32, temperature=1.0)

# The agents, as an operator would install them in REFLOW_AGENTS_DIR.
AGENTS = {
    "check_twice": """
        import json, sys
        from openai import OpenAI
        given = json.load(sys.stdin)
        client = OpenAI()
        messages = given["messages"]
        first = client.chat.completions.create(model="any", messages=messages,
                                               temperature=0.0, max_tokens=1000)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Check it and box it."}]
        second = client.chat.completions.create(model="any", messages=messages)
        print(second.choices[0].message.content)
    """,
    "rewriter": """
        import json, sys
        import openai
        given = json.load(sys.stdin)
        client = openai.OpenAI()
        messages = given["messages"]
        first = client.chat.completions.create(model="any", messages=messages)
        messages += [{"role": "assistant", "content": "I know: \\\\boxed{408}"},
                     {"role": "user", "content": "Sure?"}]
        try:
            client.chat.completions.create(model="any", messages=messages)
        except openai.BadRequestError as err:
            print(err.code)
            sys.exit(3)
    """,
    "hang": """
        import json, subprocess, sys, time
        from openai import OpenAI
        given = json.load(sys.stdin)
        if "forever" in given["text"]:
            OpenAI().chat.completions.create(model="any", messages=given["messages"])
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", MARKER])
            time.sleep(600)
        reply = OpenAI().chat.completions.create(model="any", messages=given["messages"])
        print(reply.choices[0].message.content)
    """,
}


@pytest.fixture
def agents_dir(tmp_path, monkeypatch):
    directory = tmp_path / "agents"
    directory.mkdir()
    for name, source in AGENTS.items():
        source = textwrap.dedent(source).replace("MARKER", repr(f"{tmp_path}-child"))
        (directory / f"{name}.py").write_text(source)
    # What it saw goes back in its call (it can write nowhere the test could read).
    (directory / "reporter.py").write_text(textwrap.dedent("""
        import json, os, sys
        from openai import OpenAI
        given = json.load(sys.stdin)
        with open("note.txt", "w") as f:
            f.write("scratch")
        seen = {"env": dict(os.environ), "cwd": os.getcwd(), "given": given,
                "note": open(os.path.join(os.environ["HOME"], "note.txt")).read()}
        OpenAI().chat.completions.create(model="any", messages=[
            {"role": "user", "content": "SEEN " + json.dumps(seen)}])
        print("done")
        print(json.dumps({"reward": 0.75}))
    """))
    monkeypatch.setenv(AGENTS_DIR_ENV, str(directory))
    return directory


def dataset(tmp_path):
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [
        {"question": "A warehouse holds 12 boxes of 34 items each. How many items?",
         "answer": "408"},
        {"question": "Wait forever: how many items does it hold now?", "answer": "408"}]))
    return path


def task(tmp_path, agent, **args):
    return AgentTask(agent=agent, path=str(dataset(tmp_path)), eval_fraction=0.0,
                     context=TaskContext(datasets_root=tmp_path), **args)


class Scripted(PausableEngine):
    """Answers every call with `text` and <|im_end|>, logprob -0.1 per position."""

    def __init__(self, text="The answer is \\boxed{408}."):
        super().__init__()
        self.ids = TOKENIZER.encode(text, add_special_tokens=False) + [IM_END]
        self.requests = []

    async def generate(self, request_id, prompt_ids, sampling):
        self.requests.append((request_id, list(prompt_ids), sampling))
        ids = self.ids[:sampling.max_tokens]
        await asyncio.sleep(0)
        yield TokenDelta(ids, [-0.1 * (i + 1) for i in range(len(ids))], finished=True,
                         finish_reason="stop" if ids[-1] == IM_END else "length")


def boxed_408(prompt, text):
    return RewardResult(1.0 if "\\boxed{408}" in text else 0.0)


def reported(engine):
    """What an agent sent as `SEEN <json>` in its first call."""
    text = TOKENIZER.decode(engine.requests[0][1])
    return json.loads(text.split("SEEN ", 1)[1].split("<|im_end|>", 1)[0])


def play(runner, engine, prompt, version=5):
    return asyncio.run(runner.play(engine.generate, "g0-0", prompt, SAMPLING, lambda: version))


def test_an_openai_client_agent_trains_as_one_trajectory_of_the_engines_tokens(tmp_path,
                                                                              agents_dir):
    t = task(tmp_path, "check_twice")
    prompt = next(p for p in t.prompts() if "warehouse" in p.text)
    engine = Scripted()
    started = time.monotonic()
    result = play(AgentRunner(t, RENDERER, score=boxed_408), engine, prompt)
    print(f"two-call agent episode: {time.monotonic() - started:.2f}s")

    assert (result.reward_error, result.reward, result.num_turns) == ("", 1.0, 2)
    (_, first_prompt, first_sampling), (_, second_prompt, _) = engine.requests
    assert result.prompt_ids == first_prompt == RENDERER.prompt_ids(t.prompt_messages(prompt))
    c = engine.ids
    observation = result.response_ids[len(c):-len(c)]
    assert result.response_ids == c + observation + c
    assert second_prompt == result.prompt_ids + c + observation
    assert "Check it and box it." in TOKENIZER.decode(observation)
    assert result.loss_mask == [1] * len(c) + [0] * len(observation) + [1] * len(c)
    policy = [lp for lp, m in zip(result.logprobs, result.loss_mask) if m]
    assert policy == [-0.1 * (i + 1) for i in range(len(c))] * 2
    assert all(lp == 0.0 for lp, m in zip(result.logprobs, result.loss_mask) if not m)
    assert [(s.policy_version, s.num_tokens) for s in result.segments] == [
        (5, len(result.response_ids))]
    # The agent asked for temperature 0 and 1000 tokens: the job's law and limit stand.
    assert first_sampling == SAMPLING
    trajectories, results = AgentRunner(t, RENDERER, score=boxed_408).trajectories(
        "g0", [result, result])
    assert [tr.loss_mask for tr in trajectories] == [result.loss_mask] * 2
    assert trajectories[0].prompt_ids == result.prompt_ids


def test_an_agent_that_rewrites_an_earlier_answer_is_refused_not_trained(tmp_path, agents_dir):
    t = task(tmp_path, "rewriter")
    engine = Scripted()
    result = play(AgentRunner(t, RENDERER, score=boxed_408), engine, next(t.prompts()))
    assert result.reward_error == "agent_retokenized" and result.reward == 0.0
    assert len(engine.requests) == 1  # the edited call never reached the engine
    trajectories, _ = AgentRunner(t, RENDERER, score=boxed_408).trajectories("g", [result])
    assert trajectories[0].loss_mask == [0] * len(result.response_ids)


def test_the_agent_sees_no_worker_secret_and_may_report_its_own_reward(tmp_path, agents_dir,
                                                                        monkeypatch):
    monkeypatch.setenv("REFLOW_GRPC_CREDENTIAL", "worker-secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "cloud-secret")
    t = task(tmp_path, "reporter", reward_source="agent")
    prompt = next(t.prompts())
    engine = Scripted()
    result = play(AgentRunner(t, RENDERER), engine, prompt)
    assert (result.reward, result.reward_error) == (0.75, "")
    seen = reported(engine)
    env = seen["env"]
    assert "worker-secret" not in json.dumps(env) and "cloud-secret" not in json.dumps(env)
    assert set(env) - {"LC_CTYPE", "PWD"} == {
        "PATH", "LANG", "HOME", "TMPDIR", "OPENAI_BASE_URL", "OPENAI_API_KEY", "NO_PROXY",
        "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "MALLOC_ARENA_MAX", "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"}
    assert env["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")
    # A writable scratch directory of its own (a tmpfs in its view, not the host's).
    assert seen["cwd"] == env["HOME"] == env["TMPDIR"] == SCRATCH_DIR
    assert seen["note"] == "scratch"
    # The agent scoring itself is given the reference; one scored by the task is not.
    assert seen["given"]["answer"] == "408" and seen["given"]["text"] == prompt.text
    assert "answer" not in task(tmp_path, "reporter").agent_input(prompt)


def _alive(pid):
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def _processes_naming(text):
    """{pid: cmdline} of the host's live processes whose command line holds `text`."""
    found = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError, PermissionError):
            continue
        if entry.isdigit() and text in cmdline:
            found[int(entry)] = cmdline
    return found


def test_a_hanging_agent_is_killed_at_the_timeout_and_the_worker_goes_on(tmp_path,
                                                                        agents_dir):
    """Through a rollout worker, its task scored by math-verify in a reward pool
    (the worker's default for an agent task)."""
    spec = parse_job_spec({
        "model": {"path": "/m"},
        "task": {"name": "agent", "args": {"agent": "hang", "path": str(dataset(tmp_path)),
                                           "eval_fraction": 0.0, "episode_timeout_s": 2.0}},
        "rollout": {"group_size": 2, "max_tokens": 32}, "trainer": {"batch_size": 4}})
    t = build_task(spec)
    prompts = {("forever" in p.text): p for p, _ in zip(t.prompts(), range(4))}

    class Puts:
        trajectories = []

        def put(self, job_id, trajectories):
            self.trajectories += trajectories
            return len(trajectories)

    seen = {}  # every process of the agents' (bubblewrap, agent, its child) while they ran

    def wait_for(n, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while len(puts.trajectories) < n and time.monotonic() < deadline:
            seen.update(_processes_naming(str(tmp_path)))
            time.sleep(0.05)
        assert len(puts.trajectories) == n

    engine, puts = Scripted(), Puts()
    worker = RolloutWorker("j", spec, lambda: engine, t, puts, encode=None,
                           decode=TOKENIZER.decode, episodes=EpisodeRunner(t, RENDERER))
    assert isinstance(worker.episodes, AgentRunner)
    worker.start()
    worker.wait_ready(10)
    try:
        started = time.monotonic()
        assert worker.submit_group("hangs", prompts[True])
        wait_for(2)
        print(f"hanging group ended after {time.monotonic() - started:.2f}s")
        assert time.monotonic() - started >= 2.0
        assert [tr.reward_error for tr in puts.trajectories] == ["agent_timeout"] * 2
        assert all(set(tr.loss_mask) == {0} for tr in puts.trajectories)
        # The agents and the children they started are gone with them.
        children = [pid for pid, cmdline in seen.items() if "time.sleep(600)" in cmdline]
        assert len(children) == 2, seen
        assert not [pid for pid in seen if _alive(pid)]
        started = time.monotonic()
        assert worker.submit_group("answers", prompts[False])
        wait_for(4)
        print(f"answering group (math-verify in the reward pool): "
              f"{time.monotonic() - started:.2f}s")
        assert [tr.reward for tr in puts.trajectories[2:]] == [1.0, 1.0]
        assert worker.state == "running"
        assert worker.counters.reward_errors_total == {"agent_timeout": 2}
        assert worker.episodes.counters.episodes_total == 4
    finally:
        worker.stop()


@pytest.mark.slow
def test_smollm2_on_vllm_trains_through_its_own_chat_template(smollm2_model, tmp_path,
                                                              agents_dir):
    """The real engine and the example's model: every completion the agent got is
    in the trajectory as vLLM sampled it, with vLLM's logprobs, and each call's
    prompt to vLLM is the trajectory so far (SmolLM2's template renders earlier
    turns verbatim, so its completions round-trip)."""
    import threading

    from transformers import AutoTokenizer

    from reflow.rollout.vllm_engine import VllmEngine

    tokenizer = AutoTokenizer.from_pretrained(smollm2_model, local_files_only=True)
    renderer = ChatRenderer(tokenizer)
    engine = VllmEngine(smollm2_model, kv_cache_gb=1, max_model_len=1024)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    calls = []

    async def generate(request_id, prompt_ids, sampling):
        tokens, logprobs = [], []
        async for delta in engine.generate(request_id, prompt_ids, sampling):
            tokens += delta.token_ids
            logprobs += delta.logprobs
            yield delta
        calls.append((request_id, list(prompt_ids), tokens, logprobs))

    t = task(tmp_path, "check_twice")
    runner = AgentRunner(t, renderer, score=boxed_408)
    prompt = next(p for p in t.prompts() if "warehouse" in p.text)
    try:
        results = [asyncio.run_coroutine_threadsafe(runner.play(
            generate, f"g-{i}", prompt, SamplingSpec(max_tokens=48, seed=i), lambda: 0),
            loop).result(300) for i in range(4)]
    finally:
        async def shutdown():  # on the loop its output handler lives on, as the worker does
            engine.shutdown()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
    trained = [(i, r) for i, r in enumerate(results) if not r.reward_error]
    print(f"smollm2 episodes: {len(trained)} of {len(results)} trained, rewards "
          f"{[r.reward for r in results]}, errors {[r.reward_error for r in results]}")
    assert trained and all(r.reward_error == "agent_retokenized" for r in results
                           if r.reward_error)
    for i, result in trained:
        mine = [c for c in calls if c[0].startswith(f"g-{i}-")]
        assert len(mine) == 2 and result.num_turns == 2
        sequence = result.prompt_ids + result.response_ids
        for _, prompt_ids, tokens, logprobs in mine:
            # The engine's prompt is the trajectory so far; its tokens follow, trained.
            assert sequence[:len(prompt_ids)] == prompt_ids
            at = len(prompt_ids) - len(result.prompt_ids)
            assert result.response_ids[at:at + len(tokens)] == tokens
            assert result.logprobs[at:at + len(tokens)] == logprobs
            assert result.loss_mask[at:at + len(tokens)] == [1] * len(tokens)
        assert sum(result.loss_mask) == sum(len(c[2]) for c in mine)
        assert "Check it and box it." in tokenizer.decode(
            [tok for tok, m in zip(result.response_ids, result.loss_mask) if not m])
