"""The base class every config section derives from, and the helpers that work on any section.

Kept apart from `pipeline.config` so stage modules can define and manipulate their config
classes (a Tune trial applies sampled values with `with_values`) without importing the whole
pipeline config, which imports every stage: that would be an import cycle.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from pipeline.errors import ConfigError


class Section(BaseModel):
    """A config section: unknown keys are errors, defaults are validated, values are immutable.

    `extra="forbid"` is what turns a typo (`max_lenn: 256`) into an error naming the key instead
    of a silently ignored setting.
    """

    model_config = ConfigDict(extra="forbid", validate_default=True, frozen=True)


def key_errors(title: str, problems: list[tuple[str, Any, str]]) -> ValidationError:
    """One validation error per (dotted key, value, why) of a raw mapping, each at the key's own path (so the message
    names `stages.serve.engine.extra.trust_remote_code`, not the mapping)."""
    from pydantic_core import InitErrorDetails, PydanticCustomError

    return ValidationError.from_exception_data(title, [InitErrorDetails(
        type=PydanticCustomError("value_error", "{why}", {"why": why}), loc=tuple(key.split(".")), input=value)
        for key, value, why in problems])


def apply_override(data: dict, path: list[str], value: Any) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
        node = child
    node[path[-1]] = value


def _model_at(root: type[Section], loc: tuple) -> type[Section] | None:
    """The config class that owns the key at `loc` (to suggest valid keys for a typo): through sections,
    optional sections (`X | None`, as most stages' are) and the values of `dict[str, X]` / items of `list[X]`."""
    model: Any = root
    parts = list(loc[:-1])
    while parts:
        field = getattr(model, "model_fields", {}).get(parts.pop(0))
        if field is None:
            return None
        model, placeholder = subsection(field.annotation)
        if model is None:
            return None
        if placeholder:  # the next part is the dict's key or the list's index
            if not parts:
                return None
            parts.pop(0)
    return model


def format_validation_error(exc: ValidationError, root: type[Section]) -> str:
    """One line per problem, each naming the key path, what is wrong and how to fix it."""
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        key = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            owner = _model_at(root, loc)
            valid = sorted(owner.model_fields) if owner else []
            close = difflib.get_close_matches(loc[-1], valid, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            lines.append(f"{key}: unknown key; {hint}valid keys here: {', '.join(valid)}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        got = err.get("input")
        shown = "" if err["type"] in ("missing",) or isinstance(got, dict) else f", got {got!r}"
        text = f"{msg[0].lower() + msg[1:]}{shown}"
        lines.append(f"{key}: {text}" if loc else msg)
    return "\n".join(lines)


def with_values(section: Section, values: dict[str, Any], prefix: str = "") -> Section:
    """A copy of `section` with dotted field paths set, validated again: {'lr': 1e-3, 'deepspeed.zero_stage': 0}.

    Raises ValueError naming `prefix.path` when the result is not a valid config (a tuned value that
    breaks a cross-field rule, e.g. a batch size that no longer divides)."""
    data = section.model_dump(mode="json")
    for dotted, value in values.items():
        apply_override(data, dotted.split("."), value)
    try:
        return type(section).model_validate(data)
    except ValidationError as exc:
        lines = format_validation_error(exc, type(section)).splitlines()
        raise ValueError("; ".join(f"{prefix}.{line}" if prefix else line for line in lines)) from None


def get_path(cfg: Section, dotted: str) -> Any:
    """`get_path(cfg, "stages.data")` -> that section (used for per-stage cache keys)."""
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def to_plain(value: Any) -> Any:
    """A config value as JSON-able plain data (paths become strings)."""
    if isinstance(value, Section):
        return value.model_dump(mode="json")
    if isinstance(value, Path):
        return str(value)
    return value


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: config as MLflow params."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): data}

def leaf_problem(model: type[Section], dotted: str, prefix: str) -> str | None:
    """Why `dotted` is not a settable value field of `model` (None if it is): for search spaces."""
    node: Any = model
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = getattr(node, "model_fields", {})
        if part not in fields or part == "use_tuned":
            valid = sorted(f for f in fields if f != "use_tuned")
            close = difflib.get_close_matches(part, valid, n=1)
            where = ".".join([prefix, *parts[:i]])
            return (f"not a field of {where}; " + (f"did you mean '{close[0]}'? " if close else "")
                    + f"fields there: {', '.join(valid)}")
        inner, placeholder = subsection(fields[part].annotation)  # a section, or an optional one (`X | None`)
        is_section = inner is not None and not placeholder
        node = inner if is_section else fields[part].annotation
        if i == len(parts) - 1 and is_section:
            return f"is a section, not a value; name one of its fields, e.g. {dotted}.{next(iter(node.model_fields))}"
        if i < len(parts) - 1 and not is_section:
            return f"{'.'.join(parts[: i + 1])} is a value, not a section"
    return None


def subsection(annotation: Any) -> tuple[type[Section] | None, str]:
    """The Section class a field holds, directly, as `X | None`, or as the values of `dict[str, X]` or the
    items of `list[X]` (then with the key or index placeholder to show in paths)."""
    import typing

    if isinstance(annotation, type) and issubclass(annotation, Section):
        return annotation, ""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is dict and len(args) == 2:
        inner, _ = subsection(args[1])
        return inner, ".<field path>" if inner else ""
    if typing.get_origin(annotation) is list and len(args) == 1:
        inner, _ = subsection(args[0])
        return inner, "[i]" if inner else ""
    sections = [a for a in args if isinstance(a, type) and issubclass(a, Section)]
    return (sections[0], "") if len(sections) == 1 and set(args) <= {sections[0], type(None)} else (None, "")
