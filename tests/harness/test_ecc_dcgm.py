"""Item ecc on a real cluster through DCGM, end to end: the bundled engine attached as a foreign
cluster (``harness up --supervise``, clusters/up-foreign.yaml) whose host claims DCGM, with a
stand-in ``dcgmi`` (no DCGM on these machines) that records each injection. The bundled engine
does not read DCGM, so nothing drains the worker: the suite must fail ecc saying so, make the
injection, set the healthy value back, and judge nothing-lost on the load."""

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_an_ecc_error_in_a_workers_gpu_monitoring_that_nobody_drains_fails_ecc(up_cluster, tmp_path):
    _port, cluster, _log, _pids = up_cluster
    record, dcgmi = tmp_path / "injections", tmp_path / "dcgmi"
    dcgmi.write_text(f'#!/bin/sh\ncase "$1" in discovery) echo "2 GPUs found."; exit 0 ;;\n'
                     f'  test) echo "$4 $6 $8" >> {record}; echo "Successfully injected field info."; exit 0 ;;\n'
                     f'esac\nexit 2\n')
    dcgmi.chmod(dcgmi.stat().st_mode | stat.S_IEXEC)
    text = cluster.read_text()
    text = text.replace("hosts: [{name: localhost, address: 127.0.0.1, roles: [router, prefill, decode]}]",
                        f"hosts: [{{name: localhost, address: 127.0.0.1, roles: [router, prefill, decode], "
                        f"dcgm: {{dcgmi: '{dcgmi}'}}}}]")
    text = text.replace("    supervised: true\n  - name: decode-1", "    supervised: true\n    gpus: [0]\n"
                                                                     "  - name: decode-1", 1)
    text = text.replace("allowed_faults: [process_kill, process_hang]", "allowed_faults: [dcgm_inject]")
    text += 'thresholds: {"ecc": {drain_after_injection_s: 4}}\n'
    cluster.write_text(text)

    cmd = [sys.executable, "-m", "pytest", "suites/test_ecc_poisoning.py", "-p", "no:cacheprovider",
           f"--cluster={cluster}", f"--report-dir={tmp_path / 'reports'}", "--live=plain", "--load-duration=40"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    verdicts = {v["item"]: v for v in json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())
                ["verdicts"]}
    ecc = verdicts["ecc"]
    assert ecc["status"] == "fail" and "decode-0 (GPU 0 on localhost) kept serving" in ecc["reason"], ecc["reason"]
    assert "not the memory" in ecc["evidence"]["what_this_exercises"]
    [inj] = ecc["evidence"]["injections"]
    assert inj["drained_after_s"] is None and all(h == 200 for _, h, _ in inj["samples"])
    assert inj["back_after_s"] is not None  # healthy all along, so "back" at once
    assert verdicts["nothing-lost"]["status"] == "pass", verdicts["nothing-lost"]["reason"]
    lines = record.read_text().splitlines()
    assert "0 311 1" in lines and lines[-1] == "0 311 0"  # the error on GPU 0, then the healthy value back
