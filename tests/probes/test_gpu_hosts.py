"""GPU state of the cluster's hosts for the report: recorded nvidia-smi documents served by a
stand-in ``nvidia-smi`` (and ``dmesg``) that the test puts first on PATH, read through the real
local executor; the two snapshots' differences (over real SSH: tests/faults/test_gpu_hosts_ssh.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from harness.faults import AuditLog, LocalExecutor
from harness.probes.gpu_hosts import HostGpus, changes, read_host

DATA = Path(__file__).parent / "data"
XID = "[ 812.5] NVRM: Xid (PCI:0000:18:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def _stand_in(bin_dir: Path, nvsmi_xml: Path, dmesg: str = "") -> None:
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("nvidia-smi", f"cat '{nvsmi_xml}'"), ("dmesg", f"printf '%s\\n' '{dmesg}'")):
        path = bin_dir / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_a_host_is_read_and_summarised_and_what_moved_between_two_readings_is_named(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    _stand_in(bin_dir, DATA / "nvsmi_h100.xml")
    before = read_host("gpu-node-0", LocalExecutor(audit=AuditLog(tmp_path / "audit.jsonl")))
    assert before.unavailable is None and len(before.gpus) == 2 and before.xids == []
    assert before.summary() == "gpu-node-0: 2x NVIDIA H100 80GB HBM3, driver 550.54.15, CUDA 12.4"
    assert "nvidia-smi" in (tmp_path / "audit.jsonl").read_text()  # every command is audited

    # the run ends: one more uncorrectable DRAM error on GPU 0 and an XID 79 in the kernel log
    later = tmp_path / "later.xml"
    later.write_text((DATA / "nvsmi_h100.xml").read_text().replace(
        "<dram_uncorrectable>1</dram_uncorrectable>", "<dram_uncorrectable>2</dram_uncorrectable>", 1))
    _stand_in(bin_dir, later, XID)
    after = read_host("gpu-node-0", LocalExecutor())
    assert after.xids == [{"bus_id": "0000:18:00", "xid": 79, "detail": "pid=4242, name=python, GPU has fallen "
                                                                         "off the bus."}]
    moved = changes([before], [after])
    assert "gpu-node-0 GPU 0: ECC uncorrected volatile 1 -> 2" in moved
    assert "gpu-node-0: XID 79 on 0000:18:00: pid=4242, name=python, GPU has fallen off the bus." in moved
    assert changes([after], [after]) == []  # an XID already there at the start is not news



def test_the_report_part_names_hosts_read_and_claims_no_changes_only_where_it_read_twice():
    from harness.probes.gpu_hosts import HostGpuWatch
    from harness.probes.nvsmi import parse_nvsmi_xml

    watch = HostGpuWatch.__new__(HostGpuWatch)  # the two snapshots only; no SSH pool needed
    gpus = parse_nvsmi_xml((DATA / "nvsmi_h100.xml").read_text())
    watch.before = [HostGpus("a", gpus=gpus), HostGpus("b", unavailable="nvidia-smi: command not found")]
    watch.after = [HostGpus("a", gpus=gpus), HostGpus("b", unavailable="nvidia-smi: command not found")]
    env = watch.environment()
    assert env["gpus_on_hosts"].startswith("a: 2x NVIDIA H100") and "b: not read (nvidia-smi" in env["gpus_on_hosts"]
    assert env["gpu_changes_during_run"] == "none on a (ECC, retired pages, remapped rows, XID)"
    watch.before, watch.after = watch.before[1:], watch.after[1:]
    assert "gpu_changes_during_run" not in watch.environment()  # nothing was read: no claim
