"""Environments for multi-turn rollouts: the protocol, the built-in tools, and the pure token bookkeeping.

An environment answers the model between its turns. The protocol is two methods, configured by
`stages.ppo.environment.name` ('calculator', 'python' or your 'module:Class', built with `options`):

    reset(row) -> list[dict] | None
        The conversation a sample starts from, as chat messages, given the whole prompt row (every
        column of your prompt data). None: the row's prompt as the data stage rendered it.
    step(messages, turn) -> Step(messages, reward, done)   (or the tuple (messages, reward, done))
        Called after every assistant turn with the conversation so far and that turn, in OpenAI form:
        {"role": "assistant", "content": text before any tool call, "tool_calls": [{"type": "function",
        "function": {"name": ..., "arguments": {...}}, "id": ...}]}. Returns the tool (or user) messages
        to add, a reward (summed over the episode, weighted by `environment.reward_weight`) and whether
        the episode is over.
    tool_schemas (optional attribute): OpenAI function specs passed to the chat template as `tools=`, for
        templates that describe the tools in the system prompt (Qwen, Llama 3.1+).

Why this shape (docs/architecture.md, "Multi-turn rollouts"): it is OpenRLHF's `AgentInstance`
(`reset` / `step` on the whole conversation state) in messages rather than raw text, so the chat template
renders what the environment adds (TRL's environments and verl's tool agent loop work in messages too),
and the engine, not the environment, owns the tokens: what the model sampled is kept token for token
and everything the environment adds is rendered, tokenized and masked out of the loss here
(`append_env`), the one place a wrong mask could come from.

Tool calls are parsed with vLLM's tool parsers (`environment.tool_parser`, 'hermes' by default: the
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` form Qwen, Hermes, SmolLM3 and the built-in
template render), the same code `vllm serve --tool-call-parser` uses.

A tool that raises, hangs past `tool_timeout_s` or prints more than `max_output_chars` never stalls
the iteration: the model gets a tool message saying so (`tool_error`, `cap_output`) and the
episode goes on; the engine loop in `stages/ppo/episodes.py` counts it.
"""

from __future__ import annotations

import ast
import json
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from pipeline.errors import UserError


@dataclass
class Step:
    """What an environment returns after an assistant turn."""

    messages: list[dict] = field(default_factory=list)  # tool / user messages added to the conversation
    reward: float = 0.0
    done: bool = False


class Environment(Protocol):
    def reset(self, row: dict) -> list[dict] | None: ...

    def step(self, messages: list[dict], turn: dict) -> Step | tuple: ...


def as_step(result: Any) -> Step:
    """A `step` return value as a Step: a Step, or the tuple (messages, reward, done). A TypeError for anything
    else, a ValueError for a reward that is not a finite number (nan, inf, "nan": one NaN would turn a whole
    GRPO group's advantages into NaN); either is the environment's error, counted as `env_errors`."""
    from stages.ppo.rewards import finite_score

    if isinstance(result, tuple) and len(result) == 3:
        messages, reward, done = result
        result = Step(list(messages or []), 0.0 if reward is None else reward, bool(done))
    if not isinstance(result, Step):
        raise TypeError(f"step() must return a Step or (messages, reward, done), got {type(result).__name__}")
    return Step(result.messages, finite_score(result.reward, "Step.reward"), result.done)


# --------------------------------------------------------------------------- tool messages


def tool_error(message: str, call: dict | None = None) -> dict:
    """The tool message the model sees when a call failed: it can read the error and try again."""
    return {"role": "tool", "content": f"error: {message}", **({"name": call["name"]} if call else {})}


