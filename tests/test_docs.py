"""The documentation holds together: README.md is the entrance (at most 300 lines, every recipe in its table),
every relative link and #anchor in README.md, docs/*.md and bench/RESULTS.md resolves, docs/README.md maps
every page, every repository path README.md and docs/ name exists, and every command their shell blocks show
parses (`python -m pipeline ...` by the CLI's own parser, `make TARGET` against the Makefile). (That
docs/configuration.md is current is tests/test_config.py's check.) Pure Python: no Ray, milliseconds."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 300

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the text may hold one level of brackets ([`a[0]`](x.md)).
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    files = [README, *sorted((ROOT / "docs").glob("**/*.md"))]
    results = ROOT / "bench" / "RESULTS.md"
    return files + [results] if results.exists() else files


def prose_lines(text: str):
    """(line number, line) for every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
        elif fence is not None and m and m.group(1).startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
        elif fence is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation other than '-' and '_'
    dropped, each space a hyphen (runs of spaces are not collapsed, as GitHub does not)."""
    text = CODE_SPAN.sub(lambda m: m.group(2).strip(), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a markdown file defines: heading slugs (a repeated one gets -1, -2, ...) and <a name/id>."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in prose_lines(text):
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str):
    """(line number, target) of every link outside code: inline links, images and reference definitions."""
    for number, line in prose_lines(text):
        m = REFERENCE_DEF.match(line)
        if m:
            yield number, m.group(1)
            continue
        for m in INLINE_LINK.finditer(CODE_SPAN.sub("code", line)):
            yield number, m.group(1).strip("<>")


def broken_links(path: Path) -> list[str]:
    """What does not resolve in one markdown file: missing files, and #anchors no heading of the target has."""
    text = path.read_text(encoding="utf-8")
    problems = []
    for number, target in links(text):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{number}: {target}"
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{where}: no such file")
            continue
        if anchor and dest.suffix == ".md" and dest.is_file():
            if unquote(anchor).lower() not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_anchor_resolves(path):
    problems = broken_links(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "heading, expected",
    [
        ("Operations: clusters, jobs, schedules, faults", "operations-clusters-jobs-schedules-faults"),
        ("The artifact store (`pipeline/storage.py`)", "the-artifact-store-pipelinestoragepy"),
        ("Serving (`serve`) and batch inference (`batch_infer`)", "serving-serve-and-batch-inference-batch_infer"),
        ("DPO: does preference optimisation learn? (`bench/dpo.py`)",
         "dpo-does-preference-optimisation-learn-benchdpopy"),
        ("Speed — 2026-11-28", "speed--2026-11-28"),
        ("See [the docs](docs/README.md) first", "see-the-docs-first"),
    ],
)
def test_slug_matches_github(heading, expected):
    assert slug(heading) == expected


def test_repeated_headings_are_numbered():
    assert anchors("# Notes\n## Notes\n```\n# Notes\n```\n### Notes\n") == {"notes", "notes-1", "notes-2"}


@pytest.mark.parametrize(
    "line, broken",
    [
        ("[ok](target.md#a-heading)", False),
        ("[ok](#local-heading)", False),
        ("[ok](sub/)", False),
        ("![ok](target.md)", False),
        ("[web](https://example.com/nowhere.md#nope)", False),
        ("`[in code](missing.md)`", False),
        ("[missing file](missing.md)", True),
        ("[missing anchor](target.md#no-such-heading)", True),
        ("[missing local anchor](#nowhere)", True),
        ("[a](target.md) and [b](gone.md#x)", True),
        ("[ref]: missing.md", True),
    ],
)
def test_the_checker_finds_broken_links(tmp_path, line, broken):
    (tmp_path / "sub").mkdir()
    (tmp_path / "target.md").write_text("# Title\n\n## A heading\n")
    page = tmp_path / "page.md"
    page.write_text(f"# Local heading\n\n{line}\n\n```\n[in a fence](missing.md)\n```\n")
    assert bool(broken_links(page)) is broken, broken_links(page)


def test_readme_is_the_entrance():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"


def test_readme_lists_every_recipe():
    text = README.read_text(encoding="utf-8")
    missing = [p.name for p in sorted((ROOT / "configs" / "recipes").glob("*.yaml"))
               if f"configs/recipes/{p.name}" not in text]
    assert not missing, f"recipes missing from README.md's table: {missing}"


def test_every_docs_page_is_on_the_map():
    """docs/README.md, the map of docs/, links every page of it."""
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve()
              for _, target in links(index.read_text(encoding="utf-8"))}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p != index and p.resolve() not in linked]
    assert not missing, f"docs pages missing from docs/README.md: {missing}"



