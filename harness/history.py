"""``python -m harness history``: every run under a reports folder, newest first (docs/compare.md,
"History").

    python -m harness history --cluster=local
    python -m harness history --cluster=local --reports reports-ci --last 50 --json history.json
    python -m harness history --cluster=local --figure 6.2.ttft.ttft_p99_ms     # its trend, run by run

The index is built by scanning ``REPORTS/*/results.json`` each time (the folders a run writes:
``reports/<run id>/``; the ``latest`` link is the newest of them and is not listed twice), so it
cannot go stale and needs no upkeep: a deleted run folder is gone from it, a copied one is in it.
Each line: when the run started (UTC), its id, its label (``pytest --label``) or git commit, its
exit code, each item's status (the worst of the item's verdicts: error, fail, inconclusive, pass)
and, for a run given ``--baseline``, the comparison's own exit code; with ``--figure ITEM.KEY``, that
measurement of each run with its interval (a trend, newest first). A results.json that cannot be
read is listed as such, not skipped silently.
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import ConfigError

# the worst status of an item's verdicts stands for it (several nothing-lost verdicts, one per suite)
_RANK = {"error": 3, "fail": 2, "inconclusive": 1, "pass": 0}


@dataclass
class Entry:
    """One run of the index."""

    path: str
    run_id: str
    cluster: str | None = None
    label: str | None = None
    commit: str | None = None
    started: float | None = None
    exit_code: int | None = None
    items: dict[str, str] = field(default_factory=dict)   # item -> its worst status
    regression_exit_code: int | None = None                # --baseline: the comparison's own exit code
    unreadable: str | None = None                          # why results.json could not be read
    # "item.key" -> (value, interval lo, interval hi) of each measurement (an item's first verdict's)
    measured: dict[str, tuple[Any, Any, Any]] = field(default_factory=dict, repr=False)

    @property
    def when(self) -> str:
        if self.started is None:
            return "?"
        return datetime.datetime.fromtimestamp(self.started, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _entry(results_path: Path) -> Entry:
    try:
        data = json.loads(results_path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        return Entry(str(results_path), results_path.parent.name, unreadable=str(exc).splitlines()[0][:200])
    items: dict[str, str] = {}
    measured: dict[str, tuple[Any, Any, Any]] = {}
    for v in data.get("verdicts") or ():
        if isinstance(v, dict) and isinstance(v.get("item"), str):
            status, prev = str(v.get("status")), items.get(v["item"])
            if prev is None or _RANK.get(status, 3) > _RANK.get(prev, 3):
                items[v["item"]] = status
            for m in (v.get("evidence") or {}).get("measurements") or ():
                iv = m.get("interval") if isinstance(m.get("interval"), dict) else {}
                measured.setdefault(f"{v['item']}.{m.get('key')}", (m.get("value"), iv.get("lo"), iv.get("hi")))
    cluster, options, env = (data.get(k) if isinstance(data.get(k), dict) else {} for k in
                             ("cluster", "options", "environment"))
    regression = data.get("regression") if isinstance(data.get("regression"), dict) else {}
    started = data.get("started")
    return Entry(str(results_path), str(data.get("run_id") or results_path.parent.name), cluster.get("name"),
                 options.get("label"), env.get("git_commit"), started if isinstance(started, (int, float)) else None,
                 data.get("exit_code"), items, regression.get("exit_code"), None, measured)


def index(reports: Path) -> list[Entry]:
    """Every run folder's results.json under ``reports``, newest first (by start time, then run id)."""
    if not reports.is_dir():
        raise ConfigError(f"{reports}: no such reports folder",
                          fix="pass the --report-dir the runs were written to (`--reports DIR`; default reports)")
    runs = [_entry(d / "results.json") for d in sorted(reports.iterdir())
            if d.is_dir() and not d.is_symlink() and not d.name.startswith(".") and (d / "results.json").is_file()]
    return sorted(runs, key=lambda e: (e.started or 0.0, e.run_id), reverse=True)


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) and not isinstance(x, bool) else "?"


def figure_text(entry: Entry, figure: str) -> str:
    """``412 [380-450]``; "-" when the run did not measure it."""
    if figure not in entry.measured:
        return "-"
    value, lo, hi = entry.measured[figure]
    return _num(value) + ("" if lo is None and hi is None else f" [{_num(lo)}-{_num(hi)}]")


def render(entries: list[Entry], figure: str | None = None) -> str:
    """One line per run: time, id, label or commit, exit code, --baseline's code, the ``figure``
    when asked for, the items' statuses."""
    extra = (figure,) if figure else ()
    rows = [("started (UTC)", "run", "label / commit", "exit", "against baseline", *extra, "items")]
    for e in entries:
        if e.unreadable is not None:
            rows.append((e.when, e.run_id, "-", "-", "-", *("-" for _ in extra),
                         f"unreadable results.json: {e.unreadable}"))
            continue
        rows.append((e.when, e.run_id, e.label or e.commit or "?", "?" if e.exit_code is None else str(e.exit_code),
                     "-" if e.regression_exit_code is None else f"exit {e.regression_exit_code}",
                     *(figure_text(e, f) for f in extra),
                     ", ".join(f"{item} {status}" for item, status in e.items.items()) or "(no verdict)"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths)), r[-1]]).rstrip() for r in rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default=None, metavar="NAME",
                        help="only runs of this cluster (its name in results.json; default: every cluster)")
    parser.add_argument("--reports", type=Path, default=Path("reports"), metavar="DIR",
                        help="the reports folder the runs were written to (pytest --report-dir; default reports)")
    parser.add_argument("--last", type=int, default=20, metavar="N", help="the newest N runs (default 20; 0: all)")
    parser.add_argument("--figure", default=None, metavar="ITEM.KEY",
                        help="a column with that measurement of each run and its interval, e.g. 6.2.ttft.ttft_p99_ms")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the listed runs as JSON")


def run(args: argparse.Namespace) -> int:
    entries = index(args.reports)
    if args.cluster is not None:
        seen = sorted({e.cluster for e in entries if e.cluster})
        # an unreadable results.json names no cluster: listed whatever the filter, so it is not missed
        entries = [e for e in entries if e.cluster == args.cluster or e.unreadable is not None]
        if not any(e.unreadable is None for e in entries):
            raise ConfigError(f"{args.reports}: no run of cluster {args.cluster!r}",
                              fix=f"use one of {', '.join(seen)}" if seen else "run the suites with "
                                  f"--report-dir={args.reports} first")
    if args.last > 0:
        entries = entries[:args.last]
    if args.figure is not None and not any(args.figure in e.measured for e in entries):
        known = sorted({k for e in entries for k in e.measured})
        raise ConfigError(f"--figure {args.figure}: no listed run measured it",
                          fix=f"use one of {', '.join(known)}" if known else "list runs that have verdicts")
    print(render(entries, args.figure))
    if args.json is not None:
        args.json.write_text(json.dumps([{**{k: v for k, v in asdict(e).items() if k != "measured"},
                                          "started_utc": e.when,
                                          **({"figure": dict(zip(("value", "lo", "hi"), e.measured[args.figure]))}
                                             if args.figure in e.measured else {})} for e in entries],
                                        indent=2) + "\n")
    return 0
