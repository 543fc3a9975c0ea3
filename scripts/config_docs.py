"""Regenerate the configuration reference, docs/configuration.md, from the config classes' field descriptions.

The table sits between the BEGIN/END markers below; the page's text around them is kept as written.

    .venv/bin/python scripts/config_docs.py          # rewrite docs/configuration.md in place
    .venv/bin/python scripts/config_docs.py --check  # exit 1 if docs/configuration.md is out of date
                                                     # (tests/test_config.py runs this)
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PAGE = ROOT / "docs" / "configuration.md"
BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def table() -> str:
    from pipeline.config import reference

    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {f'`{d}`' if d else ''} | {desc.replace('|', '/')} |" for k, d, desc in reference()]
    return "\n".join(lines)


def render(page: str) -> str:
    if BEGIN not in page or END not in page:
        raise SystemExit(f"{PAGE}: the markers {BEGIN} and {END} are missing")
    head, _, rest = page.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    text = PAGE.read_text()
    new = render(text)
    if "--check" in sys.argv:
        sys.exit(0 if new == text else 1)
    PAGE.write_text(new)
