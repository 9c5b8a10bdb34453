"""Chat scaffolding as token ids, for multi-turn episodes: the first prompt of an
episode, and the tokens that carry one observation from the end of a policy
turn to the start of the next.

An episode's sequence is built token-in/token-out (reflow.rollout.episode):
the policy's tokens stay exactly as sampled, and only what the chat template
puts around an observation is tokenized here. That continuation is found by
rendering a fixed dummy conversation to text with and without the observation
and taking what follows the dummy assistant content, so any template that
writes the assistant content verbatim works, the model's own included.

A tokenizer without a chat template gets `FALLBACK_TEMPLATE`, a minimal ChatML
(`<|im_start|>role\\ncontent<|im_end|>\\n`, tools listed in the system
message, tool results under the role `tool`). A template that cannot render a
`tool` message (some allow only user and assistant) has tool results rendered
as user messages instead.

This module knows nothing of engines, environments or rewards.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

# The dummy assistant turn the continuation is cut after. Plain ASCII with no
# whitespace at its ends, so templates that strip or trim content keep it whole.
TURN_MARK = "reflow-policy-turn-d41d8c"
DUMMY_USER = "Hello."

FALLBACK_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{%- set ns.system = ns.system + ('\n\n' if ns.system else '') + 'You may call these tools:\n"
    "<tools>\n' -%}"
    "{%- for tool in tools -%}{%- set ns.system = ns.system + (tool | tojson) + '\n' -%}"
    "{%- endfor -%}"
    "{%- set ns.system = ns.system + '</tools>\nTo call one, write <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call>.' -%}"
    "{%- endif -%}"
    "{%- if ns.system -%}{{- '<|im_start|>system\n' + ns.system + '<|im_end|>\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (loop.first and message['role'] == 'system') -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


class ChatRenderer:
    """Token ids of chat scaffolding for one model's tokenizer.

    `template_kwargs` reach the template on every render (e.g.
    `{"enable_thinking": False}` for Qwen3); `stop_token_ids` add to the
    tokenizer's EOS and the template's end-of-turn token, the tokens that end a
    policy turn (give the engine's, if it stops on more).
    """

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None,
                 stop_token_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.chat_template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_TEMPLATE
        self._tool_as_user = False
        stops = set(stop_token_ids or [])
        if tokenizer.eos_token_id is not None:
            stops.add(int(tokenizer.eos_token_id))
        self.end_of_turn_id = self._end_of_turn_id()
        if self.end_of_turn_id is not None:
            stops.add(self.end_of_turn_id)
        self.stop_token_ids = frozenset(stops)

    def prompt_ids(self, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The first prompt: `messages` rendered with a generation prompt."""
        return self._encode(self._render(messages, tools, add_generation_prompt=True))

    def continuation_ids(self, message: dict[str, Any], policy_stopped: bool) -> list[int]:
        """The tokens between the end of a policy turn and the start of the next:
        the end of the assistant turn, `message` in its role's scaffolding, and the
        next assistant header. If the policy ended its turn itself (its last token
        is a stop token, `ends_turn`), that token is not repeated: the policy's
        stop token stands for the template's."""
        ids = self._encode(self._suffix(message))
        if policy_stopped and ids and ids[0] in self.stop_token_ids:
            ids = ids[1:]
        return ids

    def ends_turn(self, token_ids: list[int]) -> bool:
        """Whether a turn's tokens end with a stop token (the policy closed its turn)."""
        return bool(token_ids) and token_ids[-1] in self.stop_token_ids

    def decode(self, token_ids: list[int]) -> str:
        """A turn's text as the environment reads it: special tokens left out."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                add_generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=False, **self.template_kwargs)
        if not isinstance(text, str):
            raise TypeError(f"chat template rendered {type(text).__name__}, not text")
        return text

    def _encode(self, text: str) -> list[int]:
        # The template writes any BOS it wants itself: no special tokens added.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _suffix(self, message: dict[str, Any]) -> str:
        """The rendered text after the dummy assistant content, `message` appended."""
        if message.get("role") == "tool" and self._tool_as_user:
            message = {**message, "role": "user"}
        dummy = [{"role": "user", "content": DUMMY_USER},
                 {"role": "assistant", "content": TURN_MARK}]
        try:
            text = self._render([*dummy, message], None, add_generation_prompt=True)
        except Exception as err:  # a template's own refusal (jinja raise_exception), any type
            if message.get("role") != "tool":
                raise ValueError(f"chat template cannot render a {message.get('role')!r} "
                                 f"message after an assistant turn: {err}") from err
            logger.warning("chat template cannot render a tool message (%s); tool results are "
                           "rendered as user messages", err)
            self._tool_as_user = True
            return self._suffix(message)
        at = text.find(TURN_MARK)
        if at < 0:
            raise ValueError("chat template does not write the assistant's content verbatim; "
                             "the observation scaffolding cannot be found")
        return text[at + len(TURN_MARK):]

    def _end_of_turn_id(self) -> int | None:
        """The token the template writes right after assistant content, if it is a
        special token (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`)."""
        ids = self._encode(self._suffix({"role": "user", "content": DUMMY_USER}))
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        special |= set(getattr(self.tokenizer, "added_tokens_decoder", {}) or {})
        return ids[0] if ids and ids[0] in special else None
