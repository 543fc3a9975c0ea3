"""Writes this example's files, the way a user brings their own (run once; the files are committed):

    .venv/bin/python examples/own_job/make_examples.py

- `sft_sharegpt.jsonl`: 400 chats in ShareGPT form (`conversations`: `from` human / gpt, `value`).
- `rl_prompts.jsonl`: RL prompts in the user's own columns, `question` and `final` (mapped to `prompt` and
  `answer` by the recipe's `columns:`), plus `aliases`, other accepted spellings that the reward reads.
- `eval.jsonl`: 320 held-out questions in the same columns, never in any training file.

The task: write a number from 1 to 999 in English words ("three hundred forty-seven"). Its answers are
words, not digits, so the arithmetic verifier cannot score it: the recipe sets `task.verifier: exact`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen").split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
WORDINGS = ("Write the number {n} in words.", "How do you write {n} in English words?", "Spell out {n} in words.",
            "{n} in words, please.")


def words(n: int, joiner: str = "-", and_: bool = False) -> str:
    """1-999 in English words: 347 -> 'three hundred forty-seven'."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + (joiner + ONES[n % 10] if n % 10 else "")
    rest = n % 100
    return ONES[n // 100] + " hundred" + ((" and " if and_ else " ") + words(rest, joiner) if rest else "")


def aliases(n: int) -> list[str]:
    """Other spellings a reader accepts: without the hyphen, British 'and'."""
    forms = {words(n, " "), words(n, "-", True), words(n, " ", True)} - {words(n)}
    return sorted(forms)


def question(n: int, rng: random.Random) -> str:
    return rng.choice(WORDINGS).format(n=n)


def main() -> None:
    rng = random.Random(0)
    numbers = list(range(1, 1000))
    rng.shuffle(numbers)
    held_out, train = numbers[:320], numbers[320:]
    rows = lambda ns: [{"question": question(n, rng), "final": words(n), "aliases": aliases(n)} for n in ns]  # noqa: E731
    sft = [{"conversations": [{"from": "human", "value": question(n, rng)}, {"from": "gpt", "value": words(n)}]}
           for n in train[:400]]
    for name, data in (("sft_sharegpt", sft), ("rl_prompts", rows(train)), ("eval", rows(held_out))):
        (HERE / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
        print(f"{name}.jsonl: {len(data)} rows")


if __name__ == "__main__":
    main()
