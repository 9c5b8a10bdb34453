"""Markdown pieces the reference pages share: table cells that cannot break a
table, and the note each generated page opens with."""

from __future__ import annotations


def cell(text: object) -> str:
    """`text` as one Markdown table cell: one line, its pipes escaped, and `<` too,
    so that a placeholder such as `<name>` is not taken for HTML."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;")


def code(text: object) -> str:
    """`text` as inline code inside a table cell. A backtick in it widens the fence;
    a pipe stays as it is (the tables extension does not split inside code spans,
    and would print an escape there literally)."""
    s = " ".join(str(text).split())
    fence = "``" if "`" in s else "`"
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def generated_note(source: str) -> str:
    return (f"!!! note \"Generated\"\n    This page is rendered from {source} when the docs "
            "are built; change the code, not this page.\n")
