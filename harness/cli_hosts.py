"""``python -m harness sshd-test up|down`` and ``python -m harness gpu-fill``: the host-side tools.

- ``sshd-test up [--loopback] [--engine] [--sabotaged] [--hosts N]``: foreign-looking SSH hosts on
  this machine, in the foreground until Ctrl-C, SIGTERM or ``sshd-test down`` (docs/fabric.md).
  Without ``--loopback``: one sshd per emulated-fabric namespace (``clusters/ssh-fabric.yaml``;
  ``--engine`` also runs the bundled engine there); with it: the loopback sshd on port 2222 that
  ``clusters/ssh-test.yaml`` names.
- ``sshd-test down``: stop them and remove everything they made; exit 1 if anything remains.
- ``gpu-fill --device N (--gib G | --fraction F)``: hold that much CUDA memory until killed
  (the HBM-fill fault's filler, harness.faults.gpu_fill).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    if parser.prog.endswith("gpu-fill"):
        from harness.faults.gpu_fill import add_arguments as gpu_arguments

        gpu_arguments(parser)
        return
    sub = parser.add_subparsers(dest="sshd_cmd", required=True)
    up = sub.add_parser("up", help="start the test sshd(s) in the foreground; Ctrl-C or `down` stops them")
    up.add_argument("--loopback", action="store_true", help="one sshd on 127.0.0.1:2222 for clusters/ssh-test.yaml")
    up.add_argument("--engine", action="store_true", help="also run the bundled engine on the fabric hosts")
    up.add_argument("--sabotaged", action="store_true", help="TCP/IP shares the lossless class (must fail 6.1.5)")
    up.add_argument("--hosts", type=int, default=3, help="fabric hosts (default 3: 1 prefill + 2 decode)")
    up.add_argument("--line-rate", type=float, default=1e9, help="fabric line rate in bit/s (default 1e9)")
    up.add_argument("--state-dir", default="state", help="where keys and known_hosts go (default ./state)")
    down = sub.add_parser("down", help="stop every sshd-test and remove what it made")
    down.add_argument("--state-dir", default="state")
    down.add_argument("--force", action="store_true", help="also remove a pds- fabric this state dir did not start")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "sshd_cmd", None) is None:
        from harness.faults.gpu_fill import run as gpu_run

        return gpu_run(args)
    from harness.fabric import sshdtest

    if args.sshd_cmd == "down":
        left = sshdtest.down(args.state_dir, force=args.force)
        print("sshd-test down: nothing left" if not left else f"sshd-test down: still there: {', '.join(left)}")
        return 1 if left else 0
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: stop.append("SIGINT"))
    sshdtest.become_subreaper()
    with sshdtest.SshdTest(args.state_dir, hosts=args.hosts, loopback=args.loopback, sabotaged=args.sabotaged,
                           line_rate_bps=args.line_rate, engine=args.engine) as servers:
        for name, listen, port in servers.endpoints():
            print(f"sshd {name}: root@{listen}:{port}", flush=True)
        print(f"key {servers.key}  known_hosts {servers.known_hosts}", flush=True)
        if servers.topology is not None:
            print(f"engine api {servers.topology.base_url}", flush=True)
        print(f"ready: cluster file clusters/{'ssh-test' if args.loopback else 'ssh-fabric'}.yaml", flush=True)
        while not stop:
            servers.reap_adopted()
            for wid in servers.supervise():
                print(f"restarted {wid}", flush=True)
            time.sleep(0.2)  # signals arrive here; orphans of remote commands are reaped meanwhile
    print(f"sshd-test stopped ({stop[0]})", file=sys.stderr, flush=True)
    return 0
