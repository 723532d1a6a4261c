"""``python -m harness load URL``: drive a load profile against any OpenAI-compatible server
with Locust, write the request records (JSONL) and print the latency summary.

    python -m harness load http://127.0.0.1:8000 --mode poisson --rate 4 --duration 30 --output out/
"""

from __future__ import annotations

import argparse
import json
import logging
import math

from harness.probes.workload import MODES, LoadProfile

log = logging.getLogger(__name__)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--mode", choices=MODES, default="closed",
                        help="closed: USERS back to back; constant/poisson: open loop at --rate")
    parser.add_argument("--users", type=int, default=2, help="users (open loop: the in-flight cap)")
    parser.add_argument("--processes", type=int, default=1,
                        help="Locust worker processes (more than 1 when one generator process is the bottleneck)")
    parser.add_argument("--rate", type=_positive_float, help="requests/s (open loop)")
    parser.add_argument("--duration", type=_positive_float, default=10.0, help="seconds of load")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="prompts and Poisson arrivals")
    parser.add_argument("--model", help="model name (default: the first in /v1/models)")
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument("--output", help="folder for requests.jsonl and locust.log (default: a temp folder)")
    parser.add_argument("--slo-ttft-ms", type=_positive_float, help="TTFT target for goodput")
    parser.add_argument("--slo-tpot-ms", type=_positive_float, help="TPOT target for goodput")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from harness.probes.analysis import SLO, summarize
    from harness.probes.load import LoadRunner

    profile = LoadProfile(mode=args.mode, users=args.users, rate=args.rate, duration_s=args.duration,
                          max_tokens=args.max_tokens, seed=args.seed, model=args.model, chat=args.chat,
                          processes=args.processes)
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms) if (args.slo_ttft_ms or args.slo_tpot_ms) else None
    runner = LoadRunner(args.url, profile, output_dir=args.output)
    records = runner.run()
    summary = summarize(records, slo=slo, basis="scheduled" if profile.open_loop else "sent")
    summary["records"] = str(runner.records_path)
    if args.json:
        print(json.dumps(summary, indent=2, default=lambda v: None))
    else:
        _print_table(summary, profile)
    return 0


def _fmt(v: float) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def _print_table(summary: dict, profile: LoadProfile) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    basis = "scheduled" if profile.open_loop else "sent"
    table = Table(title=f"{summary['ok']} ok / {summary['requests']} requests in {summary['duration_s']:.1f} s "
                        f"(latency from the {'scheduled' if profile.open_loop else 'actual'} send; failures apart)")
    for col in ("metric", "p50", "p90", "p95", "p99", "max", "n"):
        table.add_column(col, justify="left" if col == "metric" else "right")
    rows = [(m, summary["latency_ms"][basis][m]) for m in ("ttft_ms", "tpot_ms", "e2e_ms")]
    rows.append(("itl_ms", summary["itl_ms"]))
    for name, p in rows:
        table.add_row(name, *(_fmt(p[k]) for k in ("p50", "p90", "p95", "p99", "max")), str(p["n"]))
    console.print(table)
    failed = {k: v for k, v in summary["by_status"].items() if k != "ok" and v}
    console.print(f"failed by status: {failed or 'none'}; throughput {summary['throughput_rps']:.2f} req/s, "
                  f"{summary['output_tokens_per_s']:.1f} output tokens/s")
    if "goodput_rps" in summary:
        console.print(f"goodput {summary['goodput_rps']:.2f} req/s, SLO attainment {summary['slo_attainment']:.1%}")
    console.print(f"records: {summary['records']}")
