"""The `code_tests` verdict, decided where the response's code never runs.

A row's tests are split, in the caller, into what only the response can compute and what decides the verdict
(`split`). Every `assert` becomes a check; inside it, each *probe* is the outermost expression rooted at a name
that is the response's (`add(2, 3)` in `assert add(2, 3) == 5`; `Solution().run(3)`; `f(x)` in
`assert math.isclose(f(x), 0.3)`). The sandboxed run of the response (`harness.HARNESS`) evaluates the probes
only, one framed record per probe, each value type-tagged (`encode`); it never holds an expected value. The
caller decodes the records (`decode`: plain values only) and decides each check itself: `<probe> == <literal>`
against the literal it parsed (`ast.literal_eval`), `assert <probe>` and `assert not <probe>` by the value's
truth; any other check (`set(f(x)) == set(...)`, `math.isclose(...)`, `f(x) < 3`) in a second sandboxed run
holding no code of the response (`harness.JUDGE`): the row's setup, the check with each probe replaced by its
decoded value. docs/security.md states the threat model.

Whose is a name a test uses: the judge's (resolved in the judge's run) when the row's setup or an earlier test
statement binds it, when it is a builtin (a response's `def sum` does not replace `sum` in a test), when the
response binds it with a top-level import (the judge imports the same module), or when it is a standard-library
module the test only uses as `module.attr`; every other name is the response's.

`encode` runs inside the response's run, `decode`, `plain`, `value` and `equal` in the caller and in the judge's
run: the harness embeds their source (`source`), so each is self-contained (it names no global of this module).
"""

from __future__ import annotations

import ast
import builtins
import copy
import inspect
import json
import sys
from dataclasses import dataclass, field
from typing import Any

BUILTIN_NAMES = frozenset(dir(builtins))
RECORD = "\x1ecode_tests "  # each record line of the response's run starts with it (harness.HARNESS)
_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


# --------------------------------------------------------------------------- values: the codec and the comparison
def encode(value, depth=0):
    """A plain value as JSON-ready type-tagged lists (`["int", "5"]`, `["tuple", [...]]`); anything else raises.
    Plain: None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict and its standard
    subclasses (Counter, OrderedDict, defaultdict: sent as dict), range, and the standard library's iterators
    (a generator, map, zip, itertools' objects: consumed, sent as "iter"). Types are matched exactly: a subclass
    of int is not an int."""
    kind = type(value)
    if depth > 100:
        raise ValueError("a value nested more than 100 deep")
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", value]
    if kind is int:
        return ["int", int.__repr__(value)]
    if kind is float:
        return ["float", float.__repr__(value)]
    if kind is complex:
        return ["complex", [float.__repr__(value.real), float.__repr__(value.imag)]]
    if kind is str:
        return ["str", str.__str__(value)]
    if kind is bytes:
        return ["bytes", bytes.hex(value)]
    if kind in (list, tuple, set, frozenset):
        return [kind.__name__, [encode(v, depth + 1) for v in value]]
    if kind.__module__ == "collections" and kind.__name__ in ("Counter", "OrderedDict", "defaultdict") or kind is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in dict.items(value)]]
    if kind is range:
        return ["range", [value.start, value.stop, value.step]]
    if kind.__module__ in ("builtins", "itertools") and hasattr(kind, "__next__"):
        return ["iter", [encode(v, depth + 1) for v in value]]
    raise TypeError("not a plain value (built-in types only): " + kind.__name__)


def decode(tagged, depth=0):
    """The value `encode` tagged, built of plain types only; ValueError (or TypeError) for anything else. An "iter"
    becomes an iterator over its items (single use, unequal to any list, as the original was)."""
    if depth > 101 or type(tagged) is not list or not tagged or type(tagged[0]) is not str:
        raise ValueError("not a tagged value")
    tag = tagged[0]
    if tag == "none" and len(tagged) == 1:
        return None
    if len(tagged) != 2:
        raise ValueError("not a tagged value")
    data = tagged[1]
    kind = type(data)
    if tag == "bool" and kind is bool:
        return data
    if tag == "int" and kind is str and data.lstrip("-").isdigit() and data.isascii():
        return int(data)
    if tag == "float" and kind is str:
        return float(data)
    if tag == "complex" and kind is list and len(data) == 2 and all(type(x) is str for x in data):
        return complex(float(data[0]), float(data[1]))
    if tag == "str" and kind is str:
        return data
    if tag == "bytes" and kind is str:
        return bytes.fromhex(data)
    if tag == "range" and kind is list and len(data) == 3 and all(type(x) is int for x in data):
        return range(*data)
    if kind is not list:
        raise ValueError("not a tagged value")
    if tag == "dict":
        if not all(type(pair) is list and len(pair) == 2 for pair in data):
            raise ValueError("not a tagged dict")
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in data}
    items = [decode(v, depth + 1) for v in data]
    kinds = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}
    if tag not in kinds:
        raise ValueError("unknown tag " + repr(tag)[:40])
    return kinds[tag](items)


