"""Multi-turn rollouts on a vLLM engine: each sample talks with its own environment until it is done.

`AgentEngine` is the rollout engine (`stages/common/engines.py`) with one more method, `episodes`,
which the ppo stage calls instead of `generate` when `stages.ppo.environment` is set. Inside it:

    every sample's first turn is queued on the engine
    loop: step the engine (all queued turns decode together, continuous batching)
          a finished turn: parse its tool calls; hand (conversation, turn) to the environment on a
              thread, and go on stepping the other samples meanwhile
          an environment's answer: render its messages as tokens (mask 0), queue the sample's next turn
          a call past tool_timeout_s: the model is told the tool timed out; its next turn is its last
    until every sample is done: the environment said so, max_turns, or the token budget (max_tokens)

A turn cut by `sampling.max_new_tokens` (one turn's cap) still goes to the environment, as a chat API
returns a reply cut at its max_tokens: the end-of-turn token the template writes after it is then the
environment's (mask 0). Only a turn cut by the episode's budget ends the episode (truncated).

So turns of different samples interleave on the engine and no sample waits for another's tool call
(the request is in the engine's queue the moment its tool answers), as in verl's agent loop and
OpenRLHF's async agent rollouts. We drive vLLM's `LLMEngine` (`add_request` / `step`) rather than
its AsyncLLM server: the engine already lives in this actor (weight sync, fact 4), and one thread
stepping it needs no event loop in a Ray actor.

What a sample returns (besides `generate`'s ids / logprobs / finished / version): `mask` (1 on the
model's tokens, 0 on the environment's: `environments.assemble`), `final` (the last model turn, which
the rule reward reads), `turns`, `tool_calls`, `tool_errors`, `tool_s`, `env_reward`, `env_error` (why the
environment broke its protocol, ended the episode and is counted; "" normally) and the
conversation as `messages` (a few are logged as trajectories).
"""

from __future__ import annotations

import sys
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from pipeline.errors import StageError
from stages.common.engines import RolloutEngine
from stages.common.followed import HEARTBEAT_S, follow, stalled
from stages.ppo.environments import (Renderer, as_step, assemble, cap_output, environment_factory, parse_turn,
                                     tool_error)


@dataclass(frozen=True)
class EpisodeSpec:
    """How an engine runs episodes (plain data, sent with each request; from `stages.ppo.environment`)."""

    name: str
    options: dict = field(default_factory=dict)
    max_turns: int = 4
    max_tokens: int = 64  # the whole response: the model's turns and what the environment adds
    tool_timeout_s: float = 10.0
    max_output_chars: int = 1000
    tool_parser: str = "hermes"
    tool_workers: int = 8
    path: str | None = None  # the sys.path entry a 'module:Class' environment is found under on the driver


# A followed call's silences (stages/common/followed.py): while the user's code may run, the next
# beat is promised within the oldest call's remaining timeout + STALL_GRACE_S (+ 3 engine steps: a healthy
# loop notices a timed-out call only after the step it is in); while only vLLM runs, within VLLM_SILENCE_S.
STALL_GRACE_S = 10.0
VLLM_SILENCE_S = 600.0


class _Heartbeat:
    """What an episodes call promises its follower, and when it says so (at most every HEARTBEAT_S, or at
    once when the promise must shrink: the user's code is about to run)."""

    def __init__(self, timeout_s: float):
        self.timeout_s, self.longest_step, self.last, self.until = timeout_s, 0.0, 0.0, float("inf")

    def stepped(self, seconds: float) -> None:
        self.longest_step = max(self.longest_step, seconds)

    def within(self, now: float, user_code: bool, oldest: float | None) -> float:
        grace = STALL_GRACE_S + 3 * self.longest_step
        if oldest is not None:
            return max(0.0, oldest + self.timeout_s - now) + grace
        return self.timeout_s + grace if user_code else max(VLLM_SILENCE_S, 10 * self.longest_step)

    def beat(self, user_code: bool = False, oldest: float | None = None, force: bool = False) -> dict | None:
        now = time.time()
        within = self.within(now, user_code, oldest)
        # Said when it must shrink (the user's code may run next), when it grows by more than a beat's worth
        # (only vLLM runs next: a long prefill must not outlast a tight promise), and every HEARTBEAT_S.
        if not force and now - self.last < HEARTBEAT_S and \
                self.until - 1e-3 <= now + within <= self.until + HEARTBEAT_S:
            return None
        self.last, self.until = now, now + within
        return {"within": within}


