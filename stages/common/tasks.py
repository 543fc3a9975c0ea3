"""The embedded default task: integer arithmetic with verifiable answers.

Why arithmetic: every answer can be checked exactly (the verifier is the reward for PPO and the
accuracy metric for SFT), a model of a few million parameters learns it on a CPU in minutes, and
plausible wrong answers (off by one, a dropped carry) make honest preference pairs.

Everything here is pure Python and deterministic under the seed: the same config and seed give
the same rows on every machine. Later stages use `verify` (and `extract_answer`) for rewards.
"""

from __future__ import annotations

import importlib
import random
import re
from typing import Callable, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.schema import Section

Op = Literal["+", "-", "*"]

PROMPT_TEMPLATES = (
    "What is {a} {op} {b}?",
    "Compute {a} {op} {b}.",
    "{a} {op} {b} = ?",
    "Calculate {a} {op} {b}.",
)


class PreferenceConfig(Section):
    """A gold preference over responses: it labels the generated preference pairs (with noise) and judges
    the RL policy on held-out prompts, the simulated-annotator set-up of Gao et al. 2022 and AlpacaFarm."""

    gold: str | None = Field(None, description="'explained' (built in: a point for showing the worked steps and "
                             "a point for closing with 'The answer is N.' where N is the result the steps reached; "
                             "blind to whether the arithmetic is right) or 'module:function' taking (prompt, "
                             "response) and returning a float, higher preferred. Generated SFT answers then come in "
                             "four styles (bare number, steps, stated answer, steps then stated answer) and each "
                             "generated pair is two styles of the same correct answer, labelled by the gold "
                             "function. Empty: a pair is a correct answer over a plausible wrong one.")
    noise: float = Field(0.15, ge=0, lt=0.5, description="Share of generated pairs whose label is flipped: human "
                         "preference data disagrees with itself on 10-30% of pairs.")

    @field_validator("gold")
    @classmethod
    def _gold_form(cls, v: str | None) -> str | None:
        if v is not None and v not in GOLD and (":" not in v or not all(v.split(":", 1))):
            raise ValueError(f"must be one of {', '.join(GOLD)} or 'module:function', got {v!r}")
        return v


class TaskConfig(Section):
    """The generated task: integer arithmetic problems, evaluated left to right."""

    name: Literal["arithmetic"] = Field("arithmetic", description="Task family; only 'arithmetic' is built in.")
    min_digits: int = Field(1, ge=1, le=9, description="Fewest digits of an operand.")
    max_digits: int = Field(2, ge=1, le=9, description="Most digits of an operand (>= min_digits).")
    ops: list[Op] = Field(["+", "-"], min_length=1, description="Operators to draw from: any of '+', '-', '*'.")
    operands: int = Field(2, ge=2, le=4, description="Operands per problem, evaluated left to right "
                          "(`3 + 5 - 7`). With more than 2 the worked answer shows each intermediate result "
                          "(`8 - 7 = 1`), so every step is one small fact the model can learn.")
    calculator: float = Field(0.0, ge=0, le=1, description="Share of the generated SFT answers that call the "
                              "calculator tool instead of answering in their head: the assistant calls "
                              "calculator(expression), reads its result in a `tool` turn, then answers 'The answer is "
                              "N.' (docs/tools.md). With stages.ppo.environment.name: calculator, RL learns when "
                              "to call "
                              "it. 0: no tool calls (the default).")
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig, description="A gold preference over "
                                         "responses that labels the generated pairs and judges RL (empty: none).")
    verifier: str = Field("number", description="How every correctness score (SFT held-out accuracy, the RL rule "
                          "reward `verifier`, evaluation, batch-infer scoring) checks a response against its row's "
                          "`answer`: number, exact (normalised text), choice (a letter A-J), regex (the answer is a "
                          "pattern), math (math-verify: LaTeX, \\boxed{}, equivalent forms), or 'module:function' "
                          "taking (response, answer) and returning a bool (stages/common/verifiers.py).")

    @field_validator("verifier")
    @classmethod
    def _verifier_form(cls, v: str) -> str:
        # stages.common.verifiers.BUILTINS (import stays light)
        builtins = ("number", "exact", "choice", "regex", "math")
        if v not in builtins and (":" not in v or not all(v.split(":", 1))):
            raise ValueError(f"must be one of {', '.join(builtins)} or 'module:function', got {v!r}")
        return v

    @model_validator(mode="after")
    def _digits_ordered(self) -> "TaskConfig":
        if self.max_digits < self.min_digits:
            raise ValueError(
                f"max_digits ({self.max_digits}) must be >= min_digits ({self.min_digits}); raise max_digits"
            )
        return self


