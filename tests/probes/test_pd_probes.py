"""Every probe at once against a real PD topology (router + 1 prefill + 2 decode, tiny preset)
while a decode worker is killed under load: records, admin snapshots and events, scraped
series, and one timeline that puts the kill, the router's reaction and the requests in order."""

import signal
import threading
import time

import pytest

from harness.engine.pd.topology import Topology
from harness.engine.admin.client import AdminClient, WorkerPoller
from harness.probes.client.analysis import summarize
from harness.probes.loadgen.load import LoadRunner
from harness.probes.metrics.prometheus import PrometheusScraper
from harness.probes.client.streaming import CompletionRequest, StreamingClient
from harness.probes.client.timeline import merge_timeline
from harness.probes.loadgen.workload import LoadProfile

pytestmark = pytest.mark.slow


def test_probes_observe_a_decode_worker_kill_under_load(tmp_path):
    # 300 tokens: a request still runs on the victim when it is killed (48 could end in between)
    profile = LoadProfile(mode="constant", rate=4.0, users=4, duration_s=4.0, max_tokens=300, seed=5)
    with Topology(prefill=1, decode=2, preset="tiny", log_dir=tmp_path / "pd") as topo:
        admin = AdminClient(topo.admin_url)
        with PrometheusScraper(topo.api_url + "/metrics", interval_s=0.5) as scraper, \
                WorkerPoller(admin, interval_s=0.25) as poller, \
                LoadRunner(topo.api_url, profile, output_dir=tmp_path / "load") as run:
            deadline = time.monotonic() + 60
            busy = []
            while not busy:  # kill a decode worker while it holds requests
                assert run.running and time.monotonic() < deadline, run.log_tail()
                busy = [w for w in admin.workers() if w["role"] == "decode" and w["active_requests"] > 0]
                time.sleep(0.05)
            victim = busy[0]["id"]
            killed_wall = time.time_ns()
            topo.kill(victim, signal.SIGKILL)
            records = run.wait()
        events = admin.events()
        admin.close()

    # requests: every one ended; the victim's requests were resumed on the other decode worker
    assert records and {r.status for r in records} <= {"ok", "stream_error"}
    resumed = [r for r in records if victim in r.served_by and len(r.served_by) > 1]
    down = [e for e in events if e["type"] == "worker_down" and e["worker"] == victim]
    assert len(down) == 1
    affected = {a.split("#")[0] for a in down[0]["affected"]}
    assert affected and affected <= {r.response_id for r in records}
    assert {r.response_id for r in resumed} <= affected
    assert summarize(records)["requests"] == len(records)

    # admin snapshots: the victim was healthy before the kill and gone or down after it
    before = [s for s in poller.snapshots if s.t_wall_ns < killed_wall and s.workers]
    after = [s for s in poller.snapshots if s.t_wall_ns > down[0]["wall_time"] * 1e9 + 0.5e9 and s.workers]
    assert any(w["id"] == victim and w["health"] == "healthy" for w in before[-1].workers)
    assert after and all(w["health"] != "healthy" for s in after for w in s.workers if w["id"] == victim)

    # scraped series: KV bytes moved over the fabric, and the victim's up gauge left the table
    moved = scraper.series("kv_transfer_bytes")["value"]
    assert moved.iloc[-1] > moved.iloc[0] >= 0
    assert scraper.series("workers_up", worker=victim)["value"].iloc[0] == 1.0

    # timeline: the kill's worker_down comes after the first request and before the resumptions
    tl = merge_timeline(events=events, records=records)
    kinds = [e["kind"] for e in tl]
    i_down = next(i for i, e in enumerate(tl) if e["kind"] == "worker_down" and e["detail"]["worker"] == victim)
    assert kinds.index("request_ok") < i_down
    assert all(i > i_down for i, e in enumerate(tl) if e["kind"] == "resumed")
    assert [e["t_wall_ns"] for e in tl] == sorted(e["t_wall_ns"] for e in tl)
    # the router's monotonic time, placed on this process's wall clock, is after the kill
    # (10 ms allows for reading the two clocks back to back)
    assert tl[i_down]["t_wall_ns"] >= killed_wall - 10_000_000


def test_a_request_cut_off_by_a_kill_is_recorded_with_the_servers_error(tmp_path):
    """With rescheduling off (the router's sabotage knob) a killed decode worker's request ends
    with the server's error, and the record says so (never ok, never a silent end)."""
    with Topology(prefill=1, decode=1, preset="tiny", router_config={"reschedule_enabled": False},
                  log_dir=tmp_path / "pd") as topo:
        admin = AdminClient(topo.admin_url)
        decode = next(w["id"] for w in admin.workers() if w["role"] == "decode")

        def kill_when_busy():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if any(w["id"] == decode and w["active_requests"] for w in admin.workers()):
                    topo.kill(decode, signal.SIGKILL)
                    return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        with StreamingClient(topo.api_url, read_timeout_s=60) as client:
            r = client.send(CompletionRequest("cut me off", max_tokens=900, ignore_eos=True))
        killer.join()
        admin.close()
    # killed after its first token: an SSE error mid-stream; before it: the server answers an HTTP error
    expected = "stream_error" if r.token_ids else "http_error"
    assert r.status == expected, (r.status, r.error_class, r.error_message, len(r.token_ids))
    assert r.error_message and r.error_class not in ("IncompleteStream", "MalformedSSE")
    assert len(r.token_ids) < 900 and r.served_by in ([], [decode])
