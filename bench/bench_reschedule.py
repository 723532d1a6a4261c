"""Reschedule time over repeated SIGKILLs and hangs (SIGSTOP) of a decode worker under load
(checklist item 4), and false alarms of the hang detector over a loaded run with no fault.

A real topology (router, 1 prefill, 2 decode workers) serves a closed loop of streaming clients.
Each round SIGKILLs the decode worker that is streaming, then measures, from the kill (router
and this process share CLOCK_MONOTONIC): detection (``worker_down`` event), every affected
request re-placed (last ``reschedule`` event), every one streaming again (last ``resumed``),
and a fresh request sent right after the kill completing. The reschedule time of a round is
the later of "all re-placed" and "fresh request done". The killed worker is restarted (the
router keeps running) before the next round. Baseline in the same run: the fresh request's
latency with no fault. Every stream must end completed; failures are counted.

Hang rounds SIGSTOP the streaming decode worker instead, require the router to declare it down
for ``no_progress`` (its progress beats stopped), then SIGCONT it and wait for it to rejoin.
The quiet phase runs the same load for ``--quiet-s`` with ``--burners`` CPU-spinning processes
beside it and no fault: any ``worker_down`` there is a false alarm.

    .venv/bin/python bench/bench_reschedule.py            # 20 kills, 20 hangs, 30 s quiet
    .venv/bin/python bench/bench_reschedule.py --kills 5 --hangs 5 --quiet-s 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import statistics
import threading
import time

from harness.engine.pd.topology import Topology
from harness.probes.client.streaming import CompletionRequest, StreamingClient

PRESET = "tiny"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def spin(stop) -> None:
    while not stop.is_set():
        sum(range(10000))


def wait_streaming(topo: Topology, victim: str) -> None:
    deadline = time.monotonic() + 60
    while not any(w["id"] == victim and w["num_running"] > 0 and w["health"] == "healthy"
                  for w in topo.workers()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{victim} never got load")
        time.sleep(0.05)  # polling interval of the admin API


def fault_round(topo: Topology, fresh: StreamingClient, victim: str, sig: int) -> dict:
    """Fault ``victim`` with ``sig``; times from the fault to detection, re-placement, resumption."""
    since = max((e["seq"] for e in topo.events()), default=0)
    t_fault = time.monotonic()
    topo.kill(victim, sig)
    try:
        rec = fresh.send(CompletionRequest(prompt="fresh", max_tokens=4))
        fresh_s = time.monotonic() - t_fault
        wait_until = time.monotonic() + 10
        while True:  # until every affected stream resumed (or failed), at most 10 s
            events = topo.events(since)
            down = next((e for e in events if e["type"] == "worker_down" and e["worker"] == victim), None)
            if down is not None:
                affected = {a.rsplit("#", 1)[0] for a in down["affected"]}
                settled = {e["request_id"] for e in events if e["type"] in ("resumed", "reschedule_failed")}
                if affected <= settled:
                    break
            if time.monotonic() > wait_until:
                raise SystemExit(f"{victim}: not detected or not rescheduled within 10 s: {down}")
            time.sleep(0.05)  # polling interval of the admin API
    finally:
        if sig == signal.SIGSTOP:
            topo.kill(victim, signal.SIGCONT)
    placed = [e["monotonic"] for e in events if e["type"] == "reschedule" and e["request_id"] in affected]
    resumed = [e["monotonic"] for e in events if e["type"] == "resumed" and e["request_id"] in affected]
    r = {"detect": down["monotonic"] - t_fault, "reason": down["reason"],
         "placed": (max(placed) - t_fault) if len(placed) >= len(affected) else float("inf"),
         "resumed": (max(resumed) - t_fault) if resumed else 0.0,
         "fresh": fresh_s if rec.status == "ok" else float("inf"), "affected": len(affected)}
    r["reschedule"] = max(r["placed"], r["fresh"])
    if sig == signal.SIGSTOP:  # it rejoins once it runs again and finds its connection closed
        deadline = time.monotonic() + 30
        while not any(e["type"] == "worker_up" and e["worker"] == victim for e in topo.events(since)):
            if time.monotonic() > deadline:
                raise SystemExit(f"{victim} did not rejoin after SIGCONT")
            time.sleep(0.05)
    else:
        topo.restart(victim)
    return r


def table(title: str, rounds: list[dict], base: float) -> None:
    print(f"\n{title}")
    print(f"{'ms':>12} {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8} {'p50/base':>9}")
    for key in ("detect", "placed", "resumed", "fresh", "reschedule"):
        vals = [r[key] for r in rounds]
        print(f"{key:>12} {pct(vals, .5) * 1e3:>8.0f} {pct(vals, .9) * 1e3:>8.0f} {pct(vals, .99) * 1e3:>8.0f} "
              f"{max(vals) * 1e3:>8.0f} {pct(vals, .5) / base:>9.1f}")
    reasons = sorted({r["reason"] for r in rounds})
    within = sum(r["reschedule"] < 3.0 for r in rounds)
    print(f"down reasons {reasons}; reschedule < 3 s in {within}/{len(rounds)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--hangs", type=int, default=20)
    p.add_argument("--quiet-s", type=float, default=30.0, help="loaded run with no fault (false alarms)")
    p.add_argument("--burners", type=int, default=2, help="CPU-spinning processes during the quiet run")
    p.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (the load)")
    p.add_argument("--max-tokens", type=int, default=200)
    args = p.parse_args()
    stop = threading.Event()
    outcomes = {"ok": 0, "failed": 0}
    lock = threading.Lock()

    with Topology(prefill=1, decode=2, preset=PRESET) as topo:
        def load(i: int) -> None:
            with StreamingClient(topo.api_url, model=PRESET, read_timeout_s=60) as client:
                n = 0
                while not stop.is_set():
                    rec = client.send(CompletionRequest(prompt=f"load {i} {n}", max_tokens=args.max_tokens,
                                                        ignore_eos=True))
                    ok = rec.status == "ok" and len(rec.token_ids) == args.max_tokens
                    with lock:
                        outcomes["ok" if ok else "failed"] += 1
                    n += 1

        fresh = StreamingClient(topo.api_url, model=PRESET, read_timeout_s=60)
        baseline = []
        for _ in range(5):
            t0 = time.monotonic()
            assert fresh.send(CompletionRequest(prompt="fresh", max_tokens=4)).status == "ok"
            baseline.append(time.monotonic() - t0)
        threads = [threading.Thread(target=load, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        kills, hangs, false_alarms = [], [], []
        try:
            for k in range(args.kills + args.hangs):
                victim = f"decode-{k % 2}"
                sig = signal.SIGKILL if k < args.kills else signal.SIGSTOP
                wait_streaming(topo, victim)
                r = fault_round(topo, fresh, victim, sig)
                (kills if sig == signal.SIGKILL else hangs).append(r)
                print(f"{sig.name} {k + 1:>2} {victim}: {r['affected']} affected, {r['reason']} after "
                      f"{r['detect'] * 1e3:.0f} ms, re-placed {r['placed'] * 1e3:.0f} ms, "
                      f"fresh ok {r['fresh'] * 1e3:.0f} ms", flush=True)
            if args.quiet_s > 0:
                since = max((e["seq"] for e in topo.events()), default=0)
                burn_stop = multiprocessing.Event()
                burners = [multiprocessing.Process(target=spin, args=(burn_stop,)) for _ in range(args.burners)]
                for b in burners:
                    b.start()
                try:
                    time.sleep(args.quiet_s)
                finally:
                    burn_stop.set()
                    for b in burners:
                        b.join()
                false_alarms = [e for e in topo.events(since) if e["type"] == "worker_down"]
        finally:
            stop.set()
            for t in threads:
                t.join(120)
            fresh.close()
    base = statistics.median(baseline)
    print(f"\nunder {args.clients} streaming clients; fresh-request latency without fault {base * 1e3:.0f} ms "
          "(baseline)")
    if kills:
        table(f"{len(kills)} kills (SIGKILL)", kills, base)
    if hangs:
        table(f"{len(hangs)} hangs (SIGSTOP)", hangs, base)
    if args.quiet_s > 0:
        print(f"\nfalse alarms: {len(false_alarms)} worker_down in {args.quiet_s:.0f} s of load with "
              f"{args.burners} CPU burners and no fault {false_alarms}")
    print(f"streams completed {outcomes['ok']}, failed {outcomes['failed']}")


if __name__ == "__main__":
    main()
