"""The two sandboxed programs of `code_tests`, written as plain functions whose source the harness embeds
(`response_program`, `judge_program`): they run in fresh interpreters of the sandbox, never in the caller.

- The response's run (`serve`): the response's code, then the row's setup (its failures ignored: the judge's run
  decides about the setup), then the values of the names the test uses (plain values as data, anything else as a
  handle), then one answer per question the caller relays: a call of a handle (or of an attribute of one) with
  arguments as data, or the value of an attribute. Its program holds the response and the names, never a test,
  an expected value or a secret; its standard input and output are /dev/null for the response's own code (the
  questions and answers travel on copies of the descriptors made before the response runs).
- The judge's run (`judge`): the imports the test needs, the response's names bound to what the response's run
  reported (`Remote` for a handle), the row's setup, then the test rewritten by `verdict.plan`, with `eval`,
  `exec`, `compile` and the code-running functions of the modules it names refused on anything but its own
  literals. It runs no code of the response: what it computes from the response's values, and so its verdict, is
  out of the response's reach. Its last message is the verdict: the checks it counted, how it failed, or why the
  row cannot be judged.

Both talk in JSON lines through the caller (harness.Referee), which checks and rebuilds every message it forwards.
"""

from __future__ import annotations

import stages.ppo.sandbox.values as values
from stages.ppo.sandbox.verdict import ASSERT, CHAIN, CMP, Plan


# --------------------------------------------------------------------------- shared by both programs
def channel(read_fd, write_fd):
    """send(message) and receive() -> message on the two descriptors (JSON lines); receive() is None at the end."""
    import json
    import os

    dumps, loads, read, write = json.dumps, json.loads, os.read, os.write
    pending = [b""]

    def send(message):
        data = (dumps(message, ensure_ascii=True) + "\n").encode()
        while data:
            data = data[write(write_fd, data):]

    def receive():
        while b"\n" not in pending[0]:
            chunk = read(read_fd, 1 << 16)
            if not chunk:
                return None
            pending[0] += chunk
        line, _, pending[0] = pending[0].partition(b"\n")
        return loads(line)

    return send, receive


def detach():
    """The protocol's copies of stdin and stdout; fds 0 and 1 become /dev/null for everything else in the run."""
    import os

    read_fd, write_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    return read_fd, write_fd


def describe(exc):
    """'Type: message' of an exception, bounded, whatever its __str__ does."""
    try:
        text = str(exc)
    except BaseException:  # noqa: BLE001 - a response's exception may raise in its own __str__
        text = "?"
    return type(exc).__name__[:60] + ": " + text[:300]


# --------------------------------------------------------------------------- the response's run
def serve(response, setup, names):
    import builtins
    import os

    send, receive = channel(*detach())
    leave = os._exit
    handles = []

    def hold(value):
        handles.append(value)
        return ["handle", len(handles) - 1, type(value).__name__[:60]]

    def deref(tag, data):
        if tag != "ref":
            raise ValueError("not an argument")
        obj = handles[data[0]]
        for attr in data[1]:
            obj = getattr(obj, attr)
        return obj

    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(response, "<response>", "exec"), ns)
    except BaseException as exc:  # noqa: BLE001 - the response's code failed to load: it defines nothing
        send({"failed": describe(exc)})
        leave(0)
    if setup:
        try:
            exec(compile(setup, "<setup>", "exec"), ns)
        except BaseException:  # noqa: BLE001 - the judge's run reports a setup that fails
            pass
    try:
        send({"names": {n: encode(ns[n], hold) if n in ns else ["missing"] for n in names}})
    except BaseException as exc:  # noqa: BLE001 - a name's value could not be sent
        send({"failed": describe(exc)})
        leave(0)
    while True:
        message = receive()
        if message is None:
            leave(0)
        try:
            call = "call" in message
            ref, attrs = message["call"][:2] if call else message["get"]
            obj = handles[ref]
            for attr in attrs:
                obj = getattr(obj, attr)
            if call:
                args, kwargs = message["call"][2:]
                obj = obj(*[decode(a, deref) for a in args], **{k: decode(v, deref) for k, v in kwargs})
            reply = {"ok": encode(obj, hold)}
        except BaseException as exc:  # noqa: BLE001 - the response's code raised: the judge's test sees it
            reply = {"raise": describe(exc).split(": ", 1)}
        send(reply)


