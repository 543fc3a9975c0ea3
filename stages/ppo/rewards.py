"""The rule reward: what `stages.ppo.rewards.rule` names, scoring a batch of responses with their rows.

- `verifier` (the default): the task's verifier (`task.verifier`). A built-in one (number, exact, choice,
  regex, math) runs in the driver: ours, fast, pure. A `module:function` verifier is your code and runs
  like a reward function (below).
- `code_tests`: the response's Python code run against the row's test cases (`test_list` / `tests`) in
  the sandbox of `stages.ppo.sandbox` (a separate process with CPU, memory, output and time limits).
- `module:function`: your function, called with the arguments it names (below) on `rewards.workers` Ray
  actors, one call per actor at a time, each with a timeout (`rewards.timeout_s`).

Your code fails loudly. A call that raises, runs past its timeout, or returns anything but a finite real
number (a str, None, nan, inf) scores `rewards.timeout_score` and is counted (`rule_errors`,
`rule_timeouts` per iteration in MLflow, on the progress line and in the run summary when non-zero; the
first error's traceback is logged). When more than `rewards.max_error_share` of one batch's calls fail,
or every call of the first batch does, the stage stops (exit 1) with one message naming the function,
the exception, a row it failed on and the key to raise: a run never trains on errors in silence.

Timeouts hold whatever the code does: the driver keeps each call's deadline and kills the actor of a
call that passed it (a regex stuck in backtracking or a huge `str(int)` holds the interpreter, so no
thread inside the actor could stop it), then starts a fresh actor. No wait in the scoring path is
unbounded: an actor that does not start within `READY_TIMEOUT_S` is an error naming the function.

Your function receives the whole prompt row. It names what it wants, as TRL's reward functions take
dataset columns by keyword: any of `prompt`, `response` (or `completion`), `answer`, `row` (the whole row
as a dict) and any column of your prompts file under its own name (e.g. `tests`, or `solution` when the
config maps `columns: {answer: solution}`: the row carries both `answer` and `solution`); a function
with `**kwargs` gets every column. `def reward(prompt, response, answer)` keeps working. An `async def`
function is awaited.

Ray actors rather than a process pool: they are placed by the same scheduler as the rest of the stage,
run on any node of a cluster, can be killed from outside (the timeout), and each holds the loaded function
between iterations.
"""

from __future__ import annotations

import inspect
import json
import math
import numbers
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

from pipeline.errors import StageError

BUILTIN = {"code_tests": "stages.ppo.sandbox:code_tests"}
FIXED = ("prompt", "response", "completion", "answer", "row")
SHARE_KEY = "stages.ppo.rewards.max_error_share"
READY_TIMEOUT_S = 120.0  # a worker loading the user's module; past it the stage stops naming the function


# --------------------------------------------------------------------------- pure parts


def row_of(row: dict) -> dict:
    """A prompt row as a reward function sees it: every column the user gave (their extra columns, and the
    originals of mapped ones, are stored as JSON in `extra`), without the token ids."""
    out = {k: v for k, v in row.items() if k not in ("prompt_ids", "extra", "num_tokens")}
    extra = row.get("extra")
    if extra:
        out.update({k: v for k, v in (json.loads(extra) if isinstance(extra, str) else extra).items()
                    if k not in out})
    return out


def finite_score(value: Any, what: str = "the reward") -> float:
    """`value` as a float when it is a finite real number (int, float, bool, a numpy scalar, a one-element
    array or tensor); ValueError naming what came back otherwise. Strings are refused although float()
    would read them: "nan" and "1e999" would pass as numbers, and one NaN turns a GRPO group into NaN."""
    if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
        try:
            value = value.item()  # numpy 0-d arrays, torch scalars
        except (ValueError, RuntimeError):
            pass
    if isinstance(value, str) or not isinstance(value, numbers.Real):
        raise ValueError(f"{what} must be a finite number, got {type(value).__name__} {_short(repr(value))}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{what} must be a finite number, got {out}")
    return out


def over_budget(failed: int, calls: int, max_share: float, first: bool) -> bool:
    """Should the stage stop? More than `max_share` of a batch's calls failed, or every call of the first
    batch did (whatever the share: a function that never works is a mistake, not noise)."""
    if not calls or not failed:
        return False
    return (first and failed == calls) or failed / calls > max_share


