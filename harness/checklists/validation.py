"""The project's one way to validate a hand-edited file: strict pydantic models whose fields carry
the fix (``x-fix`` in the JSON Schema), YAML read with errors that name the line, and pydantic's
errors turned into the one config-error shape ``FILE: field `a.b`: problem (fix: ...)``.

Both file formats use it: the checklist (harness/checklists/models.py) and the cluster file
(harness/clusterfile). It lives in this leaf so the cluster file, a higher layer, can import it.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from harness.errors import ConfigError

PROJECT_ROOT = Path(__file__).resolve().parents[2]

Text = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


class FieldProblem(ValueError):
    """Raised by a validator: ``field`` is relative to the model (or field) being validated."""

    def __init__(self, problem: str, fix: str, field: str = "") -> None:
        self.problem, self.fix, self.field = problem, fix, field
        super().__init__(problem)


def field_with_fix(fix: str, description: str = "", **kwargs: Any) -> Any:
    """A pydantic Field whose JSON Schema carries ``x-fix``: the fix a validation error names."""
    return Field(description=description or None, json_schema_extra={"x-fix": fix}, **kwargs)


class StrictModel(BaseModel):
    """A hand-edited file's models: unknown keys rejected, no type coercion, immutable."""
    # strict: YAML's `yes-please` is not a bool, `true` is not a count (ints still widen to floats)
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def display_path(path: str | Path) -> str:
    """A path relative to the project when it lies inside it (shorter in reports and errors)."""
    try:
        return str(Path(path).resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        return str(path)


def field_error(source: str | Path, field_path: str, problem: str, fix: str) -> ConfigError:
    """The one shape of every config error: ``FILE: field `a.b`: problem (fix: ...)``."""
    return ConfigError(f"{source}: field `{field_path}`: {problem}", fix=fix)


def yaml_error_place(exc: Exception) -> str:
    """Where and what a YAML error is, lines counted from 1 (pyyaml's marks count from 0). The
    scanner notices a missing ``:`` or closing quote only on a later line: its context mark (where
    the key or the quoted string began) is the line to fix, so it comes first."""
    problem = getattr(exc, "problem", None) or str(exc)
    mark, context = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
    if mark is None:
        return f": {problem}"
    if isinstance(exc, yaml.scanner.ScannerError) and context is not None:
        return (f" at line {context.line + 1}, column {context.column + 1}: {problem} ({exc.context}; "
                f"noticed at line {mark.line + 1}, column {mark.column + 1})")
    began = f" ({exc.context} that began at line {context.line + 1})" if context is not None and exc.context else ""
    return f" at line {mark.line + 1}, column {mark.column + 1}: {problem}{began}"


def load_yaml_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML file whose top level must be a mapping, with errors that name the file."""
    if not path.is_file():
        raise ConfigError(f"{path}: file not found", fix="check the path or the name under clusters/")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML{yaml_error_place(exc)}",
                          fix="fix the YAML syntax (indentation, quotes, colons)") from exc
    if not isinstance(data, dict):
        raise field_error(path, "<top level>", f"expected a mapping, got {type(data).__name__}",
                          "write `key: value` entries at the top level")
    return data


def did_you_mean(word: str, choices: Any) -> str:
    import difflib

    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f"did you mean `{close[0]}`? " if close else ""


def config_error(exc: ValidationError, source: str, root: type[BaseModel], *,
                 default_fix: str = "see the file's documentation", hidden: tuple[str, ...] = ()) -> ConfigError:
    """The first of pydantic's errors as ``FILE: field `a.b`: problem (fix: ...)``. ``root`` is the
    model that was validated, ``hidden`` fields of ``root`` that are not keys of the file (never
    offered as a fix)."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    if err["type"] == "missing":  # a misspelt required key: the unknown key (with did-you-mean) says more
        err = next((e for e in errors if e["type"] == "extra_forbidden" and e["loc"][:-1] == err["loc"][:-1]), err)
    path, info, model, dropped = _walk(root, err["loc"], err["type"] == "extra_forbidden")
    kind, given = err["type"], err.get("input")
    problem_error = (err.get("ctx") or {}).get("error")
    if isinstance(problem_error, FieldProblem):
        path += dropped  # the validator ran on that list entry: keep its index
        base, sub = (_join(path) if path else ""), problem_error.field
        field = base + sub if sub.startswith("[") else ".".join(x for x in (base, sub) if x)
        return field_error(source, field, problem_error.problem, problem_error.fix)
    fix = ((info.json_schema_extra or {}).get("x-fix") if info is not None else None) or default_fix
    if kind == "extra_forbidden":
        allowed = [a for a in (model.model_fields if model is not None else []) if a not in hidden]
        return field_error(source, _join(path), "unknown field",
                           f"{did_you_mean(path[-1], allowed)}use only {', '.join(allowed)}")
    if kind == "missing":
        return field_error(source, _join(path), "missing", fix)
    problem = err["msg"].replace("Input should be", "expected").replace("Value error, ", "")
    shown = json.dumps(given) if isinstance(given, (str, int, float, bool, type(None))) else repr(given)
    problem = f"{problem}, got {shown}"
    if dropped:
        problem = f"entry {dropped[0]}: {problem}"
    return field_error(source, _join(path), problem, fix)


def _walk(root: type[BaseModel], loc: tuple[Any, ...],
          extra: bool) -> tuple[list[Any], Any, type[BaseModel] | None, list[int]]:
    """Follow ``loc`` through the models. Returns the path of field names and list indexes (without
    pydantic's union-member tags, and without trailing indexes into lists of plain values, which
    are returned apart), the deepest FieldInfo, and the model holding the last key."""
    model: type[BaseModel] | None = root
    holder, info, path = model, None, []
    in_dict = False
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path.append(part)
        elif model is not None and part in model.model_fields:
            holder, info = model, model.model_fields[part]
            path.append(part)
            model = _model_in(info.annotation)
            in_dict = typing.get_origin(info.annotation) is dict
        elif in_dict or (extra and i == len(loc) - 1):
            holder = model or holder
            path.append(part)  # a mapping's key, or the unknown key itself
        # else: a union member's tag (e.g. "function-after[...]"), not a key
    dropped = []
    while path and isinstance(path[-1], int):
        dropped.insert(0, path.pop())
    return path, info, holder, dropped


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class inside an annotation (``X | None``, ``tuple[X, ...]``, ``dict[str, X]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _join(path: list[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"
