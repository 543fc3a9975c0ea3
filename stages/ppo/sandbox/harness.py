"""The `code_tests` reward (MBPP-style): the response's code, the row's setup and each test run by a harness
(`HARNESS`, `program_for`) in one namespace, each assert rewritten to compare only plain values of matching
types, and a per-run secret written to stdin that the harness prints only after the last test (`passed`).
Exiting early, atexit hooks, a replaced excepthook or stdout, and values that equal anything score 0.
"""

from __future__ import annotations

import re
import secrets

from stages.ppo.sandbox.process import SandboxLimits, SandboxResult
from stages.ppo.sandbox.tiers import run_python

_OPEN = re.compile(r"[ \t]*([A-Za-z0-9_+.#-]*)")
_PYTHON_TAGS = {"python", "python3", "py", "py3"}


def extract_code(response: str) -> str:
    """The Python code of a model response: the last ```python (py, python3) fenced block, else the last fenced
    block of any language, else the whole response. A fence that was opened and never closed (the response was
    cut at its token limit) counts as a block running to the end. One pass over the text (linear time: a
    response of a megabyte of unclosed fences costs milliseconds)."""
    blocks, pos = [], 0
    while True:
        start = response.find("```", pos)
        if start < 0:
            break
        newline = response.find("\n", start + 3)
        if newline < 0:  # an opening fence needs the end of its line; no later one has one either
            break
        tag = _OPEN.match(response, start + 3, newline).group(1).lower()
        body = newline + 1
        close = response.find("```", body)
        if close < 0:  # unclosed: the block runs to the end
            blocks.append((tag, response[body:]))
            break
        end = close
        blank = close
        while blank > body and response[blank - 1] in " \t":
            blank -= 1
        if blank > body and response[blank - 1] == "\n":  # the closing fence's own line is not code
            end = blank - 1
        blocks.append((tag, response[body:end]))
        pos = close + 3
    if not blocks:
        return response.strip("\n")
    python = [code for tag, code in blocks if tag in _PYTHON_TAGS]
    return (python or [code for _, code in blocks])[-1].strip("\n")


def _lines(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip() else []
    return [str(v) for v in value if str(v).strip()]  # a list, tuple or numpy array (a parquet list column)


def row_tests(row: dict) -> tuple[str, list[str]]:
    """A row's setup code and its test statements: `test_list` (MBPP), else `tests` (a list, or one string of
    newline-joined asserts), else `test` (one string); setup from `test_setup_code` and `test_imports` (MBPP)."""
    row = row or {}
    for key in ("test_list", "tests", "test"):
        tests = _lines(row.get(key))
        if tests:
            break
    setup = "\n".join(_lines(row.get("test_imports")) + _lines(row.get("test_setup_code")))
    return setup, tests


LIMITS = SandboxLimits()  # what `code_tests` runs with (tests set smaller ones)

# The program code_tests runs: this harness, then a call with the response's code, the row's setup and its tests
# as string literals. It runs the response's code, the setup and each test statement in one namespace (each
# assert rewritten so that what it compares or tests must be a plain value: docs/security.md), then, only after
# the last test statement ran, reads the run's secret from the pipe the parent wrote it to (stdin, moved off
# fd 0 before the response's code runs) and writes `<secret>:<number of tests>` as the last line of stdout
# with os.write, and leaves with os._exit(0): no hook of the response's (atexit, excepthook, finalizers, a
# replaced sys.stdout) runs after it. The verdict needs that line, exactly once, last, with exit 0.
HARNESS = r'''
def __harness(response, setup, tests):
    import ast, builtins, collections, os, sys
    secret_fd = os.dup(0)  # the secret: read after the last test only
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    out, stdout = os.dup(1), sys.stdout
    type_, len_, id_, str_ = type, len, id, str
    atoms = {bool, int, float, complex, str, bytes, type(None)}
    seqs = {list, tuple, set, frozenset}
    maps = {dict, collections.Counter, collections.OrderedDict, collections.defaultdict}
    numbers = {int, float}

    def plain(value, depth=0):
        t = type_(value)
        if t in atoms:
            return True
        if depth > 100:
            return False
        if t in seqs:
            return all(plain(v, depth + 1) for v in value)
        if t in maps:
            return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in dict.items(value))
        return False

    def value(v):
        if not plain(v):
            raise AssertionError("not a plain value (built-in types only): " + str_(type_(v).__name__))
        return v

    def equal(a, b):
        value(a)
        value(b)
        ta, tb = type_(a), type_(b)
        if not (ta is tb or (ta in numbers and tb in numbers) or (ta in maps and tb in maps)):
            return False
        return a == b

    def guard(node):
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.Compare):
            if len_(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
                return ast.Call(ast.Name("__sbx_equal", ast.Load()), [guard(node.left), guard(node.comparators[0])], [])
            return ast.Compare(guard(node.left), node.ops, [guard(c) for c in node.comparators])
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(node.op, [guard(v) for v in node.values])
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return ast.UnaryOp(node.op, guard(node.operand))
        return ast.Call(ast.Name("__sbx_value", ast.Load()), [node], [])

    def strict(source, name):
        tree = ast.parse(source, name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assert):
                node.test = guard(node.test)
        return compile(ast.fix_missing_locations(tree), name, "exec")

    compiled = [strict(t, "<test %d>" % (i + 1)) for i, t in enumerate(tests)]  # before the response runs
    ns = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(response, "<response>", "exec"), ns)
    if setup:
        exec(compile(setup, "<setup>", "exec"), ns)
    for code in compiled:
        ns["__sbx_value"], ns["__sbx_equal"] = value, equal
        exec(code, ns)
    try:
        stdout.flush()
    except BaseException:
        pass
    secret = b""
    while True:
        chunk = os.read(secret_fd, 4096)
        if not chunk:
            break
        secret += chunk
    os.write(out, b"\n" + secret.strip() + b":" + str_(len_(compiled)).encode() + b"\n")
    os._exit(0)
'''


def program_for(response: str, row: dict) -> str | None:
    """The program `code_tests` runs (HARNESS with the response's code, the row's setup code and its tests); None
    without tests. The run's secret is not in it: code_tests writes it to the program's stdin."""
    setup, tests = row_tests(row)
    if not tests:
        return None
    return f"{HARNESS}\n__harness({extract_code(response)!r}, {setup!r}, {tests!r})\n"


def passed(result: SandboxResult, secret: str, tests: int) -> bool:
    """Whether a harness run passed: exit 0 in time and within the output cap, and its last line of stdout is
    `<secret>:<tests>`, the secret appearing nowhere else."""
    marker = f"{secret}:{tests}"
    lines = result.stdout.splitlines()
    return (result.ok and result.stdout.endswith("\n") and bool(lines) and lines[-1] == marker
            and result.stdout.count(secret) == 1)


def code_tests(prompt: str, response: str, row: dict) -> float:
    """The code-execution reward for MBPP-style rows: 1.0 if the response's code (`extract_code`) followed by
    the row's setup code and every test (`row_tests`) ran to the harness's last line in the sandbox
    (`run_python` with `LIMITS`; `program_for`, `passed`), else 0.0; a row without tests scores 0.0."""
    program = program_for(response, row)
    if program is None:
        return 0.0
    secret = secrets.token_hex(16)  # per run; never in the program, its argv or its environment
    result = run_python(program, LIMITS, stdin=secret.encode() + b"\n")
    return 1.0 if passed(result, secret, len(row_tests(row)[1])) else 0.0