def cap_output(text: str, limit: int) -> str:
    """`text` cut to `limit` characters, saying how much was cut (a tool printing megabytes)."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} characters cut]"


# --------------------------------------------------------------------------- the built-in tools


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """An arithmetic expression's value: numbers, + - * / // % ** and parentheses, nothing else.

    Its own evaluator on Python's parser rather than `eval` (which runs any code) or the python tool
    (a sandboxed process per call, ~50 ms, for a multiplication). Exponents and results are bounded so
    that no expression can hang the engine (`9 ** 9 ** 9`)."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise ValueError("exponent too large")
            out = _BINARY[type(node.op)](left, right)
            if abs(out) > 1e30:
                raise ValueError("result too large")
            return out
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")

    try:
        tree = ast.parse(str(expression).replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    try:
        out = value(tree.body)
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(out, float) and out.is_integer():
        out = int(out)
    return str(round(out, 10) if isinstance(out, float) else out)


def run_python(code: str, timeout_s: float = 5.0) -> str:
    """Run `code` in the sandbox the code_tests reward uses (no network, CPU, memory and time limits, a
    fresh uid where the machine allows): its stdout, or an error naming why it failed."""
    from stages.ppo.sandbox import SandboxLimits, run_python as sandboxed

    result = sandboxed(str(code), SandboxLimits(cpu_s=timeout_s, wall_s=timeout_s + 1))
    if result.ok:
        return result.stdout
    raise RuntimeError(f"{result.error}: {(result.stderr or result.stdout).strip()[-500:]}")


class ToolEnvironment:
    """Answers each tool call of a turn with its tool's output; a turn without a tool call ends the episode.

    `tools` maps a tool name to a function of the call's arguments returning text. The episode's reward
    is left to the rule reward on the final answer (`rewards.rule`), so the built-ins return 0."""

    tools: dict[str, Callable[..., str]] = {}

    def reset(self, row: dict) -> list[dict] | None:
        return None

    def step(self, messages: list[dict], turn: dict) -> Step:
        calls = turn.get("tool_calls") or []
        if not calls:
            return Step(done=True)
        out = []
        for call in calls:
            fn = call.get("function", call)
            name, args = fn.get("name"), fn.get("arguments") or {}
            if name not in self.tools:
                raise ValueError(f"unknown tool {name!r}; the tools are {', '.join(sorted(self.tools))}")
            if not isinstance(args, dict):
                raise ValueError(f"arguments of {name} must be an object, got {args!r}")
            out.append({"role": "tool", "name": name, "content": str(self.tools[name](**args))})
        return Step(out)


class Calculator(ToolEnvironment):
    """One tool, `calculator(expression)`: arithmetic the model need not do in its head."""

    def __init__(self):
        self.tools = {"calculator": calculate}


class Python(ToolEnvironment):
    """One tool, `python(code)`: runs the code in the sandbox and returns what it printed."""

    def __init__(self, timeout_s: float = 5.0):
        from stages.ppo.sandbox import announce

        announce("python tool")  # the sandbox tier, once per process (the engines' too)
        self.tools = {"python": lambda code: run_python(code, timeout_s)}


BUILTIN = {"calculator": Calculator, "python": Python}


def environment_factory(name: str, options: dict | None = None) -> Callable[[], Any]:
    """A function making a fresh environment per sample: a built-in name or 'module:Class' (built with
    `options` as keyword arguments). Fails now, naming the fix, if the class cannot be found."""
    from stages.common.tasks import load_function

    cls = BUILTIN.get(name) or load_function(name, "stages.ppo.environment.name",
                                                  "calculator, python, or an importable 'module:Class' whose "
                                                  "instances have reset(row) and step(messages, turn)")
    for method in ("reset", "step"):
        if not callable(getattr(cls, method, None)):
            raise UserError(f"stages.ppo.environment.name: {name} has no {method}() method; an environment "
                            "implements reset(row) and step(messages, turn) (stages/ppo/environments.py)")
    return lambda: cls(**(options or {}))


# --------------------------------------------------------------------------- parsing a turn


def parse_turn(text: str, parser) -> tuple[dict, str | None]:
    """(the assistant turn in OpenAI form, a parse error or None) from the text of one model turn.

    `parser` is a vLLM ToolParser (or anything with its `extract_tool_calls(text, request)`); a turn that
    opens a tool call the parser cannot read is an error the model is told about, not a silent answer."""
    info = parser.extract_tool_calls(text, None)
    if not info.tools_called:
        opened = getattr(parser, "tool_call_start_token", None)
        if opened and opened in text:
            return {"role": "assistant", "content": text}, f"could not read the tool call in {cap_output(text, 200)!r}"
        return {"role": "assistant", "content": text}, None
    calls = []
    for i, call in enumerate(info.tool_calls):
        try:
            args = json.loads(call.function.arguments) if call.function.arguments else {}
        except ValueError:
            return {"role": "assistant",
                    "content": text}, f"tool call arguments are not JSON: {call.function.arguments!r}"
        calls.append({"type": "function", "id": f"call_{i}",
                      "function": {"name": call.function.name, "arguments": args}})
    return {"role": "assistant", "content": info.content or "", "tool_calls": calls}, None


# --------------------------------------------------------------------------- tokens the environment adds


class Renderer:
    """Renders what an environment adds as tokens that continue a sampled assistant turn.

    The model's own tokens are kept exactly as sampled (re-tokenizing text could split them
    differently); only the new messages are rendered, as the chat template renders them after an
    assistant turn: what the template writes after the end-of-turn token the model stopped on (ChatML:
    a newline), the messages, then the next assistant header. A template that cannot render the
    conversation's prefix stably is refused with the reason."""

    _BASE = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]

    def __init__(self, tokenizer, tools: list | None = None):
        self.tok, self.tools = tokenizer, tools
        base = self._render(self._BASE, False)
        eos = tokenizer.eos_token or ""
        end = base.rfind("a" + eos)
        if end < 0:
            raise UserError("the tokenizer's chat template does not end an assistant turn with its eos token "
                            f"{eos!r}; multi-turn rollouts need it to tell the model's turns apart")
        self.base, self.after_eos = base, base[end + 1 + len(eos):]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                            **({"tools": self.tools} if self.tools else {}))

    def conversation(self, messages: list[dict]) -> str:
        """A whole conversation an environment starts from (`reset`), ready for the assistant's first turn."""
        return self._render(messages, True)

    def text(self, messages: list[dict], close: bool = False) -> str:
        """The text that follows an assistant turn: `close` when the turn was cut before its end-of-turn
        token, which the template would have written and the environment's tokens then begin with."""
        full = self._render(self._BASE + messages, True)
        if not full.startswith(self.base):
            raise UserError("the tokenizer's chat template renders a conversation's prefix differently once tool or "
                            "user messages follow; multi-turn rollouts cannot continue a turn with it")
        return (self.tok.eos_token if close else "") + self.after_eos + full[len(self.base):]

    def tokens(self, messages: list[dict], close: bool = False) -> list[int]:
        return self.tok(self.text(messages, close), add_special_tokens=False)["input_ids"]


def assemble(segments: list[tuple[str, list[int], list[float] | None]]) -> dict:
    """A multi-turn response from its segments in order, each ('model' | 'env', token ids, log-probs):
    {'ids', 'mask' (1 on the model's tokens, 0 on the environment's), 'logprobs' (the engine's on the
    model's tokens, 0 elsewhere), 'final' ([start, end) of the last model segment: the answer the rule
    reward reads)}. Pure: the loss mask of every multi-turn sample is made here."""
    ids, mask, logprobs, final = [], [], [], (0, 0)
    for kind, toks, lps in segments:
        start = len(ids)
        ids += toks
        model = kind == "model"
        mask += [int(model)] * len(toks)
        logprobs += list(lps) if model and lps is not None else [0.0] * len(toks)
        if model:
            final = (start, len(ids))
    return {"ids": ids, "mask": mask, "logprobs": logprobs, "final": final}
