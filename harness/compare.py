"""The rollout comparison: a candidate run against a baseline run of the same suites (docs/compare.md).

``python -m harness compare BASE CAND`` reads two runs' report folders (or their ``results.json``),
takes each compared figure's raw samples from both (6.2: the client TTFT and TPOT of the requests its
verdicts judged, in send order; the other items' from their verdicts' evidence: harness/compare_samples.py), and judges each figure against the checklist's
``regression:`` tolerance on an interval of the candidate/baseline ratio (a share of requests: of
the difference):

- **regressed**: the whole interval beyond the tolerance (above 1 + ``max_increase``, below
  1 - ``max_decrease``, above + ``max_rise``);
- **within tolerance**: the whole interval within it (**improved** when also on the better side of
  no change);
- **inconclusive**: the interval straddles the limit, saying about how many samples a run would
  decide it.

Ratio intervals combine each run's own percentile interval by MOVER on the log scale
(harness/stats/twosample.py); shares by Newcombe's hybrid score interval. The checklist's ``alpha``
is the chance, over all figures together, of calling one regressed that is within tolerance, and
the same of the reverse: each figure's bounds at ``alpha / figures`` one-sided.

Two runs are comparable when they measured the same thing the same way (cluster, load, thresholds,
each item's own settings); what differs is named and the comparison refused (exit 3) unless
``--force``. Exit codes: 1 a figure regressed, 2 none regressed but one is undecided, 0 every
figure within tolerance, 3 an error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.checklists import Checklist
from harness.checklists.models import NOT_COMPARABLE, TOLERANCE_KINDS
from harness.compare_fabric import change_cells, recovery_figure, window_ratio
from harness.compare_samples import (FIGURES, NEVER, SOURCES, Counts, Missing, Recovery, RttRatio, item_samples,
                                     measured_text)
from harness.checks.slo import client_samples, outside_bursts
from harness.errors import ConfigError
from harness.probes.client.records import read_records
from harness.stats import nearest_rank
from harness.stats.interval import Interval, more_to_decide
from harness.stats.intervals import percentile_interval
from harness.stats.twosample import difference_interval, mover_ratio

STATUSES = ("regressed", "inconclusive", "within tolerance", "improved")


@dataclass
class Run:
    """One run's results and the raw samples of its compared figures."""

    results_path: Path
    results: dict[str, Any]
    samples: dict[str, Any]              # "ttft" / "tpot": ms of each ok request, in send order; the other
    requests: int                        # sources: harness/compare_samples.py (a source the run lacks: absent)
    records_files: list[str]
    # samples a source lacks because the event never ended: 6.1.4 faults never rescheduled, failed migrations
    never: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        env = self.results.get("environment") or {}
        return f"{self.results.get('run_id', '?')} (commit {env.get('git_commit') or '?'})"


@dataclass
class FigureResult:
    item: str
    figure: str
    baseline: float | None
    candidate: float | None
    ratio: float | None
    interval: Interval | None
    tolerance: float         # of the figure's kind (harness/checklists TOLERANCE_KINDS)
    status: str
    reason: str
    kind: str = "max_increase"
    difference: float | None = None   # max_rise: the candidate's share minus the baseline's; max_rise_s: seconds

    @property
    def allowed(self) -> str:
        return {"max_increase": f"<= {1 + self.tolerance:g}x", "max_decrease": f">= {1 - self.tolerance:g}x",
                "max_rise": f"<= +{self.tolerance * 100:g} pt", "max_rise_s": f"<= +{self.tolerance:g} s"}[self.kind]

    def to_dict(self) -> dict[str, Any]:
        return {"item": self.item, "figure": self.figure, "baseline": self.baseline, "candidate": self.candidate,
                "ratio": self.ratio, "difference": self.difference,
                "interval": None if self.interval is None else self.interval.to_dict(),
                **({"max_increase": self.tolerance} if self.kind == "max_increase" else {}),
                "tolerance": {self.kind: self.tolerance}, "allowed": self.allowed,
                "status": self.status, "reason": self.reason,
                **({"change": " ".join(change_cells(self.kind, self.difference, self.interval) or ())}
                   if self.kind == "max_rise_s" else {})}


