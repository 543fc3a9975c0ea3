r"""Answer verifiers: is a response's answer the reference answer? One setting, `task.verifier`, names the
verifier every correctness score uses (SFT held-out accuracy, the RL rule reward, evaluation, batch-infer
scoring), so a task whose answers are not numbers is scored the same way in every stage.

A verifier is a pure function `fn(response, answer) -> bool`: the model's whole response and the reference
answer of its row. `task.verifier` is one of the built-ins below or an importable 'module:function'.

| built-in | the reference        | a response passes when                 | e.g. passes (reference)                |
| -------- | -------------------- | -------------------------------------- | -------------------------------------- |
| number   | a number             | the number it states equals it         | "7 + 5 = 12", "The answer is 12." (12) |
| exact    | a short text         | its final answer equals it, normalised | "Answer: Paris.", "**paris**" (Paris)  |
| choice   | a letter A-J         | the letter it picks is that letter     | "Answer: (b)", "B) Paris", "**B**" (B) |
| regex    | a regular expression | it `re.fullmatch`es the final answer   | "The answer is 42 km." (`\d+ ?km`)     |
| math     | plain or LaTeX math  | math-verify finds the two equal        | "$\boxed{0.5}$" (\frac{1}{2})          |

- number: `tasks.verify`, the arithmetic task's verifier, unchanged: the first number after the last "the answer
  is" / "Answer:" / "the sum is", else after the last "=", else after the last "is", else the first number
  (thousands commas ignored); "12.0" is 12. A reference that is not a number matches nothing.
- exact: the final answer (below) and the reference normalised alike, SQuAD-style: case-folded; whitespace,
  sentence punctuation (`.,;:!?`), quotes and markdown `*` stripped at the ends (signs and brackets stay: "-7",
  "C++", "f(x)"); an article (a/an/the) before a word dropped; inner whitespace collapsed. Must then be equal.
- choice: the reference is "B", "(B)", "b", "B) text" (anything else is a ValueError); the response's letter
  is read as described below; case is ignored.
- regex: the reference is a regular expression (an invalid one is a ValueError); the final answer (below),
  its ends stripped as for `exact`, must `re.fullmatch` it; case-sensitive unless it says `(?i)`.
- math: math-verify (Hugging Face) extracts the response's answer (`\boxed{}` first, then a stated final
  answer, then the last expression) and compares it symbolically and numerically with the reference ("0.5" is
  "\frac{1}{2}", "1+x^2" is "x^2+1"); a reference without `$` delimiters is read as LaTeX whole.

The final answer (`exact`, `regex`): the last `\boxed{...}` if there is one; else what follows the last stated
marker ("The answer is", "Answer:", "Final answer:", "**Answer:**"), up to the end of its line; else the last
non-empty line. It is compared whole and also cut at its first sentence end (". ", "! ", "? ", "; "), so a
same-line explanation ("Paris. It is the capital.") passes while an abbreviation ("St. Louis") still compares
whole. Deliberately strict: "Paris or Lyon", "Paris, France", "not Paris" and "Parisian" do not pass for
"Paris"; a wrong answer that contains the right one is wrong.

The choice letter (`choice`): the letter after the last marker ("answer", "option" or "choice", optionally
followed by is/was/would be/:/=, e.g. "The answer is (C)", "Option C", "choice: c"); else the whole response
when it is one letter ("b"); else the one letter the response names as a token ("(B)", "[B]", "B) Paris",
"B.", a standalone capital; lowercase only in brackets or as a line's "b) " label). A response that names two
different letters without a marker is ambiguous and fails. English "A" and "I" followed by a lowercase word
("A careful reading", "I think") are the article and the pronoun, not letters. Markdown `*` is ignored.
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import time
from typing import Callable, Iterator

from pipeline.errors import UserError
from stages.common import tasks

Verifier = Callable[[str, str], bool]


# --------------------------------------------------------------------------- number


def number(response: str, answer: str) -> bool:
    """The embedded arithmetic task's verifier, unchanged (`tasks.verify`): the number a response states equals
    the reference number. Delegated, not copied, so figures measured with it stay comparable."""
    return tasks.verify(response, answer)


# --------------------------------------------------------------------------- the final answer of a response

# "The answer is", "Answer:", "Final answer:", "**Answer**:", "the answer would be": a stated marker needs its
# verb or colon, so "to answer this" is not one.
_ANSWER_MARKER = re.compile(r"\banswer\b\**\s*(?:is\b|was\b|would\s+be\b|:|=)\s*:?", re.IGNORECASE)
# A boxed answer with no braces inside (\boxed{Paris}); math-verify handles nested LaTeX for `math`.
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_SENTENCE_END = re.compile(r"[.!?;](?=\s)")
# What may surround an answer without being part of it: sentence punctuation, quotes, markdown emphasis and
# inline code. Brackets, signs and symbols ("-7", "C++", "50%", "f(x)") are part of an answer and stay.
_ENDS = " \t\r\n.,;:!?\"'`*“”‘’«»"
_ARTICLE = re.compile(r"\b(?:a|an|the)\s+(?=\S)")


def final_answer(response: str) -> str | None:
    """The answer a free-text response ends on: its last `\\boxed{}`, else the rest of the line after its last
    stated marker, else its last non-empty line; None when there is none (empty, or cut off after the marker).

    Why the last: chat models reason first and state the answer at the end, and correct themselves on the way
    ("The answer is Lyon. No, the answer is Paris.")."""
    boxed = _BOXED.findall(response)
    if boxed:
        return boxed[-1].strip() or None
    markers = list(_ANSWER_MARKER.finditer(response))
    text = response[markers[-1].end():] if markers else response
    lines = [line.strip() for line in text.splitlines() if line.strip(_ENDS)]
    if not lines:
        return None
    return lines[0] if markers else lines[-1]


def _candidates(final: str) -> list[str]:
    """The final answer whole and cut at its first sentence end: "Paris. It is the capital." reads as "Paris",
    while "St. Louis" still compares whole."""
    cut = _SENTENCE_END.search(final)
    return [final] if cut is None else [final, final[: cut.start()]]


def _strip_ends(text: str) -> str:
    return text.strip(_ENDS)


def normalize(text: str) -> str:
    """SQuAD-style normalisation for exact match: case-folded, ends stripped (`_ENDS`), articles dropped,
    whitespace collapsed. Unlike SQuAD, punctuation inside the answer stays ("3.5" is not "35")."""
    text = _strip_ends(text.casefold())
    text = _ARTICLE.sub("", text)  # only an article before a word: a reference "a" (a letter) stays "a"
    return _strip_ends(" ".join(text.split()))


# --------------------------------------------------------------------------- exact, regex


def exact(response: str, answer: str) -> bool:
    """The response's final answer equals the reference after `normalize`: for short factual answers (a name,
    a word, a date). Strict: an answer that merely contains the reference is wrong, so a model cannot hedge
    ("Paris or Lyon") into reward. A reference that normalises to nothing matches nothing."""
    expected = normalize(answer)
    final = final_answer(response)
    if not expected or final is None:
        return False
    return any(normalize(c) == expected for c in _candidates(final))


def regex(response: str, answer: str) -> bool:
    """The reference is a regular expression that `re.fullmatch`es the response's final answer (ends stripped
    of whitespace, quotes, markdown `*` and sentence punctuation): for answers with many right spellings
    ("(?i)(Mt\\.? )?Everest", "\\d+ ?km"). Only the final answer, never a search of the whole response, so
    listing candidates earns nothing. Case-sensitive unless the expression says `(?i)`.

    Raises ValueError when the reference is not a valid regular expression (a data error, never a miss)."""
    try:
        pattern = re.compile(answer)
    except re.error as exc:
        raise ValueError(f"regex verifier: the reference answer {answer!r} is not a valid regular expression "
                         f"({exc})") from None
    final = final_answer(response)
    return final is not None and any(pattern.fullmatch(_strip_ends(c)) for c in _candidates(final))


# --------------------------------------------------------------------------- choice

_REFERENCE_LETTER = re.compile(r"\s*[(\[]?([A-Ja-j])[)\]]?(?:[.:)]|\s|$)")
# A letter token: bracketed in any case "(b)", or a capital standing alone "B" (not "Berlin", "I'm", "Ph.D.").
_TOKEN = r"[(\[]([A-Ja-j])[)\]]|(?<![\w'’.\-/])([A-J])(?![\w'’\-/]|\.\w)"
# After a marker a lowercase letter counts too where nothing but punctuation follows ("answer: b."); elsewhere
# it would be "e.g." or "i.e.".
_MARKED_LETTER = re.compile(r"\b(?i:answer|option|choice)\b\s*(?i:is|was|would\s+be)?\s*[:=]?\s*"
                            r"(?:(?i:option|choice)\s+)?"
                            r"(?:" + _TOKEN + r"|(?<![\w'’.\-/])([a-j])(?=[ \t]*(?:$|\n|[.,;:!?)\]])))")
_LONE_LETTER = re.compile(r"\s*[(\[]?([A-Ja-j])[)\]]?[.:]?\s*")
_LABEL_LETTER = re.compile(r"^[ \t]*([a-j])[.)][ \t]", re.MULTILINE)  # "b) Paris" as a line's label
# "A careful reading", "I think": the article and the pronoun, unless a connective or copula follows ("A and C",
# "A is correct"), where they are letters.
_ENGLISH_A_OR_I = re.compile(r"[AI]\s+(?!(?:and|or|nor|is|was|are)\b)[a-z]")


def reference_letter(answer: str) -> str:
    """The letter of a multiple-choice reference ("B", "(B)", "b", "B) text"), upper-case.

    Raises ValueError for anything else: a reference that is not a letter is a data error, not a miss."""
    m = _REFERENCE_LETTER.match(answer)
    if m is None:
        raise ValueError(f"choice verifier: the reference answer {answer!r} is not a choice letter A-J "
                         "(give e.g. 'B', '(B)' or 'B) text')")
    return m.group(1).upper()


def _letter(m: re.Match) -> str:
    return next(g for g in m.groups() if g).upper()


def _named_letters(text: str) -> set[str]:
    """Every letter the text names as a token (`_TOKEN`) or a line's label, less the English "A" and "I"."""
    letters = {_letter(m) for m in re.finditer(_TOKEN, text) if not _ENGLISH_A_OR_I.match(text, m.start())}
    return letters | {m.group(1).upper() for m in _LABEL_LETTER.finditer(text)}


