"""A pd-nixl launcher whose UCX cannot start stops with one named error and the fix, exits non-zero and
leaves nothing behind (issue 35 item 5; clusters/vllm/nixl_errors.py, docs/vllm.md "When pd-nixl does
not start"). The cheapest real failure is planted: ``--ucx-tls bogus``, a transport UCX does not have, so
each instance's NIXL agent fails to make its UCX backend about 20 s into its start.

Slow (two vLLM starts that fail) and root (the emulated hosts). Its own launcher, not the pool's: the
cluster never becomes ready. The classification of the other failures (nixl missing, no NIXL plugin, a
taken side-channel port, a handshake timeout) is tested on their real logs in test_nixl_error_lines.py.
"""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from harness.fabric.builder import fabric_unavailable_reason, leftovers
from tests.realengine.conftest import REPO, pgrep

pytestmark = [pytest.mark.slow, pytest.mark.root, pytest.mark.timeout(900)]
EXIT_BOUND_S = 300   # the launcher's own start-up timeout is 600 s; the failure shows after about 20 s here


@pytest.fixture(scope="module", autouse=True)
def _needs_root():
    if reason := fabric_unavailable_reason():
        pytest.skip(reason)


def _ours() -> list[int]:
    """Any process of a pd-nixl instance or router (titles from VLLM_PROCESS_NAME_PREFIX, ports 840x)."""
    return (pgrep("^prefill-0::") + pgrep("^decode-0::") + pgrep(r"vllm.entrypoints.openai.api_server .*--port 840[12]")
            + pgrep("vllm-router --host 127.0.0.1 --port 8400"))


def test_a_bogus_ucx_tls_stops_the_launcher_with_the_named_error_and_nothing_left(require_vllm, tmp_path):
    """Planted defects it catches: the launcher's error not naming the UCX transport, vLLM's line or the
    fix (the launcher before this change said only "prefill-0 exited with code 1 while starting: see
    .../prefill-0.log"), a traceback on the launcher's output, exit code 0 on the error path, and a
    pvn- namespace, link or vLLM process left after the error."""
    assert not leftovers(prefix="pvn-") and not _ours(), "a pd-nixl cluster is already up: stop it first"
    log_path = tmp_path / "launcher.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "clusters.vllm.launch", "pd-nixl", "--venv", str(require_vllm),
             "--run-dir", str(tmp_path / "run"), "--ucx-tls", "bogus"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        rc = launcher.wait(EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        launcher.terminate()
        launcher.wait(120)
        pytest.fail(f"the launcher did not stop within {EXIT_BOUND_S} s:\n{log_path.read_text()[-3000:]}")
    took = time.monotonic() - t0
    out = log_path.read_text(errors="replace")
    left_ns, left_procs = leftovers(prefix="pvn-"), _ours()
    for pid in left_procs:   # nothing may outlive a failing test either
        subprocess.run(["kill", "-9", str(pid)], check=False)
    assert rc == 3, out[-3000:]
    errors = [line for line in out.splitlines() if "] error: " in line]
    assert len(errors) == 1, out[-3000:]
    error = errors[0]
    assert re.search(r"error: (prefill|decode)-0: UCX transport failed: vLLM's log says \".*"
                     r"transport 'bogus' is not available", error), error
    assert re.search(r"\(log \S+/run/(prefill|decode)-0\.log\)", error), error
    assert "Fix: UCX_TLS=bogus" in error and "must include tcp" in error, error
    assert "Traceback" not in out, out[-3000:]
    assert not left_ns, f"left behind: {left_ns}"
    assert not left_procs, f"vLLM processes left behind: {left_procs}"
    print(f"launcher exited {rc} after {took:.0f} s: {error}")