@dataclass
class Comparison:
    baseline: Run
    candidate: Run
    alpha: float
    figures: list[FigureResult]
    differences: list[str] = field(default_factory=list)   # compared anyway (--force)
    not_compared: list[str] = field(default_factory=list)  # "item.figure" neither run measured
    not_comparable: dict[str, str] = field(default_factory=dict)  # item either run measured -> why no figure
    tolerances_from: str = ""   # the checklist, and the cluster file that overrode some

    @property
    def exit_code(self) -> int:
        statuses = {f.status for f in self.figures}
        return 1 if "regressed" in statuses else 2 if "inconclusive" in statuses else 0

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": str(self.baseline.results_path), "candidate": str(self.candidate.results_path),
                "alpha": self.alpha, "exit_code": self.exit_code, "differences": self.differences,
                "figures": [f.to_dict() for f in self.figures], "not_compared": self.not_compared,
                "not_comparable": self.not_comparable, "tolerances_from": self.tolerances_from,
                "method": "MOVER on the log scale: each run's percentile interval (order statistics, from the "
                          "effective samples of its send-ordered stream), their margins added in quadrature; "
                          "shares of requests: Newcombe's hybrid score interval of the difference; "
                          "each figure's bounds at alpha / figures one-sided"}


def results_file(path: str | Path) -> Path:
    """``results.json`` of a report folder (its ``latest`` run when it is a reports root), or the file."""
    p = Path(path)
    for candidate in (p, p / "results.json", p / "latest" / "results.json"):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{path}: no results.json there (nor in {p / 'latest'})",
                      fix="pass a report folder written by `pytest suites/ --report-dir=DIR` (DIR/latest or "
                          "DIR/<run id>) or its results.json")


def load_run(path: str | Path) -> Run:
    """A run's results and its 6.2 request records (the links of its 6.2.ttft verdict)."""
    rf = results_file(path)
    try:
        results = json.loads(rf.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{rf}: not a readable results.json ({exc})",
                          fix="pass the results.json a harness run wrote, unedited") from None
    return run_of(results, rf)


def run_of(results: dict[str, Any], results_path: Path) -> Run:
    """:func:`load_run` of results already in memory (a run judging itself against a baseline
    before its results.json is written); the records are read beside ``results_path``."""
    rf = results_path
    verdicts = results.get("verdicts") or ()
    v62 = [v for v in verdicts if v.get("item") == "6.2.ttft"]
    samples, never = item_samples(results)
    if not v62 and not samples:
        raise ConfigError(f"{rf}: the run has no verdict with a figure to compare (6.2, 6.1.1, 6.1.2, 6.1.4, 6.1.5, "
                          "nic-flap, nothing-lost)",
                          fix="run the same suites in both runs (`pytest suites/`, or one item's suite)")
    if not v62:
        return Run(rf, results, samples, 0, [], never)
    links = [link for link in (v62[0].get("evidence") or {}).get("links") or () if link.endswith(".jsonl")]
    if not links:
        raise ConfigError(f"{rf}: the 6.2.ttft verdict links no request records (evidence.links): the run predates "
                          "them or its load never ran", fix="compare runs whose 6.2 suite sent load; run it again")
    records = []
    for link in links:
        f = rf.parent / link
        if not f.is_file():
            raise ConfigError(f"{rf}: its request records {link} are missing",
                              fix="keep the report folder whole (results.json with its artifacts/ folder)")
        records.extend(read_records(f))
    # the requests the verdicts judged (those timed in VM steal bursts left out: harness/checks/slo.py), in
    # send order, as the verdicts took them (the dependence estimate reads the order)
    spans = [tuple(s) for s in ((v62[0].get("evidence") or {}).get("steal_bursts") or {}).get("spans") or ()]
    requests, ttft, tpot = client_samples(sorted(outside_bursts(records, spans)[0], key=lambda r: r.start_wall_ns()))
    return Run(rf, results, {"ttft": ttft, "tpot": tpot, **samples}, requests, links, never)


def _thresholds(results: dict[str, Any]) -> dict[str, float]:
    return {f"{v['item']}.{m['key']}": m.get("threshold") for v in results.get("verdicts") or ()
            if v.get("item") in ("6.2.ttft", "6.2.tpot") for m in (v.get("evidence") or {}).get("measurements") or ()}


