"""The agent endpoint and episode in-process: the OpenAI client against the
endpoint (its key, its schema errors, streaming), the agent registry, and the
token checks of an agent episode's calls against a scripted engine (the prefix
each call must extend, the stop token, the masks, the limits)."""

import asyncio
import json
import os
import sys
import threading

import httpx
import openai
import pytest

from reflow.core.config import parse_job_spec
from reflow.core.types import Segment
from reflow.rollout.agent_endpoint import AgentEndpoint, ChatRequest, Completion, RequestError
from reflow.rollout.agent_episode import AGENT_RETOKENIZED, AgentEpisode, reported_reward
from reflow.rollout.engine import SamplingSpec, TokenDelta
from reflow.tasks import check_task
from reflow.tasks.agent import (AGENTS_DIR_ENV, AgentProgram, registered_agents,
                                resolve_agent)
from reflow.tasks.chat import ChatRenderer
from tests.unit.chat_tokenizer import build_chat_tokenizer

TOKENIZER = build_chat_tokenizer()
RENDERER = ChatRenderer(TOKENIZER)
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
END_OF_TEXT = TOKENIZER.convert_tokens_to_ids("<|endoftext|>")
SAMPLING = SamplingSpec(max_tokens=24, temperature=1.0)
KEY = "episode-key"


class Scripted:
    """Generates `texts` in turn, each ended by `stop` (None: cut at max_tokens),
    in deltas of three tokens, logprob -0.01 * (position + 1)."""

    def __init__(self, texts, stop=IM_END):
        self.texts, self.stop = list(texts), stop
        self.requests = []

    def ids(self, k):
        text = self.texts[k]
        ids = text if isinstance(text, list) else TOKENIZER.encode(text, add_special_tokens=False)
        return ids + ([self.stop] if self.stop is not None else [])

    async def generate(self, request_id, prompt_ids, sampling):
        k = len(self.requests)
        self.requests.append((request_id, list(prompt_ids), sampling))
        ids = self.ids(k)[:sampling.max_tokens]
        cut = self.stop is None or ids[-1] != self.stop
        for start in range(0, len(ids), 3):
            part = ids[start:start + 3]
            await asyncio.sleep(0)
            last = start + 3 >= len(ids)
            yield TokenDelta(part, [-0.01 * (start + i + 1) for i in range(len(part))],
                             finished=last, finish_reason=("length" if cut else "stop")
                             if last else None)


def episode(engine, renderer=RENDERER, max_calls=4, max_episode_tokens=256,
            keep_sampled=False):
    return AgentEpisode(renderer, engine.generate, "g-0", SAMPLING, max_calls,
                        max_episode_tokens, lambda: 7, keep_sampled=keep_sampled)


def call(ep, messages, **kw):
    return asyncio.run(ep.complete(ChatRequest(messages=messages, **kw)))


FIRST = [{"role": "system", "content": "Solve it."},
         {"role": "user", "content": "A warehouse holds 12 boxes of 34 items each. How many?"}]


def test_each_call_extends_the_tokens_so_far_and_the_agents_additions_are_masked():
    engine = Scripted(["The answer is 408.", "The answer is \\boxed{408}."])
    ep = episode(engine)
    first = call(ep, FIRST, max_tokens=1000)
    assert (first.text, first.finish_reason) == ("The answer is 408.", "stop")
    messages = FIRST + [{"role": "assistant", "content": first.text},
                        {"role": "user", "content": "Box it."}]
    second = call(ep, messages)
    c0, c1 = engine.ids(0), engine.ids(1)
    assert ep.prompt_ids == RENDERER.prompt_ids(FIRST) == engine.requests[0][1]
    response = ep.sample.response_ids
    observation = response[len(c0):-len(c1)]
    assert response == c0 + observation + c1
    # The engine's second prompt is the first prompt plus everything so far, and all
    # of it is what the template renders for the whole conversation.
    assert engine.requests[1][1] == ep.prompt_ids + c0 + observation
    whole = RENDERER.prompt_ids(messages + [{"role": "assistant", "content": second.text}])
    assert ep.prompt_ids + response == whole[:len(ep.prompt_ids) + len(response)]
    assert TOKENIZER.decode(observation) == "\n<|im_start|>user\nBox it.<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert ep.mask == [1] * len(c0) + [0] * len(observation) + [1] * len(c1)
    assert ep.sample.logprobs == ([-0.01 * (i + 1) for i in range(len(c0))]
                                  + [0.0] * len(observation)
                                  + [-0.01 * (i + 1) for i in range(len(c1))])
    assert ep.sample.segments == [Segment(7, len(response))]
    # The agent's max_tokens is clamped to the job's; the job's sampling law stands.
    assert engine.requests[0][2] == SAMPLING
    assert (first.prompt_tokens, first.completion_tokens) == (len(ep.prompt_ids), len(c0))


