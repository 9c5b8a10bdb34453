"""The README stays a front page: short, the two commands for a fresh machine,
and links into the docs that lead somewhere (the manual itself is docs/)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 150
LINK = re.compile(r"\]\((?P<target>[^)#\s]+)(?:#[^)]*)?\)")


def test_the_readme_is_at_most_150_lines():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, (f"README.md has {len(lines)} lines (at most {MAX_LINES}): "
                                     "move the detail into a page under docs/")


def test_the_readme_gives_the_two_commands_and_the_makefile_has_them():
    text = README.read_text(encoding="utf-8")
    block = re.search(r"## Two commands\n.*?```bash\n(?P<body>.*?)```", text, re.S)
    assert block, "README.md lost its 'Two commands' section and its bash block"
    commands = [line.split("#")[0].strip() for line in block["body"].splitlines()]
    assert [c for c in commands if c] == ["make run", "make test"]
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make docs" in text and re.search(r"^docs:", makefile, re.M)


def test_the_readme_links_to_pages_that_exist():
    targets = [m["target"] for m in LINK.finditer(README.read_text(encoding="utf-8"))]
    local = [t for t in targets if "://" not in t]
    assert any(t.startswith("docs/") for t in local)
    # docs/reference/ is generated when the site is built, never committed.
    missing = [t for t in local if not t.startswith("docs/reference/")
               and not (REPO / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