def _shape(results: dict[str, Any]) -> dict[str, Any]:
    """What must agree for two runs' figures to be comparable."""
    cluster, options = results.get("cluster") or {}, results.get("options") or {}
    v62 = next((v for v in results.get("verdicts") or () if v.get("item") == "6.2.ttft"), {})
    load = dict((v62.get("evidence") or {}).get("load") or {})
    load.pop("runs_s", None)   # how long 6.2 ran to decide: a result, not a setting
    return {"cluster name": cluster.get("name"), "cluster kind": cluster.get("kind"), "engine": cluster.get("engine"),
            "model": cluster.get("model"),
            "workers": sorted((w.get("name"), w.get("role")) for w in cluster.get("workers") or ()),
            "load": load, "load options": {k: options.get(k) for k in ("load_users", "load_rate", "load_duration")},
            "6.2 thresholds": _thresholds(results),
            # 6.1.4's faults: how many of each kind per role (the slowest of more faults is slower)
            "kills": options.get("kills"),
            # 6.1.1's transfer sizes (a larger KV block moves nearer the line rate); 6.1.5's storm (a longer
            # pause holds more round trips)
            "6.1.1 preset": _evidence(results, "6.1.1").get("preset"),
            "6.1.5 storm": {k: (_evidence(results, "6.1.5").get("storm") or {}).get(k)
                            for k in ("pause_ms", "resume_ms", "group", "gap_ms")},
            # the flaps, and the probe transfer whose length is the recovery time's resolution
            "nic-flap flaps": {k: (_evidence(results, "nic-flap").get("flaps") or {}).get(k)
                               for k in ("period_s", "duty", "count", "probe_mib")}}


# settings that count only when both runs measured their item
_ITEM_SETTINGS = {"kills": "6.1.4", "6.1.1 preset": "6.1.1", "6.1.5 storm": "6.1.5", "nic-flap flaps": "nic-flap"}


def _evidence(results: dict[str, Any], item: str) -> dict[str, Any]:
    v = next((v for v in results.get("verdicts") or () if v.get("item") == item), {})
    return v.get("evidence") or {}


def _has(results: dict[str, Any], item: str) -> bool:
    return any(v.get("item") == item for v in results.get("verdicts") or ())


def differences(base: Run, cand: Run) -> list[str]:
    """Each setting the two runs differ in, as "what: baseline X, candidate Y". An item's own settings
    (``kills``: 6.1.4's; 6.1.1's preset, 6.1.5's storm) count only when both runs measured that item
    (they do not change a 6.2 figure)."""
    a, b = _shape(base.results), _shape(cand.results)
    for key, item in _ITEM_SETTINGS.items():
        if not (_has(base.results, item) and _has(cand.results, item)):
            a.pop(key), b.pop(key)
    return [f"{key}: baseline {json.dumps(a[key], default=str)}, candidate {json.dumps(b[key], default=str)}"
            for key in a if a[key] != b[key]]


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"   # "?": no bound (too few samples), never a dash inside "[lo-hi]"


def _statistic(sample: Any, q: float | None, a: float, noun: str) -> tuple[float | None, Interval]:
    """One run's figure and its interval, each bound at one-sided ``a``."""
    if isinstance(sample, RttRatio):   # 6.1.5: the storm side over the calm side (harness/compare_fabric.py)
        return window_ratio(sample, q, a, noun)   # type: ignore[arg-type]
    # requests: a send-ordered stream whose serial dependence counts (effective samples); faults,
    # migrations, transfers: each made and judged on its own
    return nearest_rank(sample, q), percentile_interval(sample, q, alpha_lo=a, alpha_hi=a, noun=noun,
                                                        in_order=noun == "requests")


def _judge(kind: str, tol: float, iv: Interval) -> tuple[str | None, float, Any]:
    """(status or None when undecided, the limit, what holds for more_to_decide)."""
    lo = -math.inf if iv.lo is None else iv.lo
    hi = math.inf if iv.hi is None else iv.hi
    if kind == "max_decrease":   # a fall regresses (max_rise_s: harness/compare_fabric.py judges bounds)
        limit = 1 - tol
        status = "regressed" if hi < limit else ("improved" if lo > 1 else "within tolerance") if lo >= limit else None
        return status, limit, lambda x: x >= limit
    limit, none = (tol, 0.0) if kind == "max_rise" else (1 + tol, 1.0)
    status = "regressed" if lo > limit else ("improved" if hi < none else "within tolerance") if hi <= limit else None
    return status, limit, lambda x: x <= limit


