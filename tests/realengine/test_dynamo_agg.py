"""A real NVIDIA Dynamo 1.6.1 frontend with two aggregated mocker workers, supervised (clusters/dynamo-agg.yaml):
the launcher's READY, the request shape Dynamo accepts, token counting without text, the 6.2 suite as a
user runs it, and a SIGKILL under load that Dynamo's request migration absorbs.

One started cluster for this module and test_dynamo_soak.py, which runs right after it
(tests/realengine/pool.py): the pool hands it over only whole (both workers answering /health and
registered with the frontend), else starts a fresh one; a hang past Dynamo's discovery lease can leave
a worker unregistered (docs/dynamo.md). Each test reads the launcher's current state (its log from the
test's own start, the pid file of the current incarnation). test_dynamo_disagg.py and
test_dynamo_fanout.py cannot share it: other modes (one prefill and two decode workers; 128 workers)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from harness.checks.migration_blackbox import crossing
from harness.errors import ConfigError
from harness.probes.client.request_shape import check_request_shape, request_shape
from harness.probes.client.streaming import CompletionRequest, StreamingClient
from tests.realengine.conftest import REPO, healthy, kill_under_streams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
DYNAMO_MODE = "agg"


def test_ready_means_every_worker_registered_and_serving(dynamo_cluster):
    ready = dynamo_cluster.ready
    assert ready["registered"] == {"backend": 2} and set(ready["workers"]) == {"dynamo-0", "dynamo-1"}
    health = httpx.get(f"{dynamo_cluster.api}/health", timeout=10).json()
    assert sum(i["endpoint"] == "generate" for i in health["instances"]) == 2
    log = dynamo_cluster.launcher_log()
    for name, worker in ready["workers"].items():
        assert healthy(worker["health"]), name
        started = re.findall(rf"started {name} pid (\d+) ", log)  # READY's is the first; the pid file names the last
        assert started and int(started[0]) == worker["pid"], (name, started, worker)
        assert int(Path(worker["pid_file"]).read_text()) == int(started[-1]), (name, started)
        spec = dynamo_cluster.worker(name)
        assert spec["process"]["pid_file"] == worker["pid_file"] and spec["health"] == worker["health"]


def test_the_dynamo_shape_is_accepted_and_return_token_ids_would_be_refused(dynamo_cluster):
    """The launcher leaves DYN_IGNORE_OPENAI_FE_UNSUPPORTED_FIELDS unset, as a user's Dynamo may."""
    check_request_shape(dynamo_cluster.api, request_shape("dynamo"))
    with pytest.raises(ConfigError, match="rejects request field\\(s\\) return_token_ids"):
        check_request_shape(dynamo_cluster.api, request_shape("vllm"))


def test_streams_carry_the_tokens_usage_says_although_their_text_is_empty(dynamo_cluster):
    with StreamingClient(dynamo_cluster.api, request_shape=request_shape("dynamo")) as client:
        records = [client.send(CompletionRequest(f"count me {i}", max_tokens=24, ignore_eos=True, chat=i % 2 == 1))
                   for i in range(4)]
    for rec in records:
        assert rec.ok and rec.token_source == "usage", rec
        assert sum(rec.chunk_tokens) == rec.completion_tokens == 24 and rec.first_token_ns == rec.chunk_ns[0]
    assert not "".join(r.text for r in records)  # the mocker's tokens detokenize to nothing


def starved(verdict: dict) -> bool:
    """Inconclusive because the 2-core test machine was CPU-starved (harness/checks/machine.py names it)."""
    return verdict["status"] == "inconclusive" and "test machine CPU-starved" in verdict["reason"]


