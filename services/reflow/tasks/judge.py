"""The unit-test judge of the code tasks: a test program split into
statements (parsed with `ast`, never run here), the sandbox request that
judges a candidate program on them, and the verdict read back.

The trust model. Tests must call the candidate, and code in one process can
forge anything that process reports (print a pass marker, exit 0 before any
test runs, return an object whose `__eq__` is always true). So the candidate
never runs in the process that holds the tests: the judge program (`JUDGE`,
the sandbox's main program) reads the tests and a fresh nonce from its stdin,
makes itself undumpable (no process of the same user may then read its
memory, descriptors or environment), and only then starts the candidate in a
child interpreter (`RUNNER`) with its own stdout and no stdin. The tests run
in the judge; each call of `candidate(...)` goes to the child as data and
comes back as data (tagged JSON of None, bool, int, float, str, bytes, list,
tuple, dict, set), so all the candidate can do is return values. The verdict
is the judge's last stdout line, prefixed with the nonce; no verdict (the
child killed the judge, the sandbox's limits did) means every test failed.
The tests never reach the child or the disk, so hidden tests stay hidden.

This module knows nothing of datasets, prompts or rewards; the sandbox is
reached through its client (reflow.sandbox.client).
"""

from __future__ import annotations

import ast
import json
import secrets
from dataclasses import dataclass

from reflow.sandbox.client import SandboxClient
from reflow.sandbox.types import OK, ExecLimits, ExecRequest, ExecResult
from reflow.tasks.code import MAX_OUTPUT_CHARS, STATUS_TEXT

MAX_TEST_CHARS = 300
SOLUTION_FILE = "solution.py"


@dataclass(frozen=True)
class Statement:
    """One statement of a test program: a test (it asserts on the candidate) or
    setup (imports, data, functions) that runs in order between them."""

    source: str
    is_test: bool


def split_tests(source: str, entry_point: str) -> list[Statement]:
    """A test program as statements, in order. HumanEval's form (`def
    check(candidate)` plus module statements) gives the module statements, then
    check's body; any other program gives its own statements. A test is a
    statement that asserts and names `candidate` or `entry_point`. ValueError
    for a program that does not parse or holds no test."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ValueError(f"the tests do not parse ({err})") from None
    module: list[ast.stmt] = []
    check: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "check":
            check.extend(node.body)
        elif not _check_call(node) and not _metadata(node):
            module.append(node)
    body = module + check
    names = {"candidate", entry_point}
    statements = []
    for node in body:
        walked = list(ast.walk(node))
        asserts = any(isinstance(n, ast.Assert) for n in walked)
        calls = any(isinstance(n, ast.Name) and n.id in names for n in walked)
        statements.append(Statement(ast.unparse(node), asserts and calls))
    if not any(s.is_test for s in statements):
        raise ValueError("the tests hold no assert that calls the candidate")
    return statements


def _check_call(node: ast.stmt) -> bool:
    """A program's own `check(f)`: calling the candidate is the judge's part."""
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "check")


def _metadata(node: ast.stmt) -> bool:
    """HumanEval's `METADATA = {...}`: a data card, not a test's setup."""
    return (isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "METADATA")


@dataclass(frozen=True)
class Outcome:
    passed: bool
    message: str = ""


@dataclass(frozen=True)
class Verdict:
    """The judge's verdict on one program: an outcome per test, in order. With no
    verdict (`error`), every test failed."""

    outcomes: tuple[Outcome, ...]
    load_error: str = ""
    output: str = ""
    error: str = ""

    @property
    def num_passed(self) -> int:
        return sum(o.passed for o in self.outcomes)

    def passed(self) -> bool:
        """Every test passed (and there was one)."""
        return bool(self.outcomes) and all(o.passed for o in self.outcomes)

    def fraction(self) -> float:
        return self.num_passed / len(self.outcomes) if self.outcomes else 0.0


def judge_request(candidate: str, statements: list[Statement], entry_point: str,
                  preamble: str, limits: ExecLimits) -> tuple[ExecRequest, str]:
    """The sandbox request that judges `candidate` (the model's program;
    `preamble`, the problem's own code, runs before it in the child and alone in
    the judge) on `statements`, and the nonce its verdict carries."""
    nonce = secrets.token_hex(16)
    spec = {"nonce": nonce, "entry_point": entry_point, "preamble": preamble,
            "statements": [[s.source, s.is_test] for s in statements],
            # The judge's own deadline leaves it time to report before the sandbox's.
            "time_s": max(0.5, limits.wall_s * 0.8 - 0.3),
            "max_output_chars": MAX_OUTPUT_CHARS, "runner": RUNNER}
    return ExecRequest(code=JUDGE, stdin=json.dumps(spec), limits=limits,
                       files={SOLUTION_FILE: f"{preamble}\n{candidate}\n"}), nonce


def run_tests(client: SandboxClient, candidate: str, statements: list[Statement],
              entry_point: str, preamble: str, limits: ExecLimits,
              job_id: str = "") -> Verdict:
    """Judge `candidate` on `statements` in the sandbox (`judge_request`).
    Sandbox faults (unreachable, a refused request) raise: they are not the
    candidate's."""
    request, nonce = judge_request(candidate, statements, entry_point, preamble, limits)
    return read_verdict(client.execute(request, job_id), nonce,
                        sum(s.is_test for s in statements))


