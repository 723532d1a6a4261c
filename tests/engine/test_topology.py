"""Topology lifecycle: the `up` subcommand and the Python API start real processes, report where
they run, change membership without a router restart, and leave nothing behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from harness.engine.pd.router_config import RouterConfig
from harness.engine.pd.topology import Topology
from harness.errors import ConfigError

PRESET = "tiny"


def children_of_this_process() -> set[int]:
    pids: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    return pids


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) != 0


def pid_gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_bad_configuration_is_refused_with_a_fix():
    with pytest.raises(ConfigError, match="at least one prefill"):
        Topology(prefill=0, decode=1)
    with pytest.raises(ConfigError, match="unknown router options"):
        RouterConfig.from_dict({"heartbeat_timeout": 2})
    with pytest.raises(ConfigError, match="must exceed"):
        RouterConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=0.5)
    with pytest.raises(ConfigError, match="unknown transfer options"):
        RouterConfig(transfer={"mode": "layerwise", "retry": 2})
    r = subprocess.run([sys.executable, "-m", "harness", "up", "--router-config", "{not json"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "--router-config" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("started_with_sigint_ignored", [False, True])
def test_up_prints_where_everything_runs_and_ctrl_c_stops_it_all(started_with_sigint_ignored):
    # a shell starts background jobs (`cmd &`) with SIGINT ignored: Ctrl-C must still stop `up`
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if started_with_sigint_ignored else None
    proc = subprocess.Popen([sys.executable, "-m", "harness", "up", "--prefill", "1", "--decode", "1",
                             "--port", "0", "--preset", PRESET], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=ignore)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C" in line:
                break
        out = "".join(lines)
        m = re.search(r"router\s+pid (\d+)\s+api http://([\d.]+):(\d+)/v1", out)
        assert m, out + proc.stderr.read() if proc.poll() is not None else out
        pids = [int(m.group(1))] + [int(p) for p in re.findall(r"(?:prefill|decode)-\d+\s+pid (\d+)", out)]
        host, port = m.group(2), int(m.group(3))
        assert len(pids) == 3
        r = httpx.post(f"http://{host}:{port}/v1/completions",
                       json={"prompt": "up and running", "max_tokens": 3, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    assert all(pid_gone(pid) for pid in pids), "a child of `up` outlived it"
    assert port_is_free(host, port)


@pytest.mark.slow
def test_membership_changes_without_restarting_the_router():
    before = children_of_this_process()
    topo = Topology(prefill=1, decode=1, preset=PRESET)
    with topo:
        router_pid = topo.router_pid
        old = topo.pid("decode-0")
        assert {w["id"]: w["role"] for w in topo.workers()} == {"prefill-0": "prefill", "decode-0": "decode"}
        assert all(w["kv_blocks_total"] > 0 and w["health"] == "healthy" for w in topo.workers())

        new_id = topo.add_worker("decode")
        assert new_id == "decode-1"
        topo.kill("decode-0")
        assert topo.wait_health("decode-0", "dead")["down_reason"] == "connection_lost"
        assert {w["id"]: w["health"] for w in topo.workers()}["decode-1"] == "healthy"

        new_pid = topo.restart("decode-0")
        assert new_pid != old and pid_gone(old)
        assert {w["id"]: w["health"] for w in topo.workers()}["decode-0"] == "healthy"
        assert any(e["type"] == "worker_up" and e["worker"] == "decode-0" and e["rejoined"] for e in topo.events())
        assert topo.router_pid == router_pid
        r = httpx.post(f"{topo.base_url}/completions", json={"prompt": "after churn", "max_tokens": 2,
                                                             "temperature": 0}, timeout=60)
        assert r.status_code == 200
        api = topo.api_url.removeprefix("http://").split(":")
    assert children_of_this_process() == before, "a topology process was left running or unreaped"
    assert port_is_free(api[0], int(api[1]))
