"""The `code_tests` reward: a response's Python code judged by a row's tests (MBPP's top-level asserts,
HumanEval's `def check(candidate)` with `entry_point`, or any test code), decided by a process that runs nothing
the response chose. docs/security.md states the threat model and why each class of attack cannot pass.

Two sandboxed runs start side by side and talk only through the caller (`relay.converse`, `Referee`):
- the response's run (programs.serve) holds the response's code; it learns the inputs of the calls the test makes
  on that code and answers with values as data (`values.encode`: plain values, else an opaque handle);
- the judge's run (programs.judge) holds the row's setup and its test as `verdict.plan` rewrote it, with the
  response's names bound to what the response's run reported, and decides: every check passed (at least one), a
  check failed, or the row cannot be judged (a ValueError naming the row: the reward's error).
The referee checks every message, forwards only what it rebuilt (`values.canonical`), and fails the row on any
breach: a message nobody asked for, one that is not data, a run that ends or stalls before the verdict.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import stages.ppo.sandbox.programs as programs
import stages.ppo.sandbox.values as values
from stages.ppo.sandbox.process import SandboxLimits
from stages.ppo.sandbox.relay import Concluded
from stages.ppo.sandbox.tiers import converse
from stages.ppo.sandbox.verdict import plan, row_name

_OPEN = re.compile(r"[ \t]*([A-Za-z0-9_+.#-]*)")
_PYTHON_TAGS = {"python", "python3", "py", "py3"}


def extract_code(response: str) -> str:
    """The Python code of a model response: the last ```python (py, python3) fenced block, else the last fenced
    block of any language, else the whole response. A fence that was opened and never closed (the response was
    cut at its token limit) counts as a block running to the end. One pass over the text (linear time: a
    response of a megabyte of unclosed fences costs milliseconds)."""
    blocks, pos = [], 0
    while True:
        start = response.find("```", pos)
        if start < 0:
            break
        newline = response.find("\n", start + 3)
        if newline < 0:  # an opening fence needs the end of its line; no later one has one either
            break
        tag = _OPEN.match(response, start + 3, newline).group(1).lower()
        body = newline + 1
        close = response.find("```", body)
        if close < 0:  # unclosed: the block runs to the end
            blocks.append((tag, response[body:]))
            break
        end = close
        blank = close
        while blank > body and response[blank - 1] in " \t":
            blank -= 1
        if blank > body and response[blank - 1] == "\n":  # the closing fence's own line is not code
            end = blank - 1
        blocks.append((tag, response[body:end]))
        pos = close + 3
    if not blocks:
        return response.strip("\n")
    python = [code for tag, code in blocks if tag in _PYTHON_TAGS]
    return (python or [code for _, code in blocks])[-1].strip("\n")