# --------------------------------------------------------------------------- the judge's run
class Refused(BaseException):
    """The row cannot be judged (the reward's error): a value run as code, a non-plain value passed to the response."""


class Broken(BaseException):
    """The conversation with the response's run broke: the row fails."""


class ResponseError(Exception):
    """The response's code raised an exception that is not one of Python's built-in ones."""


STATE = {"checks": 0, "refused": None, "broken": None, "ask": None}


def raised(name, message):
    """The exception the response's code raised, as the judge raises it: a built-in class by its name (so a test
    may catch ValueError), anything else as ResponseError."""
    import builtins

    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and not issubclass(cls, (StopIteration,
                                                                                    StopAsyncIteration)):
        return cls(message)
    return ResponseError(name + ": " + message)


def ask(message, opened=False):
    """One question to the response's run; its value (handles as closed Remotes unless `opened`)."""
    if STATE["broken"]:
        raise Broken(STATE["broken"])
    reply = STATE["ask"](message)
    if type(reply) is not dict or len(reply) != 1 or not ("ok" in reply or "raise" in reply):
        STATE["broken"] = "the response's run stopped answering"
        raise Broken(STATE["broken"])
    if "raise" in reply:
        name, message = (reply["raise"] + ["", ""])[:2]
        raise raised(str(name), str(message))
    return decode(reply["ok"], lambda tag, data: Remote(data[0], (), opened, data[1], False))


def passed(value):
    """What an argument to the response's code may be: plain, or the response's own object back; else refused."""
    def other(v):
        if getattr(type(v), "__judge_remote__", False):
            return ["ref", v._ref, list(v._attrs)]
        STATE["refused"] = ("the test passes a " + type(v).__name__ + " to the response's code: only plain values "
                            "and the response's own objects can cross to it")
        raise Refused(STATE["refused"])

    return encode(value, other)


class Remote:
    """The judge's handle on an object in the response's run. A name of the response (`root`) may be called and
    its attributes used; a value a call returned is a handle only when it is not plain, and then it can be passed
    back to the response's code or called, while its attributes may be used only when the test constructed it by
    calling a name it spells as a class (CapWords: `Solution().two_sum(...)`, `Stack().push(1)`). Anything else
    (a method of an object a function returned, comparing it, testing its truth) is a TypeError: the response's
    object cannot stand in for a value."""

    __judge_remote__ = True
    __slots__ = ("_ref", "_attrs", "_open", "_name", "_root")

    def __init__(self, ref, attrs, opened, name, root):
        self._ref, self._attrs, self._open, self._name, self._root = ref, attrs, opened, name, root

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if not self._open:
            raise TypeError("the response's code returned a " + self._name + " object where the test uses a value "
                            "(only objects the test constructs from a class it names have attributes here)")
        return Remote(self._ref, self._attrs + (attr,), True, self._name, False)

    def __call__(self, *args, **kwargs):
        message = {"call": [self._ref, list(self._attrs), [passed(a) for a in args],
                            [[k, passed(v)] for k, v in kwargs.items()]]}
        return ask(message, opened=self._root and self._name[:1].isupper())

    def __repr__(self):  # not the response's type name: a string the test may compare must not be the response's
        return "<a handle on an object of the response>"

    __hash__ = object.__hash__

    def __eq__(self, other):
        return judge_cmp("==", self, other)

    def __ne__(self, other):
        return judge_cmp("!=", self, other)

    def __bool__(self):
        return bool(resolved(self, True))

    def __len__(self):
        return len(resolved(self, True))

    def __iter__(self):
        return iter(resolved(self, True))

    def __contains__(self, item):
        return contains(resolved(self, True), item)

    def __getitem__(self, key):
        return resolved(self, True)[key]

    def __int__(self):
        return int(resolved(self, True))

    def __float__(self):
        return float(resolved(self, True))

    def __index__(self):
        return resolved(self, True).__index__()

    def __str__(self):
        return str(resolved(self, True))

    def __format__(self, spec):
        return format(resolved(self, True), spec)

    def __add__(self, other):
        return resolved(self, True) + other

    def __radd__(self, other):
        return other + resolved(self, True)

    def __sub__(self, other):
        return resolved(self, True) - other

    def __rsub__(self, other):
        return other - resolved(self, True)

    def __mul__(self, other):
        return resolved(self, True) * other

    def __rmul__(self, other):
        return other * resolved(self, True)

    def __neg__(self):
        return -resolved(self, True)

    def __abs__(self):
        return abs(resolved(self, True))


