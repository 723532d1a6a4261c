"""The checklist (``checklists/section6.yaml``) as pydantic models: the file's schema
(:class:`ChecklistFile`, printed by ``python -m harness schema --checklist``) and the thresholds the
checks judge against (:class:`Checklist`, with a cluster's overrides applied).

Every error names the file, the field and the fix, because these files are edited by hand by
people who are about to gate a rollout on them.
"""

from __future__ import annotations

import functools
import logging
import operator
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, field_validator

from harness.checklists.validation import (FieldProblem, StrictModel, Text, config_error, display_path, field_error,
                                           field_with_fix, load_yaml_mapping)
from harness.errors import ConfigError

log = logging.getLogger(__name__)

# Shipped inside the package (a link to checklists/section6.yaml in a checkout, so the documented
# file and the packaged one are the same file): a wheel install finds it too.
DEFAULT_CHECKLIST = Path(__file__).resolve().parent / "section6.yaml"

COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
}
Comparison = Literal["<", "<=", ">", ">=", "=="]
_NUMBER_FIX = "write a plain number such as 3 or 0.8"
# error budgets (docs/statistics.md, "Error rates"): `false_fail_alpha` / `false_pass_alpha` of an item
ALPHA_SUFFIX = "_alpha"


def _check_alpha(key: str, value: float, error: Callable[[str, str], Exception]) -> None:
    """An error budget is a chance of a wrong verdict: strictly between 0 and 0.5."""
    if key.endswith(ALPHA_SUFFIX) and not 0 < value < 0.5:
        raise error(f"{key} {value:g} is not a chance of a wrong verdict in (0, 0.5)",
                    "write e.g. 0.001 (one run in a thousand); see docs/statistics.md, \"Error rates\"")
_DOCS_FIX = "see the comments at the top of checklists/section6.yaml"


def _text_keys(value: Any) -> Any:
    """YAML reads an unquoted ``6.1: ...`` as a number: a key is its text either way."""
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else value


class ThresholdEntry(StrictModel):
    """One threshold as the file writes it: ``{value: 3, op: '<=', unit: s}``."""

    value: float = field_with_fix(_NUMBER_FIX, "the number; a cluster file may override it", allow_inf_nan=False)
    op: Comparison = field_with_fix(f"use one of {', '.join(COMPARISONS)}", "how a measurement is compared")
    unit: str = field_with_fix("write e.g. `unit: s`", default="")
    origin: Literal["article", "harness"] = field_with_fix(
        "use article or harness", "harness: the article gives no number, the harness chose it", default="article")


class ItemEntry(StrictModel):
    """One checklist item as the file writes it."""

    title: Text = field_with_fix("add `title: ...` to the item")
    source: Text = field_with_fix("add `source: ...` to the item", "the article's words")
    why: Text = field_with_fix("add `why: ...` to the item", "why the item matters to users")
    thresholds: dict[str, ThresholdEntry] = field_with_fix(
        "add `thresholds: {name: {value: N, op: '<=', unit: s}}`", min_length=1)

    @field_validator("thresholds", mode="before")
    @classmethod
    def _threshold_names_are_text(cls, value: Any) -> Any:
        return _text_keys(value)

    @field_validator("thresholds")
    @classmethod
    def _alphas_are_chances(cls, value: dict[str, ThresholdEntry]) -> dict[str, ThresholdEntry]:
        for key, entry in value.items():
            _check_alpha(key, entry.value, lambda problem, fix: FieldProblem(problem, fix, f"{key}.value"))
        return value


# figures the rollout comparison measures that no threshold names: the median rescheduling time (the
# checklist judges 6.1.4's p95 and p100, which a dozen faults a run cannot bound; the median they can)
COMPARE_ONLY_FIGURES: dict[str, tuple[str, ...]] = {"6.1.4": ("reschedule_p50_s",)}
# how a figure's tolerance is written when not `max_increase` (the candidate/baseline ratio may rise by at
# most this): `max_decrease` where a higher figure is better (the ratio may fall by at most this),
# `max_rise` for a share of requests (the candidate's share may exceed the baseline's by at most this many
# points: a difference, as a ratio of two zeros is nothing), `max_rise_s` for a time known only within
# measurement-resolution bounds that may start at 0 (nic-flap's recovery: at most this many seconds longer)
TOLERANCE_KINDS: dict[tuple[str, str], str] = {("6.1.1", "line_rate_fraction"): "max_decrease",
                                               ("6.1.5", "tcp_throughput_ratio"): "max_decrease",
                                               ("nothing-lost", "requests_without_final_state"): "max_rise",
                                               ("nic-flap", "recovery_time_s"): "max_rise_s"}
