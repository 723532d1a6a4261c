"""Reschedule time over repeated SIGKILLs of a decode worker under load (checklist item 4).

A real topology (router, 1 prefill, 2 decode workers) serves a closed loop of streaming clients.
Each round SIGKILLs the decode worker that is streaming, then measures, from the kill (router
and this process share CLOCK_MONOTONIC): detection (``worker_down`` event), every affected
request re-placed (last ``reschedule`` event), every one streaming again (last ``resumed``),
and a fresh request sent right after the kill completing. The reschedule time of a round is
the later of "all re-placed" and "fresh request done". The killed worker is restarted (the
router keeps running) before the next round. Baseline in the same run: the fresh request's
latency with no fault. Every stream must end completed; failures are counted.

    .venv/bin/python bench/bench_reschedule.py            # 20 kills
    .venv/bin/python bench/bench_reschedule.py --kills 5
"""

from __future__ import annotations

import argparse
import signal
import statistics
import threading
import time

from harness.engine.topology import Topology
from harness.probes.streaming import CompletionRequest, StreamingClient

PRESET = "tiny"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
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
        rounds = []
        try:
            for k in range(args.kills):
                victim = f"decode-{k % 2}"
                deadline = time.monotonic() + 60
                while not any(w["id"] == victim and w["num_running"] > 0 for w in topo.workers()):
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{victim} never got load")
                    time.sleep(0.05)  # polling interval of the admin API
                since = max((e["seq"] for e in topo.events()), default=0)
                t_kill = time.monotonic()
                topo.kill(victim, signal.SIGKILL)
                rec = fresh.send(CompletionRequest(prompt="fresh", max_tokens=4))
                fresh_s = time.monotonic() - t_kill
                wait_until = time.monotonic() + 10
                while True:  # until every affected stream resumed (or failed), at most 10 s
                    events = topo.events(since)
                    down = next(e for e in events if e["type"] == "worker_down" and e["worker"] == victim)
                    affected = {a.rsplit("#", 1)[0] for a in down["affected"]}
                    settled = {e["request_id"] for e in events if e["type"] in ("resumed", "reschedule_failed")}
                    if affected <= settled or time.monotonic() > wait_until:
                        break
                    time.sleep(0.05)  # polling interval of the admin API
                placed = [e["monotonic"] for e in events if e["type"] == "reschedule" and e["request_id"] in affected]
                resumed = [e["monotonic"] for e in events if e["type"] == "resumed" and e["request_id"] in affected]
                all_placed = (max(placed) - t_kill) if len(placed) >= len(affected) else float("inf")
                rounds.append({"detect": down["monotonic"] - t_kill, "placed": all_placed,
                               "resumed": (max(resumed) - t_kill) if resumed else 0.0,
                               "fresh": fresh_s if rec.status == "ok" else float("inf"),
                               "affected": len(affected)})
                rounds[-1]["reschedule"] = max(rounds[-1]["placed"], rounds[-1]["fresh"])
                print(f"kill {k + 1:>2} {victim}: {len(affected)} affected, detect {rounds[-1]['detect'] * 1e3:.0f} ms,"
                      f" re-placed {all_placed * 1e3:.0f} ms, fresh ok {fresh_s * 1e3:.0f} ms", flush=True)
                topo.restart(victim)
        finally:
            stop.set()
            for t in threads:
                t.join(120)
            fresh.close()
    base = statistics.median(baseline)
    print(f"\n{len(rounds)} kills under {args.clients} streaming clients; fresh-request latency without fault "
          f"{base * 1e3:.0f} ms (baseline)")
    print(f"{'ms':>12} {'p50':>8} {'p90':>8} {'max':>8} {'p50/base':>9}")
    for key in ("detect", "placed", "resumed", "fresh", "reschedule"):
        vals = [r[key] for r in rounds]
        print(f"{key:>12} {pct(vals, .5) * 1e3:>8.0f} {pct(vals, .9) * 1e3:>8.0f} {max(vals) * 1e3:>8.0f} "
              f"{pct(vals, .5) / base:>9.1f}")
    within = sum(r["reschedule"] < 3.0 for r in rounds)
    print(f"reschedule < 3 s in {within}/{len(rounds)} kills; streams completed {outcomes['ok']}, "
          f"failed {outcomes['failed']}")


if __name__ == "__main__":
    main()
