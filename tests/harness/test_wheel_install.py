"""`pip install` from a built wheel, outside the checkout, as a user who only attaches to a cluster:
a fresh virtualenv without torch (the base dependencies from the package index; about 45 s here),
the suites and the default checklist shipped in the package, `--cluster NAME` found in ./clusters/
of the current directory.

- From an empty folder holding only `clusters/prod-a.yaml`, `harness run --dry-run` runs the shipped
  suites: the plan (each fault, target, hold time, refused by prod-a's safety settings) on stdout,
  exit 2, and nothing contacted: the file's every URL and SSH port point at listening sockets this
  test holds and never answers, and none of them saw a connection; no key file, no API-key variable.
- The user's own copy of the suites dry-runs against a cluster file naming a real PD topology
  (`python -m harness up`, started from this checkout's environment, which has the engine extra)
  with an admin API: the plan names its targets by role, read from nothing.

The wheel is built and installed into a new virtualenv once per run of this module (nothing is
reused between runs: a packaging mistake cannot hide behind an older install)."""

import os
import re
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


def _user_env(home: Path) -> dict:
    """The environment of a user of the installed package: not this checkout's, no API key, a home
    folder without ~/.ssh."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PROD_A_API_KEY")}
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), HARNESS_STATE_DIR=str(home / "state"))
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh virtualenv holding the wheel built from this tree (base install: no extras)."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = _user_env(tmp / "home")
    wheels, src = tmp / "wheels", tmp / "src"
    # build from a clean copy: an in-tree build/ folder could carry stale files into the wheel
    shutil.copytree(ROOT, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "build", "dist", "reports", "state", "*.egg-info", "__pycache__", ".pytest_cache"))
    built = _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-w", wheels, "-q"],
                 cwd=src, env=env, timeout=300)
    assert built.returncode == 0, built.stderr
    wheel = next(wheels.glob("harness-*.whl"))
    venv_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(venv_dir)
    py = venv_dir / "bin" / "python"
    installed = _run([py, "-m", "pip", "install", "-q", wheel], cwd=tmp, env=env, timeout=900)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return venv_dir


class Trap:
    """A listening socket that never answers: a connection to it completes in the kernel and waits
    in the backlog, so :meth:`connections` counts every attempt made while it was held."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]

    def connections(self) -> int:
        self.sock.setblocking(False)
        count = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return count
            conn.close()
            count += 1


def _prod_a_pointing_at(http: Trap, ssh: Trap) -> str:
    """The shipped prod-a.yaml (production: true, allowed_faults: [], key files under ~/.ssh), each
    address moved to this machine's traps."""
    text = (ROOT / "clusters" / "prod-a.yaml").read_text()
    text = re.sub(r"http://10\.30\.\d+\.\d+:8000", f"http://127.0.0.1:{http.port}", text)
    text = re.sub(r"address: 10\.30\.\d+\.\d+", "address: 127.0.0.1", text)
    text = text.replace("port: 22,", f"port: {ssh.port},")
    assert "10.30." not in text and text.count(str(ssh.port)) == 2
    return text


