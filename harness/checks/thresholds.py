"""Checklist thresholds: load ``checklists/section6.yaml``, validate it, apply cluster overrides.

Every error names the file, the field and the fix, because these files are edited by hand by
people who are about to gate a rollout on them.
"""

from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from harness.errors import ConfigError

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Shipped inside the package (a link to checklists/section6.yaml in a checkout, so the documented
# file and the packaged one are the same file): a wheel install finds it too.
DEFAULT_CHECKLIST = Path(__file__).resolve().parents[1] / "checklists" / "section6.yaml"

COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
}


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


def as_number(source: str | Path, field_path: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise field_error(source, field_path, f"expected a finite number, got {value!r}",
                          "write a plain number such as 3 or 0.8")
    return float(value)


@dataclass(frozen=True)
class Threshold:
    item: str
    key: str
    value: float
    op: str
    unit: str
    origin: str  # the file the value came from (checklist or the cluster that overrode it)
    article: bool = True  # False when the article gives no number and the harness chose it

    def __post_init__(self) -> None:
        if self.op not in COMPARISONS:
            raise ConfigError(f"threshold {self.item}.{self.key}: unknown op {self.op!r}",
                              fix=f"use one of {', '.join(COMPARISONS)}")

    def holds(self, measured: float) -> bool:
        return COMPARISONS[self.op](float(measured), self.value)

    def describe(self) -> str:
        return f"{self.op} {self.value:g} {self.unit}".strip()


@dataclass(frozen=True)
class ChecklistItem:
    id: str
    title: str
    source: str  # the article's words
    why: str
    thresholds: Mapping[str, Threshold] = field(default_factory=dict)


@dataclass(frozen=True)
class Checklist:
    path: str
    items: Mapping[str, ChecklistItem]

    @classmethod
    def load(cls, path: str | Path = DEFAULT_CHECKLIST) -> "Checklist":
        data = load_yaml_mapping(Path(path))
        path = display_path(path)
        raw_items = data.get("items")
        if not isinstance(raw_items, dict) or not raw_items:
            raise field_error(path, "items", "missing or empty", "list checklist items under `items:`")
        items = {str(item_id): _parse_item(path, str(item_id), raw) for item_id, raw in raw_items.items()}
        return cls(path=str(path), items=items)

    def item(self, item_id: str) -> ChecklistItem:
        try:
            return self.items[item_id]
        except KeyError:
            raise ConfigError(f"{self.path}: no checklist item {item_id!r}",
                              fix=f"use one of {', '.join(self.items)}") from None

    def threshold(self, item_id: str, key: str) -> Threshold:
        item = self.item(item_id)
        try:
            return item.thresholds[key]
        except KeyError:
            raise ConfigError(f"{self.path}: item {item_id} has no threshold {key!r}",
                              fix=f"use one of {', '.join(item.thresholds)}") from None

    def with_overrides(self, overrides: Any, *, origin: str | Path,
                       field_prefix: str = "thresholds") -> "Checklist":
        """Return a copy with values replaced from ``{item: {key: value}}`` (a cluster's
        ``thresholds:`` section); unknown items or keys are errors, not silently ignored."""
        if overrides is None:
            return self
        if not isinstance(overrides, dict):
            raise field_error(origin, field_prefix, f"expected a mapping, got {type(overrides).__name__}",
                              'write `"6.1.4": {reschedule_p100_s: 3.0}`')
        items = dict(self.items)
        for item_id, values in overrides.items():
            item_id = str(item_id)
            where = f"{field_prefix}.{item_id}"
            if item_id not in items:
                raise field_error(origin, where, "unknown checklist item",
                                  f"use one of {', '.join(items)} (defined in {self.path})")
            if not isinstance(values, dict):
                raise field_error(origin, where, f"expected a mapping of threshold values, got {values!r}",
                                  "write `key: number` pairs under the item")
            item = items[item_id]
            new = dict(item.thresholds)
            for key, value in values.items():
                if key not in new:
                    raise field_error(origin, f"{where}.{key}", "unknown threshold",
                                      f"use one of {', '.join(new)}")
                number = as_number(origin, f"{where}.{key}", value)
                log.info("threshold %s.%s overridden: %s -> %s (%s)", item_id, key, new[key].value, number, origin)
                new[key] = replace(new[key], value=number, origin=str(origin))
            items[item_id] = replace(item, thresholds=new)
        return replace(self, items=items)

    def to_dict(self) -> dict[str, Any]:
        return {iid: {"title": it.title, "source": it.source, "why": it.why,
                      "thresholds": {k: {"value": t.value, "op": t.op, "unit": t.unit, "origin": t.origin,
                                         "article": t.article} for k, t in it.thresholds.items()}}
                for iid, it in self.items.items()}


def _parse_item(path: str, item_id: str, raw: Any) -> ChecklistItem:
    where = f"items.{item_id}"
    if not isinstance(raw, dict):
        raise field_error(path, where, "expected a mapping", "give the item a title, source, why and thresholds")
    for key in ("title", "source", "why"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            raise field_error(path, f"{where}.{key}", "missing or not text", f"add `{key}: ...` to the item")
    raw_thresholds = raw.get("thresholds")
    if not isinstance(raw_thresholds, dict) or not raw_thresholds:
        raise field_error(path, f"{where}.thresholds", "missing or empty",
                          "add `thresholds: {name: {value: N, op: '<=', unit: s}}`")
    thresholds = {}
    for key, spec in raw_thresholds.items():
        tw = f"{where}.thresholds.{key}"
        if not isinstance(spec, dict):
            raise field_error(path, tw, "expected {value, op, unit}", "write `{value: 3, op: '<=', unit: s}`")
        unknown = set(spec) - {"value", "op", "unit", "origin"}
        if unknown:
            raise field_error(path, f"{tw}.{sorted(unknown)[0]}", "unknown key", "use value, op, unit, origin")
        if spec.get("op") not in COMPARISONS:
            raise field_error(path, f"{tw}.op", f"unknown comparison {spec.get('op')!r}",
                              f"use one of {', '.join(COMPARISONS)}")
        if spec.get("origin", "article") not in ("article", "harness"):
            raise field_error(path, f"{tw}.origin", f"unknown origin {spec['origin']!r}", "use article or harness")
        thresholds[str(key)] = Threshold(
            item=item_id, key=str(key), value=as_number(path, f"{tw}.value", spec.get("value")),
            op=spec["op"], unit=str(spec.get("unit", "")), origin=str(path),
            article=spec.get("origin", "article") == "article")
    return ChecklistItem(id=item_id, title=raw["title"].strip(), source=raw["source"].strip(),
                         why=raw["why"].strip(), thresholds=thresholds)