def chosen_letter(response: str) -> str | None:
    """The letter a response picks: after its last marker, else the response when it is one letter, else the
    only letter it names; None when it names none or several (ambiguous: a hedge is not an answer)."""
    text = response.replace("*", "")  # markdown bold and italics carry no letter
    marked = list(_MARKED_LETTER.finditer(text))
    if marked:
        return _letter(marked[-1])
    lone = _LONE_LETTER.fullmatch(text)
    if lone:
        return lone.group(1).upper()
    letters = _named_letters(text)
    return letters.pop() if len(letters) == 1 else None


def choice(response: str, answer: str) -> bool:
    """The letter the response picks (`chosen_letter`) is the reference's: for multiple-choice tasks
    (MMLU-style, up to ten options A-J). Case is ignored: "(b)" picks B."""
    expected = reference_letter(answer)
    return chosen_letter(response) == expected


# --------------------------------------------------------------------------- math

# math-verify bounds each parse and comparison with a timeout because sympy can run forever on what a policy
# writes ("\boxed{9^{9^{9^{9}}}}" never finishes comparing). Its timeout is signal.alarm (SIGALRM), which only
# works in the main thread: elsewhere parse/verify raise ValueError ("signal only works in main thread") unless
# given parsing_timeout=None / timeout_seconds=None. So: the timeout in the main thread (Ray tasks and plain
# actors run there), none in other threads (Ray Train's training function, threaded actors), where a
# pathological response can stall the caller. A timeout counts as not equal.
MATH_TIMEOUT_S = 5
_LATEX_DELIMITED = ("$", "\\(", "\\[", "\\boxed")


