"""Values as data between the response's process, the caller and the judge's process (`code_tests`), and the
comparison a check uses.

- `encode(value, other)`: a value as JSON-ready type-tagged lists (`["int", "0x5"]`, `["tuple", [...]]`). Plain:
  None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict and its standard subclasses
  (Counter, OrderedDict, defaultdict: sent as dict), range, and the standard library's iterators (consumed, sent
  as "iter"). Types match exactly: a subclass of int is not an int. Anything else goes to `other(value)`, which
  returns a tag of its own (the response's process: a handle; the judge: a reference back) or raises.
- `decode(tagged, other)`: the value back, built of plain types only; the tags `encode` does not make go to
  `other(tag, data)` (None: refused). Ints travel in hex: Python's 4,300-digit limit applies only to decimal.
- `canonical(tagged, allowed)`: the caller's check of a message from a sandboxed process: a clean copy, or a
  ValueError. The caller forwards only what it rebuilt, never the bytes a process wrote.
- `equal(a, b)`: a check's `==`, type-strict all the way down; `has_nan`, `contains` (`in`, strict likewise).

`encode`, `decode`, `plain`, `has_nan`, `equal` and `contains` run inside the sandboxed programs too
(harness.RESPONSE, harness.JUDGE embed their source), so each is self-contained: it names no global of this module.
"""

from __future__ import annotations

import inspect
import math

ITER_MODULES = ("builtins", "itertools")
HANDLE_TAGS = frozenset({"handle"})  # what the response's process may send beside plain values
REF_TAGS = frozenset({"ref"})  # what the judge may pass to the response's code beside plain values


def encode(value, other=None, depth=0):
    """`value` as type-tagged JSON-ready lists (the module docstring); a value that is not plain goes to
    `other(value)` (None: TypeError)."""
    kind = type(value)
    if depth > 100:
        raise ValueError("a value nested more than 100 deep")
    if value is None:
        return ["none"]
    if kind is bool:
        return ["bool", value]
    if kind is int:
        return ["int", int.__format__(value, "#x")]
    if kind is float:
        return ["float", float.__repr__(value)]
    if kind is complex:
        return ["complex", [float.__repr__(value.real), float.__repr__(value.imag)]]
    if kind is str:
        return ["str", str.__str__(value)]
    if kind is bytes:
        return ["bytes", bytes.hex(value)]
    if kind in (list, tuple, set, frozenset):
        return [kind.__name__, [encode(v, other, depth + 1) for v in value]]
    if kind is dict or kind.__module__ == "collections" and kind.__name__ in ("Counter", "OrderedDict", "defaultdict"):
        return ["dict", [[encode(k, other, depth + 1), encode(v, other, depth + 1)] for k, v in dict.items(value)]]
    if kind is range:
        return ["range", [encode(value.start), encode(value.stop), encode(value.step)]]
    if kind.__module__ in ("builtins", "itertools") and hasattr(kind, "__next__"):
        return ["iter", [encode(v, other, depth + 1) for v in value]]
    if other is not None:
        return other(value)
    raise TypeError("not a plain value (built-in types only): " + kind.__name__)