def test_the_62_suite_measures_ttft_and_tpot_and_nothing_is_lost(dynamo_cluster, tmp_path):
    """The mocker's TTFT (about 53 ms p50) and TPOT (about 6 ms p50) are within 6.2's targets: a true pass,
    inconclusive only where the gate names the starved machine or where a p99 straddles for want of
    effective requests, saying how many would decide (CI 2026-12-06: TPOT p99 6.44 ms of 3300 requests
    whose slow ones came in bursts, no upper bound within the 90 s budget; docs/statistics.md
    "Dependence"); never fail. Catches a harness that fails (or cannot
    decide) what the cluster meets, e.g. TTFT taken at the wrong token or judged against the wrong limit
    (planted: a 1 ms ``ttft_p50_ms`` in a copy of the cluster file: 6.2.ttft fails and so does this;
    checked once: 'client TTFT p50 was 51.93 ms ..., required < 1 ms', the status assertion failed)."""
    reports = tmp_path / "reports"
    # clusters/dynamo-agg.yaml with 6.2's load capped at 30 s (the checklist's 90 s): the p50s decide within
    # seconds; a p99 left straddling after 30 s stays so at 90 s on this machine (CI 2026-12-06), 60 s of CI
    cluster = tmp_path / "dynamo-agg-capped.yaml"
    data = yaml.safe_load((REPO / "clusters" / "dynamo-agg.yaml").read_text())
    data.setdefault("thresholds", {})["6.2.ttft"] = {"max_load_s": 30}
    cluster.write_text(yaml.safe_dump(data))
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/test_62_slo.py", "-p", "no:cacheprovider",
                           f"--cluster={cluster}", f"--report-dir={reports}", "--load-duration=5", "--load-users=8",
                           "--live=plain"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    out = proc.stdout[-4000:] + proc.stderr[-2000:]
    verdicts = {v["item"]: v for v in json.loads((reports / "latest" / "results.json").read_text())["verdicts"]}
    from tests.harness.test_soak_e2e import straddles_by_size

    for item in ("6.2.ttft", "6.2.tpot"):
        v = verdicts[item]
        assert v["status"] == "pass" or starved(v) or straddles_by_size(v), (item, v["reason"])
        assert v["evidence"]["server"]["observations"] > 0  # the frontend's own histogram beside
    undecided = [i for i in ("6.2.ttft", "6.2.tpot") if verdicts[i]["status"] != "pass"]
    assert proc.returncode == (2 if undecided else 0), out
    lost = verdicts["nothing-lost"]
    assert lost["status"] == "pass" and lost["evidence"]["tokens_counted_by"] == {"usage": lost["evidence"]["completed"]}


def _excess_ms(arrivals: list[float], kill: float) -> float | None:
    """An independent client's view of the crossing: its longest gap after the kill minus its mean gap before."""
    j = next((i for i, t in enumerate(arrivals) if t >= kill), None)
    if j is None or j < 4:
        return None
    stall = max(arrivals[i] - arrivals[i - 1] for i in range(j, len(arrivals)) if arrivals[i - 1] <= kill + 5)
    return (stall - (arrivals[j - 1] - arrivals[0]) / (j - 1)) * 1000


def test_a_killed_worker_s_streams_migrate_nothing_is_lost_and_the_harness_sees_what_a_client_sees(dynamo_cluster):
    mark = dynamo_cluster.log_mark()
    out = kill_under_streams(dynamo_cluster, "dynamo-0", n=6, independent=6)
    for rec in out.records:  # every stream completed with every token: none was cut, none failed
        assert rec is not None and rec.ok and sum(rec.chunk_tokens) == rec.completion_tokens == 400, rec
    assert all(len(a) == 400 for a in out.independent), [len(a) for a in out.independent]
    # round robin put about half of the 12 streams on the victim: each one it held migrated
    assert 1 <= out.migrated <= 12, out.migrated
    log = dynamo_cluster.launcher_log(mark)
    assert "dynamo-0 (pid" in log and "exited with code -9" in log, log
    # acceptance (issue 24): the harness's 6.1.2 excess stall within 2x of what an independent client sees
    # (measured here: largest excess 41-57 ms from the harness, 43-65 ms from the independent client)
    harness = [c[0] - c[1] for r in out.records
               if not isinstance(c := crossing(r, r.anchor.perf_to_wall(out.kill_perf_ns) / 1e9), str)]
    independent = [e for a in out.independent if (e := _excess_ms(a, out.kill_perf_ns / 1e9)) is not None]
    assert harness and independent, (harness, independent)
    assert 0.5 <= max(harness) / max(independent) <= 2.0, (sorted(harness), sorted(independent))


