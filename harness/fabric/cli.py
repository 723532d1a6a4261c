"""``python -m harness fabric status|down|measure``: the emulated fabric from the command line.

- ``status``: the fabric namespaces and links on this machine, per slot, and whether a live run holds it.
- ``down``: remove what a dead run left behind (slots no live run holds; ``--force`` for all).
- ``measure``: build a throw-away fabric and print its line rate, the raw bulk probe and the KV curve.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import re

from harness.errors import HarnessError
from harness.fabric.builder import MAX_SLOTS, SLOT_DIR, Fabric, fabric_unavailable_reason, leftovers, remove_prefixed
from harness.hosts import LocalExecutor

SLOT_PREFIX = re.compile(r"^pdh(\d*)-")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="fabric_cmd", required=True)
    sub.add_parser("status", help="list fabric namespaces and links, per slot")
    down = sub.add_parser("down", help="remove fabrics no live run holds")
    down.add_argument("--force", action="store_true", help="also remove fabrics a live run holds")
    m = sub.add_parser("measure", help="line rate, raw bulk and KV curve on a throw-away 2-host fabric")
    m.add_argument("--line-rate", type=float, default=1e9, help="bit/s (default 1e9)")
    m.add_argument("--preset", default="tiny", help="KV layout of this model preset (default tiny)")
    m.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 32, 128])


def slot_held(slot: int) -> bool:
    """Whether a live run holds fabric slot ``slot`` (its flock is taken)."""
    path = SLOT_DIR / f"slot-{slot}.lock"
    if not path.exists():
        return False
    with open(path, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(lock, fcntl.LOCK_UN)
        return False


def _slots() -> dict[str, list[str]]:
    """{prefix: its namespaces and links} for every fabric slot with something on this machine."""
    found: dict[str, list[str]] = {}
    for item in leftovers(prefix="pdh"):
        m = SLOT_PREFIX.match(item.split(" ", 1)[1])
        if m:
            found.setdefault(m.group(0), []).append(item)
    return found


def slot_of(prefix: str) -> int:
    """The slot number of a fabric prefix (``pdh`` is slot 0, ``pdh3`` slot 3)."""
    digits = SLOT_PREFIX.match(prefix).group(1)  # type: ignore[union-attr]
    return int(digits or 0)


def run(args: argparse.Namespace) -> int:
    reason = fabric_unavailable_reason()
    if reason:
        raise HarnessError(f"the emulated fabric is not available here: {reason}",
                           fix="run as root on a machine with iproute2")
    if args.fabric_cmd == "status":
        slots = _slots()
        for prefix, items in sorted(slots.items()):
            held = "held by a live run" if slot_held(slot_of(prefix)) else "left behind (no live run)"
            print(f"{prefix:7} slot {slot_of(prefix)}: {held}: {', '.join(items)}")
        if not slots:
            print(f"no fabric on this machine (slots 0..{MAX_SLOTS - 1} free)")
        return 0
    if args.fabric_cmd == "down":
        for prefix in sorted(_slots()):
            if slot_held(slot_of(prefix)) and not args.force:
                print(f"{prefix}: a live run holds it; kept (use --force to remove it anyway)")
                continue
            remove_prefixed(LocalExecutor(), prefix)
            print(f"{prefix}: removed" if not leftovers(prefix=prefix) else f"{prefix}: some parts remain")
        remaining = [p for p in _slots() if args.force or not slot_held(slot_of(p))]
        return 1 if remaining else 0
    from harness.fabric.bandwidth import Station, measure_bulk
    from harness.fabric.kvbandwidth import measure_kv_curve
    from harness.fabric.linerate import read_line_rate
    from harness.fabric.shaping import ShapingSpec

    with Fabric.in_free_slot(2, ShapingSpec(line_rate_bps=args.line_rate)) as fabric:
        a, b = fabric.hosts
        line = read_line_rate(LocalExecutor(), a.fabric_dev, a.netns)
        raw = measure_bulk(Station.of(a), Station.of(b), port=fabric.config.bench_port)
        curve = measure_kv_curve(Station.of(a), Station.of(b), port=fabric.config.bench_port, preset=args.preset,
                                 sizes_mib=args.sizes_mib)
    print(json.dumps({"line_rate": line.to_dict(), "raw": raw.to_dict(), "kv_curve": curve.to_dict()}, indent=2))
    return 0