def _operand(rng: random.Random, cfg: TaskConfig) -> int:
    digits = rng.randint(cfg.min_digits, cfg.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _problem(rng: random.Random, cfg: TaskConfig) -> tuple[str, str, int, str]:
    """Draw one problem: (prompt, worked answer text, integer answer, problem id).

    The problem id (`7 + 35`) is the rows' `group`: the data stage splits train/eval by it, so a
    held-out problem is held out in every wording and in every dataset.
    """
    nums = [_operand(rng, cfg) for _ in range(cfg.operands)]
    ops = [rng.choice(cfg.ops) for _ in range(cfg.operands - 1)]
    problem = " ".join([str(nums[0])] + [f"{op} {n}" for op, n in zip(ops, nums[1:])])
    # The worked answer: each left-to-right reduction (`3 + 5 - 7` -> `8 - 7 = 1`). It does not
    # restate the problem: the first operand follows a space in the prompt and none in the answer,
    # so a byte-level BPE model would have to learn to map " 3" to "3", which a tiny model learns
    # last. Two-operand answers keep the familiar `3 + 5 = 8`.
    steps, value = [problem], nums[0]
    for i, (op, n) in enumerate(zip(ops, nums[1:])):
        value = {"+": value + n, "-": value - n, "*": value * n}[op]
        steps.append(" ".join([str(value)] + [f"{o} {m}" for o, m in zip(ops[i + 1:], nums[i + 2:])]))
    a, rest = problem.split(" ", 1)
    op, b = rest.split(" ", 1)
    prompt = rng.choice(PROMPT_TEMPLATES).format(a=a, op=op, b=b)
    return prompt, " = ".join(steps if cfg.operands == 2 else steps[1:]), value, problem


def _wrong_value(rng: random.Random, value: int) -> int:
    """A plausible wrong answer: off by one or ten, a dropped carry, or a swapped digit pair."""
    while True:
        kind = rng.randrange(4)
        if kind == 0:
            wrong = value + rng.choice((-1, 1))
        elif kind == 1:
            wrong = value + rng.choice((-10, 10))
        elif kind == 2:
            wrong = value + rng.choice((-100, 100, -1, 1)) * rng.randint(1, 9)
        else:
            digits = list(str(abs(value)))
            if len(digits) < 2:
                continue
            i = rng.randrange(len(digits) - 1)
            digits[i], digits[i + 1] = digits[i + 1], digits[i]
            wrong = int("".join(digits)) * (-1 if value < 0 else 1)
        if wrong != value:
            return wrong


# --------------------------------------------------------------------------- the gold preference
# Answer styles of the generated task when a gold preference is set: the same correct answer written
# four ways. The SFT data mixes them evenly, so the SFT policy writes each about a quarter of the time
# and a preference over them is something RL can move.
STYLES = ("{value}", "{work}", "The answer is {value}.", "{work}. The answer is {value}.")
_STATED = re.compile(r"The answer is (-?\d+)\.$")


def explained(prompt: str, response: str) -> float:
    """The built-in gold preference: 0-2 points, blind to whether the arithmetic is right.

    One point for showing the work (a worked step, `8 - 7 = 1`); one for closing with the stated
    answer (`The answer is 1.`, nothing after it) when that answer is the one the work reached (or
    there is no work). Correctness never enters: a wrong sum explained and stated scores 2. So a
    reward model that learns it learns a style, which the verifier cannot see, and a policy can
    over-optimise a proxy of it (a stated answer that contradicts its own work scores 1 here).
    """
    text = response.strip()
    work = "=" in text
    stated = _STATED.search(text)
    if stated is None:
        return float(work)
    if not work:
        return 1.0
    head = text[: stated.start()]
    reached = _NUMBER.findall(head[head.rindex("=") + 1:]) if "=" in head else []
    return 1.0 + float(bool(reached) and reached[0] == stated.group(1))


GOLD: dict[str, Callable[[str, str], float]] = {"explained": explained}


def gold_function(spec: str) -> Callable[[str, str], float]:
    """The gold preference named by `task.preference.gold`: a built-in name or 'module:function'."""
    if spec in GOLD:
        return GOLD[spec]
    return load_function(spec, "task.preference.gold", f"one of {', '.join(GOLD)} or an importable 'module:function' "
                         "taking (prompt, response) and returning a float")


def load_function(spec: str, key: str, expected: str) -> Callable:
    """The function a config names as 'module:function' (a rule reward, a gold preference); a clear error
    naming `key` and what it should be (`expected`) when it cannot be imported or is not callable."""
    from pipeline.errors import UserError

    module, name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"{key}: cannot load {spec!r} ({exc}); give {expected}") from None
    if not callable(fn):
        raise UserError(f"{key}: {spec!r} is not callable; give {expected}")
    return fn


