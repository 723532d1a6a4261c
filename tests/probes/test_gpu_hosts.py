"""GPU state of the cluster's hosts for the report: recorded nvidia-smi documents served by a
stand-in ``nvidia-smi`` (and ``dmesg``) that the test puts first on PATH, read through the real
local executor; the two snapshots' differences (over real SSH: tests/faults/test_gpu_hosts_ssh.py)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from harness.hosts import AuditLog, LocalExecutor
from harness.probes.workers.gpu_hosts import HostGpus, changes, read_host

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
    from harness.probes.workers.gpu_hosts import HostGpuWatch
    from harness.probes.workers.nvsmi import parse_nvsmi_xml

    watch = HostGpuWatch.__new__(HostGpuWatch)  # the two snapshots only; no SSH pool needed
    watch._exporters, watch.exporter_before, watch.exporter_after = {}, {}, {}
    gpus = parse_nvsmi_xml((DATA / "nvsmi_h100.xml").read_text())
    watch.before = [HostGpus("a", gpus=gpus), HostGpus("b", unavailable="nvidia-smi: command not found")]
    watch.after = [HostGpus("a", gpus=gpus), HostGpus("b", unavailable="nvidia-smi: command not found")]
    env = watch.environment()
    assert env["gpus_on_hosts"].startswith("a: 2x NVIDIA H100") and "b: not read (nvidia-smi" in env["gpus_on_hosts"]
    assert env["gpu_changes_during_run"] == "none on a (ECC, retired pages, remapped rows, XID)"
    watch.before, watch.after = watch.before[1:], watch.after[1:]
    assert "gpu_changes_during_run" not in watch.environment()  # nothing was read: no claim


EXPORTER = """# HELP DCGM_FI_DEV_ECC_DBE_VOL_TOTAL Total number of double-bit volatile ECC errors.
# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="0",UUID="GPU-1",device="nvidia0",modelName="NVIDIA H100 80GB HBM3"} %d
DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="1",UUID="GPU-2",device="nvidia1",modelName="NVIDIA H100 80GB HBM3"} 0
# HELP DCGM_FI_DEV_XID_ERRORS Value of the last XID error encountered.
# TYPE DCGM_FI_DEV_XID_ERRORS gauge
DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-1",device="nvidia0",modelName="NVIDIA H100 80GB HBM3"} %d
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-1",device="nvidia0",modelName="NVIDIA H100 80GB HBM3"} 41
"""


def test_a_hosts_dcgm_exporter_is_read_at_both_ends_and_its_ecc_and_xid_changes_reported(tmp_path):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from harness.cluster import ClusterHandle
    from harness.clusterfile import load_cluster
    from harness.probes.workers.gpu_hosts import HostGpuWatch

    body = {"text": EXPORTER % (0, 0)}

    class Exporter(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            data = body["text"].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Exporter)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        path = tmp_path / "c.yaml"
        path.write_text("kind: external\nendpoints: {api: http://127.0.0.1:9}\n"
                        f"hosts: [{{name: gpu-node-0, address: 127.0.0.1, roles: [decode], dcgm: {{exporter: '{url}'}}}},"
                        " {name: gpu-node-1, address: 127.0.0.1, roles: [decode],"
                        " dcgm: {exporter: 'http://127.0.0.1:9/metrics'}}]\n")
        spec = load_cluster(path)
        watch = HostGpuWatch(ClusterHandle(spec, spec.checklist(), "http://127.0.0.1:9", None, None),
                             tmp_path / "audit.jsonl")
        assert watch.active  # no SSH host: the exporters alone
        watch.start()
        body["text"] = EXPORTER % (2, 48)  # two double-bit errors and XID 48 on GPU 0 during the run
        watch.finish()
    finally:
        server.shutdown()
        server.server_close()
    env = watch.environment()
    assert env["gpu_changes_during_run"] == (
        "gpu-node-0 dcgm-exporter DCGM_FI_DEV_ECC_DBE_VOL_TOTAL gpu=0: 0.0 -> 2; "
        "gpu-node-0 dcgm-exporter DCGM_FI_DEV_XID_ERRORS gpu=0: 0.0 -> 48")
    assert "127.0.0.1:9/metrics" in env["dcgm_exporters_not_read"]  # the other host's exporter is down: said
