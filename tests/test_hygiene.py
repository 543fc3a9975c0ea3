"""The tests say what they are (issue 38, item 6): no assertion that cannot fail, and unit modules
(tests/*_units.py) that use no Ray.

conftest.py enforces the second while the tests run (a unit module's test that asks for a Ray fixture,
calls `ray.init`, leaves Ray up or calls into the session's Ray fails); the checks here read the files,
so they hold for deselected tests too, and show the run-time check failing on purpose (slow)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
import textwrap

import pytest

from conftest import RAY_FIXTURES, ROOT

TEST_FILES = sorted((ROOT / "tests").rglob("*.py"))
UNIT_FILES = sorted((ROOT / "tests").glob("*_units.py"))

# Calls whose result is always truthy: a loaded config (a pydantic model), pytest.approx. Any call of a
# class named *Config counts too.
ALWAYS_TRUTHY_CALLS = frozenset({"smoke_config", "load_config", "approx"})
SAME_VALUE_OPS = (ast.Eq, ast.Is, ast.LtE, ast.GtE)  # `x OP x` holds for any x (NaN aside)


def _name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _truthy_constant(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and bool(node.value)


def _without_calls(node: ast.expr) -> bool:
    """Evaluated twice, the same value: no call, await or assignment in it (names, attributes, subscripts)."""
    return not any(isinstance(n, (ast.Call, ast.Await, ast.NamedExpr, ast.Yield, ast.YieldFrom))
                   for n in ast.walk(node))


def _is_len_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and _name(node.func) == "len" and isinstance(node.func, ast.Name)


def _never_negative_len(test: ast.Compare) -> bool:
    """`len(x) >= 0`, `len(x) > -1`, `0 <= len(x)`."""
    if len(test.ops) != 1:
        return False
    left, op, right = test.left, test.ops[0], test.comparators[0]
    if isinstance(right, ast.UnaryOp) and isinstance(right.op, ast.USub) and isinstance(right.operand, ast.Constant):
        right = ast.Constant(-right.operand.value)
    if _is_len_call(left) and isinstance(right, ast.Constant) and isinstance(right.value, (int, float)):
        return (isinstance(op, ast.GtE) and right.value <= 0) or (isinstance(op, ast.Gt) and right.value < 0)
    if _is_len_call(right) and isinstance(left, ast.Constant) and isinstance(left.value, (int, float)):
        return (isinstance(op, ast.LtE) and left.value <= 0) or (isinstance(op, ast.Lt) and left.value < 0)
    return False


def cannot_fail(source: str) -> list[tuple[int, str]]:
    """(line, why) of every `assert` in `source` whose test is true whatever the code under test does."""
    tree = ast.parse(source)
    functions = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        test, why = node.test, None
        if _truthy_constant(test):
            why = "a true constant"
        elif isinstance(test, (ast.Tuple, ast.List, ast.Set)) and test.elts or isinstance(test, ast.Dict) and test.keys:
            why = "a non-empty literal (a tuple is not `assert test, message`)"
        elif isinstance(test, (ast.Lambda, ast.GeneratorExp)):
            why = "a function or generator object (all(...)/any(...) meant?)"
        elif isinstance(test, ast.JoinedStr) and any(_truthy_constant(v) for v in test.values):
            why = "a non-empty string"
        elif isinstance(test, ast.Call) and (_name(test.func) in ALWAYS_TRUTHY_CALLS or
                                             (_name(test.func)[:1].isupper() and _name(test.func).endswith("Config"))):
            why = f"{_name(test.func)}(...), always truthy: assert on what it returned"
        elif (isinstance(test, ast.Call) and _name(test.func) == "isinstance" and len(test.args) == 2
              and isinstance(test.args[1], ast.Name) and test.args[1].id == "object"):
            why = "isinstance(x, object)"
        elif isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) and any(map(_truthy_constant, test.values)):
            why = "`or` with a true constant"
        elif isinstance(test, ast.Name) and test.id in functions:
            why = f"the function or class {test.id} itself, not a call of it"
        elif isinstance(test, ast.Compare):
            operands = [test.left, *test.comparators]
            for op, a, b in zip(test.ops, operands, operands[1:]):
                if isinstance(op, SAME_VALUE_OPS) and _without_calls(a) and ast.dump(a) == ast.dump(b):
                    why = f"compares {ast.unparse(a)} with itself"
            if why is None and _never_negative_len(test):
                why = "a length is never negative"
        if why:
            found.append((node.lineno, why))
    return found


BAD = {
    "assert True": "a true constant",
    "assert 'checked'": "a true constant",
    "assert (x == 1, 'x is one')": "a non-empty literal",
    "assert [x]": "a non-empty literal",
    "assert (r.ok for r in rows)": "generator object",
    "assert f'{x} rows'": "a non-empty string",
    "assert smoke_config(tmp_path, 'stages.serve.http.host=0.0.0.0')": "smoke_config(...), always truthy",
    "assert load_config(SMOKE)": "load_config(...), always truthy",
    "assert ServeConfig(replicas=2)": "ServeConfig(...), always truthy",
    "assert pytest.approx(x)": "approx(...), always truthy",
    "assert isinstance(cfg, object)": "isinstance(x, object)",
    "assert x.ok or True": "`or` with a true constant",
    "def helper():\n    pass\nassert helper": "the function or class helper itself",
    "assert x == x": "compares x with itself",
    "assert cfg.stages.ppo.lr >= cfg.stages.ppo.lr": "compares cfg.stages.ppo.lr with itself",
    "assert len(rows) >= 0": "a length is never negative",
    "assert 0 <= len(rows)": "a length is never negative",
}
GOOD = [
    "assert False, 'unreachable'",
    "assert x",
    "assert verify(response, '4')",
    "assert smoke_config(tmp_path, 'a=1').stages.serve.http.host == '0.0.0.0'",
    "assert tasks.sft_rows(50, 3, CFG) == tasks.sft_rows(50, 3, CFG)",  # two calls: determinism, can fail
    "assert isinstance(env, Calculator)",
    "assert len(rows) >= 1",
    "assert x.ok or y.ok",
    "assert [r for r in rows]",  # an empty list comprehension is false
    "assert all(r.ok for r in rows)",
    "assert a == b, (a, b)",
    "assert 0 < n and rows[0] is rows[0]",  # can fail (on n); the parts of an `and` are not looked into
]


@pytest.mark.parametrize("snippet", list(BAD), ids=lambda s: s.splitlines()[-1][:60])
def test_the_scanner_finds_each_assert_that_cannot_fail(snippet):
    [(line, why)] = cannot_fail(snippet)
    assert BAD[snippet] in why and line == len(snippet.splitlines())


@pytest.mark.parametrize("snippet", GOOD)
def test_the_scanner_leaves_assertions_that_can_fail_alone(snippet):
    assert cannot_fail(snippet) == []


def test_no_test_asserts_what_cannot_fail():
    found = [f"{path.relative_to(ROOT)}:{line}: {why}" for path in TEST_FILES
             for line, why in cannot_fail(path.read_text())]
    assert len(TEST_FILES) > 40 and UNIT_FILES  # the walk sees the suite
    assert found == [], "\n".join(found)


def test_unit_modules_ask_for_no_ray_fixture():
    """What conftest refuses at run time, read from the files: also for tests a `-m`/`-k` leaves out. A
    module-scoped fixture of a unit module that asks for one counts too."""
    found = []
    for path in UNIT_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                asked = {a.arg for a in node.args.args + node.args.kwonlyargs} & RAY_FIXTURES
                if asked:
                    found.append(f"{path.name}::{node.name} asks for {sorted(asked)}")
    assert found == [], "move these to the stage's test module:\n" + "\n".join(found)


PROBE_CONFTEST = f'''
import importlib.util
import sys

sys.path[:0] = [{str(ROOT / "tests")!r}, {str(ROOT)!r}]
_spec = importlib.util.spec_from_file_location("project_conftest", {str(ROOT / "tests" / "conftest.py")!r})
_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_conftest)
globals().update({{k: v for k, v in vars(_conftest).items() if not k.startswith("__")}})
'''
PROBE_UNITS = '''
def test_pure():
    assert sum([1, 2]) == 3


def test_asks_for_the_session_ray(ray_local):
    pass


def test_starts_and_stops_its_own_ray():
    import ray

    ray.init(num_cpus=1, include_dashboard=False)
    ray.shutdown()
'''


@pytest.mark.slow  # starts a Ray (~10 s)
def test_conftest_fails_a_unit_modules_test_that_uses_ray(tmp_path):
    """The run-time check on a unit module of its own, run by pytest with this suite's conftest: the pure test
    passes, the one asking for `ray_local` errors at setup (before Ray starts), the one that starts and stops
    a Ray of its own errors at teardown."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(PROBE_CONFTEST)
    (tmp_path / "test_probe_units.py").write_text(textwrap.dedent(PROBE_UNITS))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_probe_units.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    # (the test that started a Ray passes its call and errors at its teardown: 2 passed, 2 errors)
    assert out.returncode == 1 and "2 passed, 2 errors" in text, text[-3000:]
    assert "PASSED test_probe_units.py::test_pure" in text
    assert "ERROR test_probe_units.py::test_asks_for_the_session_ray" in text
    assert "asks for the Ray fixture(s) ray_local" in text
    assert "ERROR test_probe_units.py::test_starts_and_stops_its_own_ray" in text
    assert "used Ray (ray.init)" in text


def test_ruff_passes_the_line_length_and_pyflakes():
    """`ruff check` over the repository ([tool.ruff] in pyproject.toml: lines of at most 120 characters, pyflakes'
    rules) exits 0. ruff comes with the `dev` extra; a venv without it fails here rather than skipping the check."""
    assert importlib.util.find_spec("ruff") is not None, \
        f"ruff is not installed in {sys.executable}'s environment: run `make setup` (the dev extra pins it)"
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"ruff check {ROOT} (exit {out.returncode}):\n{out.stdout}{out.stderr}"
