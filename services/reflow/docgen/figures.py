"""Measured figures in the docs cannot drift from the data that backs them.

A figure carries a marker right after it, no space between:
`2.96×<!-- fig bench/sim/modes_32gpus.json 32.reflow.throughput_tokens_per_s/32.sync.throughput_tokens_per_s .2f -->`
that is `<!-- fig PATH KEY [FORMAT] -->`: PATH a JSON file relative to the repository
root, committed to git (never a gitignored output such as bench/out/, nor a file
not yet committed); KEY a dotted path into it (list indices as numbers, a space
in a key written `%20`), or two such paths `A/B` for a ratio of committed values; FORMAT an optional Python
format spec (`,.0f`, `.2f`, `.0%`). Without FORMAT the number is compared at the
decimals it shows. The check:

- every marker in docs/**/*.md and README.md: the number before it equals the
  value, formatted; its file exists, is JSON, and is git's;
- on the benchmark pages (docs/benchmarks/*.md), a measured number (a number
  followed by a unit: ×, %, s, ms, tok/s, GB, ...) outside code and without a
  marker is an error: a figure typed by hand.

`python -m reflow.docgen.figures` checks the repository and prints each problem;
`--write`, after a benchmark was run again and its JSON committed, rewrites each
marked number from its JSON (the prose around it stays the author's to reread).
It knows the marker's grammar, not what any benchmark measures.
"""

from __future__ import annotations

import json
import re
import subprocess  # nosec B404 # git ls-files, an argv list, no shell
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

MARKER = re.compile(r"<!--\s*fig\s+(?P<path>\S+)\s+(?P<key>\S+)(?:\s+(?P<fmt>\S+))?\s*-->")
# The figure a marker closes: a number, then at most one space and a unit word.
_FIGURE = re.compile(r"(?P<number>[-+−]?\d[\d,]*(?:\.\d+)?)(?P<unit>\s?[^\s\d<>|*`]{1,12})?$")
# A measured number on a benchmark page: a number and a unit of time, rate, size
# or ratio. A word character right before (p50 ms) or after (200 steps) rules it out.
UNITS = ("×", "%", "ms", "µs", "s", "tok/s", "tokens/s", "samples/s", "exec/s",
         "executions/s", "GB", "GiB", "MB", "MiB", "KiB", "kB")
_MEASURED = re.compile(r"(?<![\w.])[-+−]?\d[\d,]*(?:\.\d+)?\s?(?:"
                       + "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
                       + r")(?![\w/])")
_FENCE = re.compile(r"^\s*(```|~~~)")
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


@dataclass(frozen=True)
class Problem:
    page: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.message}"


def git_files(root: Path) -> frozenset[str]:
    """Paths committed to git under `root` (its index)."""
    return _git_files(str(root.resolve()))


@lru_cache(maxsize=4)
def _git_files(root: str) -> frozenset[str]:
    # Committed files only: a figure's source must be in the repository (a JSON
    # written but not committed fails until it is).
    out = subprocess.run(["git", "ls-files", "--cached", "-z"],  # nosec B603 B607 # fixed argv
                         cwd=root, capture_output=True, check=True).stdout
    return frozenset(p for p in out.decode().split("\0") if p)


def lookup(data: Any, key: str) -> Any:
    """The value at dotted `key` (list indices as numbers), or the ratio `A/B`."""
    if "/" in key:
        top, bottom = key.split("/", 1)
        return float(lookup(data, top)) / float(lookup(data, bottom))
    node = data
    for part in key.replace("%20", " ").split("."):
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise KeyError(f"{key}: no item {part!r} in a list of {len(node)}")
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(f"{key}: no key {part!r}")
    return node


def expected_text(value: Any, shown: str, fmt: str | None) -> str:
    """`value` written as the page must show it: with `fmt`, or at the decimals of
    `shown` (thousands separators as `shown` uses them)."""
    if fmt:
        return format(value, fmt)
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    return format(float(value), f"{',' if ',' in shown else ''}.{decimals}f")