def _user(row: dict) -> dict:
    return {"role": "user", "content": row.get("prompt", "")}


@dataclass
class _Episode:
    key: int  # sample index in the request (prompt i's samples are i*n ... i*n+n-1)
    env: Any
    prompt: list[int]
    messages: list[dict]
    segments: list = field(default_factory=list)  # ('model' | 'env', ids, logprobs)
    length: int = 0  # response tokens so far
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_error: str = ""  # the environment broke its protocol (a bad return value, a non-finite reward): ended
    tool_s: float = 0.0
    reward: float = 0.0
    truncated: bool = False
    open: bool = False  # the last model turn was cut by sampling.max_new_tokens: the template's end-of-turn follows
    broken: bool = False  # its environment did not answer in time: never called again, the next turn is the last

    def context(self) -> list[int]:
        return self.prompt + [t for _, ids, _ in self.segments for t in ids]


def run_episodes(engines: list, prompt_parts: list, row_parts: list, sampling: dict, spec: EpisodeSpec,
                 log=print) -> list[list[dict]]:
    """Engine i runs the episodes of prompt_parts[i] (with row_parts[i]); per prompt a list of samples, in
    order. The calls are followed (stages/common/followed.py): an engine stalled by the environment
    is killed (`EngineStalled`), one left running abandoned calls is replaced after its answer."""
    calls = [(e, e.episodes.remote(p, r, sampling, spec)) for e, p, r in zip(engines, prompt_parts, row_parts) if p]
    return [group for part in follow(calls, f"the environment {spec.name}", log) for group in part]


def retrying(layout, call, spec: EpisodeSpec | None, say=print, since: int | None = None):
    """`layout.retrying(call, say, since=since)`: engines that died or were stalled are restarted and `call` made
    again. When the environment stalled the engine on every attempt, the stage stops (exit 1) saying how to
    fix it."""
    attempts = []

    def counted():
        attempts.append(1)
        return call()

    try:
        return layout.retrying(counted, say, since=since)
    except Exception as exc:
        stall = stalled(exc)
        if spec is None or stall is None:
            raise
        raise StageError(
            f"the environment {spec.name} stalled its rollout engine on {len(attempts)} attempt(s) in a row: {stall}. "
            f"Its reset and step must return within stages.ppo.environment.tool_timeout_s ({spec.tool_timeout_s:g} s); "
            f"run slow or untrusted work in a subprocess it can time out (the python tool's sandbox does)") from None


