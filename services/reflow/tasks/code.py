"""What the code tasks (python_tool, code_tests, coding_agent) share: the
program a turn submits, the text a sandbox run becomes for a model to read,
and the sandbox limits a task's arguments set. The unit-test judge is
reflow.tasks.judge.

A turn is hostile text: only its last closed ```python block is taken, from a
bounded tail of the turn, and a block past MAX_CODE_CHARS is refused. Program
output is shown bounded (stdout's head, stderr's tail, where a traceback
ends) and plain: control characters dropped and chat-template markers broken.

This module knows nothing of datasets, prompts, rewards or how the sandbox
isolates a program (reflow.sandbox).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from reflow.sandbox.types import OK, ExecLimits, ExecResult

MAX_CODE_CHARS = 32_000
MAX_SCAN_CHARS = 100_000
# What an observation shows of a program's output.
MAX_OUTPUT_CHARS = 2_000
_FENCE = re.compile(r"^ {0,3}(`{3,})[ \t]*([A-Za-z0-9_+-]*)[^\n`]*$")
PYTHON_FENCES = frozenset({"python", "py", "python3"})


@dataclass(frozen=True)
class CodeBlock:
    """The code a turn submits; `error` says why there is none to run."""

    code: str = ""
    error: str = ""


def extract_code(text: str) -> CodeBlock | None:
    """The last closed ```python block of `text`; None when it has none (an
    unclosed block is not code: the turn was cut or is prose)."""
    lines = text[-MAX_SCAN_CHARS:].split("\n")
    found: tuple[int, int] | None = None
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        ticks = len(opening.group(1))
        end = next((j for j in range(i + 1, len(lines))
                    if re.fullmatch(r" {0,3}`{%d,}[ \t]*" % ticks, lines[j])), None)
        if end is None:
            break
        if opening.group(2).lower() in PYTHON_FENCES:
            found = (i + 1, end)
        i = end + 1
    if found is None:
        return None
    code = "\n".join(lines[found[0]:found[1]])
    if len(code) > MAX_CODE_CHARS:
        return CodeBlock(error=f"the code block is longer than {MAX_CODE_CHARS} characters")
    if not code.strip():
        return CodeBlock(error="the code block is empty")
    return CodeBlock(code=code)


def plain_text(text: str) -> str:
    """Program output made safe to show a model: control characters dropped and
    chat-template markers (`<|im_end|>`, DeepSeek's `<｜...｜>`) broken, so a
    program cannot print a fake turn into the conversation."""
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", "", text)
    return (text.replace("<|", "< |").replace("|>", "| >")
            .replace("<\uff5c", "< \uff5c").replace("\uff5c>", "\uff5c >"))


def clip(text: str, max_chars: int, keep: str = "head") -> str:
    if len(text) <= max_chars:
        return text
    cut = len(text) - max_chars
    if keep == "tail":
        return f"[... {cut} characters cut]\n{text[-max_chars:]}"
    return f"{text[:max_chars]}\n[... {cut} characters cut]"


STATUS_TEXT = {
    "timeout": "the program ran past its time limit and was stopped",
    "memory": "the program ran out of memory",
    "output_limit": "the program wrote too much output and was stopped",
}


def execution_text(result: ExecResult, max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """What a model reads of one run: stdout (its head), stderr (its tail: a
    traceback ends there) and how the run ended, bounded and plain."""
    parts = []
    if result.stdout.strip():
        parts.append(clip(plain_text(result.stdout.rstrip()), max_chars))
    if result.stderr.strip():
        parts.append("stderr:\n" + clip(plain_text(result.stderr.rstrip()), max_chars, "tail"))
    if result.status in STATUS_TEXT:
        parts.append(f"({STATUS_TEXT[result.status]})")
    elif result.status != OK and not result.stderr:
        parts.append(f"(exit status {result.exit_code})")
    return "\n".join(parts) if parts else "(no output)"


class SandboxArgs(BaseModel):
    """The limits of one program run, as flat task arguments (a spec's plug-in
    arguments are scalars); `exec_limits` gives them as the sandbox takes them."""

    model_config = ConfigDict(extra="forbid")

    exec_wall_s: float = Field(default=5.0, gt=0.0, le=120.0,
                               description="Wall-clock seconds one program run may take.")
    exec_cpu_s: float = Field(default=5.0, gt=0.0, le=120.0,
                              description="CPU seconds one program run may use.")
    exec_memory_bytes: int = Field(default=512 * 2**20, ge=64 * 2**20, le=8 * 2**30,
                                   description="Address space of a program run.")
    exec_max_processes: int = Field(default=16, ge=4, le=256,
                                    description="Processes and threads a run may hold at once.")
    exec_max_output_bytes: int = Field(default=256 * 1024, ge=16 * 1024, le=16 * 2**20,
                                       description="stdout and stderr of a run are cut here.")

    @property
    def exec_limits(self) -> ExecLimits:
        return ExecLimits(wall_s=self.exec_wall_s, cpu_s=self.exec_cpu_s,
                          memory_bytes=self.exec_memory_bytes,
                          max_processes=self.exec_max_processes,
                          max_output_bytes=self.exec_max_output_bytes)
