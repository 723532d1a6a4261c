"""The main job on a foreign engine, as a user runs it: ``pytest suites/ --cluster=vllm-agg`` against
two real vLLM instances behind the real vllm-router, restarted by the launcher's supervisor.

Issue 10's acceptance: the run exits 0, 1 or 2, never 3; 6.2 (TTFT/TPOT from the client, vLLM's own
histograms beside) and 6.1.4 (inventory workers killed and hung, judged from the client records)
reach a pass or fail verdict with their evidence; nothing-lost is judged; every other item is
inconclusive with a reason naming what is missing. A hung EngineCore (SIGSTOP 8 s) keeps /health
at 200, so vllm-router does not route around it: the stall clients see is longer than 3 s and 6.1.4
fails, saying so. A killed API server cuts the streams in flight on it with no error event: nothing-lost
fails, naming them. (Seen here: 6.1.4 fail, hang stall 8.1 s; kill cut load-1, load-3, load-4.)

6.1.3 is left out of this run (``--ignore=suites/test_item3_degradation.py``): it is judged on vLLM by
test_degradation_on_vllm.py, on the tiny model that fills a 4096-token pool in seconds. On this slow
model the pool fills slowly and then drains ~32 streams of 600 tokens a few at a time: 164 s of this
test's 387 s in CI, to end "not reached" or a verdict the other test already asserts (issue 34: CI time).

Issue 23's acceptance on the external side rides on the same run (one vLLM start-up, one restart):
vllm-router's circuit breaker at its defaults decides when the killed instance gets traffic again; the
run states whether and when the router took it back (evidence ``rejoin``: healthy -> new prompt tokens
on it and the router's breaker for it closed), the hang is injected only after that (or the run says
why it stopped), and the hang is judged while the other instance serves. Open-loop load (2 requests/s,
at most 32 users: both instances' 16 running slots) keeps requests arriving while streams stall on the hung instance, so whether the other one serves
meanwhile is measured, not decided by a few closed-loop users all waiting on the hung one. vLLM on 2
cores starves the test machine by itself: a timing verdict may be inconclusive naming the machine,
except where the same run's baseline shows the machine does not explain it (the hang's stall). (Seen
here: restart 237 s, vllm-router kept vllm-1 out 109 s after it was healthy: breaker open, half_open at
+108.7 s, closed at +109.4 s; the hang 0.7 s later; stall 10.1 s.)

vLLM's own KV pool, not the 4096 tokens 6.1.3 needs: at 16 running streams of 264 tokens a 4096-token
pool preempts and recomputes all the time, and on a slower machine the hung instance, resumed, served a
request sent straight to it only after 150+ s (CI, 2026-12-07; 350 s for this test here) and the other
instance left new requests waiting 8.4 s through the 8 s hang. With vLLM's pool and half the load it was
back in 21.5 s, new requests served within 3.1 s (258 s for the test on the same machine).

Its started cluster (slow model, vLLM's own pool) is shared with test_vllm_agg.py, which runs after it
(tests/realengine/pool.py); this test runs first on it, so its kill is the cluster's first restart.
test_degradation_on_vllm.py cannot share it (the tiny model), nor test_vllm_pd.py (another mode)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.realengine.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]  # vLLM start-up, then a kill whose restart takes minutes
VLLM_MODE = "agg"
VLLM_MODEL_PRESET = "slow"  # ~30 ms/token: streams are in flight when a worker is killed or hung
# a pool load can fill: clusters/vllm-agg.yaml states its degradation levels, so 6.1.3 is driven by load
VLLM_KV_CACHE_TOKENS = None  # vLLM's own pool (see the docstring)


def test_the_main_job_judges_6_2_and_6_1_4_on_vllm_and_never_exits_3(vllm_cluster, tmp_path):
    reports = tmp_path / "reports"
    cmd = [sys.executable, "-m", "pytest", "suites/", "-p", "no:cacheprovider", "--cluster=vllm-agg",
           f"--report-dir={reports}", "--kills=1", "--load-rate=2", "--load-users=32", "--live=plain",
           "--ignore=suites/test_item3_degradation.py"]   # 6.1.3 on vLLM: test_degradation_on_vllm.py
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=2400)
    # the launcher's log says when an instance died, restarted and came back (a slow restart fails 6.1.4's revert)
    out = proc.stdout[-6000:] + proc.stderr[-3000:] + "\n--- launcher log ---\n" + vllm_cluster.launcher_log()[-2000:]
    assert proc.returncode in (0, 1, 2), out
    data = json.loads((reports / "latest" / "results.json").read_text())
    assert not data["harness_errors"], data["harness_errors"]
    verdicts: dict[str, list[dict]] = {}
    for v in data["verdicts"]:
        verdicts.setdefault(v["item"], []).append(v)
    judged = {item: vs for item, vs in verdicts.items() if any(v["status"] in ("pass", "fail") for v in vs)}
    assert {"6.1.4", "nothing-lost"} <= set(judged), (sorted(judged), out)
    for item in ("6.2.ttft", "6.2.tpot"):   # judged, or inconclusive naming why (never a missing capability)
        assert item in judged or all(starved(v) or "straddles" in v["reason"] for v in verdicts[item]), verdicts[item]

    # 6.2: the client's percentiles measured, vLLM's own histograms read beside them
    ttft = verdicts["6.2.ttft"][0]
    assert ttft["evidence"]["server_metric"] == "vllm:time_to_first_token_seconds", ttft["evidence"]
    assert ttft["evidence"]["server"]["observations"] > 0, ttft["evidence"]  # summed over the workers' /metrics

    # 6.1.4: one kill and one hang of an aggregated instance, from the client's view
    [v614] = judged["6.1.4"]
    _the_router_took_the_killed_instance_back_before_the_hang(v614, data)
    labels = [s["label"] for s in v614["evidence"]["samples"]]
    assert any(lbl.startswith("kill vllm-") for lbl in labels)
    if v614["evidence"].get("stopped"):
        # vllm-router kept the restarted instance out past the watch: a recovery finding, no hang injected
        assert v614["status"] == "fail" and "vllm-router kept vllm-" in v614["reason"], v614["reason"]
    else:
        assert any(lbl.startswith("hang vllm-") for lbl in labels), labels
        stalls = v614["evidence"]["longest_stall_s"]
        # the hung EngineCore's /health stays 200: the router keeps sending to it, clients stall ~8 s
        assert v614["status"] == "fail" and stalls["p100"] > 3.0, (v614["reason"], stalls)

    # the kill ends an API server: streams in flight on it are cut with no error event, which
    # nothing-lost fails by name
    cut = v614["evidence"]["cut_without_error"]
    lost = [v for v in judged["nothing-lost"] if v["status"] == "fail"]
    if cut:   # every cut stream counted; named in the evidence, which lists at most 20 per category
        listed = {r["request_id"] for v in lost for r in v["evidence"]["failures_without_error"]}
        counted = sum(m["value"] for v in lost for m in v["evidence"]["measurements"]
                      if m["key"] == "failures_without_error")
        assert lost and counted >= len(cut), (cut, lost)
        assert set(cut) <= listed or (len(listed) >= 20 and listed & set(cut)), (cut, listed)

    assert "6.1.3" not in verdicts, verdicts["6.1.3"]   # its suite was left out (the docstring says why)
    assert "6.1.3" in data["coverage"]["not_run"], data["coverage"]   # and the report says it was not run

    # every other item: inconclusive, naming the missing capability
    for item in ("6.1.1", "6.1.2", "6.1.5", "nic-flap", "ecc"):
        assert item in verdicts and all(v["status"] == "inconclusive" for v in verdicts[item]), item
        assert all("not judged on this cluster: needs " in v["reason"] for v in verdicts[item]), verdicts[item]
    cov = data["coverage"]
    assert "6.1.4" in cov["judged"] and all(i in cov["judged"] or all(starved(v) or "straddles" in v["reason"]
                                                                  for v in verdicts[i]) for i in ("6.2.ttft", "6.2.tpot"))

    # every fault reverted: both instances healthy again, the ledger closed
    assert not data["revert_failures"]
    html = (reports / "latest" / "report.html").read_text()
    assert "6.1.4" in html and "6.2.ttft" in html
    log_left = subprocess.run(["pgrep", "-f", "^vllm-[01]::EngineCore"], capture_output=True, text=True).stdout.split()
    assert len(log_left) == 2, "both instances must run again after the suites (one EngineCore each)"


def starved(verdict: dict) -> bool:
    """Inconclusive because vLLM starved the 2-core test machine (the gate names it)."""
    return verdict["status"] == "inconclusive" and "test machine CPU-starved" in verdict["reason"]


def _the_router_took_the_killed_instance_back_before_the_hang(v: dict, data: dict) -> None:
    ev = v["evidence"]
    kill, *rest = ev["rejoin"]
    assert kill["fault"].startswith("kill vllm-") and kill["observable"], kill
    assert kill["kept_out_by"] == "vllm-router" and kill["watched"], kill   # its /metrics and the router's view
    assert kill["sentence"] in json.dumps(ev["samples"]), ev["samples"]      # stated beside the fault
    samples = {s["label"].split()[0]: s for s in ev["samples"]}
    if kill["back"]:   # whether and when: healthy, then traffic seen and the breaker closed; the hang only after
        assert kill["serving_wall"] >= kill["traffic_wall"] >= kill["healthy_wall"], kill
        # back means served (issue 33): a request the watch sent straight to the instance after the revert got
        # a token, before the router's traffic counted (planted: a counter rise alone taken as back)
        assert kill["served_how"].startswith("a request sent straight to ") and kill["probes"] >= 1, kill
        assert kill["traffic_wall"] >= kill["served_wall"] >= kill["healthy_wall"], kill
        assert not kill["breaker"] or kill["breaker"][-1][1] == "closed", kill
        assert "hang" in samples and samples["hang"]["wall"] > kill["serving_wall"], (kill, samples)
        # judged while a healthy instance serves: a request sent after the hang was served, and the stall
        # clients saw on the hung instance (vllm-router keeps sending to it: /health stays 200) fails 6.1.4,
        # however starved the machine: outside the faults the same run's streams did not stall like that
        assert samples["hang"]["new_request_s"] is not None and samples["hang"]["new_request_s"] < 8.0, samples
        assert v["status"] == "fail" and samples["hang"]["longest_stall_s"] > 3.0, v["reason"]
        assert rest and rest[0]["back"], rest    # the resumed instance carries traffic again
        assert rest[0]["served_how"].startswith("a request sent straight to "), rest   # served, not queued work
    else:              # never taken back within the watch: the hang was not injected, and the item says why
        assert "hang" not in samples and ev["stopped"].startswith(f"stopped after {kill['fault']}: vllm-router kept")
        assert "not injected: hang aggregated" in ev["stopped"] and v["status"] == "fail", v["reason"]
    if kill["kept_out_s"] > 60.0:   # beyond rejoin_limit_s: a finding named in the verdict's one line
        assert "vllm-router kept vllm-" in v["reason"] and v["status"] == "fail", v["reason"]
    # the kill's revert record: healthy, then what the router did within rejoin_limit_s (never a failed revert)
    [reverted] = [r for r in data["faults"] if r["action"] == "verify_reverted" and r["kind"] == "process_kill"]
    assert reverted["output"].startswith(f"{kill['worker']} is healthy again; vllm-router "), reverted
