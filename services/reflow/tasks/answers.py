"""Final answers out of a model's text: the last `\\boxed{...}` (braces balanced,
as math models write it), or a fallback a task configures."""

from __future__ import annotations

import re
from typing import Literal

Fallback = Literal["none", "last_number"]

BOXED = "\\boxed"
# Integers, decimals and simple fractions, with an optional sign and thousands commas.
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")
# How far back an answer is looked for: a runaway response cannot make extraction slow.
MAX_SCAN_CHARS = 20_000


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` in `text`, or None."""
    text = text[-MAX_SCAN_CHARS:]
    start = text.rfind(BOXED)
    while start >= 0:
        i = start + len(BOXED)
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth, j = 0, i
            while j < len(text):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j].strip()
                j += 1
        start = text.rfind(BOXED, 0, start)
    return None


def last_number(text: str) -> str | None:
    found = NUMBER.findall(text[-MAX_SCAN_CHARS:])
    return found[-1].replace(",", "") if found else None


def extract_answer(text: str, fallback: Fallback = "last_number") -> str | None:
    """The final answer: the last boxed expression, else the fallback's pick."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if fallback == "last_number":
        return last_number(text)
    return None
