"""The REST reference: every route of the API, read from the OpenAPI schema the
FastAPI app builds (reflow.api.app.create_app), without serving it: parameters,
request body fields, responses, and the schemas they name. The job-spec
sections a submission carries are the job-spec page's, linked, not repeated."""

from __future__ import annotations

from typing import Any

from reflow.docgen.text import cell, code, generated_note

# Schemas the job-spec page documents field by field.
_SPEC_PAGE = "jobspec.md"
_METHODS = ("get", "post", "put", "patch", "delete")


def openapi() -> dict[str, Any]:
    """The app's OpenAPI document. Built with a placeholder token and no scheduler:
    building the schema calls neither."""
    from reflow.api.app import ApiSettings, create_app

    return create_app(None, ApiSettings(token="x" * 32)).openapi()


def page(schema: dict[str, Any] | None = None) -> str:
    schema = schema or openapi()
    spec_models = _spec_models()
    info = schema.get("info", {})
    lines = ["# REST API reference", "", generated_note("the FastAPI app's OpenAPI schema "
             "(`reflow/api/app.py`)"), "", info.get("description", ""), "",
             "Every `/v1` route needs `Authorization: Bearer <token>`; `/healthz`, "
             "`/openapi.json` and `/docs` are open. A running API serves the same schema at "
             "`/openapi.json`.", "", "## Routes", ""]
    lines += ["| method | path | summary |", "|---|---|---|"]
    for path, method, op in _operations(schema):
        lines.append(f"| {method.upper()} | {code(path)} | {cell(op.get('summary', ''))} |")
    lines.append("")
    used: set[str] = set()
    for path, method, op in _operations(schema):
        lines += _operation(path, method, op, schema, spec_models, used)
    lines += ["## Schemas", ""]
    for name in sorted(used - spec_models):
        lines += _schema(name, schema["components"]["schemas"][name], spec_models)
    return "\n".join(lines).rstrip() + "\n"


def _operations(schema):
    for path, ops in schema["paths"].items():
        for method in _METHODS:
            if method in ops:
                yield path, method, ops[method]


def _operation(path, method, op, schema, spec_models, used) -> list[str]:
    lines = [f"### {method.upper()} `{path}`", ""]
    for text in (op.get("summary"), op.get("description")):
        if text:
            lines += [" ".join(text.split()), ""]
    params = op.get("parameters", [])
    if params:
        lines += ["| parameter | in | type | default | description |", "|---|---|---|---|---|"]
        for p in params:
            s = p.get("schema", {})
            lines.append(f"| {code(p['name'])} | {p['in']} | {cell(_type(s))}{_limits(s)} | "
                         f"{_default(s)} | {cell(p.get('description') or s.get('description', ''))} |")
        lines.append("")
    body = op.get("requestBody")
    if body:
        for media, content in body.get("content", {}).items():
            name = _ref_name(content.get("schema", {}))
            if name:
                used.add(name)
                lines += [f"Request body ({code(media)}): [{name}](#{name.lower()}).", ""]
    lines += ["| status | description | body |", "|---|---|---|"]
    for status, resp in sorted(op.get("responses", {}).items()):
        bodies = []
        for media, content in resp.get("content", {}).items():
            name = _ref_name(content.get("schema", {}))
            if name:
                used.add(name)
                bodies.append(f"[{name}](#{name.lower()})")
            else:
                bodies.append(code(media))
        lines.append(f"| {status} | {cell(resp.get('description', ''))} | {', '.join(bodies)} |")
    lines.append("")
    _close(used, schema)
    return lines


def _close(used: set[str], schema) -> None:
    """Add the schemas that `used` ones refer to, so each link has a table."""
    todo = list(used)
    while todo:
        for ref in _refs(schema["components"]["schemas"][todo.pop()]):
            if ref not in used:
                used.add(ref)
                todo.append(ref)


def _refs(node) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        name = _ref_name(node)
        if name:
            found.add(name)
        for v in node.values():
            found |= _refs(v)
    elif isinstance(node, list):
        for v in node:
            found |= _refs(v)
    return found


def _schema(name: str, s: dict[str, Any], spec_models: set[str]) -> list[str]:
    lines = [f"### {name}", ""]
    if s.get("description"):
        lines += [" ".join(s["description"].split()), ""]
    required = set(s.get("required", []))
    lines += ["| field | type | required | default | description |", "|---|---|---|---|---|"]
    for field, p in s.get("properties", {}).items():
        ref = _ref_name(p)
        if ref in spec_models:
            kind = f"[{ref}]({_SPEC_PAGE}#{field})"
        else:
            kind = cell(_type(p)) + _limits(p)
        lines.append(f"| {code(field)} | {kind} | {'yes' if field in required else ''} | "
                     f"{_default(p)} | {cell(p.get('description', ''))} |")
    return [*lines, ""]


def _ref_name(s: dict[str, Any]) -> str | None:
    ref = s.get("$ref")
    return ref.rsplit("/", 1)[-1] if ref else None


def _type(s: dict[str, Any]) -> str:
    if "$ref" in s:
        return _ref_name(s) or ""
    if "enum" in s:
        return "one of " + ", ".join(str(v) for v in s["enum"])
    if "anyOf" in s:
        return " or ".join(_type(x) for x in s["anyOf"])
    if s.get("type") == "array":
        return f"list of {_type(s.get('items', {}))}"
    return str(s.get("type", "any"))


def _limits(s: dict[str, Any]) -> str:
    parts = [f"{sign} {_number(s[k])}"
             for k, sign in (("minimum", "≥"), ("exclusiveMinimum", ">"), ("maximum", "≤"),
                             ("exclusiveMaximum", "<"), ("minLength", "length ≥"),
                             ("maxLength", "length ≤")) if k in s]
    return f" ({', '.join(parts)})" if parts else ""


def _default(s: dict[str, Any]) -> str:
    return code(repr(s["default"])) if "default" in s else ""


def _spec_models() -> set[str]:
    """The names of JobSpec's section models, as the OpenAPI schema names them."""
    from pydantic import BaseModel

    from reflow.core.config import JobSpec
    from reflow.docgen.jobspec import _nested

    names: set[str] = set()
    todo: list[type[BaseModel]] = [JobSpec]
    while todo:
        for f in todo.pop().model_fields.values():
            sub = _nested(f.annotation)
            if sub is not None and sub.__name__ not in names:
                names.add(sub.__name__)
                todo.append(sub)
    return names


def _number(value: float) -> str:
    """A JSON Schema bound as written in the model (`2147483647`, not `2.14748e+09`)."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