# items whose figures a comparison cannot take, and why (a `regression:` entry for one is an error)
NOT_COMPARABLE: dict[str, str] = {
    "6.1.3": "a run measures each trigger level once (the KV use when Level 2 and Level 3 were entered; its "
             "evidence.samples are the levels reached at each step, not repeated trigger readings): one value a "
             "run has no interval, so no candidate/baseline ratio can be judged"}


class ToleranceEntry(StrictModel):
    """How much worse than the baseline's a candidate's figure may be (``python -m harness compare``)."""

    max_increase: float | None = field_with_fix("write a fraction such as 0.10 (at most 10 % higher than the baseline)",
                                                "the candidate's figure over the baseline's may be at most 1 + this",
                                                ge=0, allow_inf_nan=False, default=None)
    max_decrease: float | None = field_with_fix("write a fraction such as 0.10 (at least 90 % of the baseline's)",
                                                "the candidate's figure over the baseline's must be at least 1 - this",
                                                ge=0, lt=1, allow_inf_nan=False, default=None)
    max_rise: float | None = field_with_fix("write a share such as 0.01 (at most 1 point more of the requests)",
                                            "the candidate's share may exceed the baseline's by at most this",
                                            ge=0, le=1, allow_inf_nan=False, default=None)
    max_rise_s: float | None = field_with_fix("write seconds such as 1.0 (at most 1 s longer than the baseline's)",
                                              "the candidate's time may exceed the baseline's by at most this (s)",
                                              ge=0, allow_inf_nan=False, default=None)

    def kind_and_value(self) -> tuple[str, float] | None:
        """(kind, value) of the one tolerance written; None when none or several are."""
        given = [(k, v) for k in ("max_increase", "max_decrease", "max_rise", "max_rise_s")
                 if (v := getattr(self, k)) is not None]
        return given[0] if len(given) == 1 else None


class RegressionEntry(StrictModel):
    """The checklist's ``regression:`` section: the rollout comparison's tolerances (docs/compare.md)."""

    alpha: float = field_with_fix("write a chance such as 0.05", "the chance, over one comparison's figures "
                                  "together, of calling a figure regressed that is within its tolerance; the same "
                                  "of calling one within tolerance that regressed", gt=0, lt=0.5, allow_inf_nan=False)
    figures: dict[str, dict[str, ToleranceEntry]] = field_with_fix(
        "write `figures: {\"6.2.ttft\": {ttft_p99_ms: {max_increase: 0.10}}}`", min_length=1)

    @field_validator("figures", mode="before")
    @classmethod
    def _figure_items_are_text(cls, value: Any) -> Any:
        return _text_keys(value)


class RegressionOverrides(StrictModel):
    """A cluster file's ``regression:`` section: its own alpha and tolerances over the checklist's."""

    alpha: float | None = field_with_fix("write a chance such as 0.05", "replaces the checklist's regression alpha",
                                         gt=0, lt=0.5, allow_inf_nan=False, default=None)
    figures: dict[str, dict[str, ToleranceEntry]] = field_with_fix(
        "write `figures: {\"6.2.ttft\": {ttft_p99_ms: {max_increase: 0.20}}}`", default_factory=dict)

    @field_validator("figures", mode="before")
    @classmethod
    def _figure_items_are_text(cls, value: Any) -> Any:
        return _text_keys(value)


class _ClusterRegression(StrictModel):
    regression: RegressionOverrides


class ChecklistFile(StrictModel):
    """A checklist file (``checklists/section6.yaml``)."""

    version: Literal[1] | None = field_with_fix("write `version: 1`", default=None)
    items: dict[str, ItemEntry] = field_with_fix("list checklist items under `items:`", min_length=1)
    regression: RegressionEntry | None = field_with_fix(
        "write `regression: {alpha: 0.05, figures: {...}}`", "tolerances of `harness compare` (docs/compare.md)",
        default=None)

    @field_validator("items", mode="before")
    @classmethod
    def _item_ids_are_text(cls, value: Any) -> Any:
        return _text_keys(value)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Threshold(_Frozen):
    """A threshold the checks judge against: the file's entry plus where its number came from."""

    item: str
    key: str
    value: float
    op: Comparison
    unit: str = ""
    origin: str  # the file the value came from (checklist or the cluster that overrode it)
    article: bool = True  # False when the article gives no number and the harness chose it

    def holds(self, measured: float) -> bool:
        return COMPARISONS[self.op](float(measured), self.value)

    def describe(self) -> str:
        return f"{self.op} {self.value:g} {self.unit}".strip()


