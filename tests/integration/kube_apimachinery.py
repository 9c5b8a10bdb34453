"""The Kubernetes API machinery conventions that the strict API test server
(`kube_apiserver.py`) follows: Status errors, label and field selectors,
object-metadata validation and the three PATCH formats.

Each behaves as k8s.io/apimachinery and the kube-apiserver do for the subset
the server serves; where a docstring says "simplified", it names the part left out.
"""

from __future__ import annotations

import copy
import re
from typing import NamedTuple

REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
           405: "MethodNotAllowed", 409: "Conflict", 410: "Gone", 415: "UnsupportedMediaType",
           422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
           504: "Timeout"}

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*")
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
# metav1.MicroTime: RFC 3339 with exactly six fractional digits
# (Go layout "2006-01-02T15:04:05.000000Z07:00"); anything else does not decode.
_MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")


class ApiError(Exception):
    """A request answered with a `Status` object instead of being carried out."""

    def __init__(self, code: int, message: str, reason: str | None = None,
                 details: dict | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.message = code, message
        self.reason = reason or REASONS.get(code, "Unknown")
        self.details, self.headers = details, headers or {}

    def status(self) -> dict:
        return status_object(self.code, self.message, self.reason, self.details)


def status_object(code: int, message: str, reason: str, details: dict | None = None) -> dict:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}
    if details:
        body["details"] = details
    return body


def invalid(kind: str, name: str, field: str, detail: str) -> ApiError:
    """422 Invalid, shaped as the API server reports a field validation error."""
    message = f"{field}: {detail}"
    return ApiError(422, f'{kind} "{name}" is invalid: {message}', details={
        "name": name, "kind": kind,
        "causes": [{"reason": "FieldValueInvalid", "message": detail, "field": field}]})


# --- label and field selectors ---------------------------------------------------------

class Requirement(NamedTuple):
    key: str
    op: str  # "=", "==", "!=", "in", "notin", "exists", "!", "<", ">"
    values: frozenset[str]


