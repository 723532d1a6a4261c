"""``python -m harness load URL``: drive a load profile against any OpenAI-compatible server
with Locust, write the request records (JSONL) and print the latency summary.

    python -m harness load http://127.0.0.1:8000 --mode poisson --rate 4 --duration 30 --output out/
    python -m harness load http://127.0.0.1:8000 --prompt-tokens 512 --output-tokens 64 --requests 200 \
        --concurrency 8            # 200 requests of 512 prompt tokens, 8 in flight, then stop
    python -m harness load http://10.0.0.5:8000 --cluster lab.yaml --requests 600 --rate 20 --users 12
                                   # from the cluster file's load_hosts: a Locust worker on each over SSH
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
import logging
import math

from harness.probes.client.request_shape import REQUEST_SHAPES
from harness.probes.loadgen.workload import MODES, LoadProfile

log = logging.getLogger(__name__)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


DEFAULT_DURATION_S = 10.0
REQUESTS_CAP_S = 3600.0  # with --requests and no --duration: the run ends when they are done


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--mode", choices=MODES,
                        help="closed: USERS back to back; constant/poisson: open loop at --rate "
                             "(default: poisson with --rate, else closed)")
    parser.add_argument("--users", "--concurrency", dest="users", type=_positive_int, default=2,
                        help="requests in flight at once (closed loop: users; open loop: the in-flight cap)")
    parser.add_argument("--processes", type=int, default=1,
                        help="Locust worker processes (more than 1 when one generator process is the bottleneck)")
    parser.add_argument("--rate", type=_positive_float, help="requests/s (open loop)")
    parser.add_argument("--duration", type=_positive_float,
                        help=f"seconds of load (default {DEFAULT_DURATION_S:.0f}; with --requests: at most "
                             f"{REQUESTS_CAP_S:.0f}, the run ends when they are done)")
    parser.add_argument("--requests", type=_positive_int, help="send this many requests in all, then stop")
    parser.add_argument("--max-tokens", "--output-tokens", dest="max_tokens", type=_positive_int, default=32,
                        help="output tokens per request (asked with ignore_eos, so every request gets them)")
    parser.add_argument("--prompt-tokens", type=_positive_int,
                        help="prompt length in the server's tokens (measured on the server before the run; "
                             "default: 16-96 characters)")
    parser.add_argument("--seed", type=int, default=0, help="prompts and Poisson arrivals")
    parser.add_argument("--model", help="model name (default: the first in /v1/models)")
    parser.add_argument("--engine", choices=sorted(REQUEST_SHAPES), default="bundled",
                        help="the server's engine: which request extensions are sent (return_token_ids, "
                             "continuous usage, ignore_eos; default bundled: all but continuous usage)")
    parser.add_argument("--chat", action="store_true", help="use /v1/chat/completions")
    parser.add_argument("--output", help="folder for requests.jsonl and locust.log (default: a temp folder)")
    parser.add_argument("--slo-ttft-ms", type=_positive_float, help="TTFT target for goodput")
    parser.add_argument("--slo-tpot-ms", type=_positive_float, help="TPOT target for goodput")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--cluster", help="cluster file (name or path) whose load_hosts each run a Locust worker "
                                          "over SSH, the master here (default: all load from this machine)")


def run(args: argparse.Namespace) -> int:
    from harness.probes.client.analysis import SLO, summarize
    from harness.probes.loadgen.load_distributed import runner_for

    mode = args.mode or ("poisson" if args.rate is not None else "closed")
    duration = args.duration or (REQUESTS_CAP_S if args.requests else DEFAULT_DURATION_S)
    profile = LoadProfile(mode=mode, users=args.users, rate=args.rate, duration_s=duration,
                          max_tokens=args.max_tokens, seed=args.seed, model=args.model, chat=args.chat,
                          processes=args.processes, prompt_tokens=args.prompt_tokens, requests=args.requests,
                          engine=args.engine,
                          num_prompts=max(64, min(args.requests or 64, 4096)))
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms) if (args.slo_ttft_ms or args.slo_tpot_ms) else None
    spec = None
    if args.cluster:
        from harness.clusterfile import check_cluster
        from harness.hosts import AuditLog, state_dir

        spec = check_cluster(args.cluster)
    runner = runner_for(spec, args.url, profile, output_dir=args.output, api_key=spec.api_key() if spec else None,
                        audit=AuditLog(state_dir() / "audit.jsonl") if spec else None)
    records = runner.run()
    summary = summarize(records, slo=slo, basis="scheduled" if profile.open_loop else "sent")
    summary["records"] = str(runner.records_path)
    by_host = Counter(r.load_host for r in records if r.load_host)
    if by_host:
        summary["records_by_load_host"] = dict(sorted(by_host.items()))
    counted = sorted(r.prompt_tokens for r in records if r.prompt_tokens)
    summary["prompt_tokens_server"] = ({"min": counted[0], "p50": counted[len(counted) // 2], "max": counted[-1]}
                                       if counted else None)
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
    if summary.get("prompt_tokens_server"):
        pt = summary["prompt_tokens_server"]
        console.print(f"prompt tokens (the server's count): min {pt['min']}, p50 {pt['p50']}, max {pt['max']}")
    console.print(f"records: {summary['records']}")
    if summary.get("records_by_load_host"):
        console.print("per load host: " + ", ".join(f"{h} {n}" for h, n in summary["records_by_load_host"].items()))
