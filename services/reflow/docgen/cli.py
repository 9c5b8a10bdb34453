"""The CLI reference: every `reflow` subcommand and its arguments, walked from the
argparse parser that `reflow` itself parses with (reflow.cli.build_parser)."""

from __future__ import annotations

import argparse
import os

from reflow.docgen.text import cell, code, generated_note


def page(parser: argparse.ArgumentParser | None = None) -> str:
    if parser is None:
        parser = _parser()
    lines = ["# CLI reference", "", generated_note("the argparse parser in `reflow/cli.py`"),
             "", parser.description or "", "",
             "Some defaults come from environment variables (the help names them); the "
             "defaults shown are those with none of `REFLOW_*` set.", ""]
    for path, sub, help_text in _commands(parser, parser.prog):
        lines += _command(path, sub, help_text)
    lines += ["`reflow sim plan` (size a cluster on the simulator) parses its own arguments: "
              "`reflow sim plan --help` lists them.", ""]
    return "\n".join(lines).rstrip() + "\n"


def _parser() -> argparse.ArgumentParser:
    """reflow's parser as a clean environment builds it: a default taken from a
    `REFLOW_*` variable (the API token among them) must not reach the page."""
    from reflow.cli import build_parser

    saved = {k: v for k, v in os.environ.items() if k.startswith("REFLOW_")}
    for k in saved:
        del os.environ[k]
    try:
        return build_parser()
    finally:
        os.environ.update(saved)


def _commands(parser: argparse.ArgumentParser, prefix: str):
    """(`reflow run`, its parser, its help) for every leaf command, depth first; a
    command with subcommands of its own (`reflow models`) yields only its leaves."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help for a in action._choices_actions}
        for name, sub in action.choices.items():
            path = f"{prefix} {name}"
            if any(isinstance(a, argparse._SubParsersAction) for a in sub._actions):
                yield from _commands(sub, path)
            else:
                yield path, sub, helps.get(name) or sub.description or ""


def _command(path: str, parser: argparse.ArgumentParser, help_text: str) -> list[str]:
    lines = [f"## `{path}`", ""]
    if help_text:
        text = " ".join(help_text.split()).rstrip(".") + "."
        lines += [text[0].upper() + text[1:], ""]
    usage = parser.format_usage().removeprefix("usage: ").strip()
    lines += ["```text", " ".join(usage.split()), "```", ""]
    rows = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    if rows:
        lines += ["| argument | default | help |", "|---|---|---|"]
        lines += [f"| {_name(a)} | {_default(a)} | {_help(a)} |" for a in rows]
        lines.append("")
    return lines


def _name(a: argparse.Action) -> str:
    if a.option_strings:
        text = ", ".join(code(o) for o in a.option_strings)
        if a.nargs != 0:  # not a flag: it takes a value
            text += " " + code(a.metavar or a.dest.upper())
        return text + (" (required)" if a.required else "")
    name = code(a.metavar or a.dest)
    if a.nargs in ("?", "*", argparse.REMAINDER):
        return name + " (optional" + (", repeatable)" if a.nargs == "*" else ")")
    return name


def _default(a: argparse.Action) -> str:
    if a.nargs == 0 or a.default in (None, argparse.SUPPRESS, [], ""):
        return ""
    return code(a.default)


def _help(a: argparse.Action) -> str:
    text = cell(a.help or "")
    if a.choices:
        if text and not text.endswith((".", ")")):
            text += "."
        text = (text + " " if text else "") + "One of " + ", ".join(code(c) for c in a.choices) + "."
    return text
