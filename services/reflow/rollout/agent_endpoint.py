"""An OpenAI-compatible chat-completions endpoint for one agent episode, served on
the rollout worker's event loop (the engine's loop too), on 127.0.0.1.

Transport only: HTTP/1.1 (h11 over asyncio streams, keep-alive, bounded
bodies), the API key, the request's schema, and the reply in OpenAI's shapes
(`chat.completion`, or `chat.completion.chunk` events when `stream` is set).
What a call does, and what the policy may sample, is the handler's
(reflow.rollout.agent_episode).

- `POST /v1/chat/completions`, `GET /v1/models`; anything else is 404.
- `Authorization: Bearer <key>` must carry the episode's key (401 otherwise,
  before the body is read). A body over `max_body_bytes` is 413.
- A malformed body is 400 with OpenAI's error object, whose `param` names the
  field (`messages[2].role`).
- `model` is ignored (every call reaches the policy being trained). The policy's
  sampling law is the job's: `temperature`, `top_p`, `seed`, penalties,
  `logit_bias` and `stop` are accepted and ignored (a stop string cut out of a
  completion could not be rendered back to the tokens that were sampled).
  `n` must be 1 and `top_logprobs` is not offered. `tools` reach the chat
  template; tool calls come back as the assistant's text.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11

logger = logging.getLogger(__name__)

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Message keys passed on to the chat template besides role and content.
PASSED_KEYS = ("name", "tool_call_id", "tool_calls")
MAX_MESSAGES = 4096
MAX_TOOLS = 256
MAX_CONNECTIONS = 16
MAX_HEADER_BYTES = 16384
READ_BYTES = 65536


class RequestError(Exception):
    """A call refused: its HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # None: as many as the handler allows.
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    model: str = ""


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    # (token text, logprob) of every completion token, when the request asked.
    token_logprobs: list[tuple[str, float]] | None = None


Handler = Callable[[ChatRequest], Awaitable[Completion]]


def _bad(param: str, message: str) -> RequestError:
    return RequestError(400, f"{param}: {message}", param=param)


def _content(value: Any, where: str) -> str | None:
    """A message's content as text: a string, null, or a list of text parts."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(where, "must be a string, null or a list of text parts")
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                part.get("text"), str):
            raise _bad(f"{where}[{j}]", "only {\"type\": \"text\", \"text\": ...} parts are served")
        texts.append(part["text"])
    return "".join(texts)


def _message(value: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(value, dict):
        raise _bad(where, "must be an object")
    role = value.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role", f"{str(role)[:32]!r} is not one of {', '.join(sorted(ROLES))}")
    content = _content(value.get("content"), f"{where}.content")
    if content is None and not (role == "assistant" and value.get("tool_calls")):
        raise _bad(f"{where}.content", "is required")
    # The developer role is the system role of newer models' APIs.
    message = {"role": "system" if role == "developer" else role, "content": content or ""}
    for key in PASSED_KEYS:
        if value.get(key) is not None:
            message[key] = value[key]
    return message


def _optional_int(data: dict[str, Any], name: str) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(name, f"{str(value)[:32]} is not a positive integer")
    return value


def _flag(data: dict[str, Any], name: str) -> bool:
    value = data.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _bad(name, "must be true or false")
    return value


def parse_chat_request(body: bytes) -> ChatRequest:
    """A chat-completions request from its JSON body; RequestError(400) naming the field."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise RequestError(400, "body: not a JSON document") from None
    if not isinstance(data, dict):
        raise RequestError(400, "body: must be a JSON object")
    messages = data.get("messages")
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_MESSAGES:
        raise _bad("messages", f"must be a list of 1 to {MAX_MESSAGES} messages")
    tools = data.get("tools")
    if tools is not None and not (isinstance(tools, list) and len(tools) <= MAX_TOOLS
                                  and all(isinstance(t, dict) for t in tools)):
        raise _bad("tools", f"must be a list of at most {MAX_TOOLS} objects")
    max_tokens = _optional_int(data, "max_completion_tokens") or _optional_int(data, "max_tokens")
    if data.get("n") not in (None, 1):
        raise _bad("n", "only one choice per call is served")
    if data.get("top_logprobs") not in (None, 0):
        raise _bad("top_logprobs", "not served; `logprobs: true` gives the sampled tokens'")
    options = data.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", "must be an object")
    model = data.get("model", "")
    if not isinstance(model, str):
        raise _bad("model", "must be a string")
    return ChatRequest(messages=[_message(m, i) for i, m in enumerate(messages)],
                       tools=tools or None, max_tokens=max_tokens, stream=_flag(data, "stream"),
                       include_usage=_flag(options, "include_usage"),
                       logprobs=_flag(data, "logprobs"), model=model[:256])