def test_attach_only_user_dry_runs_the_shipped_suites_from_an_empty_folder_contacting_nothing(installed, tmp_path):
    py, harness = installed / "bin" / "python", installed / "bin" / "harness"
    env = _user_env(tmp_path / "home")
    http, ssh = Trap(), Trap()
    work = tmp_path / "empty"
    (work / "clusters").mkdir(parents=True)
    (work / "clusters" / "prod-a.yaml").write_text(_prod_a_pointing_at(http, ssh))

    probe = _run([py, "-c", "import importlib.util as u, harness.suites as s; print(s.__file__); "
                            "print(u.find_spec('torch') is None)"], cwd=work, env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr
    where, no_torch = probe.stdout.splitlines()
    assert where.startswith(str(installed)) and no_torch == "True"  # the installed copy; attaching needs no torch

    run = _run([harness, "run", "--cluster=prod-a", "--dry-run", "--live=off"], cwd=work, env=env, timeout=300)
    out = run.stdout
    assert run.returncode == 2, (out + run.stderr)[-4000:]  # inconclusive: a dry run proves nothing
    assert f"cluster prod-a (external, engine vllm, {work / 'clusters' / 'prod-a.yaml'})" in out, out[-4000:]
    assert "every planned fault is refused" in out
    kills = [line for line in out.splitlines() if line.startswith("[dry-run] process_")]
    assert len(kills) == 6 and all("REFUSED by safety" in line and "hold " in line for line in kills), kills
    assert "process_kill 1/6: kill -s KILL <pid> of one aggregated worker (vllm-0 on gpu-node-0" in out
    assert "a real run would stop here" in out and "hosts[0].ssh.key_file" in out  # said, not needed
    assert "$PROD_A_API_KEY" in out
    assert "suites/test_item4_reschedule.py" in out  # node ids as in a checkout
    # issue 37: the dry run leaves the folder as it found it (only clusters/ there, no reports/, state/,
    # .pytest_cache/) and says so
    assert sorted(p.name for p in work.iterdir()) == ["clusters"], sorted(work.iterdir())
    assert "dry run: no report written, nothing left here" in out
    assert not list(installed.rglob(".pytest_cache"))  # nothing written into the installed package
    assert (http.connections(), ssh.connections()) == (0, 0)  # no API, metrics, worker or SSH contact

    # the same checks as a run: a real run stops on the missing key file, a dry run does not
    check = _run([py, "-m", "harness", "schema", "--check", "prod-a", "local"], cwd=work, env=env, timeout=120)
    assert check.returncode == 3 and "hosts[0].ssh.key_file" in check.stderr, check.stderr
    assert "local.yaml: ok" in check.stdout  # every file is checked
    check = _run([py, "-m", "harness", "schema", "--dry-run", "--check", "prod-a"], cwd=work, env=env, timeout=120)
    assert check.returncode == 0, check.stderr
    real = _run([harness, "run", "--cluster=prod-a", "test_62_slo.py"], cwd=work, env=env, timeout=300)
    assert real.returncode == 3 and real.stdout.count("hosts[0].ssh.key_file") == 1, real.stdout[-3000:]
    assert (http.connections(), ssh.connections()) == (0, 0)  # it stopped before contacting anything
    schema = subprocess.run(f"{py} -m harness schema | head -1", shell=True, cwd=work, env=env,
                            capture_output=True, text=True, timeout=120)
    assert schema.stdout == "{\n" and "Traceback" not in schema.stderr, schema.stderr
    # pytest's own way in collects the same shipped suites
    pyargs = _run([py, "-m", "pytest", "--pyargs", "harness.suites", "--collect-only", "-q", "-p", "no:cacheprovider"],
                  cwd=work, env=env, timeout=300)
    assert "9 tests collected" in pyargs.stdout, pyargs.stdout[-3000:]


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


def test_users_own_copy_of_the_suites_dry_runs_against_a_cluster_file_in_cwd(installed, tmp_path, pd_cluster):
    py = installed / "bin" / "python"
    env = _user_env(tmp_path / "home")
    work = tmp_path / "my-repo"  # the user's own repository: their suites copy and their cluster file
    shutil.copytree(ROOT / "suites", work / "suites", ignore=shutil.ignore_patterns("__pycache__"))
    (work / "clusters").mkdir()
    api = f"http://127.0.0.1:{pd_cluster}"
    (work / "clusters" / "mine.yaml").write_text(yaml.safe_dump({
        "name": "mine", "kind": "external", "description": "attached to by a wheel install, dry run only",
        "endpoints": {"api": f"{api}/v1", "metrics": f"{api}/metrics", "admin": api}}))

    probe = _run([py, "-c", "import harness, harness.plugin; from harness.checklists import Checklist; "
                            "print(harness.__file__); print(Checklist.load().item('6.1.1').title)"],
                 cwd=work, env=env, timeout=120)
    assert probe.returncode == 0, probe.stderr
    where, title = probe.stdout.splitlines()
    assert str(installed) in where and str(ROOT) not in where  # the installed copy, not the checkout
    assert "KV" in title  # the default checklist shipped inside the package

    run = _run([py, "-m", "pytest", "suites/", "--dry-run", "--cluster", "mine", "-p", "no:cacheprovider"],
               cwd=work, env=env, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 2, out[-4000:]  # inconclusive: a dry run proves nothing
    assert f"attaching to cluster mine (external, {work / 'clusters' / 'mine.yaml'})" in out
    # a dry run reads nothing from the cluster, its admin API included: the targets are named by role
    assert (f"[dry-run] hbm_fill on each decode worker: filled in steps to the engine's Level 2 then Level 3 KV-use "
            f"thresholds; the targets come from {api}/admin/workers, read when a real run starts, not by a dry run "
            "[allowed by safety]") in out, out[-4000:]
    assert "[dry-run] ecc_poison on each healthy decode worker" in out
    # an attached topology with an admin API but no `workers:` inventory cannot bring a killed worker
    # back: 6.1.4 is not judged there, and says why (harness/checks/capabilities.py)
    assert "needs restartable_workers" in out and "[dry-run] process_kill" not in out, out[-4000:]
    assert "Unknown pytest.mark" not in out  # the plugin registers the suites' marks
    # issue 37: the dry run leaves the user's repository as it found it (its clusters/ and suites/, no
    # reports/ or state/; pytest's cache is off here) and says so
    assert sorted(p.name for p in work.iterdir()) == ["clusters", "suites"], sorted(work.iterdir())
    assert "dry run: no report written, nothing left here" in out