class AgentEngine(RolloutEngine):
    """A rollout engine that also runs multi-turn episodes against environments (`episodes`)."""

    def episodes(self, prompt_ids: list[list[int]], rows: list[dict], sampling: dict, spec: EpisodeSpec):
        """For each prompt (and its row), `sampling['n']` episodes; per prompt a list of samples.

        A streaming call (`run_episodes` follows it): it yields heartbeats `{"within": s}`, each promising
        the next within s seconds, then `{"result": samples, "retire": reason}`. The promise is tight
        (the oldest environment call's timeout + `stall_grace`) whenever the user's code may run before
        the next beat, so an environment holding the interpreter gets the engine killed soon after its
        timeout; while only vLLM runs (no call in flight) it is loose (`VLLM_SILENCE_S`). `retire` is
        set when calls abandoned at their timeout still run: the follower then replaces the engine."""
        from vllm import SamplingParams
        from vllm.tool_parsers import ToolParserManager

        import logging

        clock = _Heartbeat(spec.tool_timeout_s)
        yield clock.beat(user_code=True)  # the environment's import, constructors and resets run next
        # The parser logs a traceback for every unreadable call; such turns are reported to the model and
        # counted (tool_errors) instead, so its log would only flood the stage's log file.
        logging.getLogger(f"vllm.tool_parsers.{spec.tool_parser}_tool_parser").setLevel(logging.CRITICAL)
        tok = self.llm.get_tokenizer()
        if spec.path and spec.path not in sys.path:  # the user's environment module, as the driver found it
            sys.path.insert(0, spec.path)
        make_env = environment_factory(spec.name, spec.options)
        n, engine, tag = sampling.get("n", 1), self.llm.llm_engine, uuid.uuid4().hex[:8]
        envs = []
        for _ in range(len(rows) * n):  # one per episode
            if (b := clock.beat(user_code=True)) is not None:
                yield b
            envs.append(make_env())
        renderer = Renderer(tok, getattr(envs[0], "tool_schemas", None) if envs else None)
        episodes, active, waiting = [], {}, {}  # active: request id -> episode; waiting: future -> (episode, t0)
        for i, (prompt, row) in enumerate(zip(prompt_ids, rows)):
            for j in range(n):
                if (b := clock.beat(user_code=True)) is not None:
                    yield b
                env = envs[i * n + j]
                try:
                    start = env.reset(row)
                except Exception as exc:  # the environment's own failure: counted (env_errors), never called again
                    episodes.append(_Episode(i * n + j, env, list(prompt), [_user(row)], broken=True,
                                             env_error=f"reset raised {type(exc).__name__}: {exc}"))
                    continue
                ids = list(prompt) if start is None else tok(
                    renderer.conversation(start), add_special_tokens=False)["input_ids"]
                episodes.append(_Episode(i * n + j, env, ids, list(start or [_user(row)])))
        parser = ToolParserManager.get_tool_parser(spec.tool_parser)(tok)
        per_turn = {k: v for k, v in sampling.items() if k not in ("n", "seed", "max_tokens")}
        pool = ThreadPoolExecutor(spec.tool_workers, thread_name_prefix="environment")
        calls: list[tuple[_Episode, list[dict], dict]] = []  # environment calls to start after the next beat
        abandoned: list[Future] = []  # calls given up at their timeout; their threads may still run

        def queue_turn(ep: _Episode) -> None:
            budget = spec.max_tokens - ep.length
            if budget <= 0 or ep.turns >= spec.max_turns:
                ep.truncated = True
                return
            seed = sampling.get("seed")
            params = SamplingParams(n=1, max_tokens=min(budget, sampling.get("max_tokens", budget)), **per_turn,
                                    **({"seed": (seed + 7919 * ep.key + 104729 * ep.turns) % 2**31}
                                       if seed is not None else {}))
            rid = f"{tag}-{ep.key}-{ep.turns}"
            engine.add_request(rid, {"prompt_token_ids": ep.context()}, params)
            active[rid] = ep

        def add_env_messages(ep: _Episode, messages: list[dict]) -> None:
            # a tool printing more than max_output_chars is cut (saying so) and counted as a tool error
            ep.tool_errors += sum(len(str(m.get("content") or "")) > spec.max_output_chars for m in messages)
            messages = [{**m, "content": cap_output(m.get("content") or "", spec.max_output_chars)} for m in messages]
            ids = renderer.tokens(messages, close=ep.open)
            if ep.length + len(ids) >= spec.max_tokens:  # no room for the environment's answer and a reply
                ep.truncated = True
                return
            ep.segments.append(("env", ids, None))
            ep.length += len(ids)
            ep.messages += messages
            queue_turn(ep)

        def end_of_turn(ep: _Episode, completion) -> None:
            ids = list(completion.token_ids)
            lps = [step[t].logprob for step, t in zip(completion.logprobs, ids)] if completion.logprobs else None
            ep.segments.append(("model", ids, lps))
            ep.length += len(ids)
            ep.turns += 1
            text = tok.decode(ids, skip_special_tokens=False).removesuffix(tok.eos_token or "")
            ep.open = completion.finish_reason != "stop"  # cut by max_new_tokens: no end-of-turn token of its own
            if ep.open and ep.length >= spec.max_tokens:  # the episode's budget is spent
                ep.messages.append({"role": "assistant", "content": text})
                ep.truncated = True
                return
            turn, problem = parse_turn(text, parser)
            ep.messages.append(turn)
            ep.tool_calls += len(turn.get("tool_calls") or [])
            if ep.broken:  # its environment hung on an earlier call (or broke): the model has answered, done
                return
            if problem:
                ep.tool_errors += 1
                add_env_messages(ep, [tool_error(problem)])
                return
            calls.append((ep, list(ep.messages), turn))  # started after the next beat promises its timeout

        def env_answered(ep: _Episode, future: Future, t0: float) -> None:
            ep.tool_s += time.time() - t0
            try:
                result = future.result()
            except Exception as exc:  # a tool that raised: the model reads the error and may try again
                ep.tool_errors += 1
                add_env_messages(ep, [tool_error(f"{type(exc).__name__}: {exc}")])
                return
            try:
                step = as_step(result)
            except (TypeError, ValueError) as exc:  # the environment's own mistake, not the model's: counted
                ep.env_error = f"{type(exc).__name__}: {exc}"  # (env_errors) and the episode ends, unrewarded
                return
            ep.reward += step.reward
            if step.done:
                return
            add_env_messages(ep, step.messages) if step.messages else queue_turn(ep)

        try:
            for ep in episodes:
                queue_turn(ep)
            while active or waiting or calls:
                # Promise the calls' timeout before starting them: one may hold the interpreter from its first
                # instruction, and then this loop never beats again.
                if (b := clock.beat(user_code=bool(calls), oldest=min((t0 for _, t0 in waiting.values()), default=None),
                                    force=bool(calls))) is not None:
                    yield b
                for ep, messages, turn in calls:
                    waiting[pool.submit(ep.env.step, messages, turn)] = (ep, time.time())
                calls.clear()
                if active:
                    t0 = time.time()
                    outs = engine.step()
                    clock.stepped(time.time() - t0)
                    for out in outs:
                        if out.finished:
                            end_of_turn(active.pop(out.request_id), out.outputs[0])
                elif waiting:  # nothing to decode: wait for the first environment to answer (or time out)
                    oldest = min(t0 for _, t0 in waiting.values())
                    wait(list(waiting), timeout=min(HEARTBEAT_S, max(0.0, oldest + spec.tool_timeout_s - time.time())),
                         return_when=FIRST_COMPLETED)
                now = time.time()
                for future, (ep, t0) in list(waiting.items()):
                    if future.done():
                        del waiting[future]
                        env_answered(ep, future, t0)
                    elif now - t0 > spec.tool_timeout_s:  # a hung tool: its thread is abandoned, the sample goes on
                        del waiting[future]
                        abandoned.append(future)
                        ep.tool_s += now - t0
                        ep.tool_errors += 1
                        ep.broken = True
                        add_env_messages(ep, [tool_error(f"the tool did not answer within {spec.tool_timeout_s:g} s")])
        finally:
            if active:
                engine.abort_request(list(active))
            pool.shutdown(wait=False, cancel_futures=True)
        running = sum(not f.done() for f in abandoned)
        yield {"result": [[self._result(ep, tok) for ep in episodes[i * n:(i + 1) * n]]
                          for i in range(len(prompt_ids))],
               "retire": f"{running} call(s) of the environment {spec.name} still running after tool_timeout_s="
                         f"{spec.tool_timeout_s:g} s" if running else ""}

    def _result(self, ep: _Episode, tok) -> dict:
        out = assemble(ep.segments)
        return {**out, "finished": not ep.truncated, "version": self.version, "turns": ep.turns,
                "tool_calls": ep.tool_calls, "tool_errors": ep.tool_errors, "tool_s": ep.tool_s,
                "env_reward": ep.reward, "env_error": ep.env_error, "messages": ep.messages}
