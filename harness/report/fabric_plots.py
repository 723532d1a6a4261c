"""The fabric items' evidence charts: 6.1.1 on named hosts (the raw probe and vLLM's own NIXL transfers)
and 6.1.5 (the TCP class's p99 round trip and bulk throughput around the PFC storm)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from markupsafe import Markup

from harness.report.plots import PALETTE, Axes, threshold_value, kv_bandwidth_plot, threshold_of

NIXL_SOURCE = "vLLM's own NIXL transfers"


def kv_bandwidth_chart(evidence: Mapping[str, Any]) -> Markup | None:
    """6.1.1's chart: the bundled engine's curve (harness/report/plots.py), or on named hosts the raw
    probe per size and vLLM's own NIXL transfers (:func:`kv_bandwidth_hosts_plot`)."""
    line_bps = (evidence.get("line_rate") or {}).get("bps")
    if not evidence.get("kv_curve") and line_bps and (evidence.get("curve")
                                                     or (evidence.get("nixl") or {}).get("transfers")):
        return kv_bandwidth_hosts_plot(evidence)
    return kv_bandwidth_plot(evidence)


def kv_bandwidth_hosts_plot(evidence: Mapping[str, Any]) -> Markup | None:
    """6.1.1 on named hosts (over SSH), drawn as the bundled engine's curve is: x line rate per transfer
    size. The raw probe's curve (ib_write_bw or iperf3 at each size) and, where the cluster runs vLLM
    over NIXL, each of the engine's own KV transfers as a dot (bytes / time from decode's histograms)
    with their median; the title names the source the verdict's headline came from."""
    line_bps = (evidence.get("line_rate") or {}).get("bps")
    raw = [(p["size_bytes"] / (1 << 20), p["line_rate_fraction"]) for p in evidence.get("curve") or []
           if p.get("size_bytes") and p.get("line_rate_fraction") is not None]
    nixl = evidence.get("nixl") or {}
    xfers = [(t["bytes"] / max(1, t.get("count") or 1) / (1 << 20), 8 * t["bytes"] / t["seconds"] / line_bps)
             for t in nixl.get("transfers") or [] if t.get("seconds") and t.get("bytes")] if line_bps else []
    if not line_bps or not (raw or xfers):
        return None
    need = threshold_value(evidence, "line_rate_fraction", 0.8)
    source = evidence.get("source") or "raw_probe"
    tool = (evidence.get("raw_probe") or {}).get("tool") or "raw probe"
    named = NIXL_SOURCE if source == "nixl_metrics" else f"raw {tool} probe"
    sizes = [x for x, _ in raw + xfers]
    ymax = max([1.0] + [y for _, y in raw + xfers]) * 1.15
    line = line_bps / 1e9
    ax = Axes("kv-bandwidth", f"KV transfer bandwidth vs transfer size (verdict from {named})",
              "transfer size (MiB, log scale)", f"x line rate (1 = {line:.3g} Gbit/s)",
              (min(sizes) / 1.5, max(sizes) * 1.5), (0, ymax), log_x=True,
              x_tick_values=sorted({round(x, 2) for x, _ in raw} | ({round(xfers[0][0], 2)} if xfers else set())))
    ax.hline(1.0, f"line rate ({line:.3g} Gbit/s)", "#111", "none")
    ax.hline(need, f"{need:g} x line rate (required)", "#dc2626")
    judged = threshold_of(evidence, "line_rate_fraction")
    if judged and judged.get("value") is not None:
        ax.hline(float(judged["value"]), f"raw {tool} median {float(judged['value']):.3g}", "#6b7280", "2 2")
    if raw:
        ax.series(sorted(raw), f"raw {tool} per size", "#6b7280")
    if xfers:
        ax.series(xfers, f"each NIXL transfer ({len(xfers)})", "#93c5fd", line=False)
        nixl_m = threshold_of(evidence, "kv_transfer_line_rate_fraction")
        if nixl_m and nixl_m.get("value") is not None:
            mid = sorted(x for x, _ in xfers)[(len(xfers) - 1) // 2]
            ax.series([(mid, float(nixl_m["value"]))], f"NIXL median {float(nixl_m['value']):.3g}", PALETTE[0])
    return ax.render()


def pfc_samples_plot(evidence: Mapping[str, Any]) -> Markup | None:
    """6.1.5: the TCP class's p99 round trip and bulk throughput on the calm side of the storm
    (between its groups; "before" it in older runs), during and after it; the allowed latency (the
    ratio times the calm p99 the verdict used: the calm side's, or the host's floor where that is
    higher), the floor itself (the p99 of the probe's round trips over the stormed host's loopback,
    no network, measured beside the calm side) and the required throughput as lines."""
    samples = evidence.get("samples") or []
    if not samples or "rtt_p99_ms" not in samples[0]:
        return None
    labels = [s["label"] for s in samples]
    floor = evidence.get("rtt_noise_floor_ms")
    base = next((s for s in samples if s["label"] in ("calm", "before")), samples[0])
    used = evidence.get("calm_p99_used_ms")
    used = float(used) if used is not None else max(base["rtt_p99_ms"], float(floor or 0.0))
    rtts = [s.get("rtt_p99_ms") for s in samples]
    tputs = [None if s.get("throughput_bps") is None else s["throughput_bps"] / 1e9 for s in samples]
    lat_ratio = threshold_value(evidence, "tcp_p99_latency_ratio")
    tput_ratio = threshold_value(evidence, "tcp_throughput_ratio")
    lat_limit = None if lat_ratio is None else lat_ratio * used
    tput_need = None if tput_ratio is None else tput_ratio * base["throughput_bps"] / 1e9
    rmax = max([v for v in rtts if v is not None] + [lat_limit or 0, float(floor or 0), 1e-6]) * 1.2
    tmax = max([v for v in tputs if v is not None] + [tput_need or 0, 1e-6]) * 1.2
    n = len(samples)
    lat = Axes("pfc-latency", "TCP class p99 round trip around the PFC storm", "sample", "p99 round trip (ms)",
               (-0.5, n - 0.5), (0, rmax), width=520)
    lat.bars(list(zip(labels, rtts)), PALETTE[0])
    if lat_limit is not None:
        # legend labels fit the right margin (~38 characters)
        of = "host floor" if floor is not None and float(floor) > base["rtt_p99_ms"] else f"{base['label']} p99"
        lat.hline(lat_limit, f"allowed {lat_limit:.3g} ms = {lat_ratio:g} x {of}", "#dc2626")
    if floor is not None:
        lat.hline(float(floor), f"host floor {float(floor):.3g} ms (loopback p99)", "#6b7280", "2 2")
    tput = Axes("pfc-throughput", "TCP class bulk throughput around the PFC storm", "sample",
                "throughput (Gbit/s)", (-0.5, n - 0.5), (0, tmax), width=520)
    tput.bars(list(zip(labels, tputs)), PALETTE[2])
    if tput_need is not None:
        tput.hline(tput_need, f"required {tput_need:.3g} Gbit/s", "#dc2626")
    return Markup(lat.render(x_ticks=False) + tput.render(x_ticks=False)) + _more_under_the_storm(samples, base)


def _more_under_the_storm(samples: Sequence[Mapping[str, Any]], base: Mapping[str, Any]) -> Markup:
    """A line under the throughput chart when the TCP class moved more during the storm than on its
    calm side (issue 37: 0.888 against 0.499 Gbit/s, with no word why): the reason is the fabric's
    own arbitration, so the reader should not take it for a measuring error."""
    during = next((s for s in samples if s["label"] in ("during", "storm")), None)
    calm, storm = base.get("throughput_bps"), None if during is None else during.get("throughput_bps")
    if not calm or not storm or storm <= calm:
        return Markup("")
    return Markup('<p class="chart-note" data-note="pfc-throughput">{}</p>').format(
        f"The TCP class moved more under the storm than beside it ({storm / 1e9:.3g} against {calm / 1e9:.3g} "
        "Gbit/s): a pause cuts the lossless class to a trickle and the TCP class borrows the whole link, while "
        "beside the storm it shares the link with the lossless flood (round robin between the two classes, "
        "harness/fabric/shaping.py). 6.1.5 asks only that the storm leave the TCP class at least its required "
        "share of the calm side's throughput.")


__all__ = ["NIXL_SOURCE", "kv_bandwidth_chart", "kv_bandwidth_hosts_plot", "pfc_samples_plot"]
