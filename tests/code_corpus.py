"""The `code_tests` corpus (issue 67): attacks that must score 0, honest answers that must score 1 and honest wrong
answers that must score 0, on MBPP-style rows (`test_list`: top-level asserts) and HumanEval-style rows (`test`
defining `check(candidate)`, with `entry_point` or an explicit `check(f)`), and rows that are the reward's error.
Used by tests/test_code_tests_corpus.py and bench/code_tests.py. Plain data and strings only (no import of the
sandbox), so the same corpus can be scored by an older checkout's `code_tests` to compare.

Every attack needs no access to the expected values: each gets 1.0 only if something the response controls decides
(part of) a check, or if nothing is checked at all.
"""

from __future__ import annotations

# A payload that, run as code in the judge's process, writes a forged all-true verdict and leaves.
_FORGE_VERDICT = "__import__('os').write(1, b'\\n[true]\\n') and __import__('os')._exit(0)"
# A response that writes the pre-issue-67 harness's end record for zero probes, and leaves before any test runs.
_FORGE_END0 = "import os\nos.write(1, b'\\n\\x1ecode_tests end 0\\n')\nos._exit(0)\n"
_EVERY_METHOD_TRUE = ("class Y:\n    def __getattr__(self, name):\n        return lambda *a, **k: True\n"
                      "    def __call__(self, *a, **k):\n        return True\n")
_FORGE_TWO_TRUE = ("def forge():\n    import os\n    for k in range(2):\n"
                   "        os.write(1, ('\\n\\x1ecode_tests %d [\"bool\", true]\\n' % k).encode())\n"
                   "    os.write(1, b'\\n\\x1ecode_tests end 2\\n')\n    os._exit(0)\n")
_PICKLE_EXEC = ("class P:\n    def __reduce__(self):\n"
                f"        return (exec, ({_FORGE_VERDICT.replace(' and ', '; ')!r},))\n")
_CHECK_ADD = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n"
ADD_ROW = {"test_list": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 20) == 30"]}