def decode(tagged, other=None, depth=0):
    """The value `encode` tagged, of plain types only; a tag it does not know goes to `other(tag, data)` (None:
    ValueError). An "iter" becomes an iterator over its items (single use, unequal to any list, as the original)."""
    if depth > 101 or type(tagged) is not list or not tagged or type(tagged[0]) is not str:
        raise ValueError("not a tagged value")
    tag = tagged[0]
    if tag == "none" and len(tagged) == 1:
        return None
    if len(tagged) < 2:
        raise ValueError("not a tagged value")
    data = tagged[1]
    kind = type(data)
    if len(tagged) == 2:
        if tag == "bool" and kind is bool:
            return data
        if tag == "int" and kind is str:
            digits = data[3:] if data.startswith("-0x") else data[2:] if data.startswith("0x") else ""
            if not digits or not all(c in "0123456789abcdef" for c in digits):
                raise ValueError("not a tagged int")
            return int(data, 16)
        if tag == "float" and kind is str and len(data) < 40:
            return float(data)
        if tag == "complex" and kind is list and len(data) == 2 and all(type(x) is str and len(x) < 40 for x in data):
            return complex(float(data[0]), float(data[1]))
        if tag == "str" and kind is str:
            return data
        if tag == "bytes" and kind is str:
            return bytes.fromhex(data)
        if tag == "range" and kind is list and len(data) == 3:
            bounds = [decode(x, None, depth + 1) for x in data]
            if not all(type(b) is int for b in bounds):
                raise ValueError("not a tagged range")
            return range(*bounds)
        if tag == "dict" and kind is list:
            if not all(type(pair) is list and len(pair) == 2 for pair in data):
                raise ValueError("not a tagged dict")
            return {decode(k, other, depth + 1): decode(v, other, depth + 1) for k, v in data}
        kinds = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset, "iter": iter}
        if tag in kinds and kind is list:
            return kinds[tag]([decode(v, other, depth + 1) for v in data])
    if other is None or tag in ("none", "bool", "int", "float", "complex", "str", "bytes", "range", "dict", "list",
                                "tuple", "set", "frozenset", "iter"):
        raise ValueError("not a tagged value: " + repr(tag)[:40])
    return other(tag, tagged[1:])


def plain(value, depth=0):
    """Whether `value` is built only of plain types (exactly; no subclass), as a check may compare or test it."""
    import collections

    kind = type(value)
    if kind in (bool, int, float, complex, str, bytes, range, type(None)):
        return True
    if depth > 100:
        return False
    if kind in (list, tuple, set, frozenset):
        return all(plain(v, depth + 1) for v in value)
    if kind in (dict, collections.Counter, collections.OrderedDict, collections.defaultdict):
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in dict.items(value))
    return False


def has_nan(value, depth=0):
    """Whether a NaN is in `value` (a float, a complex part, or inside a plain container)."""
    kind = type(value)
    if kind is float:
        return value != value
    if kind is complex:
        return value.real != value.real or value.imag != value.imag
    if depth > 100:
        return False
    if kind in (list, tuple, set, frozenset):
        return any(has_nan(v, depth + 1) for v in value)
    if isinstance(value, dict) and plain(value):
        return any(has_nan(k, depth + 1) or has_nan(v, depth + 1) for k, v in dict.items(value))
    return False


def equal(a, b, depth=0):
    """A check's `==`: type-strict all the way down (the module docstring of harness.py's JUDGE says where it
    applies). bool equals only bool; int, float and complex mix as numbers (`avg([2, 4]) == 3` passes with 3.0);
    the dict types mix (a Counter equals a dict literal); list, tuple, set, frozenset, str, bytes and range each
    equal only their own type, element by element, and dict keys and set members are matched by strict equality
    too (`{True: 1}` is not `{1: True}`). A value of the response's code that is not plain (the judge's handle on
    it) is a TypeError; two values of which one is the test's own object compare as Python compares them."""
    import collections

    if depth > 100:
        raise ValueError("values nested more than 100 deep")
    ta, tb = type(a), type(b)
    if getattr(ta, "__judge_remote__", False) or getattr(tb, "__judge_remote__", False):
        raise TypeError("a value of the response's code that is not plain cannot be compared")
    numbers = (int, float, complex)
    maps = (dict, collections.Counter, collections.OrderedDict, collections.defaultdict)
    atoms = (str, bytes, range, type(None))
    known = numbers + maps + atoms + (bool, list, tuple, set, frozenset)
    if ta not in known or tb not in known:
        return a == b  # the test's own objects: its own semantics
    if ta is bool or tb is bool:
        return ta is tb and a == b
    if ta in numbers and tb in numbers:
        return a == b
    if ta in maps and tb in maps:
        if len(a) != len(b):
            return False
        keys = {k: k for k in dict.keys(b)}
        for k, v in dict.items(a):
            if k not in keys or not equal(k, keys[k], depth + 1) or not equal(v, dict.__getitem__(b, keys[k]),
                                                                                depth + 1):
                return False
        return True
    if ta is not tb:
        return False
    if ta in (list, tuple):
        return len(a) == len(b) and all(equal(x, y, depth + 1) for x, y in zip(a, b))
    if ta in (set, frozenset):
        members = {x: x for x in b}
        return len(a) == len(b) and all(x in members and equal(x, members[x], depth + 1) for x in a)
    return a == b