def resolved(value, strict=False):
    """An attribute of the response's object the test reads as a value: asked of the response's run. Anything else
    is itself; with `strict`, a handle that is still not plain is a TypeError."""
    if getattr(type(value), "__judge_remote__", False) and value._attrs:
        value = ask({"get": [value._ref, list(value._attrs)]}, opened=False)
    if strict and getattr(type(value), "__judge_remote__", False):
        raise TypeError("the response's code returned a " + value._name + " object where the test uses a value")
    return value


def judge_assert(value):
    """`assert value`: plain (or the test's own) and true; counted."""
    if not resolved(value, True):
        raise AssertionError("an assert of the test failed")
    STATE["checks"] += 1


def judge_cmp(op, a, b):
    """A comparison of the test: strict `==`, `!=`, `in` (values.equal, values.contains); a NaN fails every
    bound (<, <=, >, >=: an AssertionError, so `not` cannot turn it into a pass)."""
    import operator

    a, b = resolved(a), resolved(b)
    if op == "is":
        return a is b
    if op == "is not":
        return a is not b
    if op in ("==", "!="):
        return equal(a, b) == (op == "==")
    if op in ("in", "not in"):
        return contains(b, a) == (op == "in")
    a, b = resolved(a, True), resolved(b, True)
    if has_nan(a) or has_nan(b):
        raise AssertionError("a NaN in a bound (" + op + "): a NaN fails every bound")
    return {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}[op](a, b)


def judge_chain(first, ops, later):
    """`a < b < c`: each comparison by judge_cmp, each later operand evaluated only when the chain still holds."""
    left = first
    for op, thunk in zip(ops, later):
        right = thunk()
        if not judge_cmp(op, left, right):
            return False
        left = right
    return True


def guard(constants, guarded, isclose):
    """eval, exec and compile, called from the test's own code, and the code-running functions of the modules the
    test names (verdict.CODE_FUNCTIONS), from anywhere: only on a literal of the row's own (or code compiled from
    one); anything else is refused. With `isclose`, math.isclose and cmath.isclose fail on a NaN."""
    import builtins
    import sys

    allowed = set(constants)
    compiled = []

    def permitted(source):
        return (type(source) in (str, bytes) and source in allowed) or any(source is c for c in compiled)

    def wrap(fn, what, anywhere):
        def guarded_call(*args, **kwargs):
            source = args[0] if args else next(iter(kwargs.values()), None)
            if (anywhere or sys._getframe(1).f_code.co_filename == "<test>") and not permitted(source):
                STATE["refused"] = ("the test runs " + what + "() on a value that is not one of its own literals: a "
                                    "check that would execute a value (possibly the response's) as code is refused")
                raise Refused(STATE["refused"])
            out = fn(*args, **kwargs)
            if what == "compile":
                compiled.append(out)
            return out
        return guarded_call

    for name in ("eval", "exec", "compile"):
        setattr(builtins, name, wrap(getattr(builtins, name), name, False))
    for module, names in guarded.items():
        try:
            mod = __import__(module)
        except ImportError:
            continue
        for name in names:
            if hasattr(mod, name):
                setattr(mod, name, wrap(getattr(mod, name), module + "." + name, True))
    if isclose:
        import cmath
        import math

        def no_nan(fn, what):
            def close(*args, **kwargs):
                if any(has_nan(v) for v in list(args) + list(kwargs.values())):
                    raise AssertionError("a NaN in a bound (" + what + "): a NaN fails every bound")
                return fn(*args, **kwargs)
            return close

        math.isclose, cmath.isclose = no_nan(math.isclose, "math.isclose"), no_nan(cmath.isclose, "cmath.isclose")


