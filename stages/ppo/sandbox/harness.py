"""The `code_tests` reward (MBPP-style), decided outside the process that runs the response: the row's tests are
split in the caller (`verdict.split`) into probes (the calls of the response's code) and checks; the response's
run (`HARNESS`, `program_for`) evaluates the probes and writes one type-tagged record per probe; the caller
compares the values with the expectations it holds (`verdict.records`, `verdict.decide`), and a check that is
not `probe == literal` runs in a second sandboxed run holding no code of the response (`JUDGE`, `judge_for`).
Nothing the response does in its process (exiting, hooks, patched builtins, read descriptors or frames, forged
output) can turn into a pass: only values equal to expectations it never sees. docs/security.md.
"""

from __future__ import annotations

import json
import re

from stages.ppo.sandbox.process import SandboxLimits, SandboxResult
from stages.ppo.sandbox.tiers import run_python
from stages.ppo.sandbox.verdict import RECORD, Plan, decide, decode, encode, equal, plain, records, source, split, value

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



LIMITS = SandboxLimits()  # what each of `code_tests`' runs gets (tests set smaller ones)

# The response's run: this harness (with `verdict.encode`), then a call with the response's code, the imports the
# tests need, the row's setup and the steps of `verdict.split` (the tests' other statements and the probes) as
# literals. Everything is compiled before the response's code runs; then the response, the imports, the setup and,
# in order, each statement and each probe run in one namespace. Each probe's value is written as one record line
# (`verdict.RECORD`, its number, its tagged value) on a copy of fd 1 with os.write, then an end record, then
# os._exit(0). It holds no expected value and no secret: what it writes is only a claim of values, which the
# caller compares with expectations it alone holds, so nothing the response does here can make a pass.
HARNESS = f'''
RECORD = {RECORD!r}
{source(encode)}

def __harness(response, imports, setup, steps, probes):
    import builtins, json, os
    out, write, leave, dumps, str_ = os.dup(1), os.write, os._exit, json.dumps, str
    compiled = [(s[0], s[1], compile(s[2], "<probe %d>" % s[1], "eval")) if s[0] == "probe"
                else (s[0], -1, compile(s[1], "<test>", "exec")) for s in steps]
    first = [compile(i, "<import>", "exec") for i in imports]
    setup_code = compile(setup, "<setup>", "exec") if setup else None
    run, evaluate, tag = exec, eval, encode
    ns = {{"__name__": "__main__", "__builtins__": builtins}}
    run(compile(response, "<response>", "exec"), ns)
    for code in first:
        run(code, ns)
    if setup_code is not None:
        run(setup_code, ns)
    for kind, k, code in compiled:
        if kind == "exec":
            run(code, ns)
            continue
        record = dumps(tag(evaluate(code, ns)), ensure_ascii=True)
        write(out, ("\\n" + RECORD + str_(k) + " " + record + "\\n").encode())
    write(out, ("\\n" + RECORD + "end " + str_(probes) + "\\n").encode())
    leave(0)
'''

# The judge's run, for checks that are not `probe == literal`, `probe` or `not probe`: no code of the response,
# only the imports the tests need (the standard library's, the response's own import statements), the row's
# setup, the tests' other statements and each check with its probes bound to their decoded values (`__v<k>`),
# each assert's `==` type-strict and what it compares or tests plain (`verdict.equal`, `verdict.value`). Its last
# line is the JSON list of the checks' outcomes.
JUDGE = f'''
{source(decode, plain, value, equal)}

def __judge(imports, setup, steps, values):
    import json, os
    ns = {{"__name__": "__main__", "__equal": equal, "__value": value}}
    for k, tagged in enumerate(values):
        ns["__v%d" % k] = decode(tagged)
    for statement in imports:
        exec(statement, ns)
    if setup:
        exec(setup, ns)
    verdicts = []
    for kind, text in steps:
        if kind == "exec":
            exec(text, ns)
            continue
        try:
            verdicts.append(bool(eval(text, ns)))
        except Exception:
            verdicts.append(False)
    os.write(1, ("\\n" + json.dumps(verdicts) + "\\n").encode())
    os._exit(0)
'''


def _program(code: str, setup: str, plan: Plan) -> str:
    return f"{HARNESS}\n__harness({code!r}, {plan.imports!r}, {setup!r}, {plan.model!r}, {len(plan.probes)})\n"


def program_for(response: str, row: dict) -> str | None:
    """The program of the response's run (HARNESS with the response's code, the row's setup and its probes); None
    without tests. No expected value is in it."""
    setup, tests = row_tests(row)
    if not tests:
        return None
    code = extract_code(response)
    return _program(code, setup, split(setup, tests, code))


def judge_for(setup: str, plan: Plan, tagged: list) -> str:
    """The program of the judge's run: JUDGE with the setup, the judged checks and the response's values."""
    imports = plan.imports + plan.judge_imports
    return f"{JUDGE}\n__judge({imports!r}, {setup!r}, {plan.judge!r}, {tagged!r})\n"


def judged(result: SandboxResult, checks: int) -> bool:
    """Whether the judge's run found every one of its `checks` true."""
    lines = result.stdout.strip().splitlines()
    if not (result.ok and lines):
        return False
    try:
        verdicts = json.loads(lines[-1])
    except ValueError:
        return False
    return type(verdicts) is list and len(verdicts) == checks and all(v is True for v in verdicts)


def code_tests(prompt: str, response: str, row: dict) -> float:
    """The code-execution reward for MBPP-style rows: 1.0 if the response's code (`extract_code`) gives every
    probe of the row's tests (`row_tests`, `verdict.split`) a value that passes its check, decided by the caller
    and, for checks other than `probe == literal`, a run without the response's code; else 0.0. A row without
    tests scores 0.0; one whose tests cannot be split is a ValueError naming the test (the call's error, counted
    by the rule reward: rewards.py)."""
    setup, tests = row_tests(row)
    if not tests:
        return 0.0
    code = extract_code(response)
    plan = split(setup, tests, code)
    result = run_python(_program(code, setup, plan), LIMITS)
    tagged = records(result.stdout, len(plan.probes)) if result.ok else None
    if tagged is None or not decide(plan, tagged):
        return 0.0
    if not plan.judged():
        return 1.0
    return 1.0 if judged(run_python(judge_for(setup, plan, tagged), LIMITS), len(plan.judged())) else 0.0
