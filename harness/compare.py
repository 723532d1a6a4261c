"""The rollout comparison: a candidate run against a baseline run of the same suites (docs/compare.md).

``python -m harness compare BASE CAND`` reads two runs' report folders (or their ``results.json``),
takes each compared figure's raw samples from both (6.2: every request's client TTFT and TPOT from
the request records the 6.2 verdicts link to, in send order), and judges the candidate/baseline
ratio of each figure against the checklist's ``regression:`` tolerances on an interval:

- **regressed**: the ratio's lower bound above 1 + ``max_increase`` (the candidate is worse than
  the tolerance allows, at the stated confidence);
- **within tolerance**: its upper bound at or below 1 + ``max_increase`` (**improved** when also
  below 1);
- **inconclusive**: the interval straddles the limit, saying about how many requests a run would
  decide it.

The interval of a percentile ratio is the ratio of the two percentiles' order-statistic bounds
(Bonferroni: no independence between the runs assumed; harness/stats/intervals.py), each built from
the effective samples the stream's serial dependence leaves. The checklist's ``alpha`` is the
chance, over all figures together, of calling one regressed that is within tolerance, and the same
of the reverse: each figure's bounds at ``alpha / figures`` one-sided.

Two runs are comparable when they measured the same thing the same way: the same cluster (name,
kind, engine, model, workers), the same load (users, rate, duration, shape) and the same
thresholds. What differs is named and the comparison refused (exit 3) unless ``--force``, which
compares anyway and states the differences beside the verdicts. Exit codes: 1 a figure regressed,
2 none regressed but one is undecided, 0 every figure within tolerance, 3 an error.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.checklists import Checklist
from harness.checks.slo import client_samples
from harness.errors import ConfigError
from harness.probes.client.records import read_records
from harness.stats import nearest_rank
from harness.stats.interval import Interval, more_to_decide
from harness.stats.intervals import percentile_interval

# figure (a threshold key of its item, or a compare-only figure: harness/checklists COMPARE_ONLY_FIGURES)
# -> (sample, percentile)
FIGURES: dict[tuple[str, str], tuple[str, float]] = {
    ("6.2.ttft", "ttft_p50_ms"): ("ttft", 50), ("6.2.ttft", "ttft_p99_ms"): ("ttft", 99),
    ("6.2.tpot", "tpot_p50_ms"): ("tpot", 50), ("6.2.tpot", "tpot_p99_ms"): ("tpot", 99),
    ("6.1.4", "reschedule_p50_s"): ("reschedule", 50), ("6.1.4", "reschedule_p95_s"): ("reschedule", 95),
}
# each sample: the verdict it comes from, what one sample is, and what a run needs to measure it
SOURCES: dict[str, tuple[str, str, str]] = {
    "ttft": ("6.2.ttft", "requests", "the 6.2 suite (`pytest suites/test_62_slo.py`)"),
    "tpot": ("6.2.ttft", "requests", "the 6.2 suite (`pytest suites/test_62_slo.py`)"),
    "reschedule": ("6.1.4", "faults", "the 6.1.4 suite (`pytest suites/test_item4_reschedule.py`)"),
}
STATUSES = ("regressed", "inconclusive", "within tolerance", "improved")


@dataclass
class Run:
    """One run's results and the raw samples of its compared figures."""

    results_path: Path
    results: dict[str, Any]
    samples: dict[str, list[float]]      # "ttft" / "tpot": ms of each ok request, in send order; "reschedule":
    requests: int                        # s of each 6.1.4 fault, in injection order (a source the run lacks: absent)
    records_files: list[str]
    # samples a source lacks because the event never ended: 6.1.4 faults never rescheduled
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
    max_increase: float
    status: str
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"item": self.item, "figure": self.figure, "baseline": self.baseline, "candidate": self.candidate,
                "ratio": self.ratio, "interval": None if self.interval is None else self.interval.to_dict(),
                "max_increase": self.max_increase, "status": self.status, "reason": self.reason}


@dataclass
class Comparison:
    baseline: Run
    candidate: Run
    alpha: float
    figures: list[FigureResult]
    differences: list[str] = field(default_factory=list)   # compared anyway (--force)
    not_compared: list[str] = field(default_factory=list)  # "item.figure" neither run measured

    @property
    def exit_code(self) -> int:
        statuses = {f.status for f in self.figures}
        return 1 if "regressed" in statuses else 2 if "inconclusive" in statuses else 0

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": str(self.baseline.results_path), "candidate": str(self.candidate.results_path),
                "alpha": self.alpha, "exit_code": self.exit_code, "differences": self.differences,
                "figures": [f.to_dict() for f in self.figures], "not_compared": self.not_compared,
                "method": "MOVER on the log scale: each run's percentile interval (order statistics, from the "
                          "effective samples of its send-ordered stream), their margins added in quadrature; "
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
    v614 = [v for v in verdicts if v.get("item") == "6.1.4"]
    if not v62 and not v614:
        raise ConfigError(f"{rf}: the run has no 6.2.ttft and no 6.1.4 verdict, so no figure to compare",
                          fix="run the 6.2 or 6.1.4 suite in both runs (`pytest suites/test_62_slo.py "
                              "suites/test_item4_reschedule.py`, or the whole suites/)")
    samples: dict[str, list[float]] = {}
    never: dict[str, int] = {}
    if v614:   # each fault's rescheduling time (s), as the verdict judged it; a fault never rescheduled has none
        faults = [x for x in (v614[0].get("evidence") or {}).get("samples") or () if isinstance(x, dict)]
        samples["reschedule"] = [float(x["value"]) for x in faults if isinstance(x.get("value"), (int, float))]
        never["reschedule"] = len(faults) - len(samples["reschedule"])
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
    # in send order, as the verdicts took them (the dependence estimate reads the order)
    requests, ttft, tpot = client_samples(sorted(records, key=lambda r: r.start_wall_ns()))
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
            "kills": options.get("kills")}


