"""``python -m harness gpu-fill --device N (--gib G | --fraction F)``: take HBM away from the
engines on a GPU host, as another tenant would, and hold it until killed.

Allocates with torch on ``cuda:N`` in 1 GiB pieces (a cudaMalloc commits device memory at once;
each piece is also written, so nothing is lazily backed), prints one JSON line
``{"holding_bytes": ..., "device": N, "pid": ...}`` when it holds all of it, then sleeps until
SIGTERM/SIGINT and frees it by exiting. ``--fraction F`` takes F of the memory free at start.
Without CUDA (no torch, no driver, no such device) it exits 3 with the reason and the fix.
The HBM-fill-on-host fault (harness.faults.gpu_host) starts it over SSH and verifies the drop.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

from harness.errors import ConfigError, HarnessError

PIECE = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=int, required=True, help="CUDA device index")
    amount = parser.add_mutually_exclusive_group(required=True)
    amount.add_argument("--gib", type=float, help="GiB to hold")
    amount.add_argument("--fraction", type=float, help="fraction of the device's free memory to hold (0..1)")
    parser.add_argument("--pid-file", default=None, help="write our pid here once the memory is held")


def amount_bytes(free: int, gib: float | None, fraction: float | None) -> int:
    """How many bytes to hold, refusing amounts the device cannot give (clear errors, not a CUDA OOM)."""
    if gib is not None:
        if not gib > 0:
            raise ConfigError(f"gpu-fill: --gib must be > 0, got {gib}", fix="pass e.g. --gib 10")
        want = int(gib * (1 << 30))
    else:
        if fraction is None or not 0 < fraction < 1:
            raise ConfigError(f"gpu-fill: --fraction must be in (0, 1), got {fraction}", fix="pass e.g. --fraction 0.9")
        want = int(free * fraction)
    if want > free:
        raise ConfigError(f"gpu-fill: {want / (1 << 30):.2f} GiB asked, the device has {free / (1 << 30):.2f} GiB free",
                          fix="ask for less (--gib) or a fraction of what is free (--fraction)")
    return want


def _cuda(device: int):
    try:
        import torch
    except ImportError:
        raise HarnessError("gpu-fill: torch is not installed", fix="pip install torch (a CUDA build)") from None
    if not torch.cuda.is_available():
        raise HarnessError(f"gpu-fill: no CUDA device here (torch {torch.__version__}, built for CUDA "
                           f"{torch.version.cuda or 'none'})",
                           fix="run it on a GPU host with the NVIDIA driver and a CUDA build of torch")
    if not 0 <= device < torch.cuda.device_count():
        raise ConfigError(f"gpu-fill: no CUDA device {device} (this host has {torch.cuda.device_count()})",
                          fix=f"use --device 0..{torch.cuda.device_count() - 1}")
    return torch


def run(args: argparse.Namespace) -> int:
    torch = _cuda(args.device)
    dev = torch.device(f"cuda:{args.device}")
    free, total = torch.cuda.mem_get_info(dev)
    want = amount_bytes(int(free), args.gib, args.fraction)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: stop.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _: stop.append(signum))
    held, pieces = 0, []
    while held < want and not stop:
        n = min(PIECE, want - held)
        piece = torch.empty(n, dtype=torch.uint8, device=dev)
        piece.fill_(0xA5)  # written, so the pages are really backed
        pieces.append(piece)
        held += n
    torch.cuda.synchronize(dev)
    if args.pid_file:
        with open(args.pid_file, "w") as fh:
            fh.write(str(os.getpid()))
    print(json.dumps({"holding_bytes": held, "device": args.device, "pid": os.getpid(),
                      "free_before_bytes": int(free), "total_bytes": int(total)}), flush=True)
    while not stop:
        time.sleep(0.2)  # holding; the signal handler ends the wait
    del pieces
    torch.cuda.empty_cache()
    return 0