def plain(value, depth=0):
    """Whether `value` is built only of plain types (exactly; no subclass): what a check may compare or test."""
    import collections

    atoms = (bool, int, float, complex, str, bytes, type(None))
    kind = type(value)
    if kind in atoms:
        return True
    if depth > 100:
        return False
    if kind in (list, tuple, set, frozenset):
        return all(plain(v, depth + 1) for v in value)
    if kind in (dict, collections.Counter, collections.OrderedDict, collections.defaultdict):
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in dict.items(value))
    return False


def value(v):
    """`v` if it is plain, else an AssertionError: what an assert compares or tests for truth must be plain."""
    if not plain(v):
        raise AssertionError("not a plain value (built-in types only): " + type(v).__name__)
    return v


def equal(a, b):
    """A check's `==`: both plain, of the same type, except that int and float mix (`avg([2, 4]) == 3`) and the
    dict types mix (a Counter equals a dict literal); bool does not mix with int (`f() == True` fails for 1)."""
    import collections

    value(a)
    value(b)
    numbers = (int, float)
    maps = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)
    ta, tb = type(a), type(b)
    if not (ta is tb or (ta in numbers and tb in numbers) or (ta in maps and tb in maps)):
        return False
    return a == b


def source(*functions) -> str:
    """The source of these self-contained functions, for a sandboxed program to define them."""
    return "\n".join(inspect.getsource(f) for f in functions)


# --------------------------------------------------------------------------- the tests, split
@dataclass
class Check:
    kind: str  # "equal" (probe == expected), "true", "false" (the probe's truth), "judge" (the judge's run)
    test: str  # the test statement it came from
    probe: int = -1  # equal, true, false: the probe whose value is checked
    expected: Any = None  # equal: the literal the value must equal
    source: str = ""  # judge: the predicate, with probe k as the name __v<k>


@dataclass
class Plan:
    """A row's tests split: `model` for the response's run (("exec", statement) | ("probe", k, expression)),
    `judge` for the judge's run (("exec", statement) | ("check", predicate)), the imports each needs first."""

    probes: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    model: list[tuple] = field(default_factory=list)
    judge: list[tuple] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)  # standard-library modules the tests name: both runs
    judge_imports: list[str] = field(default_factory=list)  # the response's imports of names the tests use

    def judged(self) -> list[Check]:
        return [c for c in self.checks if c.kind == "judge"]


def _parse(code: str, what: str) -> ast.Module:
    try:
        return ast.parse(code, what)
    except (SyntaxError, ValueError) as exc:
        raise ValueError(f"the {what} does not parse: {exc}") from None


def _binds(stmt: ast.stmt) -> set[str]:
    """Names a module-level statement binds (not those inside the functions or classes it defines)."""
    names: set[str] = set()
    todo = [stmt]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name.split(".")[0]) for a in node.names if a.name != "*")
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        if not isinstance(node, (ast.Lambda, *_SCOPES)):
            todo.extend(ast.iter_child_nodes(node))
    return names


