"""The `code_tests` verdict's plan, made in the caller from the row's tests alone (the response is never read):
which names are the response's, which standard-library modules the judge imports, and the test rewritten so that
the judge's run counts its checks and compares strictly. docs/security.md states the threat model.

The verdict is decided by the judge's run (harness.JUDGE), a sandboxed process that runs the row's setup and the
test, as written (top-level asserts, HumanEval's `def check(candidate)`, loops, conditionals, helpers), with each
name that is the response's bound to what the response's run (harness.RESPONSE) reported: its value when plain,
else a handle whose calls are asked of that run. The response's run learns the inputs of those calls and answers
with values as data; everything else (method calls on a returned value, subscripts, comparisons) happens in the
judge, which runs no code of the response.

Whose is a name (`plan`): the judge's when the tests or the row's setup bind it anywhere at module level (a
`def check`, an import, an assignment, a loop target), when it is a builtin, or when it is a standard-library
module the tests use only as `module.attr` (the judge imports it); every other global name the tests load is the
response's. A response's import never renames or replaces a test's name: `import pickle as json` leaves the test's
`json` the standard library's, and `from math import gcd` answers `gcd(12, 8)` as the response's own `gcd`.

The rewrite: every `assert X` becomes `__judge_assert__(X)` (X must be plain and true; counted), every comparison
`__judge_cmp__` (strict `==`/`!=`/`in`, a NaN fails every bound: values.equal, values.has_nan), a chain
`__judge_chain__` with its later operands evaluated lazily as Python does. A row is refused (a ValueError naming
it, the reward's error) when its tests do not parse, hold no assert, use nothing of the response, or run a value
as code (`eval`, `exec`, `compile`, `pickle.loads`, ... on anything but a literal of the test).
"""

from __future__ import annotations

import ast
import builtins
import symtable
import sys
from dataclasses import dataclass, field

BUILTIN_NAMES = frozenset(dir(builtins))
# What runs a value as code, and so is refused on anything but a literal of the row's own tests (statically here,
# and in the judge's run for what an alias hides: harness.JUDGE's guards).
CODE_BUILTINS = ("eval", "exec", "compile")
CODE_FUNCTIONS = {
    "pickle": ("loads", "load", "Unpickler"), "_pickle": ("loads", "load", "Unpickler"), "marshal": ("loads", "load"),
    "shelve": ("open",), "dill": ("loads", "load"), "cloudpickle": ("loads", "load"), "runpy": ("run_path",),
    "code": ("interact", "InteractiveInterpreter", "InteractiveConsole"), "timeit": ("timeit", "repeat", "Timer"),
    "os": ("system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe",
           "spawnv", "spawnve", "spawnvp", "spawnl", "spawnlp", "posix_spawn", "posix_spawnp"),
    "subprocess": ("run", "call", "check_call", "check_output", "Popen", "getoutput", "getstatusoutput"),
    "pty": ("spawn",), "doctest": ("run_docstring_examples", "testmod", "testfile", "DocTestParser"),
}
ASSERT, CMP, CHAIN = "__judge_assert__", "__judge_cmp__", "__judge_chain__"
_OPS = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Is: "is",
        ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}


@dataclass
class Plan:
    """What the judge's run needs, all of it from the row: its setup, the test rewritten (`source`), the response's
    names the test uses, the standard-library modules it imports first, the literals eval and its kind may run, and
    which modules' code-running functions it guards."""

    setup: str
    source: str
    names: list[str] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    constants: list = field(default_factory=list)
    guarded: dict[str, list[str]] = field(default_factory=dict)


def _parse(code: str, what: str, row: str) -> ast.Module:
    try:
        return ast.parse(code, what)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"{row}: its {what} does not parse: {exc}") from None


def _globals(code: str) -> tuple[set[str], set[str]]:
    """(bound, read): the names a module binds at module level, wherever in it (assignments, imports, defs, loop
    targets, names its functions declare global), and every global name its code reads (at module level, and the
    free names of its functions, classes, lambdas and comprehensions that no enclosing function binds)."""
    table = symtable.symtable(code, "<test>", "exec")
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    read = {s.get_name() for s in table.get_symbols() if s.is_referenced()}
    todo = list(table.get_children())
    while todo:
        child = todo.pop()
        todo.extend(child.get_children())
        for s in child.get_symbols():
            if s.is_global():
                bound |= {s.get_name()} if s.is_declared_global() and s.is_assigned() else set()
                read |= {s.get_name()} if s.is_referenced() else set()
    return bound, read


def _only_as_module(name: str, tree: ast.AST) -> bool:
    """Whether every use of `name` in the tests is `name.attr` (as a module is used: never called or compared)."""
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name]
    return all(isinstance(parents.get(id(n)), ast.Attribute) and parents[id(n)].value is n for n in uses)


