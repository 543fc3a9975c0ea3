"""The documentation holds together: README.md is the entrance (at most 300 lines, every recipe in its table),
every relative link and #anchor in README.md, docs/*.md and bench/RESULTS.md resolves, and docs/README.md maps
every page. (That docs/configuration.md is current is tests/test_config.py's check.) Pure Python: no Ray, milliseconds."""

from __future__ import annotations

import re
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
        ("DPO: does preference optimisation learn? (`bench/dpo.py`)", "dpo-does-preference-optimisation-learn-benchdpopy"),
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
    missing = [p.name for p in sorted((ROOT / "configs" / "recipes").glob("*.yaml")) if f"configs/recipes/{p.name}" not in text]
    assert not missing, f"recipes missing from README.md's table: {missing}"


def test_every_docs_page_is_on_the_map():
    """docs/README.md, the map of docs/, links every page of it."""
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for _, target in links(index.read_text(encoding="utf-8"))}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p != index and p.resolve() not in linked]
    assert not missing, f"docs pages missing from docs/README.md: {missing}"