def response_imports(code: str) -> dict[str, str]:
    """The names whose last module-level binding in the response is an import, each with the import that binds it
    alone (`from math import gcd` -> gcd: "from math import gcd"). Not `__main__` (in the judge's run, that is
    the judge) nor relative imports."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return {}
    out: dict[str, str] = {}
    for stmt in tree.body:
        names = {}
        if isinstance(stmt, ast.Import):
            names = {a.asname or a.name.split(".")[0]: ast.unparse(ast.Import([a])) for a in stmt.names
                     if a.name.split(".")[0] != "__main__"}
        elif isinstance(stmt, ast.ImportFrom) and not stmt.level and stmt.module.split(".")[0] != "__main__":
            names = {a.asname or a.name: ast.unparse(ast.ImportFrom(stmt.module, [a], 0)) for a in stmt.names
                     if a.name != "*"}
        for name in _binds(stmt):
            out.pop(name, None)  # bound again (a def after the import): the response's own
        out.update(names)
    return out


def _inside(stmt: ast.stmt) -> set[str]:
    """Every name a statement binds anywhere in it (its functions' parameters and locals included): what its own
    loads may refer to without naming the response."""
    names = {n.arg for n in ast.walk(stmt) if isinstance(n, ast.arg)}
    for node in ast.walk(stmt):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _loads(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _scope_names(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Lambda):
        a = node.args
        return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg] if x is not None}
    return {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}


class _Splitter:
    """Splits one test statement: `response(name)` says whose a name is (the module docstring); each probe goes to
    `plan` (its source, and its step in the response's run)."""

    def __init__(self, plan: Plan, bound: set[str], imported: dict[str, str]):
        self.plan, self.bound, self.imported = plan, bound, imported
        self.modules: set[str] = set()
        self._known: dict[str, bool] = {}

    def response(self, name: str, node: ast.AST) -> bool:
        """Whether `name` (used in the statement `node`) is the response's; notes the imports the judge's is."""
        if name not in self._known:
            self._known[name] = self._response(name, node)
        return self._known[name]

    def _response(self, name: str, node: ast.AST) -> bool:
        if name in self.bound or name in BUILTIN_NAMES:
            return False
        if name in self.imported:
            if self.imported[name] not in self.plan.judge_imports:
                self.plan.judge_imports.append(self.imported[name])
            return False
        if name in sys.stdlib_module_names and self._as_module(name, node):
            self.modules.add(name)
            return False
        return True

    def _as_module(self, name: str, top: ast.AST) -> bool:
        """Whether every use of `name` in the test is `name.attr` (a module is never called or compared)."""
        parents = {id(c): p for p in ast.walk(top) for c in ast.iter_child_nodes(p)}
        uses = [n for n in ast.walk(top) if isinstance(n, ast.Name) and n.id == name]
        return all(isinstance(parents.get(id(n)), ast.Attribute) and parents[id(n)].value is n for n in uses)

    def split(self, node: ast.AST, local: frozenset, top: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and not any(self.response(n, top) for n in _loads(node) - local):
            return node
        root = _root(node) if isinstance(node, ast.expr) else None
        if isinstance(root, ast.Name) and root.id not in local and self.response(root.id, top):
            inner = _loads(node) & local
            if inner:
                raise ValueError(f"it calls the response with {', '.join(sorted(inner))}, bound inside the test "
                                 "(a comprehension or lambda): its values cannot be computed apart")
            if any(isinstance(n, ast.NamedExpr) for n in ast.walk(node)):
                raise ValueError("it assigns (:=) inside a call of the response")
            k = len(self.plan.probes)
            self.plan.probes.append(ast.unparse(node))
            self.plan.model.append(("probe", k, ast.unparse(node)))
            return ast.copy_location(ast.Name(f"__v{k}", ast.Load()), node)
        if isinstance(node, _SCOPES):
            local = local | _scope_names(node)
        for name, old in ast.iter_fields(node):
            if isinstance(old, list):
                setattr(node, name, [self.split(v, local, top) if isinstance(v, ast.AST) else v for v in old])
            elif isinstance(old, ast.AST):
                setattr(node, name, self.split(old, local, top))
        return node


def _guard(node: ast.expr) -> ast.expr:
    """The old harness's rewrite of an assert's test: a single `==` becomes `__equal(a, b)`, every other operand of
    a comparison and every value tested for truth `__value(x)` (plain values only)."""
    if isinstance(node, ast.Constant):
        return node
    if isinstance(node, ast.Compare):
        if len(node.ops) == 1 and isinstance(node.ops[0], ast.Eq):
            return ast.Call(ast.Name("__equal", ast.Load()), [_guard(node.left), _guard(node.comparators[0])], [])
        return ast.Compare(_guard(node.left), node.ops, [_guard(c) for c in node.comparators])
    if isinstance(node, ast.BoolOp):
        return ast.BoolOp(node.op, [_guard(v) for v in node.values])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ast.UnaryOp(node.op, _guard(node.operand))
    return ast.Call(ast.Name("__value", ast.Load()), [node], [])


def _probe_of(node: ast.expr) -> int | None:
    if isinstance(node, ast.Name) and node.id.startswith("__v") and node.id[3:].isdigit():
        return int(node.id[3:])
    return None


def _check(predicate: ast.expr, test: str) -> Check:
    """How a split assert is decided: in the caller when it is `probe == literal`, `probe` or `not probe`."""
    if _probe_of(predicate) is not None:
        return Check("true", test, _probe_of(predicate))
    negated = isinstance(predicate, ast.UnaryOp) and isinstance(predicate.op, ast.Not)
    if negated and _probe_of(predicate.operand) is not None:
        return Check("false", test, _probe_of(predicate.operand))
    if isinstance(predicate, ast.Compare) and len(predicate.ops) == 1 and isinstance(predicate.ops[0], ast.Eq):
        for side, other in ((predicate.left, predicate.comparators[0]), (predicate.comparators[0], predicate.left)):
            if _probe_of(side) is not None and not any(_probe_of(n) is not None for n in ast.walk(other)):
                try:
                    return Check("equal", test, _probe_of(side), expected=ast.literal_eval(other))
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    break
    return Check("judge", test, source=ast.unparse(ast.fix_missing_locations(_guard(predicate))))


def split(setup: str, tests: list[str], response_code: str) -> Plan:
    """A row's tests (`harness.row_tests`) split into probes and checks (the module docstring). ValueError, naming
    the test, for a test that cannot be split: one that does not parse, a statement other than an assert that
    calls the response (`x = f(3)`), a call of the response inside a comprehension or lambda of the test that
    uses the names it binds (`all(f(i) == i for i in ...)`)."""
    plan = Plan()
    bound = set()
    for stmt in _parse(setup, "setup code").body:
        bound |= _binds(stmt)
    imported = response_imports(response_code)
    modules: set[str] = set()
    for i, test in enumerate(tests):
        for stmt in _parse(test, f"test {i + 1}").body:
            text = ast.unparse(stmt)
            splitter = _Splitter(plan, bound, imported)
            try:
                if isinstance(stmt, ast.Assert):
                    predicate = splitter.split(copy.deepcopy(stmt.test), frozenset(), stmt.test)
                    check = _check(predicate, text)
                    plan.checks.append(check)
                    if check.kind == "judge":
                        plan.judge.append(("check", check.source))
                elif any(splitter.response(n, stmt) for n in _loads(stmt) - _inside(stmt)):
                    raise ValueError("a statement other than an assert uses the response's code")
                else:
                    plan.model.append(("exec", text))
                    plan.judge.append(("exec", text))
                    bound |= _binds(stmt)
            except RecursionError:
                raise ValueError(f"test {i + 1} ({text[:200]!r}) is nested too deeply") from None
            except ValueError as exc:
                raise ValueError(f"test {i + 1} ({text[:200]!r}) cannot be judged apart from the response: "
                                 f"{exc}") from None
            modules |= splitter.modules
    plan.imports = [f"import {m}" for m in sorted(modules)]
    return plan


# --------------------------------------------------------------------------- deciding
def records(stdout: str, probes: int) -> list | None:
    """The tagged values of a response's run (its stdout): exactly `probes` records numbered 0.. in order, each
    one `decode` accepts, then the end record; None for anything else (a missing, extra, forged or malformed
    record)."""
    lines = [line[len(RECORD):] for line in stdout.split("\n") if line.startswith(RECORD)]
    if len(lines) != probes + 1 or lines[-1] != f"end {probes}":
        return None
    tagged = []
    for k, line in enumerate(lines[:-1]):
        head, _, body = line.partition(" ")
        if head != str(k):
            return None
        try:
            tagged.append(json.loads(body))
            decode(tagged[-1])
        except (ValueError, TypeError, RecursionError, OverflowError):
            return None
    return tagged


def decide(plan: Plan, tagged: list) -> bool:
    """Whether every check the caller decides itself (equal, true, false) holds for the response's values."""
    for check in plan.checks:
        if check.kind == "judge":
            continue
        got = decode(tagged[check.probe])
        if check.kind == "equal":
            try:
                if not equal(got, check.expected):
                    return False
            except (AssertionError, RecursionError):
                return False
        elif not plain(got) or bool(got) != (check.kind == "true"):
            return False
    return True
