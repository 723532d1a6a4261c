"""What one control message costs to put on and take off the wire, against plain JSON parsing.

The control plane sends a ``Progress`` beat every 0.1 s and a ``Heartbeat`` every second per
worker, so the per-message cost of ``encode`` + ``decode`` (control/codec.py: framing, the
envelope checks, the pydantic TypeAdapter that checks every field in strict mode, building the
dataclass) is what this measures. The same-run baseline is ``json.loads`` of the very frame body
``decode`` reads: the floor any JSON protocol pays. Prints microseconds per message for each and
their ratio, the median of --repeats rounds of --n messages.

    .venv/bin/python bench/bench_messages.py
    .venv/bin/python bench/bench_messages.py --n 20000 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from harness.engine.control import codec
from harness.engine.control.messages import Heartbeat, Message, Progress

SAMPLES: dict[str, Message] = {
    "progress": Progress(123456),
    "heartbeat": Heartbeat({"kv_blocks_used": 31, "kv_used_ratio": 0.24, "num_running": 4, "spec_enabled": False,
                            "generation_tokens_total": 98765, "offload": {"cpu": 0, "disk": 0}},
                           {"frames": 912, "bytes": 73400320, "retries": 0}, 2),
}


def _per_message_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10000, help="messages per round")
    ap.add_argument("--repeats", type=int, default=7, help="rounds; the median is printed")
    args = ap.parse_args()
    for kind, msg in SAMPLES.items():
        body = codec.encode(msg)[4:]
        assert codec.decode(body) == msg  # the path measured round-trips
        typed, plain = [], []
        for _ in range(args.repeats):  # interleaved, so a noisy moment hits both
            typed.append(_per_message_us(lambda: codec.decode(codec.encode(msg)[4:]), args.n))
            plain.append(_per_message_us(lambda: json.loads(body), args.n))
        t, p = statistics.median(typed), statistics.median(plain)
        print(f"{kind:<10} encode+decode {t:6.2f} us   json.loads {p:6.2f} us   ratio {t / p:5.1f}x   "
              f"({len(body)} bytes, median of {args.repeats} x {args.n})")


if __name__ == "__main__":
    main()
