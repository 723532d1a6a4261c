"""The black-box fault loop waits for each victim to be back in the cluster's traffic before the
next fault, and stops, saying why, when it is not. Real supervised worker processes (a shell loop
restarting a small HTTP server that writes its pid file and serves /health, /metrics and completions),
a real fault runner and ledger; once ``serves`` exists the worker answers a completion sent straight
to it with a token and its prompt-token counter rises by itself (standing in for a router that sends
it requests); without it, completions get 503 and the counter stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.checklists import Checklist
from harness.cluster import ClusterHandle
from harness.clusterfile.load import parse_cluster
from harness.faults import FaultRunner, Ledger
from harness.scenarios import blackbox_faults as blackbox
from harness.probes.workers.inventory import wait_healthy
from tests.faults.conftest import free_port

pytestmark = pytest.mark.slow  # real processes restarted by a supervisor

WORKER = textwrap.dedent('''
    import os, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, home = int(sys.argv[1]), sys.argv[2]
    started = time.time()

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/metrics":
                served = os.path.exists(os.path.join(home, "serves"))
                body = f"vllm:prompt_tokens_total {int((time.time() - started) * 100) if served else 0}\\n"
            else:
                body = "ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def do_POST(self):  # a completion: one token once it serves, else 503 (no token)
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if not os.path.exists(os.path.join(home, "serves")):
                self.send_response(503)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            body = ('data: {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}\\n\\n'
                    "data: [DONE]\\n\\n").encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", port), H)
    with open(os.path.join(home, f"{port}.pid.tmp"), "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(os.path.join(home, f"{port}.pid.tmp"), os.path.join(home, f"{port}.pid"))
    server.serve_forever()
''')


@pytest.fixture
def two_workers(tmp_path: Path):
    """Two supervised workers: (cluster handle, home dir); every process is killed and reaped after."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    ports = [free_port(), free_port()]
    loops = [subprocess.Popen(["bash", "-c", f"while true; do {sys.executable} {script} {p} {tmp_path}; done"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
             for p in ports]
    try:
        for p in ports:
            assert wait_healthy(f"http://127.0.0.1:{p}/health", 30) is not None
        workers = [{"name": f"w{i}", "role": "aggregated", "host": "localhost", "api": f"http://127.0.0.1:{p}",
                    "health": f"http://127.0.0.1:{p}/health", "metrics": f"http://127.0.0.1:{p}/metrics",
                    "process": {"pid_file": str(tmp_path / f"{p}.pid")}, "supervised": True}
                   for i, p in enumerate(ports)]
        spec = parse_cluster({"version": 2, "kind": "external", "engine": "vllm", "model": "m",   # API: a balancer
                              "endpoints": {"api": f"http://127.0.0.1:{free_port()}"}, "workers": workers,
                              "hosts": [{"name": "localhost", "address": "127.0.0.1", "roles": ["decode"]}],
                              "safety": {"production": False, "allowed_faults": "all"}}, source="two-workers")
        yield ClusterHandle(spec, Checklist.load(), spec.endpoints.api, None, None), tmp_path
    finally:
        for loop in loops:
            os.killpg(loop.pid, signal.SIGKILL)  # the loop and the server it runs now
            loop.wait()


STEPS = [("process_kill", "aggregated"), ("process_hang", "aggregated")]


def test_the_next_fault_waits_until_the_restarted_worker_carries_traffic(two_workers):
    """Planted defect (run once): no probe sent straight to a worker with an API of its own (``own_api``
    always False): the kill's rejoin is then seen on its counter, not served, and this fails."""
    cluster, home = two_workers
    (home / "serves").write_text("")
    with FaultRunner(Ledger.for_cluster("two-workers", home / "state"), handle_signals=False) as runner:
        done = blackbox.run_faults(cluster, runner, STEPS, seed=0, observe_s=0.2, hang_s=0.2, rejoin_limit_s=30.0)
    assert [f.label.split()[0] for f in done.faults] == ["kill", "hang"] and done.stopped is None
    (kill_label, kill_back), (_, hang_back) = done.rejoins
    assert kill_label == done.faults[0].label and kill_back.back and hang_back.back
    assert kill_back.seen_by.startswith("vllm:prompt_tokens on http://127.0.0.1:")
    # each served a completion sent straight to it after its revert, then the counter rose
    assert kill_back.served_how.startswith("a request sent straight to ") and hang_back.served_how is not None
    assert kill_back.traffic_wall >= kill_back.served_wall and hang_back.traffic_wall >= hang_back.served_wall
    # the hang came after the killed worker was seen serving, not merely healthy
    assert done.faults[1].wall > kill_back.serving_wall > kill_back.healthy_wall
    reverted = [r.output for r in runner.records if r.action.value == "verify_reverted"]
    assert "is healthy again; the cluster took " in reverted[0] and done.restart_s[0] >= 0


def test_a_worker_never_taken_back_stops_the_plan_and_says_why(two_workers, monkeypatch):
    """Planted defect (run once): ``own_api`` always False: the worker whose completions get 503 is no
    longer probed, the sentence and ``probes`` differ, and this fails; a loop that injects the next fault
    once the victim is healthy fails on ``stopped``."""
    cluster, home = two_workers
    monkeypatch.setattr(blackbox, "REJOIN_WATCH_MAX_S", 1.5)   # watched past the 0.5 s limit, then given up
    with FaultRunner(Ledger.for_cluster("two-workers", home / "state"), handle_signals=False) as runner:
        done = blackbox.run_faults(cluster, runner, STEPS, seed=0, observe_s=0.2, hang_s=0.2, rejoin_limit_s=0.5)
        assert not runner.ledger.outstanding(include_live_owners=True)   # the revert itself succeeded
    [(label, rejoin)] = done.rejoins
    assert len(done.faults) == 1 and not rejoin.back and rejoin.kept_out_s >= 1.5
    victim = done.faults[0].victims[0]
    assert done.stopped == (f"stopped after {label}: {victim} served no request sent after the revert for "
                            f"{rejoin.watched_s:.0f}+ s after it was healthy; not injected: hang aggregated (they "
                            "would fault a cluster that is not whole)")
    assert rejoin.probes >= 1 and "HTTP503" in " ".join(rejoin.problems)
