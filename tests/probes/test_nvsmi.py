"""nvidia-smi -q -x documents (recorded shapes of a 550 driver on H100s and a 470 driver on a
V100) and kernel XID lines, parsed; an NVML stand-in for the local inventory's CUDA version."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.errors import ProbeError
from harness.hosts import LocalExecutor
from harness.probes.workers.nvsmi import DCGM_FIELDS, parse_nvsmi_xml, parse_xid_lines, read_gpus

DATA = Path(__file__).parent / "data"
MIB = 1 << 20


def test_h100_document_with_the_sram_dram_ecc_layout_and_remapped_rows():
    busy, idle = parse_nvsmi_xml((DATA / "nvsmi_h100.xml").read_text())
    assert (busy.index, busy.bus_id, busy.name) == (0, "00000000:18:00.0", "NVIDIA H100 80GB HBM3")
    assert (busy.driver_version, busy.cuda_version) == ("550.54.15", "12.4")
    assert (busy.memory_total_bytes, busy.memory_used_bytes, busy.memory_free_bytes) == (
        81559 * MIB, 71203 * MIB, 10027 * MIB)
    assert busy.ecc_enabled is True
    assert busy.ecc == {"corrected_volatile": 3, "uncorrected_volatile": 1, "corrected_aggregate": 17,
                        "uncorrected_aggregate": 2}
    assert busy.retired_pages == {"single_bit": None, "double_bit": None, "pending": None}  # N/A on Hopper
    assert busy.remapped_rows == {"correctable": 0, "uncorrectable": 2, "pending": True, "failure": False}
    assert (busy.temperature_c, busy.memory_temperature_c) == (41, 49)
    assert busy.clocks_mhz == {"graphics": 1980, "sm": 1980, "memory": 2619}
    assert idle.index == 1 and idle.memory_free_bytes == 81230 * MIB and idle.ecc["uncorrected_volatile"] == 0


def test_v100_document_with_single_double_bit_totals_and_retired_pages():
    (gpu,) = parse_nvsmi_xml((DATA / "nvsmi_v100.xml").read_text())
    assert gpu.name == "Tesla V100-SXM2-32GB" and gpu.driver_version == "470.82.01"
    assert gpu.ecc == {"corrected_volatile": 2, "uncorrected_volatile": 0, "corrected_aggregate": 41,
                       "uncorrected_aggregate": 1}
    assert gpu.retired_pages == {"single_bit": 3, "double_bit": 1, "pending": False}
    assert gpu.remapped_rows == {"correctable": None, "uncorrectable": None, "pending": None, "failure": None}
    assert gpu.to_dict()["clocks_mhz"]["memory"] == 877


@pytest.mark.parametrize("text, match", [("", "not XML"), ("<html/>", "not an nvidia-smi log"),
                                         ("NVIDIA-SMI has failed because it couldn't communicate", "not XML")])
def test_what_is_not_an_nvidia_smi_document_is_a_clear_probe_error(text, match):
    with pytest.raises(ProbeError, match=match):
        parse_nvsmi_xml(text)


def test_xid_events_from_kernel_log_lines():
    log = ("[ 1234.567890] NVRM: Xid (PCI:0000:3b:00): 79, pid=2411, GPU has fallen off the bus.\n"
           "[ 1300.000001] nvidia-nvswitch0: probe\n"
           "Dec 01 10:00:01 gpu-node-3 kernel: NVRM: Xid (PCI:0000:18:00): 48, pid='<unknown>', name=<unknown>, "
           "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6.\n")
    events = parse_xid_lines(log)
    assert [(e["bus_id"], e["xid"]) for e in events] == [("0000:3b:00", 79), ("0000:18:00", 48)]
    assert "double bit error" in events[1]["detail"]


def test_dcgm_exporter_names_of_the_probed_quantities():
    assert DCGM_FIELDS["memory_used_mib"] == "DCGM_FI_DEV_FB_USED"
    assert DCGM_FIELDS["ecc_uncorrected_volatile"] == "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
    assert DCGM_FIELDS["xid_last"] == "DCGM_FI_DEV_XID_ERRORS"


def test_reading_through_an_executor_without_nvidia_smi_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on this PATH
    with pytest.raises(Exception, match="nvidia-smi"):
        read_gpus(LocalExecutor(), 0)


def test_environment_inventory_from_nvidia_smi_when_nvml_is_not_loadable():
    from harness.probes.workers.gpu import nvsmi_inventory

    gpus = nvsmi_inventory(run=lambda argv: (DATA / "nvsmi_h100.xml").read_text())
    assert [(g["index"], g["name"], g["driver"], g["cuda"]) for g in gpus] == [
        (0, "NVIDIA H100 80GB HBM3", "550.54.15", "12.4"), (1, "NVIDIA H100 80GB HBM3", "550.54.15", "12.4")]
    assert gpus[0]["memory_used_bytes"] == 71203 * MIB and gpus[0]["ecc_uncorrected_volatile"] == 1


def test_nvml_inventory_reports_the_cuda_driver_version(monkeypatch):
    """An NVML stand-in module (the calls gpu_inventory makes) in place of pynvml."""
    import sys
    from types import SimpleNamespace

    from harness.probes.workers.gpu import gpu_inventory

    class NVMLError(Exception):
        pass

    fake = SimpleNamespace(
        NVMLError=NVMLError, NVML_VOLATILE_ECC=1, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlSystemGetDriverVersion=lambda: b"550.54.15", nvmlSystemGetCudaDriverVersion=lambda: 12040,
        nvmlDeviceGetCount=lambda: 1, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80 * 1024 * MIB, used=MIB, free=80 * 1024 * MIB - MIB),
        nvmlDeviceGetName=lambda h: "NVIDIA H200",
        nvmlDeviceGetTotalEccErrors=lambda h, kind, counter: 0 if kind == 0 else 2)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    (gpu,) = gpu_inventory()
    assert (gpu["name"], gpu["driver"], gpu["cuda"]) == ("NVIDIA H200", "550.54.15", "12.4")
    assert (gpu["ecc_uncorrected_volatile"], gpu["ecc_corrected_volatile"]) == (2, 0)