def _lines(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip() else []
    return [str(v) for v in value if str(v).strip()]  # a list, tuple or numpy array (a parquet list column)


def row_tests(row: dict) -> tuple[str, list[str]]:
    """A row's setup code and its test statements: `test_list` (MBPP), else `tests` (a list, or one string of
    newline-joined asserts), else `test` (one string: HumanEval's, with `entry_point`); setup from
    `test_setup_code` and `test_imports` (MBPP)."""
    row = row or {}
    for key in ("test_list", "tests", "test"):
        tests = _lines(row.get(key))
        if tests:
            break
    setup = "\n".join(_lines(row.get("test_imports")) + _lines(row.get("test_setup_code")))
    return setup, tests



LIMITS = SandboxLimits()  # what each of `code_tests`' two runs gets (tests set smaller ones)
MAX_QUESTIONS = 10_000  # calls and attribute reads one row's test may make of the response's code


@dataclass
class Verdict:
    passed: bool
    detail: str = ""  # why it did not pass
    refused: str = ""  # why the row cannot be judged (the reward's error)


def _line(message: dict) -> bytes:
    return (json.dumps(message, ensure_ascii=True) + "\n").encode()


class Referee:
    """The caller's side of the conversation between the response's run and the judge's (module docstring). The
    response's run speaks first (its names, or that its code failed), then only to answer the one question the
    judge asked; the judge asks one question at a time and ends with its verdict."""

    def __init__(self, names: list[str]):
        self.names, self.loaded, self.waiting, self.questions = names, False, False, 0

    def line(self, who: str, raw: bytes) -> list[tuple[str, bytes]]:
        try:
            message = json.loads(raw)
        except (ValueError, RecursionError):
            message = None
        if type(message) is not dict or len(message) != 1:
            raise Concluded(Verdict(False, f"the {who}'s run wrote something that is not a message"))
        (key, body), = message.items()
        return self._response(key, body) if who == "response" else self._judge(key, body)

    def closed(self, who: str) -> None:
        raise Concluded(Verdict(False, f"the {who}'s run ended before the verdict"))

    @staticmethod
    def _value(tagged, allowed: frozenset):
        """The response's value rebuilt (values.canonical) and checked to build (set members, dict keys hashable)."""
        try:
            clean = values.canonical(tagged, allowed)
            values.decode(clean, lambda tag, data: object())
        except (ValueError, TypeError, RecursionError, OverflowError, MemoryError):
            raise Concluded(Verdict(False, "a value that is not plain data crossed to the judge")) from None
        return clean

    def _response(self, key: str, body) -> list[tuple[str, bytes]]:
        if not self.loaded:
            if key == "failed":
                raise Concluded(Verdict(False, f"the response's code failed: {str(body)[:300]}"))
            if key != "names" or type(body) is not dict or sorted(body) != sorted(self.names):
                raise Concluded(Verdict(False, "the response's run did not report the names the test uses"))
            self.loaded = True
            clean = {n: ["missing"] if t == ["missing"] else self._value(t, values.HANDLE_TAGS)
                     for n, t in body.items()}
            return [("judge", _line({"names": clean}))]
        if not self.waiting:
            raise Concluded(Verdict(False, "the response's run wrote a message no question asked for"))
        self.waiting = False
        if key == "ok":
            return [("judge", _line({"ok": self._value(body, values.HANDLE_TAGS)}))]
        if key == "raise" and type(body) is list and len(body) == 2 and all(type(b) is str for b in body):
            return [("judge", _line({"raise": [body[0][:60], body[1][:300]]}))]
        raise Concluded(Verdict(False, "the response's run answered with something that is not an answer"))

    def _judge(self, key: str, body) -> list[tuple[str, bytes]]:
        if key == "verdict" and type(body) is dict:
            checks, failed, refused = body.get("checks"), body.get("failed"), body.get("refused")
            if refused:
                raise Concluded(Verdict(False, refused=str(refused)[:600]))
            if failed:
                raise Concluded(Verdict(False, f"a check failed: {str(failed)[:300]}"))
            if type(checks) is int and checks > 0:
                raise Concluded(Verdict(True))
            raise Concluded(Verdict(False, "no check ran (the test's asserts were never reached)"))
        if key not in ("call", "get") or not self.loaded or self.waiting or type(body) is not list:
            raise Concluded(Verdict(False, "the judge's run broke the conversation"))
        self.questions += 1
        if self.questions > MAX_QUESTIONS:
            raise Concluded(Verdict(False, f"the test asked more than {MAX_QUESTIONS} calls of the response"))
        ref, attrs = (body + [None, None])[:2]
        if not (type(ref) is int and type(attrs) is list and all(type(a) is str and a.isidentifier() for a in attrs)):
            raise Concluded(Verdict(False, "the judge's run broke the conversation"))
        clean = [ref, attrs]
        if key == "call":
            args, kwargs = (body[2:] + [None, None])[:2]
            if not (type(args) is list and type(kwargs) is list and all(
                    type(kv) is list and len(kv) == 2 and type(kv[0]) is str for kv in kwargs)):
                raise Concluded(Verdict(False, "the judge's run broke the conversation"))
            clean += [[self._value(a, values.REF_TAGS) for a in args],
                      [[k, self._value(v, values.REF_TAGS)] for k, v in kwargs]]
        self.waiting = True
        return [("response", _line({key: clean}))]


def judge(response: str, row: dict) -> Verdict:
    """The verdict on a response's code (`extract_code`) for a row's tests (module docstring); ValueError naming
    the row when its tests cannot be judged (verdict.plan)."""
    setup, tests = row_tests(row)
    judged = plan(setup, tests, row or {})
    code = extract_code(response)
    conversation = converse({"response": programs.response_program(code, setup, judged.names),
                             "judge": programs.judge_program(judged)}, LIMITS, Referee(judged.names))
    return conversation.outcome or Verdict(False, conversation.reason)


def code_tests(prompt: str, response: str, row: dict) -> float:
    """The code-execution reward: 1.0 when the judge's run found every check of the row's tests true (at least
    one), for the response's code; else 0.0. A row that cannot be judged (no tests, no check, nothing of the
    response used, a value run as code, a test that does not parse) is a ValueError naming the row and what is
    wrong: the call's error, counted by the rule reward (rewards.py) and scored as its failures are."""
    verdict = judge(response, row)
    if verdict.refused:
        raise ValueError(f"{row_name(row or {})}: {verdict.refused}")
    return 1.0 if verdict.passed else 0.0