def _has(results: dict[str, Any], item: str) -> bool:
    return any(v.get("item") == item for v in results.get("verdicts") or ())


def differences(base: Run, cand: Run) -> list[str]:
    """Each setting the two runs differ in, as "what: baseline X, candidate Y". ``kills`` counts only
    when both runs measured 6.1.4 (it does not change a 6.2 figure)."""
    a, b = _shape(base.results), _shape(cand.results)
    if not (_has(base.results, "6.1.4") and _has(cand.results, "6.1.4")):
        a.pop("kills"), b.pop("kills")
    return [f"{key}: baseline {json.dumps(a[key], default=str)}, candidate {json.dumps(b[key], default=str)}"
            for key in a if a[key] != b[key]]


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.3g}"   # "?": no bound (too few samples), never a dash inside "[lo-hi]"


def mover_ratio(num: Interval, num_point: float, den: Interval, den_point: float) -> Interval:
    """Interval of num / den for two independent positive estimates from each one's own interval at
    the same one-sided levels: MOVER on the log scale (Zou & Donner 2008, "method of variance
    estimates recovery"): each bound's distance from its estimate is that side's margin of error, and
    the two runs' margins add in quadrature, as independent errors do. The ratio of the bounds
    (harness.stats.intervals.ratio_interval: no independence assumed) is far wider: at the
    tolerance, with 600 requests a run, it called 0 of 400 regressed at a 1.25 % level and so missed
    most real regressions. Extrapolation grows both runs alike."""
    def ln(x: float | None) -> float | None:
        return None if x is None or x <= 0 else math.log(x)

    n_lo, n_hi, d_lo, d_hi = ln(num.lo), ln(num.hi), ln(den.lo), ln(den.hi)
    n0, d0 = ln(num_point), ln(den_point)
    lo = hi = None
    if None not in (n0, d0, n_lo, d_hi):
        lo = math.exp(n0 - d0 - math.hypot(n0 - n_lo, d_hi - d0))  # type: ignore[operator]
    if None not in (n0, d0, n_hi, d_lo):
        hi = math.exp(n0 - d0 + math.hypot(n_hi - n0, d0 - d_lo))  # type: ignore[operator]
    extrapolate = None
    if num.extrapolate is not None and den.extrapolate is not None:
        ne, de = num.extrapolate, den.extrapolate
        extrapolate = lambda k: mover_ratio(ne(k), num_point, de(k), den_point)  # noqa: E731
    needs = max((x for x in (num.needs_n, den.needs_n) if x is not None), default=None)
    return Interval(lo, hi, 1 - num.miss_lo - num.miss_hi, f"MOVER ratio of {num.method} intervals (log scale)",
                    num.n, noun=num.noun, n2=den.n, needs_n=needs, extrapolate=extrapolate,
                    alpha_lo=num.miss_lo, alpha_hi=num.miss_hi)