class AgentEndpoint:
    """One episode's endpoint: `start()` gives its base URL, `close()` ends every
    connection (a call in flight is cancelled)."""

    def __init__(self, handler: Handler, api_key: str, max_body_bytes: int,
                 model: str = "policy") -> None:
        self.handler = handler
        self._key = api_key.encode()
        self.max_body_bytes = max_body_bytes
        self.model = model
        self.base_url = ""
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self._closed = False

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}/v1"
        return self.base_url

    async def close(self) -> None:
        self._closed = True  # a connection accepted but not yet served is refused
        if self._server is None:
            return
        self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._closed or len(self._connections) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._connections.add(task)
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        try:
            while await self._exchange(conn, reader, writer):
                conn.start_next_cycle()
        except h11.RemoteProtocolError as err:
            await self._send_json(conn, writer, err.error_status_hint,
                                  RequestError(err.error_status_hint, f"bad HTTP: {err}").body())
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            # close() ended it. Not re-raised: this is the stream's own task, whose
            # done-callback reads task.exception(), which a cancelled task raises.
            pass
        finally:
            self._connections.discard(task)
            writer.close()

    async def _next_event(self, conn: h11.Connection, reader: asyncio.StreamReader):
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await reader.read(READ_BYTES))

    async def _exchange(self, conn: h11.Connection, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> bool:
        """One request and its reply; whether the connection may carry another."""
        request = await self._next_event(conn, reader)
        if not isinstance(request, h11.Request):
            return False
        try:
            self._authorise(request.headers)
            path = request.target.split(b"?", 1)[0]
            if request.method == b"POST" and path == b"/v1/chat/completions":
                call = parse_chat_request(await self._body(conn, reader, request))
                completion = await self.handler(call)
                if call.stream:
                    await self._send_stream(conn, writer, call, completion)
                else:
                    await self._send_json(conn, writer, 200, self._reply(call, completion))
            elif request.method == b"GET" and path == b"/v1/models":
                await self._body(conn, reader, request)
                await self._send_json(conn, writer, 200, {"object": "list", "data": [
                    {"id": self.model, "object": "model", "created": 0, "owned_by": "reflow"}]})
            else:
                raise RequestError(404, f"no route {request.method.decode('latin-1')} "
                                   f"{path.decode('latin-1')[:200]}", code="not_found")
        except RequestError as err:
            await self._send_json(conn, writer, err.status, err.body())
        except Exception:  # noqa: BLE001 - a handler's bug is one 500, not a dead endpoint
            logger.exception("agent endpoint: call failed")
            await self._send_json(conn, writer, 500, RequestError(
                500, "internal error", kind="server_error").body())
        return conn.our_state is h11.DONE and conn.their_state is h11.DONE

    def _authorise(self, headers) -> None:
        given = next((value for name, value in headers if name == b"authorization"), b"")
        scheme, _, key = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self._key):
            raise RequestError(401, "invalid API key", code="invalid_api_key",
                               kind="authentication_error")

    async def _body(self, conn: h11.Connection, reader: asyncio.StreamReader,
                    request: h11.Request) -> bytes:
        length = next((value for name, value in request.headers if name == b"content-length"),
                      b"0")
        too_large = RequestError(413, f"body: larger than {self.max_body_bytes} bytes",
                                 code="request_too_large")
        if int(length) > self.max_body_bytes:
            raise too_large
        body = bytearray()
        while True:
            event = await self._next_event(conn, reader)
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > self.max_body_bytes:
                    raise too_large
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            else:
                raise ConnectionResetError("the client left mid-request")

    def _reply(self, call: ChatRequest, completion: Completion) -> dict[str, Any]:
        return {**self._head(call, "chat.completion"), "choices": [{
            "index": 0, "message": {"role": "assistant", "content": completion.text},
            "finish_reason": completion.finish_reason,
            "logprobs": self._logprobs(completion) if call.logprobs else None}],
            "usage": self._usage(completion)}

    def _head(self, call: ChatRequest, kind: str) -> dict[str, Any]:
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": kind,
                "created": int(time.time()), "model": call.model or self.model}

    @staticmethod
    def _usage(completion: Completion) -> dict[str, int]:
        return {"prompt_tokens": completion.prompt_tokens,
                "completion_tokens": completion.completion_tokens,
                "total_tokens": completion.prompt_tokens + completion.completion_tokens}

    @staticmethod
    def _logprobs(completion: Completion) -> dict[str, Any]:
        return {"content": [{"token": token, "logprob": lp, "bytes": list(token.encode()),
                             "top_logprobs": []}
                            for token, lp in completion.token_logprobs or []]}

    async def _send_stream(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                           call: ChatRequest, completion: Completion) -> None:
        """The whole completion as server-sent events: the text, the finish, the
        usage if asked (the engine hands a completion over whole)."""
        head = self._head(call, "chat.completion.chunk")
        chunks = [
            {**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                        "content": completion.text},
                                  "logprobs": self._logprobs(completion) if call.logprobs
                                  else None, "finish_reason": None}]},
            {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                  "finish_reason": completion.finish_reason}]}]
        if call.include_usage:
            chunks.append({**head, "choices": [], "usage": self._usage(completion)})
        events = [h11.Response(status_code=200, headers=[("content-type", "text/event-stream"),
                                                         ("cache-control", "no-cache")])]
        events += [h11.Data(data=b"data: " + json.dumps(c).encode() + b"\n\n") for c in chunks]
        events += [h11.Data(data=b"data: [DONE]\n\n"), h11.EndOfMessage()]
        await self._send(conn, writer, events)

    async def _send_json(self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int,
                         payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
        if conn.their_state is not h11.DONE:
            headers.append(("connection", "close"))  # its body is left unread
        try:
            await self._send(conn, writer, [h11.Response(status_code=status, headers=headers),
                                            h11.Data(data=data), h11.EndOfMessage()])
        except h11.LocalProtocolError:
            pass  # no reply fits the connection's state: it is closed

    @staticmethod
    async def _send(conn: h11.Connection, writer: asyncio.StreamWriter, events) -> None:
        for event in events:
            writer.write(conn.send(event) or b"")
        await writer.drain()