def compare_figure(item: str, figure: str, base: Any, cand: Any, tolerance: float, alpha_each: float) -> FigureResult:
    """One figure: the candidate/baseline ratio of the percentile (a share: their difference), its
    interval (each bound at ``alpha_each`` one-sided), judged against the figure's tolerance
    (TOLERANCE_KINDS: ``max_increase`` unless named there). ``base`` / ``cand``: a list of values,
    an :class:`RttRatio`, or (events, n) of a share."""
    source, q = FIGURES[(item, figure)]
    _, noun, _ = SOURCES[source]
    kind = TOLERANCE_KINDS.get((item, figure), "max_increase")

    def result(b: float | None, c: float | None, ratio: float | None, iv: Interval | None, status: str, why: str,
               diff: float | None = None) -> FigureResult:
        return FigureResult(item, figure, b, c, ratio, iv, tolerance, status, why, kind, diff)

    if isinstance(base, tuple):   # a share: (events, n) of each run
        (xb, nb), (xc, nc) = base, cand
        if not nb or not nc:
            return result(None, None, None, None, "inconclusive", f"the {'baseline' if not nb else 'candidate'} sent "
                          f"no {noun} in the tests both ran")
        b, c = xb / nb, xc / nc
        iv = difference_interval(xc, nc, xb, nb, alpha_lo=alpha_each, alpha_hi=alpha_each, noun=noun)
        ratio, diff = None, c - b
        said = (f"candidate {figure} {xc} of {nc} ({c:.2%}) against the baseline's {xb} of {nb} ({b:.2%}): "
                f"{diff * 100:+.2g} pt [{iv.lo * 100:+.2g} to {iv.hi * 100:+.2g}], allowed <= +{tolerance * 100:g} pt")
    else:
        empty = [name for name, s in (("baseline", base), ("candidate", cand))
                 if not s or (isinstance(s, RttRatio) and not (s.during and s.calm))]   # 6.1.5: a side without any
        if empty:
            return result(None, None, None, None, "inconclusive",
                          f"the {empty[0]} has no sample of {figure} (no {noun[:-1]} measured it)")
        (b, b_iv), (c, c_iv) = _statistic(base, q, alpha_each, noun), _statistic(cand, q, alpha_each, noun)
        if b is None or c is None:
            return result(b, c, None, None, "inconclusive", f"{figure}: a run's calm side is zero, so no ratio")
        iv = mover_ratio(c_iv, c, b_iv, b)
        ratio, diff = (c / b if b > 0 else None), None
        limit_text = {"max_decrease": f">= {1 - tolerance:g}x (-{tolerance:.0%})"}.get(kind, f"<= {1 + tolerance:g}x "
                                                                                            f"(+{tolerance:.0%})")
        said = (f"candidate {figure} {c:.3g} against the baseline's {b:.3g}: {_fmt(ratio)}x "
                f"[{_fmt(iv.lo)}-{_fmt(iv.hi)}], allowed {limit_text}")
    status, limit, holds = _judge(kind, tolerance, iv)
    if status is not None:
        return result(b, c, ratio, iv, status, said, diff)
    more = more_to_decide(iv, limit, holds)
    if more is not None:
        why = f"undecided: about {more} more {noun} in each run would decide it"
    elif iv.lo is None or iv.hi is None:
        why = (f"undecided: no bound at this level: too few {noun}, or a bound at or below zero (each run needs "
               f"{iv.needs_n or 'more'})")
    else:
        why = f"undecided: more than 10x the {noun} would be needed to decide it (the figures are near the limit)"
    return result(b, c, ratio, iv, "inconclusive", f"{said}; {why}", diff)


def compare_runs(base: Run, cand: Run, checklist: Checklist, *, force: bool = False) -> Comparison:
    """Every figure of the checklist's ``regression:`` section, judged; ConfigError when the runs are
    not comparable and ``force`` is not given (the differences named)."""
    if checklist.regression is None:
        raise ConfigError(f"{checklist.path} has no `regression:` section: nothing says what tolerance to compare with",
                          fix="add one as the shipped checklists/section6.yaml does (docs/compare.md)")
    diff = differences(base, cand)
    if diff and not force:
        raise ConfigError("the two runs are not comparable: " + "; ".join(diff),
                          fix="run both with the same cluster file, load options and checklist, or pass --force "
                              "to compare anyway (the report then names the differences)")
    wanted = [(item, fig, tol) for item, figs in checklist.regression.tolerances.items() for fig, tol in figs.items()]
    unknown = [f"{item}.{fig}" for item, fig, _ in wanted if (item, fig) not in FIGURES]
    if unknown:
        raise ConfigError(f"{checklist.regression.origin or checklist.path}: regression figures {', '.join(unknown)} "
                          "cannot be compared yet", fix="use " + ", ".join(f"{i}.{f}" for i, f in FIGURES))
    # a figure neither run measured is not compared (a 6.2-only pair is not undecided on 6.1.4); one
    # measured by one run only is undecided, naming what the other run lacks
    skipped = [f"{item}.{fig}" for item, fig, _ in wanted
               if FIGURES[(item, fig)][0] not in base.samples and FIGURES[(item, fig)][0] not in cand.samples]
    wanted = [w for w in wanted if f"{w[0]}.{w[1]}" not in skipped]
    alpha_each = checklist.regression.alpha / max(1, len(wanted))
    results = [_figure(base, cand, item, fig, tol, alpha_each) for item, fig, tol in wanted]
    not_comparable = {item: why for item, why in NOT_COMPARABLE.items()
                      if any(_has(run.results, item) for run in (base, cand))}
    r = checklist.regression
    origin = r.origin + (f", overridden by {r.overridden_by}" if r.overridden_by else "")
    return Comparison(base, cand, r.alpha, results, diff, skipped, not_comparable, origin)