# --------------------------------------------------------------------------- paths and commands the docs name
#
# A path the docs name that is not there sends the reader nowhere (docs/tools.md named stages/ppo/sandbox.py
# after it became a package), and a command they show that does not parse fails at the first try. Both are
# checked in README.md and docs/ (bench/RESULTS.md is a log: it names what existed on each date).

# A repository path: a top-level folder of the repository, then the rest; not inside another path or URL.
REPO_PATH = re.compile(r"(?<![\w./~$@:-])((?:stages|pipeline|configs|bench|tests|docs|scripts|examples)/[\w./-]*)")
PLACEHOLDER = "<*{["  # `configs/recipes/<name>.yaml`, `artifacts/*/`: a pattern, not a path
SHELL_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})\s*(bash|sh|shell|console)\s*$")
SHELL_OPERATORS = {"&&", "||", ";", "|"}


def page_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("**/*.md"))]


def named_paths(text: str):
    """(line number, path, pytest node name or '') of every repository path in a page, in prose and code alike:
    `tests/test_x.py::test_y` names a test too; trailing punctuation and `:LINE` are not part of the path."""
    for number, line in enumerate(text.splitlines(), 1):
        for m in REPO_PATH.finditer(line):
            after = line[m.end():m.end() + 1]
            if after and after in PLACEHOLDER:
                continue
            node = re.match(r"::(\w+)", line[m.end():])
            yield number, m.group(1).rstrip(".,;:"), node.group(1) if node else ""


def missing_paths(path: Path) -> list[str]:
    problems = []
    for number, named, node in named_paths(path.read_text(encoding="utf-8")):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{number}"
        target = ROOT / named
        if not target.exists():
            problems.append(f"{where}: {named}: no such file or folder in the repository")
        elif node and not re.search(rf"^\s*(?:async\s+)?def {node}\(", target.read_text(encoding="utf-8"), re.M):
            problems.append(f"{where}: {named}::{node}: no such test in {named}")
    return problems


def shell_commands(text: str):
    """(line number, argv) of every command in a page's bash/sh/shell/console blocks (a line ending in '\\'
    continues on the next; `a && b`, `a | b` are two commands; comments dropped), and of the indented code
    lines that start with `python -m pipeline` or `make`."""
    fence, shell_block, pending, first = None, False, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence, shell_block = m.group(1)[0] * len(m.group(1)), bool(SHELL_FENCE.match(line))
            continue
        if fence is not None and m and m.group(1).startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
            continue
        shell = shell_block if fence is not None else bool(re.match(r"^ {4,}(?:python -m pipeline|make)\b", line))
        if not shell:
            continue
        first = first or number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command, pending = pending + line, ""
        try:
            words = shlex.split(command, comments=True)
        except ValueError:  # an unbalanced quote: prose in a shell block
            words = ["#unparsable", command]
        argv: list[str] = []
        for word in [*words, ";"]:
            if word in SHELL_OPERATORS:
                if argv:
                    yield first, argv
                argv = []
            else:
                argv.append(word)
        first = 0


def pipeline_argv(argv: list[str]) -> list[str] | None:
    """The arguments after `python -m pipeline` in a command (`.venv/bin/python -m pipeline`, or after a wrapper:
    `bash bench/time_and_memory.sh OUT -- .venv/bin/python -m pipeline run ...`); None if it runs no pipeline."""
    for i in range(len(argv) - 2):
        if argv[i].split("/")[-1].startswith("python") and argv[i + 1:i + 3] == ["-m", "pipeline"]:
            return argv[i + 3:]
    return None


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return {t for line in text.splitlines() if (m := re.match(r"^([\w.-]+(?:\s+[\w.-]+)*)\s*:(?!=)", line))
            for t in m.group(1).split()}


def bad_commands(path: Path) -> list[str]:
    """Commands a page shows that would fail before doing anything: `python -m pipeline ...` that the CLI's
    parser refuses (argparse's own message), `make TARGET` for a target the Makefile lacks."""
    from pipeline.__main__ import parse_args  # the parser `main` uses; builds no config, starts nothing

    problems, targets = [], makefile_targets()
    for number, argv in shell_commands(path.read_text(encoding="utf-8")):
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{number}: {shlex.join(argv)}"
        if argv[0] == "#unparsable":
            problems.append(f"{where}: unbalanced quotes")
            continue
        args = pipeline_argv(argv)
        if args is not None:
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                    parse_args(args)
            except SystemExit as exc:
                if exc.code not in (0, None):  # --help exits 0
                    problems.append(f"{where}: {(err.getvalue().strip().splitlines() or ['refused'])[-1]}")
        elif argv[0] == "make":
            unknown = [w for w in argv[1:] if not w.startswith("-") and "=" not in w and w not in targets]
            if unknown:
                problems.append(f"{where}: no Makefile target {', '.join(unknown)}")
    return problems


