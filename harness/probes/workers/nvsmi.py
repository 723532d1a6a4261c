"""GPU state from ``nvidia-smi -q -x`` (local or over SSH) and from kernel XID lines.

:func:`parse_nvsmi_xml` turns the XML document into one :class:`GpuState` per GPU: memory
total/used/free, ECC volatile and aggregate counts (corrected / uncorrected; both the
``single_bit``/``double_bit`` layout of older drivers and the ``sram_*``/``dram_*`` one of
drivers >= 525), retired pages (pre-Ampere) and remapped rows (Ampere and later),
temperature and clocks, with the driver and CUDA versions of the document. XID events are not
in that document: :func:`parse_xid_lines` reads them from the kernel log (``NVRM: Xid ...``).

DCGM exporter names of the same quantities are in :data:`DCGM_FIELDS` (for clusters that
expose a dcgm-exporter ``/metrics``).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.errors import ProbeError

NVSMI_ARGV = ["nvidia-smi", "-q", "-x"]
MIB = 1 << 20

# our quantity -> dcgm-exporter metric name (DCGM field identifiers, default exporter counters)
DCGM_FIELDS: dict[str, str] = {
    "memory_used_mib": "DCGM_FI_DEV_FB_USED",
    "memory_free_mib": "DCGM_FI_DEV_FB_FREE",
    "ecc_uncorrected_volatile": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "ecc_corrected_volatile": "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "ecc_uncorrected_aggregate": "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
    "ecc_corrected_aggregate": "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
    "retired_pages_sbe": "DCGM_FI_DEV_RETIRED_SBE",
    "retired_pages_dbe": "DCGM_FI_DEV_RETIRED_DBE",
    "remapped_rows_uncorrectable": "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "remapped_rows_correctable": "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "xid_last": "DCGM_FI_DEV_XID_ERRORS",
    "temperature_c": "DCGM_FI_DEV_GPU_TEMP",
    "sm_clock_mhz": "DCGM_FI_DEV_SM_CLOCK",
    "mem_clock_mhz": "DCGM_FI_DEV_MEM_CLOCK",
}


@dataclass(frozen=True)
class GpuState:
    index: int
    bus_id: str
    name: str
    uuid: str
    driver_version: str
    cuda_version: str
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    memory_free_bytes: int | None
    ecc_enabled: bool | None
    ecc: dict[str, int | None] = field(default_factory=dict)   # {corrected,uncorrected}_{volatile,aggregate}
    retired_pages: dict[str, Any] = field(default_factory=dict)
    remapped_rows: dict[str, Any] = field(default_factory=dict)
    temperature_c: int | None = None
    memory_temperature_c: int | None = None
    clocks_mhz: dict[str, int | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(node: ET.Element | None, path: str) -> str | None:
    found = node.find(path) if node is not None else None
    if found is None or found.text is None:
        return None
    text = found.text.strip()
    return None if text in ("", "N/A", "[N/A]", "Not Supported", "[Not Supported]") else text


def _number(node: ET.Element | None, path: str) -> int | None:
    """``81559 MiB`` / ``34 C`` / ``1980 MHz`` / ``0`` -> the leading integer (None when N/A)."""
    text = _text(node, path)
    m = re.match(r"^(-?\d+)", text or "")
    return int(m.group(1)) if m else None


def _mib(node: ET.Element | None, path: str) -> int | None:
    value = _number(node, path)
    return None if value is None else value * MIB


def _yes(node: ET.Element | None, path: str) -> bool | None:
    text = _text(node, path)
    return None if text is None else text.lower() in ("yes", "enabled", "true")


def _ecc_counts(node: ET.Element | None) -> tuple[int | None, int | None]:
    """(corrected, uncorrected) of a ``volatile`` or ``aggregate`` element, old or new layout."""
    if node is None:
        return None, None
    if node.find("single_bit") is not None:  # drivers before 525: single_bit/double_bit totals
        return _number(node, "single_bit/total"), _number(node, "double_bit/total")
    corrected = [_number(node, t) for t in ("sram_correctable", "dram_correctable")]
    uncorrected = [_number(node, t) for t in ("sram_uncorrectable", "dram_uncorrectable")]

    def total(values: list[int | None]) -> int | None:
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    return total(corrected), total(uncorrected)


def parse_nvsmi_xml(text: str) -> list[GpuState]:
    """Every ``<gpu>`` of an ``nvidia-smi -q -x`` document, in order."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        raise ProbeError(f"nvidia-smi -q -x output is not XML ({exc}): {text[:200]!r}",
                         fix="check that nvidia-smi runs on the host (driver loaded)") from exc
    if root.tag != "nvidia_smi_log":
        raise ProbeError(f"not an nvidia-smi log (root element <{root.tag}>)", fix="run `nvidia-smi -q -x`")
    driver, cuda = _text(root, "driver_version") or "", _text(root, "cuda_version") or ""
    out = []
    for index, gpu in enumerate(root.findall("gpu")):
        fb = gpu.find("fb_memory_usage")
        vol_c, vol_u = _ecc_counts(gpu.find("ecc_errors/volatile"))
        agg_c, agg_u = _ecc_counts(gpu.find("ecc_errors/aggregate"))
        retired = gpu.find("retired_pages")
        remapped = gpu.find("remapped_rows")
        clocks = gpu.find("clocks")
        out.append(GpuState(
            index=_number(gpu, "minor_number") if _number(gpu, "minor_number") is not None else index,
            bus_id=gpu.get("id", ""), name=_text(gpu, "product_name") or "", uuid=_text(gpu, "uuid") or "",
            driver_version=driver, cuda_version=cuda, memory_total_bytes=_mib(fb, "total"),
            memory_used_bytes=_mib(fb, "used"), memory_free_bytes=_mib(fb, "free"),
            ecc_enabled=_yes(gpu, "ecc_mode/current_ecc"),
            ecc={"corrected_volatile": vol_c, "uncorrected_volatile": vol_u, "corrected_aggregate": agg_c,
                 "uncorrected_aggregate": agg_u},
            retired_pages={"single_bit": _number(retired, "multiple_single_bit_retirement/retired_count"),
                           "double_bit": _number(retired, "double_bit_retirement/retired_count"),
                           "pending": _yes(retired, "pending_retirement")},
            remapped_rows={"correctable": _number(remapped, "remapped_row_corr"),
                           "uncorrectable": _number(remapped, "remapped_row_unc"),
                           "pending": _yes(remapped, "remapped_row_pending"),
                           "failure": _yes(remapped, "remapped_row_failure")},
            temperature_c=_number(gpu, "temperature/gpu_temp"),
            memory_temperature_c=_number(gpu, "temperature/memory_temp"),
            clocks_mhz={"graphics": _number(clocks, "graphics_clock"), "sm": _number(clocks, "sm_clock"),
                        "memory": _number(clocks, "mem_clock")}))
    return out


_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9a-fA-F:.]+)\): (?P<xid>\d+), (?P<rest>.*)$")


def parse_xid_lines(text: str) -> list[dict[str, Any]]:
    """XID events of kernel log lines (``dmesg`` / ``journalctl -k``), e.g.
    ``NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.``"""
    events = []
    for line in text.splitlines():
        m = _XID.search(line)
        if m:
            events.append({"bus_id": m.group("bus"), "xid": int(m.group("xid")), "detail": m.group("rest").strip()})
    return events


def read_gpus(ex: Any, device: int | None = None) -> list[GpuState]:
    """``nvidia-smi -q -x [-i DEVICE]`` on the executor's host (local or SSH), parsed."""
    argv = NVSMI_ARGV + (["-i", str(device)] if device is not None else [])
    res = ex.run(argv, timeout=30, check=False)
    if res.rc != 0:
        raise ProbeError(f"nvidia-smi failed on {ex.host} (rc={res.rc}): {(res.stderr or res.stdout).strip()[:300]}",
                         fix="install the NVIDIA driver (nvidia-smi) on the host, or name a GPU it has")
    return parse_nvsmi_xml(res.stdout)
