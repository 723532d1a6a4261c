"""TTFT with layer-wise KV transfer against whole-request transfer (seed Section 3.3's table).

One real topology (router + 1 prefill + 1 decode worker processes). For each context size and
repeat, the same prompt is sent once per mode, the modes interleaved through the admin API
(``POST /admin/transfer``) so that machine load hits both alike. Reported per size (medians):
client-side TTFT in each mode, their ratio, and the transfer time left exposed after prefill
finished (``kv_transfer`` events: delivery time minus prefill time), which is what the seed's
"直传延迟 / 分层传输延迟" columns compare.

The default run uses the small preset at 512 / 1024 / 2000 tokens. For the seed's 2K / 8K / 32K
rows use the ``long`` preset (context up to 33792 tokens; a 32K-token prefill takes about 8 min on
one CPU core, twice per size): ``--preset long --contexts 2048,8192,32768 --repeats 1 --timeout-s 3600``.

    .venv/bin/python bench/bench_ttft_layerwise.py
"""

from __future__ import annotations

import argparse
import statistics

from harness.engine.pd.topology import Topology
from harness.engine.admin.client import AdminClient
from harness.probes.client.streaming import CompletionRequest, StreamingClient

SEED_TABLE = {2048: (45, 12), 8192: (180, 35), 32768: (720, 110)}  # ms: whole vs layer-wise, 70B on H100s
MODES = ("whole", "layerwise")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--contexts", default="512,1024,2000")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="per request; a 32K-token prefill of the long preset takes about 8 min on one core")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    ttft: dict[tuple[str, int], list[float]] = {}
    exposed: dict[tuple[str, int], list[float]] = {}
    with Topology(prefill=1, decode=1, preset=args.preset,
                  engine_config={"kv_budget_bytes": 512 << 20}) as topo, \
            StreamingClient(topo.api_url, model=args.preset, timeout_s=args.timeout_s,
                            read_timeout_s=args.timeout_s) as client, \
            AdminClient(topo.admin_url, timeout_s=30) as admin:
        client.send(CompletionRequest(prompt="warm up", max_tokens=2))
        for ctx in contexts:
            for r in range(args.repeats):
                prompt = "".join(chr(97 + (i * 7 + r) % 26) for i in range(ctx))  # ctx byte tokens
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):  # alternate who goes first
                    admin.set_transfer({"mode": mode})
                    since = max((e["seq"] for e in admin.events()), default=0)
                    rec = client.send(CompletionRequest(prompt=prompt, max_tokens=2))
                    if rec.status != "ok":
                        raise SystemExit(f"request failed: {rec.error_message}")
                    ttft.setdefault((mode, ctx), []).append((rec.first_token_ns - rec.sent_ns) / 1e9)
                    ev = next(e for e in admin.events(since, type="kv_transfer"))
                    exposed.setdefault((mode, ctx), []).append(ev["transfer_s"] - ev["prefill_s"])
                    kv_mib = ev["bytes"] / 2**20
            print(f"  ran {ctx} tokens ({kv_mib:.1f} MiB of KV on the wire)", flush=True)
    med = {k: statistics.median(v) for k, v in ttft.items()}
    exp = {k: statistics.median(v) for k, v in exposed.items()}
    print(f"\npreset {args.preset}, median of {args.repeats}; times in ms")
    print(f"{'tokens':>7} {'TTFT whole':>11} {'TTFT layer':>11} {'layer/whole':>12} "
          f"{'exposed whole':>14} {'exposed layer':>14} {'exposed cut':>12} {'seed cut':>9}")
    for ctx in contexts:
        tw, tl = med[("whole", ctx)], med[("layerwise", ctx)]
        ew, el = exp[("whole", ctx)], exp[("layerwise", ctx)]
        seed = min(SEED_TABLE, key=lambda s: abs(s - ctx))
        seed_cut = 1 - SEED_TABLE[seed][1] / SEED_TABLE[seed][0]
        print(f"{ctx:>7} {tw * 1e3:>11.1f} {tl * 1e3:>11.1f} {tl / tw:>12.2f} {ew * 1e3:>14.1f} {el * 1e3:>14.1f} "
              f"{1 - el / ew:>11.0%} {seed_cut:>8.0%}@{seed // 1024}K")


if __name__ == "__main__":
    main()
