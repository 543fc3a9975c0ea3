"""The suite's tiers and start-up allowance (tests/helpers/tiers.py, tests/helpers/starts.py), run as pytest
runs them: each case writes a small test project, and pytest runs it in-process (pytester) with the plugin."""

from __future__ import annotations

import ast
import json
import os
import subprocess

import pytest

from conftest import ROOT
from helpers import starts, tiers

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

PROJECT = {
    ".gitignore": "__pycache__/\n.pytest_cache/\n",  # what pytest writes is no change to the checkout
    "code/ppo.py": "X = 1\n",
    "code/serve.py": "Y = 1\n",
    "docs/notes.md": "notes\n",
    "pyproject.toml": "[tool.pytest.ini_options]\ntestpaths = ['tests']\n",
    "tests/test_things.py": '''
import pytest

def test_base():
    pass

@pytest.mark.tier("faults", covers=("code/ppo.py",))
def test_killed_rank():
    pass

@pytest.mark.tier("e2e", covers=("code/serve.py", "code/ppo.py"))
def test_whole_run():
    pass
''',
}


def git(path, *args) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}  # never a calling hook's repository
    out = subprocess.run(["git", *args], cwd=path, capture_output=True, text=True, env={**env, **GIT_ENV})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.fixture
def project(pytester):
    for name, text in PROJECT.items():
        (pytester.path / name).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / name).write_text(text)
    git(pytester.path, "init", "-q")
    git(pytester.path, "add", ".")
    git(pytester.path, "commit", "-qm", "first")
    return pytester


def record(path, commit: str) -> None:
    (path / "tests" / "full_pass.json").write_text(json.dumps({"commit": commit, "date": "2026-12-01 17:00 UTC"}))
    git(path, "add", ".")
    git(path, "commit", "-qm", "full pass")


def run(project, *args):
    return project.runpytest_inprocess("-p", "helpers.tiers", *args)


def test_a_changed_covered_file_runs_its_tier_and_the_others_are_listed_before_the_closing_line(project):
    first = git(project.path, "rev-parse", "HEAD")
    record(project.path, first)
    (project.path / "code" / "serve.py").write_text("Y = 2\n")  # uncommitted changes count too
    result = run(project, "--tiers=changed")
    result.assert_outcomes(passed=2, deselected=1)  # the base test and the e2e run that covers serve.py
    lines = result.outlines
    skipped = [line for line in lines if line.startswith("not run:")]
    assert skipped == [f"not run: tests/test_things.py::test_killed_rank (tier faults: covers code/ppo.py, unchanged "
                       f"since {first[:10]} (full pass 2026-12-01 17:00 UTC))"]
    assert lines.index(skipped[0]) < len(lines) - 1 and "passed" in lines[-1]  # the closing line stays last
    assert any(f"1 tiered test(s) not run, 1 run (code changed since the full pass {first[:10]}" in x for x in lines)


def test_a_leaf_change_runs_the_base_tier_alone(project):
    record(project.path, git(project.path, "rev-parse", "HEAD"))
    (project.path / "docs" / "notes.md").write_text("more notes\n")
    git(project.path, "commit", "-qam", "docs")
    result = run(project, "--tiers=changed")
    result.assert_outcomes(passed=1, deselected=2)
    assert sum(line.startswith("not run:") for line in result.outlines) == 2


def test_a_change_to_a_tiered_tests_own_module_or_the_shared_helpers_runs_it():
    changed = {"tests/helpers/cluster.py"}
    assert tiers.touched(("stages/ppo/",), "tests/test_ppo_stage.py", changed) == ["tests/helpers/cluster.py"]
    assert tiers.touched(("stages/ppo/",), "tests/test_ppo_stage.py", {"tests/test_ppo_stage.py"})
    assert tiers.touched(("stages/ppo/",), "tests/test_ppo_stage.py", {"stages/ppo/rl.py", "README.md"}) == \
        ["stages/ppo/rl.py"]
    assert not tiers.touched(("stages/ppo/",), "tests/test_ppo_stage.py", {"stages/ppox.py", "docs/x.md"})
    assert not tiers.touched(("stages/ppo.py",), "tests/t.py", {"stages/ppo.pyc"})  # a file matches whole


def test_a_file_moved_out_of_a_covered_folder_counts_as_a_change_there(project):
    first = git(project.path, "rev-parse", "HEAD")
    (project.path / "lib").mkdir()
    git(project.path, "mv", "code/ppo.py", "lib/ppo.py")
    git(project.path, "commit", "-qm", "move")
    changed = tiers.changed_since(project.path, first)
    assert {"code/ppo.py", "lib/ppo.py"} <= changed
    assert tiers.touched(("code/",), "tests/test_things.py", changed) == ["code/ppo.py"]