def read_verdict(result: ExecResult, nonce: str, num_tests: int) -> Verdict:
    """The judge's report in `result`; without one, every test failed."""
    verdict = _parse_verdict(result, nonce, num_tests)
    if verdict is None:
        why = STATUS_TEXT.get(result.status, f"the tests did not finish ({result.status})")
        return Verdict(tuple(Outcome(False, why) for _ in range(num_tests)), error=why)
    return verdict


def _parse_verdict(result: ExecResult, nonce: str, num_tests: int) -> Verdict | None:
    if result.status != OK:
        return None
    for line in reversed(result.stdout.splitlines()[-4:]):
        if line.startswith(nonce + " "):
            try:
                found = json.loads(line[len(nonce) + 1:])
                outcomes = tuple(Outcome(bool(p), str(m)[:MAX_OUTPUT_CHARS])
                                 for p, m in found["results"])
                load_error, output = str(found["load_error"]), str(found["output"])
            except (ValueError, TypeError, KeyError, RecursionError):
                return None
            if len(outcomes) != num_tests:
                return None
            return Verdict(outcomes, load_error, output)
    return None


# The value codec both programs share: plain data as tagged JSON; anything else
# is refused where it is encoded, and decoding builds plain types only.
CODEC = r'''
import json

def enc(v, depth=0):
    if depth > 64:
        raise ValueError("a value nested deeper than 64 levels")
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, int):
        return int(v)
    if isinstance(v, str):
        return {"u": str.__str__(v)}
    if isinstance(v, float):
        return {"f": float.__repr__(v)}
    if isinstance(v, (bytes, bytearray)):
        return {"b": bytes(v).hex()}
    tags = ((list, "l"), (tuple, "t"), (frozenset, "z"), (set, "s"))
    for kind, tag in tags:
        if isinstance(v, kind):
            return {tag: [enc(x, depth + 1) for x in v]}
    if isinstance(v, dict):
        return {"d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
    raise TypeError(f"a {type(v).__name__}, not plain data (None, bool, int, float, str, "
                    "bytes, list, tuple, dict, set)")

def dec(v, depth=0):
    if depth > 64:
        raise ValueError("a value nested deeper than 64 levels")
    if v is None or type(v) in (bool, int):
        return v
    if type(v) is not dict or len(v) != 1:
        raise ValueError("not an encoded value")
    (tag, x), = v.items()
    if tag == "u" and type(x) is str:
        return x
    if tag == "f" and type(x) is str and len(x) < 40:
        return float(x)
    if tag == "b" and type(x) is str:
        return bytes.fromhex(x)
    if type(x) is not list:
        raise ValueError("not an encoded value")
    if tag == "d":
        return {dec(k, depth + 1): dec(y, depth + 1) for k, y in x}
    items = [dec(y, depth + 1) for y in x]
    kinds = {"l": list, "t": tuple, "s": set, "z": frozenset}
    if tag not in kinds:
        raise ValueError("not an encoded value")
    return kinds[tag](items)
'''

# The child: loads the candidate, then answers calls. Everything here is the
# candidate's to tamper with; the judge trusts none of it.
RUNNER = CODEC + r'''
import os, sys, traceback

def describe(err):
    shown = traceback.TracebackException.from_exception(err)
    shown.stack = traceback.StackSummary.from_list(
        [frame for frame in shown.stack if frame.filename != "<string>"][-8:])
    return "".join(shown.format())[-2000:]

def main():
    requests = os.fdopen(int(sys.argv[1]), "r", encoding="utf-8")
    replies = os.fdopen(int(sys.argv[2]), "w", encoding="utf-8")
    def send(message):
        replies.write(json.dumps(message) + "\n")
        replies.flush()
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        with open("solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), namespace)
        function = namespace.get(sys.argv[3])
        if not callable(function):
            raise NameError(f"the program defines no function {sys.argv[3]!r}")
    except BaseException as err:
        send({"load_error": describe(err)})
        return
    send({"ready": True})
    for line in requests:
        try:
            args, kwargs = dec(json.loads(line))
            reply = {"value": enc(function(*args, **kwargs))}
        except BaseException as err:
            reply = {"raised": [type(err).__name__, str(err)[:500]]}
        try:
            send(reply)
        except Exception as err:
            send({"raised": ["TypeError", f"the value cannot be returned: {err}"[:500]]})

main()
'''

