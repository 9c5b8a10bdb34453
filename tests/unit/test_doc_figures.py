"""Measured figures in the docs (reflow.docgen.figures): every marked number equals
the committed JSON it names, and a benchmark page holds no figure typed by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reflow.docgen import figures

REPO = Path(__file__).resolve().parents[2]
BENCH_PAGES = sorted((REPO / "docs" / "benchmarks").glob("*.md"))
MODES_32 = "bench/sim/modes_32gpus.json"


def test_every_figure_in_the_docs_matches_its_json():
    problems = figures.check_tree(REPO)
    assert not problems, "\n".join(map(str, problems))


def test_the_benchmark_pages_carry_marked_figures():
    assert {p.name for p in BENCH_PAGES} >= {"index.md", "modes.md", "replay.md", "sandbox.md",
                                             "security-cost.md"}
    for page in BENCH_PAGES:
        assert figures.MARKER.search(page.read_text()), f"{page.name} has no marked figure"


def _first_figure(text: str) -> re.Match:
    return re.search(r"(\d[\d,]*\.\d+)(<!-- fig )", text)


def test_a_hand_edited_figure_fails(tmp_path):
    page = tmp_path / "modes.md"
    page.write_text((REPO / "docs" / "benchmarks" / "modes.md").read_text())
    text = page.read_text()
    assert figures.check_page(REPO, "modes.md", text, measured=True) == []
    m = _first_figure(text)
    edited = text[:m.start(1)] + m.group(1)[:-1] + str((int(m.group(1)[-1]) + 1) % 10) \
        + text[m.end(1):]
    page.write_text(edited)
    problems = figures.check_page(REPO, "modes.md", page.read_text(), measured=True)
    assert len(problems) == 1 and "but bench/" in problems[0].message


def test_a_figure_without_a_marker_fails_on_a_benchmark_page_only():
    text = "reflow is 3.03× sync here, idle 24 % of a 0.42 s step at 15 tok/s, using 2 GiB.\n"
    problems = figures.check_page(REPO, "docs/benchmarks/x.md", text, measured=True)
    assert [p.message.split("'")[1] for p in problems] == ["3.03×", "24 %", "0.42 s",
                                                          "15 tok/s", "2 GiB"]
    assert figures.check_page(REPO, "docs/concepts/x.md", text, measured=False) == []
    # Counts, code and command lines are not measured figures.
    plain = ("200 steps on 32 GPUs, the p50 ms column, `--timeout 5s`.\n"
             "```bash\nreflow sim --gpus 32  # 3.03× here\n```\n")
    assert figures.check_page(REPO, "docs/benchmarks/x.md", plain, measured=True) == []


def _value(key: str) -> float:
    return figures.lookup(json.loads((REPO / MODES_32).read_text()), key)


@pytest.mark.parametrize("marker, expected", [
    (f"<!-- fig {MODES_32} 32.reflow.nonexistent -->", "no key 'nonexistent'"),
    ("<!-- fig ../outside.json a -->", "outside the repository"),
    ("<!-- fig bench/sim/missing.json a -->", "does not exist"),
])
def test_a_marker_must_name_a_committed_value(marker, expected):
    problems = figures.check_page(REPO, "README.md", f"it is 1.00{marker}\n", measured=False)
    assert len(problems) == 1 and expected in problems[0].message


def test_a_json_written_but_not_committed_is_refused():
    # As git would list the tree before the JSON is committed (or with it ignored).
    files = figures.git_files(REPO) - {MODES_32}
    marker = f"<!-- fig {MODES_32} 32.sync.throughput_tokens_per_s ,.0f -->"
    shown = format(_value("32.sync.throughput_tokens_per_s"), ",.0f")
    problems = figures.check_page(REPO, "README.md", f"it is {shown}{marker}\n",
                                  measured=False, files=files)
    assert len(problems) == 1 and "not kept by git" in problems[0].message
    assert figures.check_page(REPO, "README.md", f"it is {shown}{marker}\n",
                              measured=False) == []


def test_formats_ratios_and_spaces_in_keys():
    files = figures.git_files(REPO)
    tokens = _value("32.reflow.throughput_tokens_per_s")
    ratio = tokens / _value("32.sync.throughput_tokens_per_s")
    key = "32.reflow.throughput_tokens_per_s/32.sync.throughput_tokens_per_s"
    assert figures.check_marker(REPO, f"is {ratio:.2f}×", MODES_32, key, ".2f", files) is None
    assert figures.check_marker(REPO, f"is {ratio + 0.01:.2f}×", MODES_32, key, None, files)
    # Without a format: at the decimals shown, thousands separators as shown.
    assert figures.check_marker(REPO, f"{tokens:,.0f}", MODES_32,
                                "32.reflow.throughput_tokens_per_s", None, files) is None
    share = _value("32.reflow.replay_fraction")
    assert figures.check_marker(REPO, f"{share:.0%}", MODES_32, "32.reflow.replay_fraction",
                                ".0%", files) is None
    assert figures.lookup({"mutual TLS": {"a": [1, 2]}}, "mutual%20TLS.a.1") == 2
    assert figures.check_marker(REPO, "the table", MODES_32, "32.sync.gpus", None, files) \
        == f"no number right before the marker for {MODES_32} 32.sync.gpus"


def test_write_rewrites_a_stale_figure_from_its_json_and_the_check_then_holds():
    from pathlib import Path

    from reflow.docgen import figures

    repo = Path(__file__).resolve().parents[2]
    files = figures.git_files(repo)
    marker = "<!-- fig bench/sim/modes_32gpus.json 32.sync.throughput_tokens_per_s ,.0f -->"
    stale = f"sync: 1,234 tok/s{marker}, and 5{marker} too\n```\n9{marker}\n```\n"
    text, changed = figures.rewrite_page(repo, stale, files)
    assert changed == 2
    assert figures.check_page(repo, "docs/benchmarks/x.md", text, measured=False,
                              files=files) == []
    assert "9<!--" in text  # a marker in a code block is an example, left alone
    again, changed = figures.rewrite_page(repo, text, files)
    assert (again, changed) == (text, 0)
