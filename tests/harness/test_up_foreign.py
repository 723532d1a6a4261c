"""Item 6.1.2 on an engine that migrates streams when their worker dies, judged from outside (no admin
API), as a Dynamo cluster with request migration would be: the bundled engine started by
``python -m harness up --supervise --pid-dir DIR`` and attached through ``clusters/up-foreign.yaml``
(its per-worker health URLs, its pid files, its supervisor). The suite kills decode workers while
the harness's streams decode on them and must reach a verdict from enough measured crossings; the
pass/fail itself is a timing threshold (a kill-triggered move includes the engine noticing the loss),
which this shared 2-core box cannot promise either way."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_migration_on_worker_loss_is_judged_from_the_client_and_killed_workers_come_back(up_cluster, tmp_path):
    port, cluster, up_log, pid_dir = up_cluster
    assert httpx.get(f"http://127.0.0.1:{port}/health/workers/decode-0").json()["health"] == "healthy"
    missing = httpx.get(f"http://127.0.0.1:{port}/health/workers/decode-9")
    assert missing.status_code == 404 and "decode-0" in missing.text
    first_pids = {p.stem: p.read_text().strip() for p in pid_dir.glob("*.pid")}

    cmd = [sys.executable, "-m", "pytest", "suites/test_item2_hot_migration.py", "-p", "no:cacheprovider",
           f"--cluster={cluster}", f"--report-dir={tmp_path / 'reports'}", "--live=plain"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=800)
    out = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode in (0, 1, 2), out
    verdicts = {v["item"]: v for v in json.loads((tmp_path / "reports" / "latest" / "results.json").read_text())
                ["verdicts"]}
    v = verdicts["6.1.2"]
    # decided, or (a true median near the 50 ms limit on this box) undecided after the checklist's budget
    # of migrations, saying so with its interval: never inconclusive for want of measured crossings
    assert v["status"] in ("pass", "fail") or ("straddles" in v["reason"] and v["evidence"].get("extension")), \
        v["reason"]
    dist = v["evidence"]["distribution_ms"]
    assert dist["idle"]["n"] >= 5 and dist["loaded"]["n"] >= 8, v["reason"]
    assert "longest inter-chunk gap at or after the kill" in v["evidence"]["definition"]
    # every measured crossing left the killed worker for the other one, as the stream's chunks say
    assert all(s["source"] != s["target"] and s["target"].startswith("decode-") for s in v["evidence"]["per_migration"])
    assert verdicts["nothing-lost"]["status"] == "pass", verdicts["nothing-lost"]["reason"]
    # the supervisor brought every killed worker back under a new pid, written to its pid file
    restarts = [line for line in up_log.read_text().splitlines() if line.startswith("supervisor: decode-")]
    assert len(restarts) == v["evidence"]["kills"], up_log.read_text()[-2000:]
    now = {p.stem: p.read_text().strip() for p in pid_dir.glob("*.pid")}
    assert set(now) == set(first_pids) and any(now[w] != first_pids[w] for w in ("decode-0", "decode-1"))
    for w in ("decode-0", "decode-1", "prefill-0"):
        assert httpx.get(f"http://127.0.0.1:{port}/health/workers/{w}").status_code == 200