def check_marker(root: Path, before: str, path: str, key: str, fmt: str | None,
                 files: frozenset[str]) -> str | None:
    """The problem with one marker, given the text right before it; None if it holds."""
    figure = _FIGURE.search(before)
    if figure is None:
        return f"no number right before the marker for {path} {key}"
    target = (root / path).resolve()
    if not target.is_relative_to(root.resolve()):
        return f"{path} lies outside the repository"
    if not target.is_file():
        return f"{path} does not exist"
    if target.relative_to(root.resolve()).as_posix() not in files:
        return f"{path} is not kept by git (ignored or outside the tree): commit the JSON"
    try:
        value = lookup(_load(str(target)), key)
        want = expected_text(value, figure["number"].replace("−", "-"), fmt)
    except (KeyError, ValueError, TypeError, ZeroDivisionError) as err:
        return f"{path} {key}: {err}"
    shown = figure["number"].replace("−", "-")
    unit = (figure["unit"] or "").strip()
    if want not in (shown, shown + unit):
        return f"shows {shown}{unit}, but {path} {key} is {value!r} ({want})"
    return None


@lru_cache(maxsize=64)
def _load(path: str) -> Any:
    return json.loads(Path(path).read_text())


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = None
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            fenced = None if fenced == m.group(1) else (fenced or m.group(1))
            continue
        if fenced is None:
            yield n, line


def check_page(root: Path, page: str, text: str, measured: bool,
               files: frozenset[str] | None = None) -> list[Problem]:
    """Every marker on the page; with `measured`, every unmarked measured number
    too (a benchmark page)."""
    files = git_files(root) if files is None else files
    problems = []
    for n, line in _prose_lines(text):
        # Code spans blanked, not removed, so positions stay: `<!-- fig ... -->` in
        # backticks is an example, not a marker.
        line = _INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        for m in MARKER.finditer(line):
            message = check_marker(root, line[:m.start()], m["path"], m["key"], m["fmt"], files)
            if message:
                problems.append(Problem(page, n, message))
        if not measured:
            continue
        # What is left once marked figures, comments and code are out: hand-typed figures.
        rest = line
        for m in reversed(list(MARKER.finditer(line))):
            figure = _FIGURE.search(line[:m.start()])
            start = figure.start() if figure else m.start()
            rest = rest[:start] + " " + rest[m.end():]
        rest = _COMMENT.sub(" ", rest)
        for m in _MEASURED.finditer(rest):
            problems.append(Problem(page, n, f"measured number {m.group(0)!r} without a "
                                    "<!-- fig PATH KEY --> marker"))
    return problems


def rewrite_page(root: Path, text: str, files: frozenset[str]) -> tuple[str, int]:
    """`text` with every marked number that no longer matches its JSON written
    from it, and how many were; a marker whose JSON cannot be read is left."""
    fenced, changed, out = None, 0, []
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if m:
            fenced = None if fenced == m.group(1) else (fenced or m.group(1))
        elif fenced is None:
            # Right to left, so the positions of the markers not yet seen hold.
            for marker in reversed(list(MARKER.finditer(line))):
                before = line[:marker.start()]
                figure = _FIGURE.search(before)
                if figure is None or check_marker(root, before, marker["path"], marker["key"],
                                                  marker["fmt"], files) is None:
                    continue
                try:
                    value = lookup(_load(str((root / marker["path"]).resolve())),
                                   marker["key"])
                    want = expected_text(value, figure["number"].replace("−", "-"),
                                         marker["fmt"])
                except (KeyError, ValueError, TypeError, ZeroDivisionError, OSError):
                    continue
                line = line[:figure.start("number")] + want + line[figure.end("number"):]
                changed += 1
        out.append(line)
    return "\n".join(out), changed


def check_tree(root: Path) -> list[Problem]:
    """docs/**/*.md and README.md; docs/benchmarks/*.md also for unmarked figures."""
    root = root.resolve()
    pages = sorted((root / "docs").rglob("*.md")) + [root / "README.md"]
    benchmarks = root / "docs" / "benchmarks"
    problems = []
    for page in pages:
        if page.is_file():
            problems += check_page(root, str(page.relative_to(root)), page.read_text(),
                                   measured=page.parent == benchmarks)
    return problems


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[3]
    if "--write" in (sys.argv[1:] if argv is None else argv):
        files = git_files(root)
        for page in sorted((root / "docs").rglob("*.md")) + [root / "README.md"]:
            text, changed = rewrite_page(root, page.read_text(), files)
            if changed:
                page.write_text(text)
                print(f"{page.relative_to(root)}: {changed} figure(s) rewritten")
    problems = check_tree(root)
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