def _figure(base: Run, cand: Run, item: str, fig: str, tol: float, alpha_each: float) -> FigureResult:
    source = FIGURES[(item, fig)][0]
    kind = TOLERANCE_KINDS.get((item, fig), "max_increase")

    def undecided(why: str) -> FigureResult:
        return FigureResult(item, fig, None, None, None, None, tol, "inconclusive", why, kind)

    lacking = [name for name, run in (("baseline", base), ("candidate", cand)) if source not in run.samples]
    if lacking:
        return undecided(f"the {lacking[0]} did not measure {item} (run {SOURCES[source][2]} in both)")
    for name, run in (("baseline", base), ("candidate", cand)):
        if isinstance(run.samples[source], Missing):
            return undecided(run.samples[source].reason(name, item))
    b, c = base.samples[source], cand.samples[source]
    if isinstance(b, Recovery):   # bounds of one time each, not a sample
        return FigureResult(item, fig, tolerance=tol, kind=kind, **recovery_figure(b, c, tol))
    if isinstance(b, Counts):   # the tests both runs ran, pooled (another suite's load is another figure)
        common = sorted(set(b.by_test) & set(c.by_test))
        if not common:
            return undecided(f"no test measured {fig} in both runs (baseline: {', '.join(sorted(b.by_test))}; "
                             f"candidate: {', '.join(sorted(c.by_test))})")
        return compare_figure(item, fig, b.pooled(common), c.pooled(common), tol, alpha_each)
    unended = [f"{name} {run.never[source]} of {run.never[source] + len(run.samples[source])}"
               for name, run in (("baseline", base), ("candidate", cand)) if run.never.get(source)]
    if unended:   # a percentile of the rest would hide them; the item's own verdict fails them
        return undecided(f"{NEVER[source]} ({', '.join(unended)}): no time to compare them by, and a {fig} of the "
                         f"others would hide them (the {item} verdict of that run judges them)")
    return compare_figure(item, fig, b, c, tol, alpha_each)


def _measured(run: Run) -> str:
    return ", ".join(([f"{run.requests} requests"] if "ttft" in run.samples else []) + measured_text(run.samples))


def render_text(comp: Comparison) -> str:
    """The terminal table: one line per figure, then what differs and what the exit code means."""
    rows = [("figure", "baseline", "candidate", "change", "interval", "allowed", "verdict")]
    for f in comp.figures:
        iv = "-" if f.interval is None else f"[{_fmt(f.interval.lo)}-{_fmt(f.interval.hi)}]"
        est, iv = change_cells(f.kind, f.difference, f.interval) or (_fmt(f.ratio), iv)   # a share's points, seconds
        rows.append((f.figure, _fmt(f.baseline), _fmt(f.candidate), est, iv, f.allowed, f.status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"baseline  {comp.baseline.label}: {_measured(comp.baseline)} ({comp.baseline.results_path})",
             f"candidate {comp.candidate.label}: {_measured(comp.candidate)} ({comp.candidate.results_path})",
             ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("")
    lines += [f"{f.figure}: {f.reason}" for f in comp.figures if f.status == "inconclusive"]
    if comp.not_compared:
        lines.append("not compared (neither run measured them): " + ", ".join(comp.not_compared))
    lines += [f"{item} not comparable: {why}" for item, why in comp.not_comparable.items()]
    if comp.differences:
        lines.append("compared anyway (--force), though the runs differ in: " + "; ".join(comp.differences))
    meaning = {0: "every figure within tolerance", 1: "a figure regressed beyond its tolerance",
               2: "no figure regressed, but one is undecided"}[comp.exit_code]
    k = len(comp.figures)
    lines.append(f"tolerances: {comp.tolerances_from}")
    lines.append(f"exit {comp.exit_code}: {meaning} (chance of a wrong 'regressed' over the {k} figures <= "
                 f"{comp.alpha:g}; each bound at {comp.alpha / max(1, k):.3g} one-sided)")
    return "\n".join(lines)