def test_an_edited_history_is_refused_before_it_reaches_the_engine():
    engine = Scripted(["The answer is 408.", "unused"])
    ep = episode(engine)
    first = call(ep, FIRST)
    edited = FIRST + [{"role": "assistant", "content": first.text + " Surely."},
                      {"role": "user", "content": "Box it."}]
    with pytest.raises(RequestError) as err:
        call(ep, edited)
    assert (err.value.status, err.value.code, err.value.param) == (400, AGENT_RETOKENIZED,
                                                                   "messages")
    assert ep.error == AGENT_RETOKENIZED and ep.ended.is_set()
    assert len(engine.requests) == 1
    # A branch (the first call again) does not extend the sequence either.
    ep = episode(Scripted(["The answer is 408.", "unused"]))
    call(ep, FIRST)
    with pytest.raises(RequestError, match="differs at token"):
        call(ep, FIRST)


def test_text_sampled_as_other_tokens_is_refused_or_kept_as_sampled():
    # "The answer" sampled letter by letter: its text re-tokenizes as fewer tokens.
    letters = [TOKENIZER.convert_tokens_to_ids(c) for c in "The"] + TOKENIZER.encode(
        " answer is 408.", add_special_tokens=False)
    assert TOKENIZER.encode("The", add_special_tokens=False) != letters[:3]
    follow_up = [{"role": "user", "content": "Box it."}]
    ep = episode(Scripted([letters, "unused"]))
    first = call(ep, FIRST)
    with pytest.raises(RequestError):
        call(ep, FIRST + [{"role": "assistant", "content": first.text}, *follow_up])
    assert ep.error == AGENT_RETOKENIZED

    engine = Scripted([letters, "\\boxed{408}"])
    ep = episode(engine, keep_sampled=True)
    first = call(ep, FIRST)
    call(ep, FIRST + [{"role": "assistant", "content": first.text}, *follow_up])
    c0, c1 = engine.ids(0), engine.ids(1)
    observation = ep.sample.response_ids[len(c0):-len(c1)]
    assert ep.sample.response_ids == c0 + observation + c1  # the letters, as sampled
    assert engine.requests[1][1] == ep.prompt_ids + c0 + observation
    assert TOKENIZER.decode(observation) == "\n<|im_start|>user\nBox it.<|im_end|>\n" \
        "<|im_start|>assistant\n"
    assert ep.mask == [1] * len(c0) + [0] * len(observation) + [1] * len(c1)
    assert ep.num_kept == 1 and not ep.error
    # Another text is refused all the same.
    ep = episode(Scripted([letters, "unused"]), keep_sampled=True)
    call(ep, FIRST)
    with pytest.raises(RequestError):
        call(ep, FIRST + [{"role": "assistant", "content": "The answer is 409."}, *follow_up])


def test_a_template_that_renders_earlier_turns_differently_is_refused():
    # This template drops every assistant turn but the last from what it renders
    # (as reasoning templates drop earlier thinking): the second call cannot extend.
    from tests.unit.chat_tokenizer import CHAT_TEMPLATE

    forgetful = build_chat_tokenizer(CHAT_TEMPLATE.replace(
        "{%- elif not (loop.first", "{%- elif message['role'] == 'assistant' and "
        "message['content'].startswith('The') -%}{%- elif not (loop.first"))
    engine = Scripted(["The answer is 408.", "unused"])
    ep = episode(engine, renderer=ChatRenderer(forgetful))
    first = call(ep, FIRST)
    with pytest.raises(RequestError):
        call(ep, FIRST + [{"role": "assistant", "content": first.text},
                          {"role": "user", "content": "Box it."}])
    assert ep.error == AGENT_RETOKENIZED