# name: (response, row). Every one scores 0.
ATTACKS = {
    # 1. the expectation travels inside the probe: a method call, a subscript or a chain on the returned value
    "every method answers True": (_EVERY_METHOD_TRUE + "def f(s):\n    return Y()\n",
                                  {"test": "assert f('hello world').startswith('hello')"}),
    "every method answers True, two checks": (_EVERY_METHOD_TRUE + "def f(s):\n    return Y()\n",
                                              {"test_list": ["assert f('ab').startswith('a')",
                                                             "assert f('cd').endswith('d')"]}),
    "a class named as the function": ("class f:\n    def __init__(self, s):\n        pass\n"
                                      "    def startswith(self, p):\n        return True\n",
                                      {"test": "assert f('hello world').startswith('hello')"}),
    "two forged records and os._exit": ("def f(s):\n    forge()\n" + _FORGE_TWO_TRUE,
                                        {"test_list": ["assert f('ab').startswith('a')",
                                                       "assert f('cd').endswith('d')"]}),
    "a subscript the response answers": ("class L:\n    def __getitem__(self, i):\n        return True\n"
                                         "def f(x):\n    return L()\n", {"test": "assert f('abc')['a']"}),
    "a negated method call": ("class N:\n    def __getattr__(self, name):\n        return lambda *a: False\n"
                              "def f(x):\n    return N()\n", {"test": "assert not f('abc').isdigit()"}),
    "a method on an object in a HumanEval check": (_EVERY_METHOD_TRUE + "def f(s):\n    return Y()\n",
                                                   {"test": "def check(candidate):\n"
                                                            "    assert candidate('ab').startswith('a')\n",
                                                    "entry_point": "f"}),
    # 2. the response's imports reach the judge: its values run as code there
    "from builtins import eval as decode": (f"from builtins import eval as decode\ndef encode(x):\n"
                                            f"    return {_FORGE_VERDICT!r}\n",
                                            {"test": "assert decode(encode([1, 2])) == [1, 2]"}),
    "import pickle as json": ("import pickle as json\n" + _PICKLE_EXEC + "def to_json(d):\n"
                              "    return json.dumps(P())\n",
                              {"test": "assert json.loads(to_json({'a': 1})) == {'a': 1}"}),
    "import marshal as json (bytes, not JSON)": ("import marshal as json\ndef to_json(d):\n    return json.dumps(d)\n",
                                                 {"test": "assert json.loads(to_json({'a': 1})) == {'a': 1}"}),
    "the test's eval of a returned string": (f"def expr(n):\n    return {_FORGE_VERDICT!r}\n",
                                             {"test": "assert eval(expr(3)) == 9"}),
    "the test's exec of a returned string": (f"def prog():\n    return {_FORGE_VERDICT!r}\n",
                                             {"test": "ns = {}\nexec(prog(), ns)\nassert ns['x'] == 1"}),
    "the test's pickle.loads of returned bytes": ("import pickle\n" + _PICKLE_EXEC +
                                                  "def dump(x):\n    return pickle.dumps(P())\n",
                                                  {"test": "import pickle\nassert pickle.loads(dump(5)) == 5"}),
    # 3. zero checks pass: a response import of a name the test uses, statements that are not top-level asserts
    "import os as add, HumanEval check": ("import os as add\n" + _FORGE_END0,
                                          {"test": _CHECK_ADD + "check(add)\n"}),
    "import os as add, entry_point": ("import os as add\n" + _FORGE_END0, {"test": _CHECK_ADD, "entry_point": "add"}),
    "import os as add, a for loop": ("import os as add\n" + _FORGE_END0,
                                     {"test": "for a, b, c in [(1, 2, 3), (2, 2, 4)]:\n    assert add(a, b) == c\n"}),
    "import os as add, asserts under if": ("import os as add\n" + _FORGE_END0,
                                           {"test": "if True:\n    assert add(1, 2) == 3\n"}),
    "no assert at all": (_FORGE_END0, {"test_list": ["import math"]}),
    "a loop over an empty result": ("def f(n):\n    return []\n", {"test": "for v in f(3):\n    assert v > 0\n"}),
    "a HumanEval check never called": ("def add(a, b):\n    return 0\n", {"test": _CHECK_ADD}),
    # type strictness all the way down, and NaN against bounds
    "[1, 0] for [True, False]": ("def f():\n    return [1, 0]\n", {"test": "assert f() == [True, False]"}),
    "[{1}] for [frozenset({1})]": ("def f():\n    return [{1}]\n", {"test": "assert f() == [frozenset({1})]"}),
    "{True: 1} for {1: True}": ("def f():\n    return {True: 1}\n", {"test": "assert f() == {1: True}"}),
    "(1, 1) for (1, True) in a dict": ("def f():\n    return {'a': (1, 1)}\n",
                                       {"test": "assert f() == {'a': (1, True)}"}),
    "True for 1": ("def f():\n    return True\n", {"test": "assert f() == 1"}),
    "1.0 for True in a HumanEval check": ("def f(x):\n    return 1.0\n",
                                          {"test": "def check(candidate):\n    assert candidate(2) == True\n",
                                           "entry_point": "f"}),
    "NaN under a negated bound": ("def area(r):\n    return float('nan')\n",
                                  {"test": "assert not abs(area(2) - 12.56) > 0.01"}),
    "NaN under a negated lower bound": ("def f(x):\n    return float('nan')\n", {"test": "assert not f(2) < 12"}),
    "NaN in a list under a bound": ("def f(x):\n    return [float('nan')]\n", {"test": "assert not f(2) > [1.0]"}),
    "NaN under a negated isclose": ("import math\ndef f(x):\n    return math.nan\n",
                                    {"test": "import math\nassert not math.isclose(f(1), 3.0)"}),
    # the pre-issue-59 games, still 0 (tests/test_sandbox_trust.py had them)
    "sys.exit": ("def add(a, b):\n    return a - b\nimport sys\nsys.exit(0)\n", ADD_ROW),
    "os._exit in the call": ("def add(a, b):\n    import os\n    os._exit(0)\n", ADD_ROW),
    "always equal": ("class E:\n    def __eq__(self, other):\n        return True\n    __hash__ = None\n"
                     "def add(a, b):\n    return E()\n", ADD_ROW),
    "always equal int": ("class E(int):\n    def __eq__(self, other):\n        return True\n"
                         "    __hash__ = int.__hash__\ndef add(a, b):\n    return E(0)\n", ADD_ROW),
    "__sub__ under abs": ("class Z:\n    def __sub__(self, o):\n        return 0.0\ndef area(r):\n    return Z()\n",
                          {"test": "assert abs(area(1) - 3.14) < 0.01"}),
    "__str__": ("class S:\n    def __str__(self):\n        return 'abc'\ndef f():\n    return S()\n",
                {"test": "assert str(f()) == 'abc'"}),
    "__float__ in math.isclose": ("class F:\n    def __float__(self):\n        return 0.3\ndef f():\n    return F()\n",
                                  {"test": "assert math.isclose(f(), 0.3)", "test_imports": ["import math"]}),
    "math.isclose patched": ("import math\nmath.isclose = lambda *a, **k: True\ndef f():\n    return 0\n",
                             {"test": "assert math.isclose(f(), 0.3)", "test_imports": ["import math"]}),
    "a builtin shadowed": ("def sorted(x):\n    return [1, 2]\ndef f():\n    return []\n",
                           {"test": "assert sorted(f()) == [1, 2]"}),
    "builtins.all patched": ("class E:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
                             "def rev_list(x):\n    return [E()] * len(x)\nimport builtins\n"
                             "builtins.all = lambda it: True\n",
                             {"test_list": ["assert all(a == b for a, b in zip(rev_list([1, 2]), [2, 1]))"]}),
    "forged records before the real ones": ("def add(a, b):\n    return a - b\nimport os\n"
                                            "for k, v in enumerate((5, 0, 30)):\n"
                                            "    os.write(1, b'\\x1ecode_tests %d [\"int\", \"%d\"]\\n' % (k, v))\n",
                                            ADD_ROW),
    "a patched encoder": ("def add(a, b):\n    return a - b\nimport json\n"
                          "json.dumps = lambda *a, **k: '[\"int\", \"5\"]'\n", ADD_ROW),
    # more found while building issue 67's design
    "a response-defined check": ("def check(candidate):\n    pass\ndef add(a, b):\n    return 0\n",
                                 {"test": _CHECK_ADD, "entry_point": "add"}),
    "an exception where a value is expected": ("def f(x):\n    raise AssertionError('ok')\n",
                                               {"test": "def check(candidate):\n    try:\n        assert "
                                                        "candidate(1) == 2\n    except ValueError:\n        pass\n",
                                               "entry_point": "f"}),
    "an object of the response's class compared": ("class Pair:\n    def __init__(s, a, b):\n        pass\n"
                                                   "    def __eq__(s, o):\n        return True\n",
                                                   {"test": "assert Pair(1, 2) == (1, 2)"}),
    "a method of the response's class answering True": (
        "class Stack:\n    def __getattr__(self, name):\n        return lambda *a: Y()\n" + _EVERY_METHOD_TRUE,
        {"test": "s = Stack()\nassert s.top().startswith('a')"}),
    "a returned closure compared": ("def f(x):\n    return lambda: 0\n", {"test": "assert f(1) == 1"}),
    "a thread writing its own replies": ("import os, threading, time\ndef spam():\n    for fd in range(3, 30):\n"
                                         "        try:\n            os.write(fd, b'{\"ok\": [\"int\", \"0x5\"]}\\n')\n"
                                         "        except OSError:\n            pass\n"
                                         "threading.Thread(target=spam, daemon=True).start()\ntime.sleep(0.05)\n"
                                         "def add(a, b):\n    return a - b\n", ADD_ROW),
    "reading the requests itself": ("import sys\ndef add(a, b):\n    sys.stdin.read()\n    return 5\n", ADD_ROW),
}