def _code_runners(tree: ast.Module, bound: set[str]) -> dict[str, str]:
    """The names through which the tests can reach a code-running function: the builtins (unless the tests bind
    the name to something of their own) and `from pickle import loads [as x]` bindings; name -> what it is."""
    runners = {n: n for n in CODE_BUILTINS if n not in bound}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in CODE_FUNCTIONS:
            for alias in node.names:
                if alias.name in CODE_FUNCTIONS[node.module]:
                    runners[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return runners


def _refuse_code(tree: ast.Module, bound: set[str], row: str) -> None:
    """A ValueError for a call that would run a value as code: eval, exec, compile, pickle.loads, os.system, ...
    on anything but a literal of the tests (a returned string or bytes would run in the judge)."""
    runners = _code_runners(tree, bound)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        what = None
        if isinstance(node.func, ast.Name) and node.func.id in runners:
            what = runners[node.func.id]
        elif (isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and node.func.attr in CODE_FUNCTIONS.get(node.func.value.id, ())):
            what = f"{node.func.value.id}.{node.func.attr}"
        if what is None:
            continue
        first = node.args[0] if node.args else None
        if not (isinstance(first, ast.Constant) and isinstance(first.value, (str, bytes))):
            raise ValueError(f"{row}: its tests run {what}() on a computed value ({ast.unparse(node)[:120]!r}): a "
                             "check that would execute a value (possibly the response's) as code is refused; "
                             "compare the value itself instead")


class _Rewrite(ast.NodeTransformer):
    """Asserts into counted strict checks, comparisons into strict ones (the module docstring)."""

    def visit_Assert(self, node: ast.Assert) -> ast.stmt:
        self.generic_visit(node)
        call = ast.Call(ast.Name(ASSERT, ast.Load()), [node.test], [])
        return ast.copy_location(ast.Expr(call), node)

    def visit_Compare(self, node: ast.Compare) -> ast.expr:
        self.generic_visit(node)
        ops = [ast.Constant(_OPS[type(op)]) for op in node.ops]
        if len(node.ops) == 1:
            call = ast.Call(ast.Name(CMP, ast.Load()), [ops[0], node.left, node.comparators[0]], [])
        else:  # a < b < c: b once, c only when a < b holds, as Python evaluates a chain
            lazy = [ast.Lambda(ast.arguments([], [], None, [], [], None, []), c) for c in node.comparators]
            call = ast.Call(ast.Name(CHAIN, ast.Load()), [node.left, ast.List(ops, ast.Load()),
                                                          ast.List(lazy, ast.Load())], [])
        return ast.copy_location(call, node)


def _with_entry_point(tree: ast.Module, entry_point: str | None, row: str) -> ast.Module:
    """HumanEval's rows define `check(candidate)` and name the function in `entry_point`; the call
    `check(<entry_point>)` is added when the tests define `check` and never call it at module level."""
    if not entry_point:
        return tree
    if not (isinstance(entry_point, str) and entry_point.isidentifier()):
        raise ValueError(f"{row}: entry_point must be a function's name, got {entry_point!r}")
    defines = any(isinstance(s, ast.FunctionDef) and s.name == "check" for s in tree.body)
    calls = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "check"
                for s in tree.body if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                for n in ast.walk(s))
    if defines and not calls:
        tree.body.append(ast.parse(f"check({entry_point})").body[0])
    return tree


def row_name(row: dict) -> str:
    """How an error names a row: its task_id (MBPP, HumanEval), id or name, else the start of its tests, else its
    prompt."""
    for key in ("task_id", "id", "name"):
        if row.get(key) not in (None, ""):
            return f"row {row[key]!r}"
    for key in ("test_list", "tests", "test", "prompt"):
        value = row.get(key)
        first = value if isinstance(value, str) else next(iter(value), "") if hasattr(value, "__iter__") else ""
        if str(first).strip():
            return f"the row whose {key} begins {str(first).strip()[:60]!r}"
    return "a row without tests or prompt"


def plan(setup: str, tests: list[str], row: dict) -> Plan:
    """The judge's plan for a row's tests (module docstring); ValueError naming the row for a row that cannot be
    judged: nothing to check, nothing of the response used, a test that does not parse, a value run as code."""
    name = row_name(row)
    if not tests:
        raise ValueError(f"{name}: it has no tests (test_list, tests or test): nothing to check is never a pass")
    setup_tree = _parse(setup, "setup code", name)
    body: list[ast.stmt] = []
    for i, test in enumerate(tests):
        body += _parse(test, f"test {i + 1}", name).body
    tree = _with_entry_point(ast.Module(body, []), row.get("entry_point"), name)
    if not any(isinstance(n, ast.Assert) for n in ast.walk(tree)):
        raise ValueError(f"{name}: its tests hold no check (no assert statement): nothing to check is never a pass; "
                         "give the row asserts on the function under test")
    try:
        text = ast.unparse(tree)
        bound, loads = _globals(text)
        setup_bound = _globals(setup)[0]
        bound |= setup_bound
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ValueError(f"{name}: its tests cannot be analysed: {exc}") from None
    free = sorted(loads - bound - BUILTIN_NAMES)
    modules = [n for n in free if n in sys.stdlib_module_names and _only_as_module(n, tree)]
    names = [n for n in free if n not in modules]
    if not names:
        raise ValueError(f"{name}: its tests never use the response's code (every name they use is their own, a "
                         "builtin or a module); a HumanEval-style `def check(candidate)` needs the row's "
                         "`entry_point` or a `check(<function>)` line")
    _refuse_code(tree, bound, name)
    _refuse_code(setup_tree, setup_bound, name)
    constants = sorted({n.value for t in (tree, setup_tree) for n in ast.walk(t)
                        if isinstance(n, ast.Constant) and type(n.value) in (str, bytes)}, key=repr)
    mentioned = {n.id for t in (tree, setup_tree) for n in ast.walk(t) if isinstance(n, ast.Name)}
    mentioned |= {a.name.split(".")[0] for t in (tree, setup_tree) for n in ast.walk(t) if isinstance(n, ast.Import)
                  for a in n.names} | {n.module.split(".")[0] for t in (tree, setup_tree) for n in ast.walk(t)
                                       if isinstance(n, ast.ImportFrom) and n.module}
    guarded = {m: list(fs) for m, fs in CODE_FUNCTIONS.items() if m in mentioned}
    rewritten = ast.fix_missing_locations(_Rewrite().visit(tree))
    return Plan(setup, ast.unparse(rewritten), names, modules, constants, guarded)
