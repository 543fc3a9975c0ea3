"""Regenerate the README's configuration reference from the config classes' field descriptions.

    .venv/bin/python scripts/config_docs.py          # rewrite README.md in place
    .venv/bin/python scripts/config_docs.py --check  # exit 1 if README.md is out of date (a test runs this)
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def table() -> str:
    from pipeline.config import reference

    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {f'`{d}`' if d else ''} | {desc.replace('|', '/')} |" for k, d, desc in reference()]
    return "\n".join(lines)


def render(readme: str) -> str:
    head, _, rest = readme.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


if __name__ == "__main__":
    path = ROOT / "README.md"
    text = path.read_text()
    new = render(text)
    if "--check" in sys.argv:
        sys.exit(0 if new == text else 1)
    path.write_text(new)