class ChecklistItem(_Frozen):
    id: str
    title: str
    source: str  # the article's words
    why: str
    thresholds: Mapping[str, Threshold] = {}


# a cluster file's `thresholds:` section: {item: {key: number}}
_OVERRIDES = TypeAdapter(dict[str, dict[str, float]], config=ConfigDict(strict=True, allow_inf_nan=False))


class Regression(_Frozen):
    """Tolerances of the rollout comparison: {item: {figure: max_increase}} and the comparison's alpha."""

    alpha: float
    tolerances: Mapping[str, Mapping[str, float]]   # the value of each figure's kind (TOLERANCE_KINDS)
    origin: str = ""                                 # the checklist file
    overridden_by: str | None = None                 # a cluster file whose `regression:` changed alpha or a tolerance


class Checklist(_Frozen):
    path: str
    items: Mapping[str, ChecklistItem]
    regression: Regression | None = None

    @classmethod
    def load(cls, path: str | Path = DEFAULT_CHECKLIST) -> "Checklist":
        """Read and validate a checklist file (the shipped one: use :func:`default_checklist`)."""
        data = load_yaml_mapping(Path(path))
        shown = display_path(path)
        try:
            parsed = ChecklistFile.model_validate(data)
        except ValidationError as exc:
            raise config_error(exc, shown, ChecklistFile, default_fix=_DOCS_FIX) from None
        log.info("checklist %s parsed: %d items", shown, len(parsed.items))
        return cls.from_file(parsed, origin=shown)

    @classmethod
    def from_file(cls, parsed: ChecklistFile, *, origin: str) -> "Checklist":
        items = {item_id: ChecklistItem(
            id=item_id, title=entry.title, source=entry.source, why=entry.why,
            thresholds={key: Threshold(item=item_id, key=key, value=t.value, op=t.op, unit=t.unit, origin=origin,
                                       article=t.origin == "article") for key, t in entry.thresholds.items()})
            for item_id, entry in parsed.items.items()}
        regression = None
        if (r := parsed.regression) is not None:
            regression = Regression(alpha=r.alpha, origin=origin, tolerances=check_figures(origin, items, r.figures))
        return cls(path=origin, items=items, regression=regression)

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
        overrides = _text_keys(overrides)
        for item_id in overrides:  # the item names first: a misspelt item is the likelier mistake
            if item_id not in self.items:
                raise field_error(origin, f"{field_prefix}.{item_id}", "unknown checklist item",
                                  f"use one of {', '.join(self.items)} (defined in {self.path})")
        try:
            numbers = _OVERRIDES.validate_python({k: _text_keys(v) for k, v in overrides.items()})
        except ValidationError as exc:
            raise _override_error(exc, origin, field_prefix) from None
        items = dict(self.items)
        for item_id, values in numbers.items():
            item = items[item_id]
            new = dict(item.thresholds)
            for key, number in values.items():
                if key not in new:
                    raise field_error(origin, f"{field_prefix}.{item_id}.{key}", "unknown threshold",
                                      f"use one of {', '.join(new)}")
                _check_alpha(key, number, lambda problem, fix: field_error(
                    origin, f"{field_prefix}.{item_id}.{key}", problem, fix))
                log.info("threshold %s.%s overridden: %s -> %s (%s)", item_id, key, new[key].value, number, origin)
                new[key] = new[key].model_copy(update={"value": number, "origin": str(origin)})
            items[item_id] = item.model_copy(update={"thresholds": new})
        return self.model_copy(update={"items": items})

    def with_regression(self, overrides: Any, *, origin: str | Path) -> "Checklist":
        """A copy whose ``regression:`` alpha and tolerances are replaced (or figures added) from a
        cluster file's ``regression:`` section, validated as the checklist's (errors name the field)."""
        if overrides is None:
            return self
        try:
            parsed = _ClusterRegression.model_validate({"regression": overrides}).regression
        except ValidationError as exc:
            raise config_error(exc, str(origin), _ClusterRegression, default_fix=_DOCS_FIX) from None
        base = self.regression
        if base is None and parsed.alpha is None:
            raise field_error(origin, "regression.alpha", f"missing: {self.path} has no `regression:` section to "
                              "take it from", "write `alpha: 0.05`")
        tolerances = {i: dict(f) for i, f in (base.tolerances if base is not None else {}).items()}
        for item_id, figures in check_figures(str(origin), self.items, parsed.figures).items():
            tolerances.setdefault(item_id, {}).update(figures)
        return self.model_copy(update={"regression": Regression(
            alpha=parsed.alpha if parsed.alpha is not None else base.alpha,  # type: ignore[union-attr]
            tolerances=tolerances, origin=base.origin if base is not None else str(origin),
            overridden_by=str(origin))})

    def false_fail_budget(self) -> dict[str, float]:
        """{item: its false_fail_alpha} for the items in the error-controlled family, and
        ``"run"``: their sum, the run's chance of a wrong fail on a healthy cluster (union bound)."""
        budgets = {iid: it.thresholds["false_fail_alpha"].value for iid, it in self.items.items()
                   if "false_fail_alpha" in it.thresholds}
        return {**budgets, "run": sum(budgets.values())}

    def to_dict(self) -> dict[str, Any]:
        return {iid: {"title": it.title, "source": it.source, "why": it.why,
                      "thresholds": {k: {"value": t.value, "op": t.op, "unit": t.unit, "origin": t.origin,
                                         "article": t.article} for k, t in it.thresholds.items()}}
                for iid, it in self.items.items()}


