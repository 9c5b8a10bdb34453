"""A small chat tokenizer built offline: byte-level BPE trained on a few
sentences, ChatML special tokens, and a Qwen-style chat template with tools
and a tool role (tool results as `<tool_response>` blocks in a user turn)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n\n' -}}{%- endif -%}"
    "{{- '# Tools\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\n</tools><|im_end|>\n' -}}"
    "{%- elif messages[0]['role'] == 'system' -%}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response>"
    "<|im_end|>\n' -}}"
    "{%- elif not (loop.first and message['role'] == 'system') -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

SENTENCES = [
    "I am thinking of an integer between 1 and 100. Guess it.",
    "The number is higher. The number is lower. Correct!",
    "A warehouse holds 12 boxes of 34 items each. How many items does it hold now?",
    ("<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12 * 34\"}}"
     "</tool_call>"),
    "The answer is \\boxed{408}. user assistant system tool_response",
]


def build_chat_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """The tokenizer, with `chat_template` (None: none at all)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(SENTENCES * 4, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=IM_END, pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START])
    wrapped.chat_template = chat_template
    return wrapped