def _tokens(text: str) -> list[str]:
    """The selector lexer: operators are tokens, anything else up to one is an identifier."""
    out, i = [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
        elif text.startswith(("!=", "=="), i):
            out.append(text[i:i + 2])
            i += 2
        elif text[i] in "!=(),<>":
            out.append(text[i])
            i += 1
        else:
            j = i
            while j < len(text) and not text[j].isspace() and text[j] not in "!=(),<>":
                j += 1
            out.append(text[i:j])
            i = j
    return out


def _is_ident(token: str | None) -> bool:
    return token is not None and token not in ("!=", "==", "!", "=", "(", ")", ",", "<", ">")


def check_label_key(key: str) -> str | None:
    """Why `key` is not a qualified name (`[prefix/]name`), or None."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _SUBDOMAIN.fullmatch(prefix)):
        return f"prefix part of {key!r} must be a DNS subdomain"
    if not name or len(name) > 63 or not _NAME_PART.fullmatch(name):
        return (f"name part of {key!r} must be 63 characters or less, alphanumerics, '-', '_' "
                "or '.', starting and ending with an alphanumeric")
    return None


def check_label_value(value: str) -> str | None:
    if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
        return (f"a valid label value {value!r} must be 63 characters or less, empty or "
                "alphanumerics, '-', '_' or '.', starting and ending with an alphanumeric")
    return None


def parse_label_selector(text: str) -> list[Requirement]:
    """labels.Parse: `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`, `k`, `!k`,
    `k>1`, `k<1`, AND-ed by commas. A malformed selector is 400 BadRequest."""
    toks, pos, reqs = _tokens(text), 0, []

    def bad(detail: str) -> ApiError:
        return ApiError(400, f"unable to parse requirement: {detail} in selector {text!r}")

    def take() -> str | None:
        nonlocal pos
        pos += 1
        return toks[pos - 1] if pos - 1 < len(toks) else None

    while toks:
        tok = take()
        if tok == "!":
            key, op, values = take(), "!", frozenset()
            if not _is_ident(key):
                raise bad("'!' must be followed by a label key")
        elif _is_ident(tok):
            key, nxt = tok, toks[pos] if pos < len(toks) else None
            if nxt in (None, ","):
                op, values = "exists", frozenset()
            else:
                op = take()
                if op in ("=", "==", "!=", "<", ">"):
                    value = take() if _is_ident(toks[pos] if pos < len(toks) else None) else ""
                    if op in ("<", ">") and not re.fullmatch(r"-?\d+", value):
                        raise bad(f"{op!r} needs an integer value, not {value!r}")
                    values = frozenset([value])
                elif op in ("in", "notin"):
                    if take() != "(":
                        raise bad(f"{op!r} must be followed by '('")
                    items, current = set(), ""
                    while (part := take()) != ")":
                        if part is None:
                            raise bad("unclosed '('")
                        if part == ",":
                            items.add(current)
                            current = ""
                        elif _is_ident(part) and not current:
                            current = part
                        else:
                            raise bad(f"unexpected {part!r} in a value set")
                    items.add(current)
                    values = frozenset(items)
                else:
                    raise bad(f"found {op!r}, expected an operator")
        else:
            raise bad(f"found {tok!r}, expected a label key")
        if why := check_label_key(key):
            raise bad(why)
        for value in values if op not in ("<", ">") else ():
            if why := check_label_value(value):
                raise bad(why)
        reqs.append(Requirement(key, op, values))
        sep = take()
        if sep is None:
            break
        if sep != "," or pos >= len(toks):
            raise bad(f"found {sep!r}, expected ',' and another requirement")
    return reqs


def labels_match(reqs: list[Requirement], labels: dict | None) -> bool:
    labels = labels or {}
    for key, op, values in reqs:
        has, value = key in labels, labels.get(key)
        if op in ("=", "==", "in"):
            ok = has and value in values
        elif op in ("!=", "notin"):  # as in Kubernetes: an object without the key matches
            ok = not has or value not in values
        elif op == "exists":
            ok = has
        elif op == "!":
            ok = not has
        else:
            bound = int(next(iter(values)))
            ok = has and bool(re.fullmatch(r"-?\d+", value or "")) and (
                int(value) > bound if op == ">" else int(value) < bound)
        if not ok:
            return False
    return True


def parse_field_selector(text: str, supported: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """fields.Parse for `path=v`, `path==v`, `path!=v` terms over the supported field
    labels (simplified: no `\\,` escapes). Anything else is 400 BadRequest."""
    terms = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        match = re.fullmatch(r"([^!=]+?)\s*(!=|==|=)\s*(.*)", term)
        if not match:
            raise ApiError(400, f"invalid selector: {term!r}; can't understand {term!r}")
        field, op, value = match.groups()
        if field not in supported:
            raise ApiError(400, f'field label not supported: {field}')
        terms.append((field, op, value))
    return terms


def fields_match(terms: list[tuple[str, str, str]], obj: dict) -> bool:
    for path, op, value in terms:
        actual = obj
        for part in path.split("."):
            actual = actual.get(part) if isinstance(actual, dict) else None
        if ((actual if actual is not None else "") == value) != (op != "!="):
            return False
    return True


# --- object validation -----------------------------------------------------------------

def validate(kind: str, obj: dict) -> None:
    """The checks the API server makes on every write of these kinds: a DNS-subdomain
    name, string labels and annotations with valid keys and values, a pod with named
    containers, a lease with a positive duration and MicroTime timestamps. A value of
    the wrong JSON type cannot be decoded (400); a bad value is 422 Invalid."""
    meta = obj["metadata"]
    name = meta.get("name", "")
    if len(name) > 253 or not _SUBDOMAIN.fullmatch(name):
        raise invalid(kind, name, "metadata.name", f'Invalid value: "{name}": a lowercase RFC '
                      "1123 subdomain must consist of lower case alphanumeric characters, '-' or "
                      "'.', and must start and end with an alphanumeric character")
    for field in ("labels", "annotations"):
        pairs = meta.get(field) or {}
        if not isinstance(pairs, dict) or not all(isinstance(v, str) for v in pairs.values()):
            raise ApiError(400, f"metadata.{field}: cannot decode: values must be strings")
        for key, value in pairs.items():
            why = check_label_key(key) or (check_label_value(value) if field == "labels" else None)
            if why:
                raise invalid(kind, name, f"metadata.{field}", f'Invalid value: "{key}": {why}')
    spec = obj.get("spec") or {}
    if kind == "Pod":
        containers = spec.get("containers")
        if not isinstance(containers, list) or not containers:
            raise invalid(kind, name, "spec.containers", "Required value")
        for i, container in enumerate(containers):
            if not isinstance(container, dict) or not container.get("name") \
                    or not container.get("image"):
                raise invalid(kind, name, f"spec.containers[{i}]", "Required value: name and image")
    if kind == "Lease":
        for key, least in (("leaseDurationSeconds", 1), ("leaseTransitions", 0)):
            value = spec.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ApiError(400, f"spec.{key}: cannot decode {value!r} as int32")
            if value is not None and value < least:
                raise invalid(kind, name, f"spec.{key}", f"Invalid value: {value}: must be "
                              + ("greater than 0" if least else "greater than or equal to 0"))
        for key in ("acquireTime", "renewTime"):
            value = spec.get(key)
            if value is not None and not (isinstance(value, str) and _MICRO_TIME.fullmatch(value)):
                raise ApiError(400, f'{kind} in version "v1" cannot be handled as a {kind}: '
                               f'parsing time "{value}" as "2006-01-02T15:04:05.000000Z07:00": '
                               f'spec.{key} needs six fractional digits')


# --- patches -----------------------------------------------------------------------------

def merge_patch(target, patch):
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, anything
    else (lists included) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# Lists that merge by a key in a strategic merge patch (patchMergeKey in the core/v1
# types); every other list is atomic and replaced. `finalizers` merges as a set.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
              "volumes": "name", "env": "name", "volumeMounts": "mountPath",
              "ports": "containerPort", "conditions": "type", "imagePullSecrets": "name",
              "ownerReferences": "uid", "hostAliases": "ip"}


def strategic_merge_patch(target, patch):
    """Strategic merge patch, simplified: a merge patch in which the lists in
    MERGE_KEYS merge item by item on their key (an item with `$patch: delete` is
    removed), `finalizers` merges as a set, `$patch: replace` replaces a map,
    `$deleteFromPrimitiveList/<field>` removes values and `$setElementOrder/<field>`
    is accepted and ignored. `$retainKeys` is refused (400)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return strategic_merge_patch({}, {k: v for k, v in patch.items() if k != "$patch"})
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key == "$patch" or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            field = key.partition("/")[2]
            result[field] = [v for v in result.get(field) or [] if v not in (value or [])]
        elif key.startswith("$"):
            raise ApiError(400, f"strategic merge patch directive {key!r} is not supported")
        elif value is None or (isinstance(value, dict) and value.get("$patch") == "delete"):
            result.pop(key, None)
        elif key in MERGE_KEYS and isinstance(value, list):
            result[key] = _merge_keyed_list(result.get(key) or [], value, MERGE_KEYS[key])
        elif key == "finalizers" and isinstance(value, list):
            old = result.get(key) or []
            result[key] = old + [v for v in value if v not in old]
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _merge_keyed_list(old: list, patch: list, key: str) -> list:
    out = list(old)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise ApiError(400, f"map: {item!r} does not contain declared merge key: {key}")
        at = next((i for i, o in enumerate(out) if isinstance(o, dict) and o.get(key) == item[key]),
                  None)
        if item.get("$patch") == "delete":
            if at is not None:
                out.pop(at)
        elif at is None:
            out.append(strategic_merge_patch({}, item))
        else:
            out[at] = strategic_merge_patch(out[at], item)
    return out


class _PatchFailed(Exception):
    pass


def _pointer(path) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise _PatchFailed(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def _index(token: str, size: int, end_ok: bool = False) -> int:
    if end_ok and token == "-":
        return size
    if not re.fullmatch(r"0|[1-9][0-9]*", token) or int(token) > size - (0 if end_ok else 1):
        raise _PatchFailed(f"array index {token!r} out of bounds")
    return int(token)


def _walk(doc, tokens: list[str]):
    for token in tokens:
        if isinstance(doc, dict) and token in doc:
            doc = doc[token]
        elif isinstance(doc, list):
            doc = doc[_index(token, len(doc))]
        else:
            raise _PatchFailed(f"missing value at {'/' + '/'.join(tokens)}")
    return doc


def _add(doc, tokens: list[str], value):
    if not tokens:
        return value
    parent = _walk(doc, tokens[:-1])
    if isinstance(parent, dict):
        parent[tokens[-1]] = value
    elif isinstance(parent, list):
        parent.insert(_index(tokens[-1], len(parent), end_ok=True), value)
    else:
        raise _PatchFailed(f"cannot add to a {type(parent).__name__}")
    return doc


def _remove(doc, tokens: list[str]):
    _walk(doc, tokens)  # must exist
    if not tokens:
        raise _PatchFailed("cannot remove the whole document")
    parent = _walk(doc, tokens[:-1])
    return parent.pop(tokens[-1] if isinstance(parent, dict) else _index(tokens[-1], len(parent)))


def _same(a, b) -> bool:
    """JSON equality: true is not 1, 1 is 1.0, and containers compare deeply."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def json_patch(doc, ops):
    """RFC 6902 JSON patch (add, remove, replace, move, copy, test). A patch that is
    not a list of operations is 400; an operation that cannot apply (a missing path,
    a failed test) is 422, and nothing of the patch is applied."""
    if not isinstance(ops, list) or not all(isinstance(o, dict) and "op" in o for o in ops):
        raise ApiError(400, "a JSON patch must be a list of operations with an 'op'")
    doc = copy.deepcopy(doc)
    try:
        for op in ops:
            kind, tokens = op["op"], _pointer(op.get("path"))
            if kind in ("add", "replace", "test") and "value" not in op:
                raise _PatchFailed(f"{kind} operation needs a value")
            if kind == "add":
                doc = _add(doc, tokens, copy.deepcopy(op["value"]))
            elif kind == "remove":
                _remove(doc, tokens)
            elif kind == "replace":
                if tokens:
                    _remove(doc, tokens)
                doc = _add(doc, tokens, copy.deepcopy(op["value"]))
            elif kind in ("move", "copy"):
                source = _pointer(op.get("from"))
                if kind == "move" and tokens[:len(source)] == source and tokens != source:
                    raise _PatchFailed("cannot move a value into itself")
                value = (_remove(doc, source) if kind == "move"
                         else copy.deepcopy(_walk(doc, source)))
                doc = _add(doc, tokens, value)
            elif kind == "test":
                if not _same(_walk(doc, tokens), op["value"]):
                    raise _PatchFailed(f"testing value {op['path']} failed")
            else:
                raise _PatchFailed(f"unexpected kind: {kind}")
    except _PatchFailed as err:
        raise ApiError(422, str(err)) from None
    return doc
