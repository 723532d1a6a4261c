"""The suites ship in the package (harness/suites); `suites/` in the checkout links to them.
`harness run` runs them from any directory with the checkout's node ids; `pytest suites/` is
unchanged (each suite collected once, file and -k selection). The dry run of prod-a from a folder
holding only its cluster file: the plan on stdout, each line on its own, refused by safety."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli_run import pytest_args, suites_dir
from harness.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SUITES = sorted(p.name for p in (ROOT / "harness" / "suites").glob("test_*.py"))


def _env(tmp_path: Path) -> dict:
    home = tmp_path / "home"  # no ~/.ssh: the cluster file's key files do not exist
    home.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PROD_A_API_KEY"}
    env.update(HOME=str(home), HARNESS_STATE_DIR=str(tmp_path / "state"), PYTHONPATH=str(ROOT))
    return env


def _collected(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stdout.splitlines() if "::" in line and " " not in line]


def test_the_suites_folder_is_the_package_folder():
    assert (ROOT / "suites").resolve() == suites_dir() == (ROOT / "harness" / "suites")
    assert len(SUITES) == 9   # the eight Section 6 suites and the soak


def test_run_arguments_select_shipped_suites_and_keep_the_checkout_node_ids(tmp_path):
    args = pytest_args(["--cluster=prod-a"], cwd=tmp_path)
    assert args[:4] == ["--rootdir", str(suites_dir().parent), "-o", f"cache_dir={tmp_path / '.pytest_cache'}"]
    assert args[-2:] == ["--cluster=prod-a", str(suites_dir())]
    dry = pytest_args(["--cluster=prod-a", "--dry-run"], cwd=tmp_path)   # a dry run writes no cache (issue 37)
    assert dry[:4] == ["--rootdir", str(suites_dir().parent), "-p", "no:cacheprovider"]
    assert dry[-3:] == ["--cluster=prod-a", "--dry-run", str(suites_dir())]
    picked = pytest_args(["-p", "no:cacheprovider", "suites/test_62_slo.py::test_x", "test_nic_flap.py"], cwd=tmp_path)
    assert "cache_dir" not in " ".join(picked)
    assert picked[-2:] == [f"{suites_dir() / 'test_62_slo.py'}::test_x", str(suites_dir() / "test_nic_flap.py")]
    with pytest.raises(ConfigError, match="no shipped suite named test_nope.py.*test_62_slo.py"):
        pytest_args(["test_nope.py"], cwd=tmp_path)


@pytest.mark.slow  # pytest subprocesses
def test_each_suite_is_collected_once_with_the_same_node_id_from_the_checkout_and_from_harness_run(tmp_path):
    reports = f"--report-dir={tmp_path / 'reports'}"
    checkout = subprocess.run([sys.executable, "-m", "pytest", "suites/", "--collect-only", "-q", "-p",
                               "no:cacheprovider", reports], cwd=ROOT, capture_output=True, text=True, timeout=300)
    ids = _collected(checkout)
    assert sorted(i.split("::")[0] for i in ids) == [f"suites/{name}" for name in SUITES], checkout.stdout[-2000:]
    elsewhere = subprocess.run([sys.executable, "-m", "harness", "run", "--collect-only", "-q", reports],
                               cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert _collected(elsewhere) == ids, elsewhere.stdout[-2000:] + elsewhere.stderr[-2000:]
    # a bare `pytest` in the checkout does not collect harness/suites a second time
    bare = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           reports, "-k", "dashboard_targets"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert _collected(bare) == ["suites/test_62_slo.py::test_ttft_and_tpot_meet_the_dashboard_targets"], \
        bare.stdout[-2000:]
    one = subprocess.run([sys.executable, "-m", "pytest", "suites/test_62_slo.py", "--collect-only", "-q", "-p",
                          "no:cacheprovider", reports], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert _collected(one) == ["suites/test_62_slo.py::test_ttft_and_tpot_meet_the_dashboard_targets"]


@pytest.mark.slow  # a pytest subprocess
def test_dry_run_of_prod_a_prints_its_plan_refused_by_safety_and_contacts_nothing(tmp_path):
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "prod-a.yaml").write_text((ROOT / "clusters" / "prod-a.yaml").read_text())
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--cluster=prod-a", "--dry-run", "--live=plain"],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 2, out[-4000:] + proc.stderr[-2000:]
    lines = out.splitlines()
    plan = [line for line in lines if line.startswith("[dry-run] ")]
    assert plan[1] == ("[dry-run] safety: production: true, allowed_faults: []: every planned fault is refused (a "
                       "real run records the items that need one inconclusive and injects nothing)")
    faults = [line for line in plan if line.startswith(("[dry-run] process_kill", "[dry-run] process_hang"))]
    assert len(faults) == 6 and all(line.endswith("is refused)]") for line in faults), faults
    assert "hold 5 s" in faults[0] and "hold 8 s" in faults[-1] and "vllm-0 on gpu-node-0" in faults[0]
    assert out.count("[dry-run]") == len(plan)  # every plan line starts a line: none glued to progress output
    assert any("a real run would stop here" in line and "hosts[0].ssh.key_file" in line for line in plan)
    assert "$PROD_A_API_KEY" in out and "cluster prod-a: dry run, http://10.30.0.10:8000 not contacted" in out
    assert "6.1.4 dry run: 6 faults planned, none injected (6 refused by the cluster's safety settings)" in out
    # issue 37: a dry run leaves the folder as it was (no reports/, state/ or .pytest_cache/) and says so;
    # planted: the report, the recovery's ledger lock or pytest's cache written as a real run writes them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clusters", "home"], sorted(tmp_path.iterdir())  # home: _env's
    assert "dry run: no report written, nothing left here" in out


@pytest.mark.slow  # a pytest subprocess
def test_a_run_stops_on_the_missing_key_file_saying_so_once(tmp_path):
    (tmp_path / "clusters").mkdir()
    (tmp_path / "clusters" / "prod-a.yaml").write_text((ROOT / "clusters" / "prod-a.yaml").read_text())
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--cluster=prod-a", "test_62_slo.py", "-p",
                           "no:cacheprovider"], cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    # every problem named at once (issue 37), each once: both hosts' key files, their known_hosts, the
    # API-key variable (planted: the error printed twice, or one problem per try)
    assert out.count("problems before a run can start") == 1, out[-3000:]
    for field in ("hosts[0].ssh.key_file", "hosts[1].ssh.key_file", "auth.api_key_env"):
        assert out.count(f"field `{field}`") == 1, (field, out[-3000:])
    assert "harness: exit 3 (the cluster file error above)" in out


@pytest.mark.slow  # pytest subprocesses
def test_harness_run_usage_errors_exit_3_with_their_message(tmp_path):
    """pytest exits 4, this harness's "a revert failed", on a usage error. Planted defect: `harness
    run` exec'ing plain `python -m pytest` (no UsageErrorsExit3) exits 4 on ``--maxfail=x``, found
    before any plugin loads (checked); without harness/plugin.py's trial parse ``--clustr=x`` does."""
    cases = {"--clustr=x": "harness run: error: unrecognized arguments: --clustr=x",
             "--maxfail=x": "harness run: error: argument --maxfail: invalid int value: 'x'",
             "--rootdir=/no/such/dir": "Directory '/no/such/dir' not found"}
    for arg, message in cases.items():
        proc = subprocess.run([sys.executable, "-m", "harness", "run", "--collect-only", arg], cwd=tmp_path,
                              env=_env(tmp_path), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 3, (arg, proc.stdout[-2000:], proc.stderr[-2000:])
        assert message in proc.stderr and "harness: exit 3 (pytest usage error" in proc.stderr, proc.stderr
        # the option meant, for a typo only (planted: UsageErrorsExit3 not passing its parser's options)
        assert ("harness: --clustr: did you mean --cluster?" in proc.stderr) == (arg == "--clustr=x"), proc.stderr
    assert not (tmp_path / "reports").exists()


@pytest.mark.slow  # pytest subprocesses
def test_harness_run_help_and_version_exit_0(tmp_path):
    """UsageErrorsExit3 wraps pytest's command-line parse: --help and --version must still exit 0
    with their output. Planted defect: the wrapper turning every SystemExit of the parse (or the
    trial parse of harness/plugin.py) into 3."""
    for args, want in ((["--help"], "usage: harness run [options]"), (["--version"], "pytest ")):
        proc = subprocess.run([sys.executable, "-m", "harness", "run", *args], cwd=tmp_path, env=_env(tmp_path),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
        assert want in proc.stdout + proc.stderr and "harness: exit" not in proc.stderr, (args, proc.stderr[-2000:])
    assert not (tmp_path / "reports").exists()


@pytest.mark.slow  # a pytest subprocess
def test_dry_run_of_an_ssh_fabric_cluster_plans_over_ssh_without_its_key_files(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--cluster=ssh-fabric", "--dry-run", "--live=off",
                           "-p", "no:cacheprovider"], cwd=tmp_path, env=_env(tmp_path), capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 2, out[-4000:] + proc.stderr[-2000:]  # no harness error: no SSH target needs its key
    assert "[dry-run] raw bandwidth fab-h0 (fab0) -> fab-h1 over SSH" in out
    assert "[dry-run] pfc_storm class 1:10 on fab0 @ fab-h0: allowed by safety" in out
    assert "[dry-run] nic_flap fab0 @ fab-h1: inject: fab-h1$ " in out
    assert "state/sshd-test/id_ed25519 does not exist" in out  # said as what a real run would stop on