def test_the_fault_suites_judge_migration_on_worker_loss_and_a_hang_fails_6_1_4_naming_the_stall(dynamo_cluster,
                                                                                                  tmp_path):
    """The expected truth on Dynamo (issue 24): SIGKILLed workers' streams migrate (6.1.2 measured from the
    client, beside the frontend's migration counter); an 8 s SIGSTOP is not detected, so clients stall and
    6.1.4 fails naming the hang; nothing is lost in either suite. Last in the module: a hang past Dynamo's
    discovery lease can leave the worker unregistered (a true finding, the rejoin measurement's). One kill and
    one hang of each worker (``--kills=1``; 6.1.2's kills are its own budget's): the shipped three a kind cost
    CI about a minute more for the same findings (issue 34)."""
    reports = tmp_path / "reports"
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/test_item2_hot_migration.py",
                           "suites/test_item4_reschedule.py", "-p", "no:cacheprovider", "--cluster=dynamo-agg",
                           f"--report-dir={reports}", "--live=plain", "--kills=1"],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    data = json.loads((reports / "latest" / "results.json").read_text())
    assert not data["harness_errors"] and not data["revert_failures"], data
    by_item: dict[str, list[dict]] = {}
    for v in data["verdicts"]:
        by_item.setdefault(v["item"], []).append(v)
    [v612], [v614] = by_item["6.1.2"], by_item["6.1.4"]
    # measured from the client: pass or fail, or, where Dynamo's crossing sits at the limit (its idle
    # median has read 33-61 ms against < 50 ms; CI once had 27-51 ms after 16 kills), inconclusive only
    # because the median's interval still straddles the limit once a phase ran its whole budget
    if v612["status"] == "inconclusive":
        spent = [p for p, e in v612["evidence"]["extension"].items() if e["stopped"].startswith("budget spent")]
        assert "straddles" in v612["reason"] and spent, (v612["reason"], v612["evidence"]["extension"])
    else:
        assert v612["status"] in ("pass", "fail"), v612["reason"]
    assert sum(w or 0 for w in v612["evidence"]["migration_counter"]) > 0, v612["evidence"]["migration_counter"]
    assert v614["status"] == "fail" and "worst: hang dynamo-" in v614["reason"], v614["reason"]
    assert v614["evidence"]["longest_stall_s"]["p100"] > 3.0
    _evidence_is_what_it_says(v612, v614)
    assert all(v["status"] == "pass" for v in by_item["nothing-lost"]), [v["reason"] for v in by_item["nothing-lost"]]


def _evidence_is_what_it_says(v612: dict, v614: dict) -> None:
    """Issue 33's evidence rules on Dynamo. 6.1.2: a sample only from a stream that moved, the k largest
    stalls, k = the rise of the ``ongoing_request`` series alone (planted: the counter summed over
    migration_type, ``new_request`` too: the counter named differs and more samples than the ongoing rises).
    6.1.4: the first hang's new request (the open-loop probe's, or a load request sent after the fault and
    served sooner) is served within half the 8 s stop, never queued behind the load's blocked users
    (planted: no probe: +5.4 s was once reported; a later hang may
    follow a hang that cost the other worker its registration, a true finding: then nothing serves new
    requests until the stop ends: +8.06 s measured); every hung mocker's rejoin is not observed, never
    back by health alone (planted: the old rule, back by health: ``observable`` true). Checked on the run
    of 2026-12-06 00:42 (results.json kept): counter rises [2 x9, 4 x2], 26 samples, each naming
    ``migration_type="ongoing_request"``; hangs' new requests newreq-3-0 +0.045 s, newreq-4-33 +8.06 s
    (dynamo-1 out of rotation), load-3239 +1.35 s."""
    rises = [int(round(w)) for w in v612["evidence"]["migration_counter"] if w is not None]
    moved = v612["evidence"]["per_migration"]
    assert moved and all('migration_type="ongoing_request"' in (s["migration"] or {}).get("counter", "")
                         and s["migration"]["k"] in rises for s in moved), (rises, [s["migration"] for s in moved])
    assert len(moved) <= sum(rises), (rises, len(moved))
    hangs = [s for s in v614["evidence"]["samples"] if s["label"].startswith("hang ")]
    assert hangs and all(s["new_request"] is not None for s in hangs), hangs
    # the first success sent after the fault, whoever sent it: the probe's (newreq-...) guarantees one that
    # no blocked user queues; a load request sent after the fault and served sooner counts as well (CI-like
    # run 2026-12-06: load-168 at +0.19 s). Without the probe only queued load requests were left: +5.4 s
    assert hangs[0]["new_request"].startswith(("newreq-", "load-")) and hangs[0]["new_request_s"] < 4.0, hangs[0]
    for r in v614["evidence"]["rejoin"]:
        if r["fault"].startswith("hang "):
            assert not r["observable"] and not r["back"] and "never taken as back by health alone" in r["sentence"], r