@dataclass
class ErrorBudget:
    """When failures of the user's code stop the stage: `check` each batch (`over_budget`), raising a
    StageError that names `name`, the first failure, its row and the key to raise."""

    name: str  # e.g. "the rule reward my_reward:score"
    max_share: float = 0.5
    unit: str = "calls"  # what a batch is made of: calls of a function, an environment's episodes
    batches: int = 0
    failed: int = 0  # over the run

    def check(self, failed: int, calls: int, first: str, row: dict | None, counts: str = "") -> None:
        self.batches += 1
        self.failed += failed
        if over_budget(failed, calls, self.max_share, first=self.batches == 1):
            what = first.strip().splitlines()[-1] if first.strip() else "unknown"  # a traceback's last line
            where = f", on {describe_row(row)}" if row is not None else ""
            raise StageError(f"{self.name} failed on {failed} of {calls} {self.unit} of one batch{counts}; the stage "
                             f"stops rather than train on failures. First failure: {what}{where}. Fix the code, or "
                             f"raise {SHARE_KEY} (now {self.max_share:g}) to train through failures")

    def check_episodes(self, flat: list[dict], rows: list[dict]) -> None:
        """An iteration's episodes (`sampling.n` per row): those whose environment broke its protocol."""
        if not flat or "env_error" not in flat[0]:
            return
        n = max(len(flat) // max(len(rows), 1), 1)
        broken = [i for i, x in enumerate(flat) if x["env_error"]]
        first = flat[broken[0]]["env_error"] if broken else ""
        self.check(len(broken), len(flat), first, row_of(rows[broken[0] // n]) if broken else None)


def _short(text: str, n: int = 80) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def describe_row(row: dict) -> str:
    """A row for an error message: its prompt (shortened) and its columns."""
    return f"prompt {_short(row.get('prompt', ''))!r} (columns: {', '.join(sorted(row))})"


def bind(fn: Callable) -> Callable[[str, str, dict], Any]:
    """`fn` as (prompt, response, row) -> its result, passing what its parameters name (module docstring)."""
    params = inspect.signature(fn).parameters
    names = [n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    known = set(FIXED)

    def call(prompt: str, response: str, row: dict):
        values = {"prompt": prompt, "response": response, "completion": response, "answer": row.get("answer") or "",
                  "row": row}
        if not var_kw and names and not any(n in known or n in row for n in names):
            return fn(prompt, response, values["answer"])  # positional (prompt, response, answer) by other names
        kwargs = {n: values[n] if n in values else row[n] for n in names if n in values or n in row}
        if var_kw:
            kwargs.update({k: v for k, v in {**row, **values}.items() if k not in kwargs and k != "row"})
        return fn(**kwargs)

    return call


def import_root(spec: str) -> str | None:
    """The sys.path entry a 'module:function' spec's module is found under here, for the workers."""
    module = spec.split(":", 1)[0]
    try:
        found = find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.origin or not found.origin.endswith(".py"):
        return None
    depth = len(module.split(".")) - (1 if Path(found.origin).name == "__init__.py" else 0)
    return str(Path(found.origin).parents[depth - 1 if depth > 0 else 0])


def load(spec: str, kind: str) -> Callable[[str, str, dict], Any]:
    """The function a spec names as (prompt, response, row) -> result: a reward bound by its parameter
    names, or a `task.verifier` 'module:function' called as (response, answer)."""
    from stages.common.tasks import load_function

    if kind == "verifier":
        verify = load_function(spec, "task.verifier", "an importable 'module:function' taking (response, answer)")
        return lambda prompt, response, row: verify(response, row.get("answer") or "")
    return bind(load_function(spec, "stages.ppo.rewards.rule", "'verifier', 'code_tests' or "
                              "an importable 'module:function'"))


def call_once(call, prompt: str, response: str, row: dict) -> tuple[str, float | None, str]:
    """('ok', score, '') or ('error', None, traceback) of one call; an async result is awaited."""
    import asyncio

    try:
        out = call(prompt, response, row)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        return "ok", finite_score(out), ""
    except BaseException:  # noqa: BLE001 - the user's code: anything it raises (SystemExit too) is that call's error
        return "error", None, traceback.format_exc(limit=5)


async def _awaited(awaitable):
    return await awaitable


# --------------------------------------------------------------------------- the workers


class RewardWorker:
    """A Ray actor holding the user's function; scores one call at a time (the driver keeps the deadline)."""

    def __init__(self, spec: str, path: str | None, kind: str = "reward"):
        from stages.ppo.sandbox import make_undumpable

        make_undumpable()  # its environment holds the run's secrets; code_tests' sandboxes are its children
        if path and path not in sys.path:
            sys.path.insert(0, path)
        self.call = load(spec, kind)

    def ready(self) -> bool:
        return True

    def score(self, prompt: str, response: str, row: dict) -> tuple[str, float | None, str]:
        return call_once(self.call, prompt, response, row)


@dataclass
class Failure:
    """The first failed call of a batch, for the message that stops the stage."""

    status: str  # error | timeout
    detail: str  # the traceback, or what happened
    row: dict


@dataclass
class RuleReward:
    """The rule reward of a PPO stage: `scores(texts, rows)`; `counts()` the timeouts and errors since last read,
    `totals()` over the run."""

    spec: str
    verifier: str = "number"
    workers: int = 2
    timeout_s: float = 30.0
    timeout_score: float = 0.0
    log: Callable[[str], None] = print
    max_error_share: float = 0.5
    _local: Callable | None = None  # a built-in verifier, in this process
    _bound: Callable | None = None  # a user's function as loaded here (to fail fast, and for one-off calls)
    _kind: str = "reward"  # what the workers load: "reward" (rewards.rule) or "verifier" (task.verifier)
    _actors: list = field(default_factory=list)
    _counts: dict = field(default_factory=lambda: {"rule_timeouts": 0, "rule_errors": 0})
    _totals: dict = field(default_factory=lambda: {"rule_timeouts": 0, "rule_errors": 0, "rule_calls": 0})
    _budget: ErrorBudget | None = None
    _reported: bool = False

    def __post_init__(self):
        from stages.common.verifiers import BUILTINS, verifier_function

        if self.spec == "verifier" and self.verifier in BUILTINS:
            verify = verifier_function(self.verifier)
            self._local = lambda prompt, response, row: float(verify(response, row.get("answer") or ""))
            return
        if self.spec == "verifier":  # the user's verifier: their code, run as a reward function is
            self.spec, self._kind = self.verifier, "verifier"
        self.spec = BUILTIN.get(self.spec, self.spec)
        self._bound = load(self.spec, self._kind)  # fail fast here, with the config key, not in a worker
        self._budget = ErrorBudget(self.name, self.max_error_share)

    @property
    def name(self) -> str:
        return f"task.verifier {self.spec}" if self._kind == "verifier" else f"the rule reward {self.spec}"

    # ----------------------------------------------------------------------- workers

    def _start(self) -> tuple[Any, Any]:
        """A fresh worker and the ref that resolves once it has loaded the function."""
        import ray

        # num_cpus 0: the workers share the stage's CPUs rather than holding bundles of their own (a reward
        # call is short; a code-execution reward's sandbox process is limited on its own).
        from stages.ppo.sandbox.tiers import allowance_env

        # runtime_env: whether its sandbox may be a weak tier (stages.ppo.sandbox.allow_weak, set in this process)
        actor = ray.remote(num_cpus=0, max_restarts=0)(RewardWorker).options(
            runtime_env={"env_vars": allowance_env()}).remote(self.spec, import_root(self.spec), self._kind)
        return actor, actor.ready.remote()

    def _await_ready(self, starting: dict) -> list[int]:
        """Wait (bounded) for starting workers; their indices. A worker that cannot load the function stops
        the stage naming it."""
        import ray

        ready, _ = ray.wait(list(starting), num_returns=len(starting), timeout=READY_TIMEOUT_S)
        if len(ready) < len(starting):
            raise StageError(f"{self.name}: a reward worker did not load the function within {READY_TIMEOUT_S:.0f} s "
                             "(does importing its module hang?)")
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - importing the user's module failed in the worker
                raise StageError(f"{self.name}: a reward worker could not load it: {_short(str(exc), 400)}") from None
        return [starting[ref] for ref in ready]

    def _run_calls(self, items: list[tuple[str, str, dict]]) -> list[tuple[str, float | None, str]]:
        """Every call's (status, score, detail), one call per worker at a time, each bounded by `timeout_s`
        from its dispatch: a worker past it is killed and replaced."""
        import ray

        if not self._actors:
            started = [self._start() for _ in range(self.workers)]
            self._actors = [a for a, _ in started]
            free = self._await_ready({ref: i for i, (_, ref) in enumerate(started)})
        else:
            free = list(range(len(self._actors)))
        results: list[Any] = [None] * len(items)
        pending = deque(range(len(items)))
        running: dict = {}  # ref -> (worker index, item index, deadline)
        starting: dict = {}  # ready ref -> worker index: a replacement loading the function
        while pending or running:
            while free and pending:
                w, i = free.pop(), pending.popleft()
                running[self._actors[w].score.remote(*items[i])] = (w, i, time.monotonic() + self.timeout_s)
            if not running:  # every worker is a replacement still loading
                free += self._await_ready(starting)
                starting.clear()
                continue
            wait_s = max(0.0, min(d for _, _, d in running.values()) - time.monotonic())
            done, _ = ray.wait(list(running) + list(starting), num_returns=1, timeout=wait_s)
            for ref in done:
                if ref in starting:
                    free += self._await_ready({ref: starting.pop(ref)})
                    continue
                w, i, _ = running.pop(ref)
                try:
                    results[i] = ray.get(ref)
                    free.append(w)
                except Exception as exc:  # noqa: BLE001 - the worker died (os._exit, a segfault, the OOM killer)
                    results[i] = ("error", None, f"the reward worker died during this call: {_short(str(exc), 300)}")
                    self._replace(w, starting)
            now = time.monotonic()
            for ref, (w, i, deadline) in list(running.items()):
                if now >= deadline:  # abandoned: the worker is killed whatever its code is doing
                    del running[ref]
                    results[i] = ("timeout", None, f"no result within rewards.timeout_s={self.timeout_s:g} s")
                    self._replace(w, starting)
        if starting:  # the next batch's deadlines must not include a replacement's start
            self._await_ready(starting)
        return results

    def _replace(self, w: int, starting: dict) -> None:
        import ray

        ray.kill(self._actors[w], no_restart=True)
        self._actors[w], ready = self._start()
        starting[ready] = w

    # ----------------------------------------------------------------------- scoring

    def scores(self, texts: list[str], rows: list[dict]) -> list[float]:
        """One score per response; failed calls score `timeout_score`, are counted, and stop the stage past
        `max_error_share` (module docstring)."""
        full = [row_of(r) for r in rows]
        if self._local is not None:
            return [self._local(r["prompt"], t, r) for t, r in zip(texts, full)]
        results = self._run_calls([(r["prompt"], t, r) for t, r in zip(texts, full)])
        self._account(results, full)
        return [score if status == "ok" else self.timeout_score for status, score, _ in results]

    def _account(self, results: list[tuple], rows: list[dict]) -> None:
        """Count the batch's failures, log the first one once (with its traceback), stop the stage when over
        budget (`ErrorBudget`)."""
        errors = sum(status == "error" for status, _, _ in results)
        timeouts = sum(status == "timeout" for status, _, _ in results)
        failures = [Failure(st, detail, row) for (st, _, detail), row in zip(results, rows) if st != "ok"]
        first = next((f for f in failures if f.status == "error"), failures[0] if failures else None)  # traceback first
        for key, n in (("rule_errors", errors), ("rule_timeouts", timeouts)):
            self._counts[key] += n
            self._totals[key] += n
        self._totals["rule_calls"] += len(results)
        if first is not None and not self._reported:
            self._reported = True
            self.log(f"{self.name} failed on {errors + timeouts} of {len(results)} calls (scored "
                     f"{self.timeout_score}; counted in rule_errors / rule_timeouts, later ones not shown); the first, "
                     f"on {describe_row(first.row)}:\n{first.detail.rstrip()}")
        self._budget.check(errors + timeouts, len(results), first.detail if first else "", first.row if first else None,
                           f" ({errors} raised or returned no finite number, {timeouts} timed out)")

    def __call__(self, prompt: str, response: str, answer: str) -> float:
        """One response, scored in this process without the workers or a timeout (a one-off check)."""
        call = self._local if self._local is not None else self._bound
        return finite_score(call(prompt, response, {"prompt": prompt, "answer": answer}))

    def counts(self) -> dict[str, int]:
        out, self._counts = self._counts, {"rule_timeouts": 0, "rule_errors": 0}
        return out

    def totals(self) -> dict[str, int]:
        """The run's failed calls, for the summary: only the non-zero counts (nothing to report otherwise)."""
        return {f"{k}_total": v for k, v in self._totals.items() if v and k != "rule_calls"}

    def close(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