# The judge: the sandbox's main program. It holds the tests and runs them;
# the candidate lives in its child (see the module's docstring).
JUDGE = CODEC + r'''
import builtins, ctypes, io, os, reprlib, select, signal, subprocess, sys, time

try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: memory and fds unreadable
except Exception:
    pass
spec = json.loads(sys.stdin.read())
deadline = time.monotonic() + spec["time_s"]
short = reprlib.Repr()
short.maxstring, short.maxother, short.maxlist = 80, 80, 8


class Stopped(BaseException):
    """The candidate's process is gone or out of time: no call can be answered."""


class Program:
    def __init__(self):
        request_r, self.request_w = os.pipe()
        self.reply_r, reply_w = os.pipe()
        os.set_blocking(self.request_w, False)
        self.output = open("output.txt", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-u", "-c", spec["runner"], str(request_r), str(reply_w), spec["entry_point"]],
            stdin=subprocess.DEVNULL, stdout=self.output, stderr=subprocess.STDOUT,
            pass_fds=(request_r, reply_w), start_new_session=True)
        os.close(request_r)
        os.close(reply_w)
        self.buffer, self.stopped = b"", ""

    def stop(self, why):
        self.stopped = self.stopped or why
        raise Stopped(self.stopped)

    def wait(self, fd, writing):
        left = deadline - time.monotonic()
        ready = select.select([] if writing else [fd], [fd] if writing else [], [], max(left, 0))
        if not (ready[0] or ready[1]):
            self.stop("the time limit was reached")

    def send(self, message):
        data = (json.dumps(message) + "\n").encode()
        while data:
            self.wait(self.request_w, True)
            try:
                data = data[os.write(self.request_w, data):]
            except BlockingIOError:
                continue
            except OSError:
                self.stop(self.death())

    def receive(self):
        while b"\n" not in self.buffer:
            self.wait(self.reply_r, False)
            chunk = os.read(self.reply_r, 1 << 16)
            if not chunk:
                self.stop(self.death())
            self.buffer += chunk
            if len(self.buffer) > 4 << 20:
                self.stop("a reply was larger than 4 MiB")
        line, _, self.buffer = self.buffer.partition(b"\n")
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            message = None
        if type(message) is not dict:
            self.stop("the program garbled its replies")
        return message

    def death(self):
        try:
            code = self.process.wait(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            return "the program stopped answering"
        return f"the program exited (status {code})" if code >= 0 else \
            f"the program was killed ({signal.Signals(-code).name})"

    def close(self):
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:
            pass
        self.process.wait()
        self.output.close()
        with open("output.txt", "rb") as f:
            f.seek(max(0, os.path.getsize("output.txt") - spec["max_output_chars"]))
            return f.read().decode("utf-8", "replace")


class Candidate:
    """`candidate(...)` in the tests: the call crosses to the child as data."""

    def __init__(self, program):
        self.program, self.last = program, ""

    def __call__(self, *args, **kwargs):
        if self.program.stopped:
            raise Stopped(self.program.stopped)
        shown = ", ".join([short.repr(a) for a in args]
                          + [f"{k}={short.repr(v)}" for k, v in kwargs.items()])
        self.last = f"candidate({shown})"
        self.program.send(enc([list(args), kwargs]))
        reply = self.program.receive()
        if "value" in reply:
            try:
                value = dec(reply["value"])
            except (ValueError, TypeError, RecursionError, OverflowError):
                self.last += " returned a value that cannot be read"
                raise TypeError("the candidate returned a value that cannot be read") from None
            self.last += f" returned {short.repr(value)}"
            return value
        name, text = (list(reply.get("raised") or []) + ["", ""])[:2]
        self.last += f" raised {str(name)[:60]}: {str(text)[:300]}"
        kind = getattr(builtins, str(name), None)
        try:
            error = kind(str(text)) if isinstance(kind, type) and issubclass(kind, Exception) \
                else RuntimeError(f"{name}: {text}")
        except Exception:
            error = RuntimeError(f"{name}: {text}")
        raise error


def main():
    results, load_error = [], ""
    tests = spec["statements"]
    sys.stdout = io.StringIO()  # the tests' own prints are not the verdict
    program = Program()
    candidate = Candidate(program)
    env = {"__name__": "tests", "__builtins__": builtins}
    try:
        exec(compile(spec["preamble"], "problem", "exec"), env)
        env["candidate"] = env[spec["entry_point"]] = candidate
        ready = program.receive()
        load_error = str(ready.get("load_error", ""))[:2000]
        if not ready.get("ready"):
            program.stopped = "the program did not load" if load_error else \
                "the program did not start"
    except Stopped:
        pass
    for number, (source, is_test) in enumerate(tests):
        if program.stopped:
            if is_test:
                results.append([False, f"not run: {program.stopped}"])
            continue
        candidate.last = ""
        try:
            exec(compile(source, f"test {number}", "exec"), env)
            outcome = [not program.stopped, program.stopped]
        except AssertionError:
            outcome = [False, candidate.last or "assertion failed"]
        except BaseException as err:
            if program.stopped:
                outcome = [False, program.stopped]
            else:
                outcome = [False, candidate.last if " raised " in candidate.last
                           else f"{type(err).__name__}: {str(err)[:300]}"]
        if is_test:
            results.append(outcome)
    output = program.close()
    verdict = {"results": results, "load_error": load_error, "output": output}
    os.write(1, f"{spec['nonce']} {json.dumps(verdict)}\n".encode())

main()
'''
