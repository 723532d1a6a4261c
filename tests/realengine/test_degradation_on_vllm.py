"""6.1.3 by load on a real vLLM: ``pytest suites/test_item3_degradation.py --cluster=vllm-agg`` against two
real vLLM instances (tiny model, a KV pool of 4096 tokens each) behind the real vllm-router.

vLLM has no degradation levels and never refuses for KV pressure; clusters/vllm-agg.yaml states what it
does instead: no errors above 80 % KV use, requests queued or preempted (and still no errors) above 90 %.
Long-prompt streams drive vllm:kv_cache_usage_perc (read from each instance's /metrics) over both
thresholds; the verdict is a pass or a fail with the KV use reached per level and the requests judged
at each. Measured here: about 1.5 min (vLLM start-up ~1 min, the suite ~25 s); seen: pass, KV use 0.98,
requests waiting and preempted, every request completed.

Its own cluster (tests/realengine/pool.py): the tiny model, which fills the 4096-token pool in seconds;
the slow model of test_suites_on_vllm.py and test_vllm_agg.py fills it too slowly to reach both levels
(their cluster is not shared with this one)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.realengine.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
VLLM_MODE = "agg"
VLLM_KV_CACHE_TOKENS = 4096  # the default pool (~1 M tokens of the tiny model) never fills under load


def test_vllm_kv_use_is_driven_over_the_stated_levels_and_their_actions_judged(vllm_cluster, tmp_path):
    reports = tmp_path / "reports"
    cmd = [sys.executable, "-m", "pytest", "suites/test_item3_degradation.py", "-p", "no:cacheprovider",
           "--cluster=vllm-agg", f"--report-dir={reports}", "--live=plain"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    out = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode in (0, 1), out  # judged: never inconclusive (2) nor a harness error (3)
    data = json.loads((reports / "latest" / "results.json").read_text())
    assert not data["harness_errors"], data["harness_errors"]
    [v613] = [v for v in data["verdicts"] if v["item"] == "6.1.3"]
    assert v613["status"] in ("pass", "fail"), v613["reason"]
    ev = v613["evidence"]
    assert ev["metrics_urls"] == ["http://127.0.0.1:8101/metrics", "http://127.0.0.1:8102/metrics"]
    assert "http://127.0.0.1:8109/metrics" in ev["metrics_urls_dropped"]  # the router exposes no KV use
    l2, l3 = ev["levels"]
    assert l2["reached"] and l3["reached"] and ev["highest_kv_use"] >= 0.9, ev["levels"]
    assert l2["requests"] + l3["requests"] > 0
    # vLLM queues when its pool is full: seen on its own metrics
    assert (l3["waiting_max"] or 0) > 0 or (l3["preemptions"] or 0) > 0, l3
    assert len(ev["kv_use_series"]) > 5 and ev["links"]
    [lost] = [v for v in data["verdicts"] if v["item"] == "nothing-lost"]
    assert lost["status"] in ("pass", "fail") and lost["evidence"]["requests"] > 0
