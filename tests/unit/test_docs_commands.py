"""Shell commands in the docs (docs/**/*.md and README.md) keep working.

Every fenced shell block carries a marker on the line before its fence:
`<!-- runnable -->` (cheap: run here from the repository root, .venv/bin first on
PATH, and expected to exit 0), `<!-- covered-by tests/PATH.py::test_name -->`
(expensive: that test must exist, and its file must name what the command names),
or `<!-- not-run: reason -->` (illustrative: a cluster, a whole training run). A
block without one fails, so a new command is either run, tied to a test, or
explicitly left out. Output and synopses go in `text` blocks, which are not read.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", "zsh", "shell-session"}
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>runnable|covered-by|not-run)\b(?P<rest>.*?)-->\s*$")
# Commands a docs page may name in a covered-by block without its test naming them.
SNAKE_CASE = re.compile(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b")
FILE_NAME = re.compile(r"^[\w./-]*\.(?:yaml|yml|json|jsonl|py|toml|parquet)$")
RUN_TIMEOUT_S = 60


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    marker: str | None  # runnable, covered-by, not-run, or None
    argument: str  # the marker's text after its kind

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO) if self.path.is_relative_to(REPO) else self.path}:{self.line}"


def doc_pages(root: Path = REPO) -> list[Path]:
    """The committed Markdown the docs consist of: README.md and docs/ (generated
    reference pages are not on disk)."""
    pages = [root / "README.md"] if (root / "README.md").exists() else []
    return pages + sorted((root / "docs").rglob("*.md"))


def shell_blocks(path: Path) -> list[Block]:
    """Every fenced block of a shell language in one page, with its marker."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, lang = opening["fence"], opening["lang"].lower()
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if lang in SHELL_LANGUAGES:
            body = "\n".join(line[len(opening["indent"]):] for line in lines[i + 1:end])
            before = MARKER.match(lines[i - 1]) if i > 0 else None
            blocks.append(Block(path, i + 1, lang, body, before["kind"] if before else None,
                                before["rest"].strip().lstrip(":").strip() if before else ""))
        i = end + 1
    return blocks


def marker_problems(block: Block) -> list[str]:
    """What is wrong with a block's marker, without running anything."""
    if block.marker is None:
        return [f"{block.where}: a {block.lang} block without a marker on the line before "
                "its fence (<!-- runnable -->, <!-- covered-by tests/...::test_name -->, "
                "<!-- not-run: reason -->)"]
    if block.marker == "not-run" and not block.argument:
        return [f"{block.where}: <!-- not-run: ... --> needs its reason"]
    if block.marker == "covered-by":
        return covered_problems(block)
    if block.marker == "runnable" and block.argument:
        return [f"{block.where}: <!-- runnable --> takes no argument, got {block.argument!r}"]
    return []


def named_things(command: str) -> set[str]:
    """What a command names that its covering test must name too: its files (by
    base name) and its snake_case identifiers (generators, fields, examples)."""
    words: set[str] = set()
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError:
        tokens = command.split()
    for token in tokens:
        if FILE_NAME.match(token):
            words.add(token.rsplit("/", 1)[-1])
    words.update(SNAKE_CASE.findall(re.sub(r"#.*", "", command)))
    return words


def covered_problems(block: Block, root: Path = REPO) -> list[str]:
    target = block.argument
    path_text, sep, test_name = target.partition("::")
    if not sep or not path_text.startswith("tests/") or not test_name:
        return [f"{block.where}: covered-by wants tests/PATH.py::test_name, got {target!r}"]
    test_file = root / path_text
    if not test_file.is_file():
        return [f"{block.where}: covered-by names {path_text}, which does not exist"]
    source = test_file.read_text(encoding="utf-8")
    names = {node.name for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    if test_name not in names:
        return [f"{block.where}: {path_text} has no test {test_name}"]
    missing = sorted(word for word in named_things(block.body) if word not in source)
    if missing:
        return [f"{block.where}: {target} does not run what the block runs: its file never "
                f"names {', '.join(missing)}"]
    return []


def all_blocks() -> list[Block]:
    return [block for page in doc_pages() for block in shell_blocks(page)]


def test_every_shell_block_in_the_docs_is_marked_and_its_marker_holds():
    blocks = all_blocks()
    assert blocks, "no shell block found in README.md and docs/"
    problems = [problem for block in blocks for problem in marker_problems(block)]
    assert not problems, "\n".join(problems)


RUNNABLE = [block for block in all_blocks() if block.marker == "runnable"]


@pytest.mark.parametrize("block", RUNNABLE, ids=[block.where for block in RUNNABLE])
def test_a_runnable_block_runs_from_the_repository_root(block):
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    run = subprocess.run(["bash", "-eo", "pipefail", "-c", block.body], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert run.returncode == 0, (f"{block.where} exited {run.returncode}:\n{block.body}\n"
                                 f"--- stdout\n{run.stdout[-2000:]}\n--- stderr\n"
                                 f"{run.stderr[-2000:]}")


# The checker itself, on pages written for the purpose.

def _page(tmp_path: Path, text: str) -> list[Block]:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return shell_blocks(page)


def test_an_unmarked_or_misplaced_marker_is_reported(tmp_path):
    blocks = _page(tmp_path, "intro\n\n```bash\nreflow --help\n```\n\n<!-- runnable -->\n\n"
                   "```sh\nreflow --help\n```\n\n```text\nnot a command\n```\n")
    assert [block.line for block in blocks] == [3, 9]  # the text block is not a shell block
    assert all(block.marker is None for block in blocks)
    assert all("without a marker" in marker_problems(block)[0] for block in blocks)


def test_markers_are_read_with_their_arguments(tmp_path):
    blocks = _page(tmp_path, "<!-- runnable -->\n```bash\nreflow --help\n```\n"
                   "<!-- not-run: needs a cluster -->\n```bash\nkubectl get pods\n```\n"
                   "<!-- not-run -->\n```bash\nhelm list\n```\n"
                   "- a list item:\n\n  <!-- runnable -->\n  ```bash\n  reflow --help\n  ```\n")
    assert [(block.marker, block.argument) for block in blocks] == [
        ("runnable", ""), ("not-run", "needs a cluster"), ("not-run", ""), ("runnable", "")]
    assert blocks[3].body == "reflow --help"
    assert [bool(marker_problems(block)) for block in blocks] == [False, False, True, False]


def test_covered_by_needs_an_existing_test_whose_file_names_the_command(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        'def test_runs_it():\n    run(["reflow", "run", "examples/math.yaml", '
        '"rollout.max_tokens=8"])\n', encoding="utf-8")

    def problems(target: str, command: str) -> list[str]:
        block = Block(tmp_path / "page.md", 1, "bash", command, "covered-by", target)
        return covered_problems(block, root=tmp_path)

    assert problems("tests/test_x.py::test_runs_it",
                    "reflow run examples/math.yaml rollout.max_tokens=64") == []
    assert "has no test" in problems("tests/test_x.py::test_gone", "reflow run x.yaml")[0]
    assert "does not exist" in problems("tests/test_y.py::test_runs_it", "reflow --help")[0]
    assert "wants tests/PATH.py" in problems("test_runs_it", "reflow --help")[0]
    missing = problems("tests/test_x.py::test_runs_it",
                       "reflow run examples/guess_number.yaml trainer.num_steps=2")[0]
    assert "guess_number.yaml" in missing and "num_steps" in missing