def test_the_engines_own_stop_token_stands_for_the_templates_end_of_turn():
    # The engine stops on <|endoftext|>; the template closes turns with <|im_end|>.
    renderer = ChatRenderer(TOKENIZER, stop_token_ids=[END_OF_TEXT])
    engine = Scripted(["The answer is 408.", "\\boxed{408}"], stop=END_OF_TEXT)
    ep = episode(engine, renderer=renderer)
    first = call(ep, FIRST)
    call(ep, FIRST + [{"role": "assistant", "content": first.text},
                      {"role": "user", "content": "Box it."}])
    c0 = engine.ids(0)
    assert ep.sample.response_ids[:len(c0)] == c0  # ends in <|endoftext|>, as sampled
    observation = ep.sample.response_ids[len(c0):-len(engine.ids(1))]
    assert TOKENIZER.decode(observation).startswith("\n<|im_start|>user\nBox it.")


def test_a_completion_cut_at_its_length_is_closed_by_the_template_outside_the_loss():
    engine = Scripted(["The answer is 408, as 12 boxes of 34 items each hold 408 items.",
                       "\\boxed{408}"], stop=None)
    ep = episode(engine)
    first = call(ep, FIRST, max_tokens=5)
    assert first.finish_reason == "length" and first.completion_tokens == 5
    call(ep, FIRST + [{"role": "assistant", "content": first.text},
                      {"role": "user", "content": "Go on."}])
    observation = [t for t, m in zip(ep.sample.response_ids, ep.mask) if m == 0]
    assert observation[0] == IM_END  # the template's end of turn, not the policy's
    assert ep.mask[:5] == [1] * 5 and ep.mask[5] == 0


def test_calls_and_tokens_past_the_limits_end_the_episode_as_cut():
    engine = Scripted(["The answer is 408."] * 3)
    ep = episode(engine, max_calls=1)
    first = call(ep, FIRST)
    with pytest.raises(RequestError) as err:
        call(ep, FIRST + [{"role": "assistant", "content": first.text},
                          {"role": "user", "content": "Again."}])
    assert err.value.code == "max_calls" and ep.finish_reason == "length" and not ep.error
    assert len(engine.requests) == 1
    # The episode's token budget clamps each call and then refuses the next.
    engine = Scripted(["The answer is 408."] * 3, stop=None)
    ep = episode(engine, max_episode_tokens=4)
    first = call(ep, FIRST)
    assert engine.requests[0][2].max_tokens == 4 and first.completion_tokens == 4
    with pytest.raises(RequestError) as err:
        call(ep, FIRST + [{"role": "assistant", "content": first.text},
                          {"role": "user", "content": "Again."}])
    assert err.value.code == "max_episode_tokens"


def test_an_engine_failure_ends_the_episode_and_is_kept_for_the_worker():
    class Broken(Scripted):
        async def generate(self, request_id, prompt_ids, sampling):
            raise RuntimeError("engine died")
            yield

    ep = episode(Broken([]))
    with pytest.raises(RuntimeError, match="engine died"):
        call(ep, FIRST)
    assert isinstance(ep.engine_error, RuntimeError) and ep.ended.is_set()


def test_the_agents_reward_report_is_its_last_line():
    assert reported_reward(b"thinking\n{\"reward\": 0.5}\n\n").value == 0.5
    for bad in (b"", b"{\"reward\": \"high\"}", b"{\"reward\": 1}\nbye", b"[1]"):
        assert reported_reward(bad).error == "agent_no_reward"
    assert reported_reward(b"{\"reward\": NaN}").error == "non_finite"


# --- the endpoint, over HTTP -------------------------------------------------