def styled(work: str, value: int, style: int) -> str:
    """The correct answer written in answer style `style` (an index into STYLES)."""
    return STYLES[style].format(work=work, value=value)


def label_pair(prompt: str, a: str, b: str, gold, flip: bool) -> tuple[str, str, bool] | None:
    """(chosen, rejected, label is gold's) for two responses, or None when gold ties them (no preference
    to learn). `flip` swaps the pair: the label noise of human preference data."""
    ga, gb = float(gold(prompt, a)), float(gold(prompt, b))
    if ga == gb:
        return None
    chosen, rejected = (a, b) if ga > gb else (b, a)
    return (rejected, chosen, False) if flip else (chosen, rejected, True)


# --------------------------------------------------------------------------- rows


def tool_conversation(prompt: str, problem: str, value: int) -> list[dict]:
    """A worked answer through the calculator tool: the call (OpenAI form, its arguments a JSON string as
    the API sends them), the tool's result, the stated answer."""
    import json

    call = {"type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": problem})}}
    return [{"role": "user", "content": prompt, "tool_calls": None},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": str(value), "tool_calls": None},
            {"role": "assistant", "content": f"The answer is {value}.", "tool_calls": None}]


def sft_rows(n: int, seed: int, cfg: TaskConfig) -> list[dict]:
    """`n` chat conversations (user question, assistant worked answer; with a gold preference, the answer in
    one of the four `STYLES`, drawn evenly; with `calculator`, that share of them through the tool)."""
    rng = random.Random(f"sft-{seed}")
    tools = random.Random(f"sft-tools-{seed}")  # its own stream: the problems are the same with or without tools
    rows = []
    for _ in range(n):
        prompt, response, value, group = _problem(rng, cfg)
        if cfg.preference.gold:
            response = styled(response, value, rng.randrange(len(STYLES)))
        if cfg.calculator and tools.random() < cfg.calculator:
            rows.append({"messages": tool_conversation(prompt, group, value), "group": group})
            continue
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        if cfg.calculator:  # one schema for every row (Arrow): the tool rows carry tool_calls
            messages = [{**m, "tool_calls": None} for m in messages]
        rows.append({"messages": messages, "group": group})
    return rows


def preference_rows(n: int, seed: int, cfg: TaskConfig) -> list[dict]:
    """`n` preference pairs. Without a gold preference: the correct answer is chosen over a plausible wrong
    one. With one: two styles of the correct answer, the one gold prefers chosen, except for a `noise`
    share of pairs whose label is flipped (the reward stage re-labels its held-out pairs by the gold function
    and reports its accuracy against both)."""
    rng = random.Random(f"preference-{seed}")
    gold = gold_function(cfg.preference.gold) if cfg.preference.gold else None
    rows = []
    for _ in range(n):
        prompt, response, value, group = _problem(rng, cfg)
        if gold is None:
            head = response.rsplit("=", 1)[0]
            rows.append({"prompt": prompt, "chosen": response, "rejected": f"{head}= {_wrong_value(rng, value)}",
                         "group": group})
            continue
        flip = rng.random() < cfg.preference.noise
        for _attempt in range(20):
            a, b = rng.sample(range(len(STYLES)), 2)
            pair = label_pair(prompt, styled(response, value, a), styled(response, value, b), gold, flip)
            if pair is not None:
                break
        else:
            from pipeline.errors import UserError

            raise UserError(f"task.preference.gold: {cfg.preference.gold} gave every answer style of {prompt!r} the "
                            "same score; a gold function must prefer some styles over others")
        rows.append({"prompt": prompt, "chosen": pair[0], "rejected": pair[1], "group": group})
    return rows