def contains(container, item):
    """A check's `item in container`, strict as `equal` is for plain containers (`True in [1]` is False); as Python
    has it for str in str, bytes in bytes and the test's own objects."""
    import collections

    kind = type(container)
    if getattr(kind, "__judge_remote__", False) or getattr(type(item), "__judge_remote__", False):
        raise TypeError("a value of the response's code that is not plain cannot be compared")
    if kind in (list, tuple) or (kind.__module__ in ("builtins", "itertools") and hasattr(kind, "__next__")):
        return any(equal(item, x) for x in container)
    if kind in (set, frozenset, dict, collections.Counter, collections.OrderedDict, collections.defaultdict):
        if item not in container:
            return False
        members = {x: x for x in container}
        return equal(item, members[item])
    if kind is range:
        return type(item) is not bool and item in container
    return item in container


def source(*functions) -> str:
    """The source of these self-contained functions, for a sandboxed program to define them."""
    return "\n".join(inspect.getsource(f) for f in functions)


# --------------------------------------------------------------------------- the caller's check of a message
def canonical(tagged, allowed: frozenset = frozenset(), depth: int = 0):
    """A clean copy of a tagged value a sandboxed process sent, rebuilt from checked parts; ValueError for anything
    `decode` would refuse (plus the extra tags `allowed`: "handle" [id, type name] from the response's process, "ref"
    [id, attribute names] from the judge's). The caller forwards this copy, never what was written."""
    if depth > 101 or type(tagged) is not list or not tagged or type(tagged[0]) is not str:
        raise ValueError("not a tagged value")
    tag = tagged[0]
    if tag == "handle" and tag in allowed:
        if len(tagged) == 3 and type(tagged[1]) is int and 0 <= tagged[1] < 1 << 31 and type(tagged[2]) is str:
            return ["handle", tagged[1], tagged[2][:80]]
        raise ValueError("not a tagged handle")
    if tag == "ref" and tag in allowed:
        if (len(tagged) == 3 and type(tagged[1]) is int and 0 <= tagged[1] < 1 << 31 and type(tagged[2]) is list
                and len(tagged[2]) < 64 and all(type(a) is str and a.isidentifier() for a in tagged[2])):
            return ["ref", tagged[1], list(tagged[2])]
        raise ValueError("not a tagged reference")
    if tag in ("none", "bool", "int", "float", "complex", "str", "bytes", "range"):
        value = decode(tagged)  # atoms: decoding checks them; the copy is their encoding again
        if tag == "float" and not (math.isfinite(value) or tagged[1] in ("nan", "inf", "-inf")):
            raise ValueError("not a tagged float")
        return encode(value)
    if tag == "dict" and len(tagged) == 2 and type(tagged[1]) is list:
        if not all(type(pair) is list and len(pair) == 2 for pair in tagged[1]):
            raise ValueError("not a tagged dict")
        return ["dict", [[canonical(k, allowed, depth + 1), canonical(v, allowed, depth + 1)] for k, v in tagged[1]]]
    if tag in ("list", "tuple", "set", "frozenset", "iter") and len(tagged) == 2 and type(tagged[1]) is list:
        return [tag, [canonical(v, allowed, depth + 1) for v in tagged[1]]]
    raise ValueError("not a tagged value: " + repr(tag)[:40])