@pytest.fixture
def endpoint():
    """An endpoint on an event loop of its own thread, as on a rollout worker;
    its handler answers every call with the last message's content reversed."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    calls = []

    async def handler(request):
        calls.append(request)
        return Completion(request.messages[-1]["content"][::-1], "stop", 10, 3,
                          [("a", -0.5), ("b", -0.25)])

    server = AgentEndpoint(handler, KEY, max_body_bytes=4096)
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(5)
    yield url, calls
    asyncio.run_coroutine_threadsafe(server.close(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_the_openai_client_calls_the_endpoint_plainly_and_streaming(endpoint):
    url, calls = endpoint
    client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
    reply = client.chat.completions.create(
        model="gpt-4o", messages=[{"role": "developer", "content": "Be brief."},
                                  {"role": "user", "content": [{"type": "text", "text": "olleh"}]}],
        temperature=0.2, stop=["\n"], max_completion_tokens=7, logprobs=True)
    assert reply.choices[0].message.content == "hello"
    assert reply.choices[0].finish_reason == "stop" and reply.usage.total_tokens == 13
    assert [t.logprob for t in reply.choices[0].logprobs.content] == [-0.5, -0.25]
    assert calls[0].messages[0] == {"role": "system", "content": "Be brief."}
    assert calls[0].max_tokens == 7
    chunks = list(client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "dlrow"}], stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "world"
    assert chunks[-1].usage.completion_tokens == 3
    assert [m.id for m in client.models.list()] == ["policy"]


def test_a_wrong_key_is_401_and_a_malformed_body_is_400_naming_the_field(endpoint):
    url, calls = endpoint
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="not-the-key", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}])
    post = lambda body, key=KEY: httpx.post(  # noqa: E731
        f"{url}/chat/completions", content=body, headers={"Authorization": f"Bearer {key}"})
    assert post(b"{}", key="wrong").status_code == 401
    assert httpx.post(f"{url}/chat/completions", content=b"{}").status_code == 401
    for body, param in [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ]:
        reply = post(json.dumps(body))
        assert reply.status_code == 400, body
        assert reply.json()["error"]["param"] == param
        assert reply.json()["error"]["message"].startswith(param)
    assert post(b"{not json").json()["error"]["message"].startswith("body")
    assert post(b"x" * 5000).status_code == 413
    assert httpx.get(f"{url}/admin", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert calls == []


# --- the registry ------------------------------------------------------------


def test_agents_are_registered_names_and_a_spec_cannot_name_a_path(tmp_path, monkeypatch):
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "solver.py").write_text("print('hi')\n")
    (agents / "_private.py").write_text("")
    outside = tmp_path / "outside.py"
    outside.write_text("")
    (agents / "escape.py").symlink_to(outside)
    monkeypatch.setenv(AGENTS_DIR_ENV, str(agents))
    assert sorted(registered_agents()) == ["solver"]
    assert resolve_agent("solver").argv[1:] == (str(agents / "solver.py"),)
    # What an isolated agent must see of its own code: its directory, or its package's.
    assert resolve_agent("solver").code_paths() == [str(agents)]
    module = AgentProgram("tool", (sys.executable, "-m", "json.tool"))
    assert module.code_paths() == [os.path.dirname(json.__file__)]
    assert AgentProgram("gone", (sys.executable, "-m", "no_such_module.x")).code_paths() == []
    for name in ("escape", "../outside", str(agents / "solver.py"), "nope"):
        with pytest.raises(ValueError) as err:
            resolve_agent(name)
        assert str(err.value).startswith("task.args.agent: unknown agent")
        assert "registered: solver" in str(err.value)
    # At submission: the scheduler's check names the field and the registered agents.
    data = tmp_path / "problems.jsonl"
    data.write_text(json.dumps({"question": "2 + 2?", "answer": "4"}) + "\n")
    spec = parse_job_spec({"model": {"path": "/m"}, "task": {"name": "agent", "args": {
        "agent": "nope", "path": str(data)}}})
    with pytest.raises(ValueError, match="task.args.agent: unknown agent 'nope'; "
                       "registered: solver"):
        check_task(spec, tmp_path)
    check_task(spec.model_copy(update={"task": spec.task.model_copy(update={"args": {
        "agent": "solver", "path": str(data)}})}), tmp_path)


def test_closing_mid_call_cancels_the_call_and_leaves_the_loop_clean():
    loop_errors, cancelled = [], []

    async def handler(request):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(request)
            raise

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx))
        server = AgentEndpoint(handler, KEY, max_body_bytes=4096)
        url = await server.start()
        async with httpx.AsyncClient() as client:
            pending = asyncio.create_task(client.post(
                f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "x"}]},
                headers={"Authorization": f"Bearer {KEY}"}))
            while not cancelled and not pending.done():
                await asyncio.sleep(0.01)
                if len(server._connections) == 1:
                    await asyncio.sleep(0.05)
                    await server.close()
            with pytest.raises(httpx.HTTPError):
                await pending
        await asyncio.sleep(0.05)

    asyncio.run(main())
    assert len(cancelled) == 1 and loop_errors == []