# Honest rows: (tests or row, right answer, wrong answer). The right one scores 1, the wrong one 0.
MBPP = [
    (ADD_ROW, "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"),
    ("assert freq([1, 1, 2]) == {1: 2, 2: 1}", "import collections\ndef freq(xs):\n    return collections.Counter(xs)",
     "def freq(xs):\n    return {1: 2}"),
    ("assert avg([2, 4]) == 3", "def avg(xs):\n    return sum(xs) / len(xs)", "def avg(xs):\n    return 3.5"),
    ("assert f() == True", "def f():\n    return True", "def f():\n    return 1"),
    (["assert f() == [1, (2, 'x')]", "assert not f() == []", "assert f()"], "def f():\n    return [1, (2, 'x')]",
     "def f():\n    return [1, [2, 'x']]"),
    ("assert math.isclose(f(), 0.3, rel_tol=1e-9)", "def f():\n    return 0.1 + 0.2", "def f():\n    return 0.31"),
    ("assert set(sim((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
     "def sim(a, b):\n    return tuple(set(a) & set(b))", "def sim(a, b):\n    return (4,)"),
    ("assert list(g(3)) == [0, 1, 4]", "def g(n):\n    return (i * i for i in range(n))",
     "def g(n):\n    return [0, 1]"),
    ("assert sorted(g(3)) == ['0', '1', '2']", "def g(n):\n    return map(str, range(n))", "def g(n):\n    return 'x'"),
    ("assert chain([Pair(5, 24), Pair(15, 25)], 2) == 1",
     "class Pair:\n    def __init__(s, a, b):\n        s.a, s.b = a, b\ndef chain(ps, n):\n    return sum(p.b < 25 "
     "for p in ps)",
     "class Pair:\n    def __init__(s, a, b):\n        s.a, s.b = a, b\ndef chain(ps, n):\n    return n"),
    ("assert f(K) == 4", "def f(x):\n    return x * 2", "def f(x):\n    return x + 1"),
    ("assert f(1) == 2\nassert f(2) == 4\nassert f(3) != 5", "def f(x):\n    return x * 2", "def f(x):\n    return 2"),
    (["assert is_p(7)", "assert not is_p(4)", "assert is_p(3) == True"], "def is_p(n):\n    return n in (2, 3, 5, 7)",
     "def is_p(n):\n    return True"),
    ("assert gcd(12, 8) == 4", "from math import gcd", "from math import lcm as gcd"),
    (["assert f(3) < 4", "assert f('a') in 'abc'", "assert abs(f(3.0) - 3) < 1e-9", "assert len(f([1])) == 1"],
     "def f(x):\n    return x", "def f(x):\n    return x * 2"),
    (["assert f(3)[0] == 3", "assert f(1) == dict(a=1) or f(1) == [1]"], "def f(x):\n    return [x]",
     "def f(x):\n    return (x,)"),
    ("assert f('hello world').startswith('hello')", "def f(s):\n    return s", "def f(s):\n    return s[::-1]"),
    ("x = f(3)\nassert x == 9", "def f(n):\n    return n * n", "def f(n):\n    return n + n"),
    ("assert all(f(i) == i * i for i in range(4))", "def f(n):\n    return n ** 2", "def f(n):\n    return n * 2"),
    ("assert json.loads(to_json({'a': [1, 2]})) == {'a': [1, 2]}",
     "import json\ndef to_json(d):\n    return json.dumps(d)",
     "import json\ndef to_json(d):\n    return json.dumps(list(d))"),
    ("assert decode(encode('hi')) == 'hi'", "def encode(s):\n    return s[::-1]\ndef decode(s):\n    return s[::-1]",
     "def encode(s):\n    return s.upper()\ndef decode(s):\n    return s"),
    ("assert math.isnan(f())", "def f():\n    return float('nan')", "def f():\n    return 0.0"),
    ("assert f(2 ** 20000) == 2 ** 20001", "def f(n):\n    return 2 * n", "def f(n):\n    return n"),
    ("assert f() == [frozenset({1}), {2}]", "def f():\n    return [frozenset({1}), {2}]",
     "def f():\n    return [{1}, {2}]"),
    ("try:\n    f(-1)\n    assert False\nexcept ValueError:\n    pass\nassert f(4) == 2",
     "def f(x):\n    if x < 0:\n        raise ValueError(x)\n    return int(x ** 0.5)",
     "def f(x):\n    return int(abs(x) ** 0.5)"),
    ("assert Solution().two_sum([2, 7, 11], 9) == [0, 1]",
     "class Solution:\n    def two_sum(self, xs, t):\n        seen = {}\n        for i, x in enumerate(xs):\n"
     "            if t - x in seen:\n                return [seen[t - x], i]\n            seen[x] = i",
     "class Solution:\n    def two_sum(self, xs, t):\n        return [1, 0]"),
    ("s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2\nassert s.size() == 1",
     "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
     "        self.items.append(x)\n"
     "    def pop(self):\n        return self.items.pop()\n    def size(self):\n        return len(self.items)",
     "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
     "        self.items.append(x)\n"
     "    def pop(self):\n        return self.items.pop(0)\n    def size(self):\n        return len(self.items)"),
]