@functools.cache
def default_checklist() -> Checklist:
    """The shipped checklist, parsed on first use and then shared (the models are immutable): a run
    parses it once however many places read it (the plugin, the cluster file's overrides, the report)."""
    return Checklist.load(DEFAULT_CHECKLIST)


def _override_error(exc: ValidationError, origin: str | Path, field_prefix: str) -> ConfigError:
    err = exc.errors(include_url=False)[0]
    where = ".".join([field_prefix, *(str(p) for p in err["loc"])])
    if len(err["loc"]) < 2:  # the item's value is not a mapping
        return field_error(origin, where, f"expected a mapping of threshold values, got {err.get('input')!r}",
                           "write `key: number` pairs under the item")
    return field_error(origin, where, f"expected a finite number, got {err.get('input')!r}", _NUMBER_FIX)


def json_schema() -> dict[str, Any]:
    """The checklist file's JSON Schema (``python -m harness schema --checklist``)."""
    schema = ChecklistFile.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "PD conformance harness checklist"
    return schema


def check_figures(origin: str, items: Mapping[str, ChecklistItem],
                  figures: Mapping[str, Mapping[str, ToleranceEntry]]) -> dict[str, dict[str, float]]:
    """{item: {figure: tolerance}} of a `regression:` section's figures, each checked: a known item that
    can be compared, one of its thresholds or compare-only figures, a tolerance of its kind."""
    for item_id, entries in figures.items():
        if item_id not in items:
            raise field_error(origin, f"regression.figures.{item_id}", "unknown checklist item",
                              f"use one of {', '.join(items)}")
        if item_id in NOT_COMPARABLE:
            raise field_error(origin, f"regression.figures.{item_id}", "not comparable: " + NOT_COMPARABLE[item_id],
                              "remove it (docs/compare.md)")
        for key, tol in entries.items():   # one of the item's thresholds (the same measurement), or compare-only
            allowed = [*items[item_id].thresholds, *COMPARE_ONLY_FIGURES.get(item_id, ())]
            if key not in allowed:
                raise field_error(origin, f"regression.figures.{item_id}.{key}", "unknown figure",
                                  f"use one of {', '.join(allowed)}")
            check_tolerance(origin, item_id, key, tol)
    return {i: {k: t.kind_and_value()[1] for k, t in f.items()} for i, f in figures.items()}  # type: ignore[index]


def check_tolerance(origin: str, item_id: str, key: str, tol: ToleranceEntry) -> None:
    """One tolerance written, of the kind its figure takes (TOLERANCE_KINDS); a field error naming it."""
    kind = TOLERANCE_KINDS.get((item_id, key), "max_increase")
    given = tol.kind_and_value()
    if given is None or given[0] != kind:
        why = {"max_decrease": "a higher figure is better, so a fall regresses",
               "max_rise": "a share of requests: the rise in points is judged, not a ratio",
               "max_rise_s": "a time known within bounds that may start at 0: the rise in seconds is judged",
               "max_increase": "a higher figure is worse"}[kind]
        raise field_error(origin, f"regression.figures.{item_id}.{key}", f"write exactly one `{kind}` ({why})",
                          f"write `{key}: {{{kind}: ...}}` (docs/compare.md)")