def judge(modules, setup, source, constants, guarded):
    import builtins
    import ctypes
    import os

    send, receive = channel(*detach())
    # PR_SET_DUMPABLE=0: where both runs share a uid (the weak tiers), the response's run cannot ptrace this one
    # or open its descriptors (1.4 ms; the strong tiers keep them apart with pid namespaces or uids anyway)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
    STATE["ask"] = lambda message: (send(message), receive())[1]
    run = exec

    def finish(failed=None, refused=None):
        send({"verdict": {"checks": STATE["checks"], "failed": None if STATE["refused"] else failed,
                          "refused": STATE["refused"] or refused}})
        os._exit(0)

    ns = {"__name__": "__main__", "__builtins__": builtins}
    for module in modules:
        try:
            ns[module] = __import__(module)
        except ImportError as exc:
            finish(refused="the judge cannot import " + module + ", which the test uses: " + describe(exc))
    first = receive()
    if type(first) is not dict or type(first.get("names")) is not dict:
        finish(failed="the response's run sent no names")
    for name, tagged in first["names"].items():
        if tagged != ["missing"]:
            ns[name] = decode(tagged, lambda tag, data: Remote(data[0], (), True, name, True))
    if setup:
        try:
            run(compile(setup, "<setup>", "exec"), ns)
        except Exception as exc:  # noqa: BLE001 - the row's own setup: it cannot be judged
            finish(refused="the row's setup fails in the judge: " + describe(exc))
    ns.update({ASSERT: judge_assert, CMP: judge_cmp, CHAIN: judge_chain})
    guard(constants, guarded, "isclose" in source)
    try:
        run(compile(source, "<test>", "exec"), ns)
    except BaseException as exc:  # noqa: BLE001 - any failure of the test is the row failing (Refused: refused)
        finish(failed=describe(exc))
    finish()


# --------------------------------------------------------------------------- the programs
_CODEC = values.source(values.encode, values.decode, values.plain, values.has_nan, values.equal, values.contains)


def response_program(code: str, setup: str, names: list[str]) -> str:
    """The response's run: the codec, `serve` and the call with the response's code, the setup and the names."""
    return "\n".join([_CODEC, values.source(channel, detach, describe, serve),
                      f"serve({code!r}, {setup!r}, {names!r})", ""])


_JUDGE = "\n".join([_CODEC, values.source(channel, detach, describe, Refused, Broken, ResponseError),
                    f"STATE = {STATE!r}\nASSERT, CMP, CHAIN = {ASSERT!r}, {CMP!r}, {CHAIN!r}",
                    values.source(raised, ask, passed, Remote, resolved, judge_assert, judge_cmp,
                                  judge_chain, guard, judge)])


def judge_program(plan: Plan) -> str:
    """The judge's run: the codec, the judge and the call with the plan (no code of the response)."""
    args = (plan.modules, plan.setup, plan.source, plan.constants, plan.guarded)
    return f"{_JUDGE}\njudge({', '.join(repr(a) for a in args)})\n"