@pytest.mark.parametrize("path", page_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_the_docs_name_exists(path):
    problems = missing_paths(path)
    assert not problems, "paths that are not in the repository:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", page_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_parses(path):
    problems = bad_commands(path)
    assert not problems, "commands that would fail as written:\n" + "\n".join(problems)


MODEL_URI = re.compile(r"models:/([\w.-]+)(?:@([\w.-]+)|/\d+)?")


def registered_names() -> tuple[set[str], set[str]]:
    """The model names and aliases the pipeline registers: the serve stage's defaults and any a shipped config
    sets (`stages.serve.registry`); nothing else registers a model."""
    from stages.serve import RegistryConfig

    fields = RegistryConfig.model_fields
    names, aliases = {fields["model_name"].default}, {fields["alias"].default}
    for config in (ROOT / "configs").glob("**/*.yaml"):
        text = config.read_text(encoding="utf-8")
        names.update(re.findall(r"^\s*model_name:\s*['\"]?([\w.-]+)", text, re.M))
        aliases.update(re.findall(r"^\s*alias:\s*['\"]?([\w.-]+)", text, re.M))
    return names, aliases


def unregistered_models(path: Path) -> list[str]:
    """`models:/NAME@ALIAS` URIs a page shows that no stage registers (a placeholder in capitals is not one)."""
    names, aliases = registered_names()
    problems = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for m in MODEL_URI.finditer(line):
            name, alias = m.group(1), m.group(2)
            if name.isupper():
                continue
            if name not in names or (alias and not alias.isupper() and alias not in aliases):
                problems.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{number}: "
                                f"{m.group(0)}: nothing registers it (registered: {', '.join(sorted(names))} "
                                f"@ {', '.join(sorted(aliases))}); name a model directory, or register it first")
    return problems


@pytest.mark.parametrize("path", page_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_registry_uri_the_docs_show_is_registered(path):
    """docs/serving.md showed `--reward-model models:/posttrain-reward@champion`, which nothing registers."""
    problems = unregistered_models(path)
    assert not problems, "\n".join(problems)


def test_the_registry_check_finds_an_unregistered_model(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("serve models:/posttrain-policy@champion or models:/NAME@ALIAS;\n"
                    "score with --reward-model models:/posttrain-reward@champion\n")
    assert [p.split(": nothing")[0] for p in unregistered_models(page)] == [
        "page.md:2: models:/posttrain-reward@champion"]


def test_the_docs_show_commands_and_name_paths():
    """The two checks above look at something: the README's first command and the cli page's are found."""
    readme = [argv for _, argv in shell_commands(README.read_text(encoding="utf-8"))]
    assert ["python", "-m", "pipeline", "run", "configs/full.yaml"] in readme
    assert ["make", "run"] in readme
    assert sum(pipeline_argv(a) is not None for p in page_files()
               for _, a in shell_commands(p.read_text(encoding="utf-8"))) >= 30
    assert sum(1 for p in page_files() for _ in named_paths(p.read_text(encoding="utf-8"))) >= 100


PAGE = """# Page

Run `stages/ppo/sandbox.py` and `configs/recipes/<name>.yaml` (a pattern), see tests/test_docs.py::{test}.

```bash
python -m pipeline {command}   # a comment
.venv/bin/python -m pipeline run configs/full.yaml \\
    --only data
make {target} EXTRA=gpu
bash bench/time_and_memory.sh /tmp/x.stats -- .venv/bin/python -m pipeline {command}
```

```python
python -m pipeline not-a-command   # python code, not a shell command
```
"""


@pytest.mark.parametrize("test, command, target, found", [
    ("test_readme_is_the_entrance", "run configs/full.yaml --only sft", "run", []),
    ("test_no_such_thing", "run configs/full.yaml", "run", ["tests/test_docs.py::test_no_such_thing: no such test"]),
    ("test_readme_is_the_entrance", "run configs/full.yaml --froms sft", "run",
     ["unrecognized arguments: --froms"] * 2),
    ("test_readme_is_the_entrance", "trian configs/full.yaml", "run", ["unknown command 'trian'"] * 2),
    ("test_readme_is_the_entrance", "run configs/full.yaml", "runn", ["no Makefile target runn"]),
])
def test_the_checkers_find_missing_paths_and_bad_commands(tmp_path, test, command, target, found):
    page = tmp_path / "page.md"
    page.write_text(PAGE.format(test=test, command=command, target=target))
    paths, commands = missing_paths(page), bad_commands(page)
    assert paths[0] == "page.md:3: stages/ppo/sandbox.py: no such file or folder in the repository"
    problems = paths[1:] + commands
    assert len(problems) == len(found), problems
    for problem, expected in zip(problems, found):
        assert expected in problem, problems
