"""The job-spec reference: every JobSpec field, walked from the pydantic models
(reflow.core.config and its section modules), with its type, default, bounds and
description. A section is a heading; a nested model (a list of stages, a limits
block) is a heading under it, its fields named with the full dotted path."""

from __future__ import annotations

import types
import typing
from typing import Any, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from reflow.docgen.text import cell, code, generated_note

_BOUNDS = ((at.Ge, "ge", "≥"), (at.Gt, "gt", ">"), (at.Le, "le", "≤"), (at.Lt, "lt", "<"))


def page(model: type[BaseModel] | None = None) -> str:
    """The page for `model` (default: JobSpec)."""
    if model is None:
        from reflow.core.config import JobSpec

        model = JobSpec
    lines = ["# Job spec reference", "", generated_note(
        f"the pydantic models of `{model.__module__}.{model.__name__}`"), "",
        "A job spec is YAML; every field below can also be set on the command line as "
        "`section.field=value` (`reflow run`, `reflow submit`). Unknown keys are refused, "
        "and a value outside its bounds is refused with a message naming the field.", ""]
    top = {n: f for n, f in model.model_fields.items() if _nested(f.annotation) is None}
    if top:
        lines += ["## Top level", "", *_table("", top)]
    for name, f in model.model_fields.items():
        sub = _nested(f.annotation)
        if sub is not None:
            lines += _section(name, f, sub, depth=2)
    return "\n".join(lines).rstrip() + "\n"


def _section(path: str, info: FieldInfo, model: type[BaseModel], depth: int) -> list[str]:
    many = _is_list(info.annotation)
    title = f"{path}[]" if many else path
    lines = ["#" * depth + f" `{title}`", ""]
    doc = (info.description or model.__doc__ or "").strip()
    if doc:
        lines += [" ".join(doc.split()), ""]
    if many:
        lines += [f"A list of {model.__name__} entries{_bounds_text(info)}; each has:", ""]
    prefix = f"{title}."
    flat = {n: f for n, f in model.model_fields.items() if _nested(f.annotation) is None}
    if flat:
        lines += _table(prefix, flat)
    for name, f in model.model_fields.items():
        sub = _nested(f.annotation)
        if sub is not None:
            lines += _section(prefix + name, f, sub, depth=min(depth + 1, 6))
    return lines


def _table(prefix: str, fields: dict[str, FieldInfo]) -> list[str]:
    rows = ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, f in fields.items():
        rows.append(f"| {code(prefix + name)} | {cell(type_name(f.annotation))} | "
                    f"{_default(f)} | {bounds(f)} | {cell(f.description or '')} |")
    return [*rows, ""]


def _nested(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (itself, optional, or a list of it), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        if arg is type(None):
            continue
        found = _nested(arg)
        if found is not None:
            return found
    return None


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (list, tuple)


def type_name(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        text = " or ".join(names)
        return f"{text} or null" if type(None) in args else text
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}" if args else "mapping"
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation)


def _default(f: FieldInfo) -> str:
    if f.default_factory is not None:
        value = f.default_factory()
        return "(section)" if isinstance(value, BaseModel) else code(repr(value))
    if f.default is PydanticUndefined:
        return "required"
    return code(repr(f.default))


def bounds(f: FieldInfo) -> str:
    """The field's constraints, as a reader checks a value against them: numeric
    bounds, length bounds and a pattern, the field's own and those of an optional
    type's `Annotated` member. Rendered for a table cell."""
    parts: list[str] = []
    for m in _constraints(f):
        for kind, attr, sign in _BOUNDS:
            if isinstance(m, kind):
                parts.append(f"{sign} {getattr(m, attr)}")
        if isinstance(m, at.MinLen):
            parts.append(f"length ≥ {m.min_length}")
        if isinstance(m, at.MaxLen):
            parts.append(f"length ≤ {m.max_length}")
        pattern = getattr(m, "pattern", None)
        if pattern is not None:
            parts.append(f"matches {code(pattern)}")
    return ", ".join(dict.fromkeys(parts))


def _bounds_text(f: FieldInfo) -> str:
    text = bounds(f)
    return f" ({text})" if text else ""


def _constraints(f: FieldInfo) -> list[Any]:
    found = list(f.metadata)
    if typing.get_origin(f.annotation) not in (typing.Union, types.UnionType):
        return found  # a mapping's or list's inner constraints are its items', not its own
    for arg in typing.get_args(f.annotation):
        if typing.get_origin(arg) is typing.Annotated:
            found += list(typing.get_args(arg)[1:])
    return found
