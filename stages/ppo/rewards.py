"""The rule reward: what `stages.ppo.rewards.rule` names, scoring a batch of responses with their rows.

- `verifier` (the default): the task's verifier (`task.verifier`), in the driver: a pure function of the
  response and the row's `answer`, fast and ours, so it needs no isolation.
- `code_tests`: the response's Python code run against the row's test cases (`test_list` / `tests`) in
  the sandbox of `stages.ppo.sandbox` (a separate process with CPU, memory, output and time limits).
- `module:function`: your function, called with the arguments it names (below), on `rewards.workers` Ray
  actors in parallel, each call with a timeout (`rewards.timeout_s`): a call that times out scores
  `rewards.timeout_score`, one that raises scores it too, and both are counted (`rule_timeouts`,
  `rule_errors` per iteration in MLflow; the first error's traceback is logged). A worker whose call
  timed out is replaced after the batch (the stuck call keeps running in its thread until then), so
  one `while True` costs one timeout, never the run.

Your function receives the whole prompt row. It names what it wants, as TRL's reward functions take
dataset columns by keyword: any of `prompt`, `response` (or `completion`), `answer`, `row` (the whole row
as a dict) and any column of your prompts file (e.g. `tests`); a function with `**kwargs` gets every
column. `def reward(prompt, response, answer)` keeps working. An `async def` function is awaited.

Ray actors rather than a process pool: they are placed by the same scheduler as the rest of the stage
and run on any node of a cluster; each holds the loaded function between iterations. Threads inside a
worker give the timeout without a process per call (a fork per call would cost more than most rewards).
"""

from __future__ import annotations

import inspect
import json
import sys
import threading
import traceback
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable

BUILTIN = {"code_tests": "stages.ppo.sandbox:code_tests"}
FIXED = ("prompt", "response", "completion", "answer", "row")


def row_of(row: dict) -> dict:
    """A prompt row as a reward function sees it: every column the user gave (their extra columns are
    stored as JSON in `extra`), without the token ids."""
    out = {k: v for k, v in row.items() if k not in ("prompt_ids", "extra", "num_tokens")}
    extra = row.get("extra")
    if extra:
        out.update(json.loads(extra) if isinstance(extra, str) else extra)
    return out


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


def _run_one(call, prompt: str, response: str, row: dict, timeout_s: float) -> tuple[str, float | None, str]:
    """('ok' | 'timeout' | 'error', score, traceback) of one call, in a daemon thread joined with a timeout."""
    import asyncio

    box: dict[str, Any] = {}

    def target():
        try:
            out = call(prompt, response, row)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            box["score"] = float(out)
        except BaseException:  # noqa: BLE001 - the user's code: anything it raises is that call's error
            box["error"] = traceback.format_exc(limit=5)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return "timeout", None, ""
    if "error" in box:
        return "error", None, box["error"]
    return "ok", box["score"], ""


async def _awaited(awaitable):
    return await awaitable


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


class RewardWorker:
    """A Ray actor holding the user's reward function; scores its share of a batch, each call timed."""

    def __init__(self, spec: str, path: str | None):
        from stages.common.tasks import load_function

        if path and path not in sys.path:
            sys.path.insert(0, path)
        self.call = bind(load_function(spec, "stages.ppo.rewards.rule", "an importable 'module:function'"))
        self.stuck = False

    def score(self, items: list[tuple[str, str, dict]], timeout_s: float, timeout_score: float) -> dict:
        scores, timeouts, errors, first_error = [], 0, 0, ""
        for prompt, response, row in items:
            status, value, error = _run_one(self.call, prompt, response, row, timeout_s)
            timeouts += status == "timeout"
            errors += status == "error"
            first_error = first_error or error
            scores.append(value if status == "ok" else timeout_score)
        self.stuck = self.stuck or timeouts > 0
        return {"scores": scores, "timeouts": timeouts, "errors": errors, "first_error": first_error,
                "stuck": self.stuck}


@dataclass
class RuleReward:
    """The rule reward of a PPO stage: `scores(texts, rows)`; `counts()` the timeouts and errors since last read."""

    spec: str
    verifier: str = "number"
    workers: int = 2
    timeout_s: float = 30.0
    timeout_score: float = 0.0
    log: Callable[[str], None] = print
    _local: Callable | None = None  # the verifier, in this process
    _bound: Callable | None = None  # a user's function as loaded here (to fail fast, and for one-off calls)
    _actors: list = field(default_factory=list)
    _counts: dict = field(default_factory=lambda: {"rule_timeouts": 0, "rule_errors": 0})
    _reported: bool = False

    def __post_init__(self):
        if self.spec == "verifier":
            from stages.common.verifiers import verifier_function

            verify = verifier_function(self.verifier)
            self._local = lambda prompt, response, row: float(verify(response, row.get("answer") or ""))
        else:
            if self.spec == "code_tests":  # say how untrusted code is isolated here (a weak fallback shows)
                from stages.ppo.sandbox import interpreter, isolation

                self.log(f"code_tests: responses run sandboxed ({isolation()}, {interpreter()})")
            self.spec = BUILTIN.get(self.spec, self.spec)
            from stages.common.tasks import load_function  # fail fast here, with the config key, not in a worker

            self._bound = bind(load_function(self.spec, "stages.ppo.rewards.rule", "'verifier', 'code_tests' or "
                                             "an importable 'module:function'"))

    def _start(self, n: int) -> list:
        import ray

        # num_cpus 0: the workers share the stage's CPUs rather than holding bundles of their own (a reward
        # call is short; a code-execution reward's sandbox process is limited on its own).
        actor = ray.remote(num_cpus=0)(RewardWorker)
        return [actor.remote(self.spec, import_root(self.spec)) for _ in range(n)]

    def scores(self, texts: list[str], rows: list[dict]) -> list[float]:
        full = [row_of(r) for r in rows]
        if self._local is not None:
            return [self._local(r["prompt"], t, r) for t, r in zip(texts, full)]
        import ray

        if not self._actors:
            self._actors = self._start(self.workers)
        items = [(r["prompt"], t, r) for t, r in zip(texts, full)]
        n = len(self._actors)
        parts = [items[i::n] for i in range(n)]  # round robin: neighbouring samples of a prompt spread out
        outs = ray.get([a.score.remote(p, self.timeout_s, self.timeout_score) for a, p in zip(self._actors, parts)])
        result = [0.0] * len(items)
        for i, out in enumerate(outs):
            result[i::n] = out["scores"]
            self._counts["rule_timeouts"] += out["timeouts"]
            self._counts["rule_errors"] += out["errors"]
            if out["first_error"] and not self._reported:
                self._reported = True
                self.log(f"the rule reward {self.spec} raised (scored {self.timeout_score}; later errors are "
                         f"counted in rule_errors, not shown):\n{out['first_error']}")
        for i, out in enumerate(outs):
            if out["stuck"]:  # its timed-out call still runs in a thread: a fresh worker instead
                ray.kill(self._actors[i])
                self._actors[i] = self._start(1)[0]
        return result

    def __call__(self, prompt: str, response: str, answer: str) -> float:
        """One response, scored in this process without the workers or a timeout (a one-off check)."""
        call = self._local if self._local is not None else self._bound
        return float(call(prompt, response, {"prompt": prompt, "answer": answer}))

    def counts(self) -> dict[str, int]:
        out, self._counts = self._counts, {"rule_timeouts": 0, "rule_errors": 0}
        return out

    def close(self) -> None:
        import ray

        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