@pytest.mark.parametrize("covers, why", [
    (("code",), "a folder ends with '/'"), (("code/ppo.py/",), "a folder ends with '/' and a file does not"),
    (("./code/ppo.py",), "relative to the repository's root"), (("/etc/hosts",), "relative to the repository's root"),
    (("code/../code/ppo.py",), "relative to the repository's root")])
def test_covered_paths_are_spelled_as_git_spells_them(project, covers, why):
    assert why in tiers.problem("e2e", covers, project.path)
    assert tiers.problem("e2e", ("code/", "code/ppo.py"), project.path) is None


def test_without_a_record_or_with_one_from_another_history_every_tier_runs(project):
    result = run(project, "--tiers=changed")
    result.assert_outcomes(passed=3)
    assert any("every tier runs: no full pass recorded" in line for line in result.outlines)
    record(project.path, "0" * 40)
    result = run(project, "--tiers=changed")
    result.assert_outcomes(passed=3)
    assert any("is not in this checkout's history" in line for line in result.outlines)


def test_the_default_runs_everything(project):
    record(project.path, git(project.path, "rev-parse", "HEAD"))
    run(project).assert_outcomes(passed=3)


@pytest.mark.parametrize("covers, why", [("()", "declares no covered code"),
                                         ("('code/renamed.py',)", "covers code/renamed.py, which does not exist")])
def test_a_tiered_test_without_existing_covered_code_fails_and_is_never_left_out(project, covers, why):
    record(project.path, git(project.path, "rev-parse", "HEAD"))
    (project.path / "tests" / "test_rot.py").write_text(
        f"import pytest\n\n@pytest.mark.tier('e2e', covers={covers})\ndef test_rotting():\n    pass\n")
    result = run(project, "--tiers=changed")
    result.assert_outcomes(passed=1, errors=1, deselected=2)  # fails at set-up, never deselected
    assert any(why in line for line in result.outlines)


def test_a_full_pass_is_recorded_only_when_everything_ran_and_passed_on_a_clean_checkout(project):
    head = git(project.path, "rev-parse", "HEAD")
    result = run(project, "--record-full-pass")
    result.assert_outcomes(passed=3)
    data = json.loads((project.path / "tests" / "full_pass.json").read_text())
    assert data["commit"] == head and data["passed"] == 3 and "date" in data
    (project.path / "tests" / "full_pass.json").unlink()
    run(project, "--record-full-pass", "-k", "base")
    assert not (project.path / "tests" / "full_pass.json").exists()  # part of the suite
    run(project, "--record-full-pass", "--co")
    assert not (project.path / "tests" / "full_pass.json").exists()  # nothing ran
    (project.path / "code" / "ppo.py").write_text("X = 2\n")
    result = run(project, "--record-full-pass")
    assert not (project.path / "tests" / "full_pass.json").exists()  # uncommitted changes
    assert any("full pass not recorded: uncommitted changes" in line for line in result.outlines)
    git(project.path, "commit", "-qam", "ppo")
    (project.path / "tests" / "test_commits.py").write_text(  # a commit made while the suite runs
        "import os, subprocess\n\ndef test_commit():\n    env = {k: v for k, v in os.environ.items() if not "
        "k.startswith('GIT_')}\n    subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', "
        "'-q', '--allow-empty', '-m', 'during'], check=True, env=env)\n")
    git(project.path, "add", ".")
    git(project.path, "commit", "-qm", "a test that commits")
    result = run(project, "--record-full-pass")
    assert not (project.path / "tests" / "full_pass.json").exists()  # HEAD moved: the new commit was not tested
    assert any("the checkout changed while the suite ran" in line for line in result.outlines)
    (project.path / "tests" / "test_commits.py").unlink()
    git(project.path, "commit", "-qam", "no more")
    (project.path / "tests" / "test_things.py").write_text(PROJECT["tests/test_things.py"] + "\ndef test_broken():\n"
                                                           "    assert False\n")
    git(project.path, "commit", "-qam", "broken")
    result = run(project, "--record-full-pass")
    assert not (project.path / "tests" / "full_pass.json").exists()  # a failure
    assert any("full pass not recorded: the run did not pass" in line for line in result.outlines)


# --------------------------------------------------------------------------- the start-up allowance
STARTING = '''
import pytest
from pipeline.events import record_start
{declaration}

@pytest.fixture(scope="session")
def shared_run():
    record_start("pipelines")  # a session fixture's starts are the suite's, not this module's

def test_one(shared_run):
    record_start("ray")
    record_start("vllm_engines", count=2)

def test_two():
    pass
'''