def _math_timeout() -> int | None:
    return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@contextlib.contextmanager
def _keeping_outer_alarm() -> Iterator[None]:
    """math-verify's timeout restores the SIGALRM handler it found but cancels the timer (signal.alarm(0)),
    which silently disarms an outer caller's alarm (pytest-timeout's, a job's deadline): re-arm it with what
    was left of it."""
    remaining, interval = signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    try:
        yield
    finally:
        if remaining > 0:
            signal.setitimer(signal.ITIMER_REAL, max(remaining - (time.monotonic() - started), 1e-3), interval)


def _as_latex(answer: str) -> str:
    """A reference in `$...$` unless it already has math delimiters: math-verify extracts LaTeX only between
    delimiters, so bare "x^2+1", "\\sqrt{2}" or "\\pi" would parse to nothing and "2\\sqrt{3}" to 2."""
    return answer if any(d in answer for d in _LATEX_DELIMITED) else f"${answer}$"


def math(response: str, answer: str) -> bool:
    """The response's answer equals the reference mathematically, by math-verify (Hugging Face): it extracts
    the response's answer (`\\boxed{}` first, then a stated final answer, then the last expression) and compares
    symbolically and numerically, so "$\\boxed{0.5}$" is "\\frac{1}{2}" and "1+x^2" is "x^2+1". Using the
    maintained checker rather than a home-grown one: LaTeX answers come in more forms than a regex can know."""
    from math_verify import parse, verify  # lazy: sympy and the LaTeX parser are for `math` users only

    timeout = _math_timeout()
    with _keeping_outer_alarm() if timeout else contextlib.nullcontext():
        gold = parse(_as_latex(answer), parsing_timeout=timeout)
        predicted = parse(response, parsing_timeout=timeout)
        return bool(gold) and bool(predicted) and verify(gold, predicted, timeout_seconds=timeout)