def prompt_rows(n: int, seed: int, cfg: TaskConfig) -> list[dict]:
    """Up to `n` RL prompts with their reference answers (checked by `verify`), one per distinct problem.

    Distinct problems make every held-out prompt an independent test item (a paired sign test
    over prompts assumes it); when the task has fewer than `n` problems, fewer rows come back.
    """
    rng = random.Random(f"prompts-{seed}")
    rows, seen, misses = [], set(), 0
    while len(rows) < n and misses < 20 * n:
        prompt, _, value, group = _problem(rng, cfg)
        if group in seen:
            misses += 1
            continue
        seen.add(group)
        rows.append({"prompt": prompt, "answer": str(value), "group": group})
    return rows


def corpus(cfg: TaskConfig, seed: int, n: int = 2000) -> list[str]:
    """Texts to train the built-in tokenizer on: prompts and answers of every shape the task makes."""
    messages = [m for row in sft_rows(n, seed, cfg) for m in row["messages"]]
    texts = [m["content"] for m in messages]
    # tool calls as the chat template writes them (models.CHAT_TEMPLATE), so BPE learns their pieces
    texts += [f'<tool_call>{{"name": "{c["function"]["name"]}", "arguments": {c["function"]["arguments"]}}}</tool_call>'
              for m in messages for c in m.get("tool_calls") or []]
    texts += [f"{r['chosen']}\n{r['rejected']}" for r in preference_rows(n // 4, seed, cfg)]
    return texts + ["system", "user", "assistant"] * 50


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
# Where a model states its result: "the answer is 12", "Answer: 12", "the sum is 12".
_MARKER = re.compile(r"\b(?:answer|result|total|sum)\b\s*(?:is|was|would be|=|:)", re.IGNORECASE)


def _first_number(text: str) -> int | float | None:
    """The first number in `text`; a decimal with an integer value as that integer ("12.0" -> 12)."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    value = float(m.group())
    return int(value) if value.is_integer() else value


def extract_answer(response: str) -> int | float | None:
    """The answer a response gives, in the forms models write it (thousands commas ignored):

    1. after the last stated marker ("the answer is", "Answer:", "the sum is"), its first number;
    2. else after the last "=", its first number: the worked form this task trains ("3 + 5 = 8"),
       and "7 + 5 = 12 (7 more than 5)"; nothing after it is an answer cut off, so None;
    3. else after the last "is", its first number ("The sum of 7 and 5 is 12.");
    4. else the first number: an answer followed by its explanation ("12. I added 7 and 5").

    Why not the last integer, as before: chat models explain after answering ("12 (7 more than 5)"
    ended on 5) and write decimals ("12.0" ended on 0)."""
    text = response.replace(",", "")
    markers = list(_MARKER.finditer(text))
    if markers:
        return _first_number(text[markers[-1].end():])
    if "=" in text:
        return _first_number(text[text.rindex("=") + 1:])
    stated = re.split(r"\bis\b", text, flags=re.IGNORECASE)
    if len(stated) > 1:
        found = _first_number(stated[-1])
        if found is not None:
            return found
    return _first_number(text)


def verify(response: str, answer: str) -> bool:
    """True when the answer the response gives (`extract_answer`) equals the reference answer."""
    got = extract_answer(response)
    try:
        expected = float(str(answer).strip().replace(",", ""))
    except ValueError:  # a reference that is not a number (a user's dataset) matches nothing
        return False
    return got is not None and got == expected
