"""Final answers out of a model's text: the last `\\boxed{...}` (braces balanced,
as math models write it), or a fallback a task configures."""

from __future__ import annotations

import re
from fractions import Fraction
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
    limit = len(text)
    start = text.rfind(BOXED)
    while start >= 0:
        i = start + len(BOXED)
        while i < limit and text[i] == " ":
            i += 1
        if i < limit and text[i] == "{":
            depth, j = 0, i
            while j < limit:
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1:j].strip()
                j += 1
            # Unclosed: an earlier `\boxed{` still open here is nested one deeper
            # from now on, so it cannot close past this point either. Scanning the
            # earlier ones only up to here keeps a text of many unclosed boxes linear.
            limit = start
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


# A number as written: integer, decimal or fraction (no exponent: its size is bounded).
PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,64}(?:\.\d{1,64})?|\.\d{1,64})(?:/\d{1,64})?")
THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
LATEX_FRACTION = re.compile(r"([-+]?)\\[dt]?frac\{(\d{1,64})\}\{(\d{1,64})\}")


def canonical_answer(answer: str) -> str | None:
    """An answer in a form that compares as a string, for voting (maj@k): math
    delimiters, spaces and a final full stop dropped, and a plain number, decimal,
    fraction or `\\frac{a}{b}` written as its exact reduced fraction ("0.5",
    "1/2" and "\\frac{1}{2}" all read "1/2"). Anything else is kept as written;
    math-verify's notion of equal (sympy) is finer, and too slow for every sample.
    None for an empty answer."""
    text = answer.strip()
    if len(text) >= 2 and text[0] == text[-1] == "$":
        text = text.strip("$")
    text = re.sub(r"\s+", "", text).rstrip(".")
    if THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    fraction = LATEX_FRACTION.fullmatch(text)
    if fraction:
        text = f"{fraction[1]}{fraction[2]}/{fraction[3]}"
    if PLAIN_NUMBER.fullmatch(text):
        try:
            return str(Fraction(text))
        except ZeroDivisionError:
            return text
    return text or None