# --------------------------------------------------------------------------- by name

BUILTINS: dict[str, Verifier] = {"number": number, "exact": exact, "choice": choice, "regex": regex, "math": math}


def verifier_function(spec: str) -> Verifier:
    """The verifier `task.verifier` names: a built-in name or 'module:function' taking (response, answer) and
    returning a bool; a UserError naming the key and the built-ins otherwise."""
    if spec in BUILTINS:
        return _scoring(BUILTINS[spec], spec)
    expected = (f"one of {', '.join(BUILTINS)} or an importable 'module:function' taking (response, answer) "
                "and returning a bool")
    if ":" not in spec or not all(spec.split(":", 1)):
        raise UserError(f"task.verifier: {spec!r} is neither a built-in verifier nor 'module:function'; "
                        f"give {expected}")
    return _scoring(tasks.load_function(spec, "task.verifier", expected), spec)


def _scoring(fn: Verifier, name: str) -> Verifier:
    """`fn` for scoring many rows: a row whose reference the verifier cannot read (`choice` given "maybe", an
    invalid `regex`) scores False with one warning per process, rather than stopping an RL run an hour in."""
    warned: list[bool] = []

    def verify(response: str, answer: str) -> bool:
        try:
            return bool(fn(response, answer))
        except ValueError as exc:
            if not warned:
                warned.append(True)
                import logging

                logging.getLogger(__name__).warning("task.verifier %s: %s (scored as wrong; further such rows "
                                                    "are not reported)", name, exc)
            return False

    verify.__name__ = getattr(fn, "__name__", name)
    return verify