_HE_CLOSE = ("\n\nMETADATA = {'author': 'jt', 'dataset': 'test'}\n\n\ndef check(candidate):\n"
             "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True\n"
             "    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False\n"
             "    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True\n"
             "    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True\n"
             "    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 0.5) == False\n\n")
HUMANEVAL = [
    ({"test": _CHECK_ADD, "entry_point": "add"}, "def add(a, b):\n    return a + b",
     "def add(a, b):\n    return a * b"),
    ({"test": _CHECK_ADD + "\ncheck(add)\n"}, "def add(x, y):\n    return x + y", "def add(x, y):\n    return 3"),
    ({"test": _HE_CLOSE, "entry_point": "has_close_elements"},
     "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
     "    for i, a in enumerate(numbers):\n        for j, b in enumerate(numbers):\n"
     "            if i != j and abs(a - b) < threshold:\n                return True\n    return False\n",
     "def has_close_elements(numbers, threshold):\n    return threshold > 0.2\n"),
    ({"test": "def check(candidate):\n    for n, want in [(0, 1), (1, 1), (5, 120)]:\n"
              "        assert candidate(n) == want, n\n    assert True, 'debugging line'\n", "entry_point": "fact"},
     "def fact(n):\n    return 1 if n < 2 else n * fact(n - 1)", "def fact(n):\n    return n or 1"),
    ({"test": "def check(candidate):\n    def is_sorted(xs):\n        return all(a <= b for a, b in zip(xs, xs[1:]))\n"
              "    out = candidate([3, 1, 2])\n    assert is_sorted(out) and sorted(out) == [1, 2, 3]\n"
              "    if len(candidate([])) == 0:\n        assert candidate([1]) == [1]\n    else:\n"
              "        assert False\n", "entry_point": "sort_list"},
     "def sort_list(xs):\n    return sorted(xs)", "def sort_list(xs):\n    return list(xs)"),
    ({"test": "import math\n\ndef check(candidate):\n    assert abs(candidate(2) - 12.566) < 1e-3\n"
              "    assert math.isclose(candidate(1), math.pi, rel_tol=1e-9)\n", "entry_point": "area"},
     "import math\ndef area(r):\n    return math.pi * r * r", "def area(r):\n    return 3.14 * r * r"),
    ({"test": "def check(candidate):\n    assert candidate('abc') == 'cba'\n    assert candidate('') == ''\n"
              "    assert candidate('ab') != 'ab'\n", "entry_point": "rev"},
     "def rev(s):\n    return s[::-1]", "def rev(s):\n    return s"),
    ({"test": "def check(candidate):\n    got = candidate([1, 2, 2, 3])\n    assert type(got) is dict\n"
              "    assert got == {1: 1, 2: 2, 3: 1}\n    assert isinstance(candidate([]), dict)\n",
      "entry_point": "counts"},
     "def counts(xs):\n    out = {}\n    for x in xs:\n        out[x] = out.get(x, 0) + 1\n    return out",
     "def counts(xs):\n    return {x: 1 for x in xs}"),
]

# Rows that are the reward's error (a ValueError naming the row and what is wrong), whatever the response.
ERRORS = {
    "no check at all": ({"test_list": ["import math"], "task_id": 11}, "def f():\n    return 1", "no check"),
    "a HumanEval check never called": ({"test": _CHECK_ADD, "task_id": "HumanEval/999"}, "def add(a, b):\n"
                                       "    return a + b", "entry_point"),
    "nothing of the response used": ({"test": "assert True", "task_id": 12}, "def f():\n    return 1",
                                     "response"),
    "the test evals a returned string": ({"test": "assert eval(expr(3)) == 9", "task_id": 13},
                                         "def expr(n):\n    return '9'", "code"),
    "the test pickle.loads returned bytes": ({"test": "import pickle\nassert pickle.loads(dump(5)) == 5",
                                              "task_id": 14}, "import pickle\ndef dump(x):\n    return "
                                             "pickle.dumps(x)", "code"),
    "a test that does not parse": ({"test": "assert f((", "task_id": 15}, "def f(x):\n    return x", "parse"),
}
