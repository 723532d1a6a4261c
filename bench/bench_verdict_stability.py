"""Does the same cluster get the same verdict on a quiet and on a starved test machine? (issue 23)

Runs the main job (``pytest suites/`` with this Python, each run with its own ``--report-dir``)
N times on the machine as it is and N times beside a CPU burner (``--per-core`` busy processes
per CPU, 3 by default: PSI some near 100 %, load average about 8 on 2 cores, what a busy shared
CI runner looks like), interleaved quiet / burner so that drift in the machine's other load hits
both alike. Prints each run's exit code, wall time and every verdict: status, measured value,
interval (when the verdict has one) and the test machine's figures while it was measured. Then
the acceptance checks of issue 23:

1. no run exits 3 (harness error) or 4 (a revert failed);
2. no verdict (item and the test that recorded it) passes in one run and fails in another;
3. beside the burner every timing item is pass, or inconclusive naming the test machine;
4. the quiet runs exit 0.

Exits 1 when a check fails. The burner is stopped and reaped on every exit path.

    .venv/bin/python bench/bench_verdict_stability.py                  # 3 quiet + 3 burner runs
    .venv/bin/python bench/bench_verdict_stability.py --runs 1 --cluster local -- -k "62 or item1"
    # the two kinds apart (e.g. the quiet ones while the machine is otherwise idle), judged as one set:
    .venv/bin/python bench/bench_verdict_stability.py --only quiet --report-dir reports/stab
    .venv/bin/python bench/bench_verdict_stability.py --only burner --report-dir reports/stab
    .venv/bin/python bench/bench_verdict_stability.py --judge reports/stab
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.checks.machine import TIMING_ITEMS  # noqa: E402  (after the path set-up above)

MACHINE_MARK = "test machine"  # the words every starvation reason starts with (harness/checks/machine.py)


class Burner:
    """``per_core`` x CPUs busy shell loops (as a shared CI runner's neighbours), killed and
    reaped when the block ends, however it ends."""

    def __init__(self, per_core: int) -> None:
        self.count = per_core * (os.cpu_count() or 1)
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Burner:
        try:
            for _ in range(self.count):
                self.procs.append(subprocess.Popen(["/bin/sh", "-c", "while :; do :; done"],
                                                   stdin=subprocess.DEVNULL, start_new_session=True))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs.clear()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Row:
    """One verdict of one run, as the bench prints and checks it."""

    item: str
    test: str
    status: str
    measured: float | None
    unit: str
    reason: str
    interval: dict[str, Any] | None = None
    machine: dict[str, Any] | None = None  # the first window's figures
    starved: str | None = None


@dataclass
class RunOutcome:
    kind: str           # "quiet" or "burner"
    index: int
    exit_code: int
    wall_s: float
    report_dir: Path
    rows: list[Row] = field(default_factory=list)
    problem: str | None = None  # no results.json, or one that could not be read

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"


def rows_of(results: dict[str, Any]) -> list[Row]:
    """The verdict rows of one ``results.json`` (as harness/report/jsonout.py writes it)."""
    rows = []
    for v in results.get("verdicts", []):
        machine = v.get("evidence", {}).get("machine") or {}
        windows = machine.get("windows") or [None]
        interval = v.get("interval") or (v.get("evidence", {}).get("interval"))
        rows.append(Row(item=v["item"], test=v.get("test") or "?", status=v["status"], measured=v.get("measured"),
                        unit=v.get("unit", ""), reason=v.get("reason", ""), interval=interval, machine=windows[0],
                        starved=machine.get("starved")))
    return rows


def read_outcome(kind: str, index: int, exit_code: int, wall_s: float, report_dir: Path) -> RunOutcome:
    outcome = RunOutcome(kind, index, exit_code, wall_s, report_dir)
    path = report_dir / "latest" / "results.json"
    try:
        outcome.rows = rows_of(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError) as exc:
        outcome.problem = f"no readable results.json at {path}: {exc}"
    return outcome


def acceptance(outcomes: Sequence[RunOutcome]) -> list[str]:
    """The failed acceptance checks (module docstring), one line each; empty when all hold."""
    failed = []
    for o in outcomes:
        if o.exit_code in (3, 4):
            failed.append(f"{o.name} exited {o.exit_code} ({'harness error' if o.exit_code == 3 else 'revert failed'})")
        if o.problem:
            failed.append(f"{o.name}: {o.problem}")
    seen: dict[tuple[str, str], dict[str, list[str]]] = {}
    for o in outcomes:
        for r in o.rows:
            seen.setdefault((r.item, r.test), {}).setdefault(r.status, []).append(o.name)
    for (item, test), by_status in seen.items():
        if "pass" in by_status and "fail" in by_status:
            failed.append(f"{item} ({test}) passed in {', '.join(by_status['pass'])} "
                          f"and failed in {', '.join(by_status['fail'])}")
    for o in outcomes:
        if o.kind != "burner":
            continue
        for r in o.rows:
            if r.item in TIMING_ITEMS and not (r.status == "pass" or (r.status == "inconclusive"
                                                                      and MACHINE_MARK in r.reason)):
                failed.append(f"{o.name}: timing item {r.item} was {r.status} beside the burner without naming "
                              f"the test machine: {r.reason}")
    failed += [f"{o.name} (quiet) exited {o.exit_code}, not 0" for o in outcomes
               if o.kind == "quiet" and o.exit_code != 0]
    return failed


def _fmt(v: Any, spec: str = ".3g") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, (int, float)) else str(v)


def describe(o: RunOutcome) -> list[str]:
    lines = [f"== {o.name}: exit {o.exit_code}, {o.wall_s:.0f} s, report {o.report_dir}"
             + (f"  ({o.problem})" if o.problem else "")]
    for r in o.rows:
        i = r.interval or {}
        interval = f"[{_fmt(i.get('lo'))}-{_fmt(i.get('hi'))}]" if i else ""
        m = r.machine or {}
        lines.append(f"  {r.item:<12} {r.status:<12} {_fmt(r.measured):>8} {r.unit:<12} {interval:<16} "
                     f"psi {_fmt(m.get('psi_some_pct'))}% steal {_fmt(m.get('steal_pct'))}% wait/run {_fmt(m.get('watched_wait_per_run_ms'))}ms "
                     f"lg-no-cpu {_fmt(m.get('load_generator_wait_share_pct'))}% "
                     f"fab-no-cpu {_fmt(m.get('fabric_probe_wait_share_pct'))}% "
                     f"lag-p99 {_fmt(m.get('timer_lag_p99_ms'))}ms run/cpu {_fmt(m.get('runnable_per_cpu'))}  "
                     f"{r.test.split('::')[-1]}")
        if r.status in ("fail", "inconclusive"):
            lines.append(f"      {r.reason[:300]}")
    return lines


def run_main_job(kind: str, index: int, base: Path, suites: str, cluster: str | None, extra: Sequence[str],
                 per_core: int) -> RunOutcome:
    report_dir = base / f"{kind}-{index}"
    report_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", suites, f"--report-dir={report_dir}", "-p", "no:cacheprovider",
           "--live=plain", *([f"--cluster={cluster}"] if cluster else []), *extra]
    print(f"-- {kind}-{index}: {' '.join(cmd)} (log {report_dir / 'pytest.log'})", flush=True)
    t0 = time.monotonic()
    with open(report_dir / "pytest.log", "wb") as log:
        if kind == "burner":
            with Burner(per_core):
                code = _run(cmd, log)
        else:
            code = _run(cmd, log)
    wall = time.monotonic() - t0
    (report_dir / "outcome.json").write_text(json.dumps({"kind": kind, "index": index, "exit_code": code,
                                                         "wall_s": wall, "command": cmd}), encoding="utf-8")
    return read_outcome(kind, index, code, wall, report_dir)


def judged_again(base: Path) -> list[RunOutcome]:
    """Every run under ``base`` (its ``quiet-N``/``burner-N`` folders, each with the ``outcome.json``
    a run writes), so that runs made by separate invocations (``--only quiet``, then ``--only burner``
    with the same ``--report-dir``) are judged as one set."""
    outcomes = []
    for path in sorted(base.glob("*/outcome.json")):
        o = json.loads(path.read_text(encoding="utf-8"))
        outcomes.append(read_outcome(o["kind"], o["index"], o["exit_code"], o["wall_s"], path.parent))
    if not outcomes:
        raise SystemExit(f"--judge: no runs under {base} (each run folder holds an outcome.json; "
                         "fix: give the --report-dir the runs were made with)")
    return outcomes


def _run(cmd: Sequence[str], log: Any) -> int:
    """The main job's exit code. Interrupted, it gets SIGTERM (the harness unwinds as on Ctrl-C:
    faults reverted, cluster stopped) and is waited for, never killed mid-revert."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        return proc.wait()
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait()
        raise


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs of each kind, quiet and beside the burner (default 3)")
    p.add_argument("--per-core", type=int, default=3, help="burner processes per CPU (default 3)")
    p.add_argument("--cluster", default=None, help="the --cluster of the main job (default: the bundled one)")
    p.add_argument("--suites", default="suites/", help="what pytest runs (default suites/)")
    p.add_argument("--report-dir", type=Path, default=None,
                   help="where each run's report folder goes (default reports/stability-<time>)")
    p.add_argument("--only", choices=("quiet", "burner"), default=None, help="run one kind only")
    p.add_argument("--judge", type=Path, default=None, metavar="DIR",
                   help="run nothing: judge every run already under DIR (a --report-dir of earlier invocations)")
    args = p.parse_args(argv)
    if args.judge:
        outcomes = judged_again(args.judge)
        for o in outcomes:
            print("\n".join(describe(o)))
        return report(outcomes)
    if args.runs < 1 or args.per_core < 1:
        p.error("--runs and --per-core must be at least 1")
    base = args.report_dir or ROOT / "reports" / time.strftime("stability-%Y%m%dT%H%M%S")
    kinds = [k for k in ("quiet", "burner") if args.only in (None, k)]
    signal.signal(signal.SIGTERM, _interrupt)  # unwind like Ctrl-C: the main job stopped, the burner reaped
    outcomes = []
    for index in range(1, args.runs + 1):
        for kind in kinds:
            outcomes.append(run_main_job(kind, index, base, args.suites, args.cluster, extra, args.per_core))
            print("\n".join(describe(outcomes[-1])), flush=True)
    return report(outcomes)


def report(outcomes: Sequence[RunOutcome]) -> int:
    """Prints the runs' summary and the acceptance checks; 1 when one fails."""
    failed = acceptance(outcomes)
    print(f"\n{len(outcomes)} runs: " + ", ".join(f"{o.name} exit {o.exit_code} ({o.wall_s:.0f} s)" for o in outcomes))
    for line in failed:
        print(f"ACCEPTANCE FAILED: {line}")
    if not failed:
        print("acceptance: all checks hold")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
