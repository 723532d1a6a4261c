"""`pip install` from a built wheel, outside the checkout, as a user who only attaches to a cluster:
a fresh virtualenv (no torch, deps from the registry), the default checklist loaded from the
package, `--cluster NAME` found in ./clusters/ of the current directory, and `pytest suites/
--dry-run` printing every fault plan and exiting 2 (inconclusive: nothing was injected).

The cluster attached to is a real PD topology (`python -m harness up`) started from this
checkout's environment, which has the engine extra."""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import venv
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list, *, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def pd_cluster(tmp_path):
    """A router, one prefill and two decode workers; yields the API port once every worker is healthy."""
    port = _free_port()
    log = open(tmp_path / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "harness", "up", "--prefill", "1", "--decode", "2",
                             "--port", str(port), "--log-dir", str(tmp_path / "up-logs")], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "up.log").read_text()[-2000:]
            try:  # /health answers before the workers have joined: wait for all three
                workers = httpx.get(f"http://127.0.0.1:{port}/admin/workers", timeout=2).json()
                if len(workers) == 3 and all(w.get("health") == "healthy" for w in workers):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, "the PD topology did not come up within 180 s"
            time.sleep(0.5)
        yield port
    finally:
        proc.send_signal(signal.SIGINT)  # `harness up` stops and reaps its workers on Ctrl-C
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_wheel_in_fresh_venv_dry_runs_the_suites_against_a_cluster_file_in_cwd(tmp_path, pd_cluster):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["HARNESS_STATE_DIR"] = str(tmp_path / "state")
    wheels, src = tmp_path / "wheels", tmp_path / "src"
    # build from a clean copy: an in-tree build/ folder could carry stale files into the wheel
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "reports", "state", "*.egg-info", "__pycache__", ".pytest_cache"))
    built = _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-w", wheels, "-q"],
                 cwd=src, env=env, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next(wheels.glob("harness-*.whl"))

    venv_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(venv_dir)
    py = venv_dir / "bin" / "python"
    installed = _run([py, "-m", "pip", "install", "-q", wheel], cwd=tmp_path, env=env, timeout=900)
    assert installed.returncode == 0, installed.stderr[-3000:]

    work = tmp_path / "my-repo"  # the user's own repository: their suites copy and their cluster file
    shutil.copytree(ROOT / "suites", work / "suites", ignore=shutil.ignore_patterns("__pycache__"))
    (work / "clusters").mkdir()
    api = f"http://127.0.0.1:{pd_cluster}"
    (work / "clusters" / "mine.yaml").write_text(yaml.safe_dump({
        "name": "mine", "kind": "external", "description": "attached to by a wheel install, dry run only",
        "endpoints": {"api": f"{api}/v1", "metrics": f"{api}/metrics", "admin": api}}))

    probe = _run([py, "-c", "import importlib.util as u, harness, harness.plugin; from harness.checks.thresholds "
                            "import Checklist; print(harness.__file__); print(u.find_spec('torch') is None); "
                            "print(Checklist.load().item('6.1.1').title)"], cwd=work, env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr
    where, no_torch, title = probe.stdout.splitlines()
    assert str(venv_dir) in where and str(ROOT) not in where  # the installed copy, not the checkout
    assert no_torch == "True"  # attaching needs no torch
    assert "KV" in title  # the default checklist shipped inside the package

    run = _run([py, "-m", "pytest", "suites/", "--dry-run", "--cluster", "mine", "-p", "no:cacheprovider"],
               cwd=work, env=env, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-4000:]  # inconclusive: a dry run proves nothing
    assert f"attaching to cluster mine (external, {work / 'clusters' / 'mine.yaml'})" in out
    assert "[dry-run] hbm_fill decode-0" in out, out[-4000:]
    # an attached topology with an admin API but no `workers:` inventory cannot bring a killed worker
    # back: 6.1.4 is not judged there, and says why (harness/checks/capabilities.py)
    assert "needs restartable_workers" in out and "[dry-run] process_kill" not in out, out[-4000:]
    assert "Unknown pytest.mark" not in out  # the plugin registers the suites' marks
    assert (work / "reports" / "latest" / "report.html").is_file()
