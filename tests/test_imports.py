"""`import pipeline` and `import stages` stay light (docs/architecture.md)."""

import subprocess
import sys

from conftest import ENV_CHANGED_BY_COLLECTION, ROOT


def test_package_imports_pull_in_no_heavy_packages():
    code = (
        "import sys, pipeline, stages, pipeline.config, pipeline.runner, pipeline.registry, "
        "stages.data, stages.model, stages.common.models, stages.common.tasks, stages.data.formats; "
        "print(sorted(m for m in ('ray', 'vllm', 'deepspeed', 'torch', 'mlflow', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _project_imports() -> dict[str, set[str]]:
    """{module: project modules it imports}, counting imports inside functions too (they still couple).

    Imports under `if TYPE_CHECKING:` are left out: they never run, they only name types."""
    import ast

    def nodes(node):
        yield node
        for child in ast.iter_child_nodes(node):
            if not (isinstance(child, ast.If) and getattr(child.test, "id", None) == "TYPE_CHECKING"):
                yield from nodes(child)

    files = {}
    for package in ("pipeline", "stages"):
        for f in (ROOT / package).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            files[name] = f
    graph = {}
    for name, f in files.items():
        found = set()
        for node in nodes(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_among_the_project_modules():
    graph = _project_imports()
    assert "stages.ppo" in graph and "stages.ppo.config" in graph["stages.ppo"]  # the walk sees imports
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_stages_common_holds_only_what_two_or_more_stages_share():
    """A module used by one stage lives with that stage (stages/ppo/, stages/data/), not in common/. A stage
    uses a common module directly or through other common modules (sft and dpo reach the engines through
    `common.evaluation`)."""
    graph = _project_imports()
    common = [m for m in graph if m.startswith("stages.common.")]
    assert "stages.common.training" in common

    def reaches(m: str, module: str, seen: set) -> bool:
        deps = graph.get(m, set())
        return module in deps or any(d.startswith("stages.common.") and d not in seen and reaches(d, module, seen | {d})
                                     for d in deps)

    for module in common:
        users = {m.split(".")[1] for m in graph
                 if m.startswith("stages.") and not m.startswith("stages.common") and reaches(m, module, set())}
        assert len(users) >= 2, f"{module} is used by {sorted(users) or 'no stage'} only; move it to that stage"


def test_importing_the_test_modules_leaves_the_environment_as_it_was():
    """No test module changes os.environ on import: the subprocesses the suite starts later (the
    command-line smoke run) must see the user's environment. TRL's import set VLLM_LOGGING_LEVEL=ERROR,
    and the smoke run's ppo log lost vLLM's lines in the full suite only (conftest records the change)."""
    assert not ENV_CHANGED_BY_COLLECTION, f"changed while collecting (before, after): {ENV_CHANGED_BY_COLLECTION}"