def compare_figure(item: str, figure: str, base: list[float], cand: list[float], max_increase: float,
                   alpha_each: float) -> FigureResult:
    """One figure: the candidate/baseline ratio of the percentile, its interval (each bound at
    ``alpha_each`` one-sided), judged against 1 + ``max_increase``."""
    source, q = FIGURES[(item, figure)]
    _, noun, _ = SOURCES[source]
    limit = 1 + max_increase
    if not base or not cand:
        which = "baseline" if not base else "candidate"
        return FigureResult(item, figure, None, None, None, None, max_increase, "inconclusive",
                            f"the {which} has no sample of {figure} (no {noun[:-1]} measured it)")
    b, c = nearest_rank(base, q), nearest_rank(cand, q)
    # requests: a send-ordered stream whose serial dependence counts (effective samples); faults: each
    # injected and judged on its own, after the cluster was whole again
    in_order = noun == "requests"
    iv = mover_ratio(percentile_interval(cand, q, alpha_lo=alpha_each, alpha_hi=alpha_each, noun=noun,
                                         in_order=in_order), c,
                     percentile_interval(base, q, alpha_lo=alpha_each, alpha_hi=alpha_each, noun=noun,
                                         in_order=in_order), b)
    ratio = c / b if b > 0 else None
    said = (f"candidate {figure} {c:.3g} against the baseline's {b:.3g}: {_fmt(ratio)}x "
            f"[{_fmt(iv.lo)}-{_fmt(iv.hi)}], allowed <= {limit:g}x (+{max_increase:.0%})")
    if iv.lo is not None and iv.lo > limit:
        return FigureResult(item, figure, b, c, ratio, iv, max_increase, "regressed", said)
    if iv.hi is not None and iv.hi <= limit:
        status = "improved" if iv.hi < 1 else "within tolerance"
        return FigureResult(item, figure, b, c, ratio, iv, max_increase, status, said)
    more = more_to_decide(iv, limit, lambda x: x <= limit)
    if more is not None:
        why = f"undecided: about {more} more {noun} in each run would decide it"
    elif iv.lo is None or iv.hi is None:
        why = (f"undecided: too few {noun} for a p{q:g} bound at this level (each run needs "
               f"{iv.needs_n or 'more'})")
    else:
        why = f"undecided: more than 10x the {noun} would be needed to decide it (the figures are near the limit)"
    return FigureResult(item, figure, b, c, ratio, iv, max_increase, "inconclusive", f"{said}; {why}")


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
        raise ConfigError(f"{checklist.path}: regression figures {', '.join(unknown)} cannot be compared yet",
                          fix="use " + ", ".join(f"{i}.{f}" for i, f in FIGURES))
    # a figure neither run measured is not compared (a 6.2-only pair is not undecided on 6.1.4); one
    # measured by one run only is undecided, naming what the other run lacks
    skipped = [f"{item}.{fig}" for item, fig, _ in wanted
               if FIGURES[(item, fig)][0] not in base.samples and FIGURES[(item, fig)][0] not in cand.samples]
    wanted = [w for w in wanted if f"{w[0]}.{w[1]}" not in skipped]
    alpha_each = checklist.regression.alpha / max(1, len(wanted))
    results = []
    for item, fig, tol in wanted:
        source = FIGURES[(item, fig)][0]
        lacking = [name for name, run in (("baseline", base), ("candidate", cand)) if source not in run.samples]
        if lacking:
            results.append(FigureResult(item, fig, None, None, None, None, tol, "inconclusive",
                                        f"the {lacking[0]} did not measure {item} (run {SOURCES[source][2]} in both)"))
            continue
        unended = [f"{name} {run.never[source]} of {run.never[source] + len(run.samples[source])}"
                   for name, run in (("baseline", base), ("candidate", cand)) if run.never.get(source)]
        if unended:   # a percentile of the rest would hide them; the item's own verdict fails them
            results.append(FigureResult(item, fig, None, None, None, None, tol, "inconclusive",
                                        f"faults never rescheduled ({', '.join(unended)}): no time to compare "
                                        f"them by, and a {fig} of the others would hide them (the {item} verdict "
                                        "of that run judges them)"))
            continue
        results.append(compare_figure(item, fig, base.samples[source], cand.samples[source], tol, alpha_each))
    return Comparison(base, cand, checklist.regression.alpha, results, diff, skipped)


def _measured(run: Run) -> str:
    parts = [f"{run.requests} requests"] if "ttft" in run.samples else []
    if "reschedule" in run.samples:
        parts.append(f"{len(run.samples['reschedule'])} faults rescheduled")
    return ", ".join(parts)


def render_text(comp: Comparison) -> str:
    """The terminal table: one line per figure, then what differs and what the exit code means."""
    rows = [("figure", "baseline", "candidate", "ratio", "interval", "allowed", "verdict")]
    for f in comp.figures:
        iv = "-" if f.interval is None else f"[{_fmt(f.interval.lo)}-{_fmt(f.interval.hi)}]"
        rows.append((f.figure, _fmt(f.baseline), _fmt(f.candidate), _fmt(f.ratio), iv,
                     f"<= {1 + f.max_increase:g}x", f.status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"baseline  {comp.baseline.label}: {_measured(comp.baseline)} ({comp.baseline.results_path})",
             f"candidate {comp.candidate.label}: {_measured(comp.candidate)} ({comp.candidate.results_path})",
             ""]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("")
    lines += [f"{f.figure}: {f.reason}" for f in comp.figures if f.status == "inconclusive"]
    if comp.not_compared:
        lines.append("not compared (neither run measured them): " + ", ".join(comp.not_compared))
    if comp.differences:
        lines.append("compared anyway (--force), though the runs differ in: " + "; ".join(comp.differences))
    meaning = {0: "every figure within tolerance", 1: "a figure regressed beyond its tolerance",
               2: "no figure regressed, but one is undecided"}[comp.exit_code]
    k = len(comp.figures)
    lines.append(f"exit {comp.exit_code}: {meaning} (chance of a wrong 'regressed' over the {k} figures <= "
                 f"{comp.alpha:g}; each bound at {comp.alpha / max(1, k):.3g} one-sided)")
    return "\n".join(lines)