@pytest.mark.parametrize("declaration, outcome", [
    ('STARTS = {"ray": 1, "vllm_engines": 2}', {"passed": 2}),
    ('STARTS = {"ray": 1, "vllm_engines": 1}', {"passed": 2, "errors": 1}),
    ("", {"passed": 2, "errors": 1}),
    ('STARTS = {"rays": 1}', {"passed": 2, "errors": 1}),
])
def test_a_module_that_starts_more_than_it_declares_fails_at_its_end(pytester, monkeypatch, declaration, outcome):
    monkeypatch.setenv("PIPELINE_START_LEDGER", str(pytester.path / "ledger.jsonl"))  # not the suite's own ledger
    pytester.makepyfile(test_mod=STARTING.format(declaration=declaration))
    result = pytester.runpytest_inprocess("-p", "helpers.starts")
    result.assert_outcomes(**outcome)
    text = "\n".join(result.outlines)
    if "errors" in outcome and "rays" in declaration:
        assert "STARTS names rays; the kinds are pipelines, ray" in text
    elif "errors" in outcome:
        assert "started more than its STARTS allowance (" in text and "vllm_engines: started 2, declares" in text
        assert "at test_two" in text or "ERROR at teardown of test_two" in text  # the module's last test
    assert "shared (shared_run): pipelines 1" in text  # counted apart, never against the module
    assert "whole run: pipelines 1, ray 1, vllm_engines 2" in text


def test_the_ledger_skips_a_line_cut_short_and_counts_only_inside_the_window(tmp_path):
    ledger = tmp_path / "l.jsonl"
    ledger.write_text('{"t": 10, "kind": "ray", "n": 1}\n{"t": 20, "kind": "vllm_engines", "n": 3}\n{"t": 30, "ki')
    lines = starts.read_ledger(ledger)
    assert len(lines) == 2
    assert starts.count(lines, 0, 100, []) == {"ray": 1, "vllm_engines": 3}
    assert starts.count(lines, 15, 100, []) == {"vllm_engines": 3}
    assert starts.count(lines, 0, 100, [(19, 21)]) == {"ray": 1}  # inside a session fixture's set-up


# --------------------------------------------------------------------------- the suite's own declarations
def _tier_calls(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "tier":
            yield node


def test_every_tiered_test_of_the_suite_declares_covered_code_that_exists():
    """Read from the files, so it holds for the tests a run leaves out too."""
    found, bad = 0, []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for call in _tier_calls(path):
            found += 1
            name = ast.literal_eval(call.args[0]) if call.args else ""
            covers = next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "covers"), ())
            why = tiers.problem(name, tuple(covers), ROOT)
            if why:
                bad.append(f"{path.name}:{call.lineno}: {why}")
    assert found >= 10 and not bad, bad


def test_every_module_declares_only_known_start_kinds():
    from pipeline.events import START_KINDS

    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "STARTS" for t in node.targets):
                declared = ast.literal_eval(node.value)
                assert set(declared) <= set(START_KINDS), (path.name, declared)
                assert all(isinstance(v, int) and v >= 0 for v in declared.values()), (path.name, declared)


# --------------------------------------------------------------------------- which tests cover a change to each folder
# The rows of docs/development.md's table: every source folder, and the single-file stages.
FOLDERS = ("pipeline/", "pipeline/upstream/", "stages/common/", "stages/data/", "stages/dpo/", "stages/ppo/",
           "stages/reward/", "stages/serve/", "stages/tune/", "stages/batch_infer.py", "stages/compare.py",
           "stages/model.py", "stages/sft.py", "configs/", "scripts/")
TABLE_START, TABLE_END = "<!-- covers table (tests/test_tiers.py) -->", "<!-- end of the covers table -->"


def coverage_table() -> str:
    """docs/development.md's table, from the tier declarations in the files: for each folder, the tiered test
    modules whose `covers` reach into it (a covered path inside the folder, or a covered folder holding it)."""
    modules: dict[str, set[str]] = {folder: set() for folder in FOLDERS}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for call in _tier_calls(path):
            covers = next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "covers"), ())
            for folder in FOLDERS:
                if any(c.startswith(folder) or (c.endswith("/") and folder.startswith(c)) for c in covers):
                    modules[folder].add(path.name)
    rows = ["| a change to | runs, besides the base tier (every test without a tier, on every change) |", "|---|---|"]
    rows += [f"| `{folder}` | {', '.join(f'`{m}`' for m in sorted(found)) or 'the base tier alone'} |"
             for folder, found in modules.items()]
    return "\n".join(rows)


def test_the_development_guide_says_which_tests_cover_a_change_to_each_folder():
    """The table is the tier declarations' own reading, so it cannot drift from them; on a mismatch, paste this."""
    guide = (ROOT / "docs" / "development.md").read_text()
    assert TABLE_START in guide and TABLE_END in guide, f"docs/development.md lacks {TABLE_START}"
    written = guide.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert written == coverage_table(), "docs/development.md's covers table is stale; it should read:\n" \
        + coverage_table()
    every_source = {p.relative_to(ROOT).parts[0] + "/" + p.relative_to(ROOT).parts[1] for p in ROOT.glob("stages/*")
                    if not p.name.startswith("_") and p.name != "__pycache__"}
    assert {s + ("/" if (ROOT / s).is_dir() else "") for s in every_source} <= set(FOLDERS)
