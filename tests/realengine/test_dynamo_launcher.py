"""The Dynamo launcher's own logic without Dynamo (fast; runs without .venv-dynamo)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from clusters.dynamo.launch import FRONTEND_PORT, LaunchError, build, worker_layout
from harness.clusterfile import load_cluster
from tests.realengine.conftest import REPO


def test_many_is_split_into_processes_that_are_each_a_fault_target():
    layout = worker_layout("many", 128, 8)
    assert len(layout) == 16 and {count for *_, count in layout} == {8}
    assert [port for _, _, port, _ in layout] == list(range(8601, 8617))
    with pytest.raises(LaunchError, match="one process: a kill would take every worker down"):
        worker_layout("many", 8, 8)
    with pytest.raises(LaunchError, match="multiple of --per-process 8"):
        worker_layout("many", 100, 8)


def test_each_cluster_file_names_the_launcher_s_ports_and_pid_files(tmp_path):
    """The cluster files are static: they must match what the launcher starts, worker for worker."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    for mode in FRONTEND_PORT:
        run_dir = tmp_path / mode
        instances, frontend, expected = build(mode, venv, tmp_path / "model", run_dir)
        spec = load_cluster(str(REPO / "clusters" / f"dynamo-{mode}.yaml"))
        assert spec.endpoints.api == frontend.health_url.removesuffix("/health") and spec.engine == "dynamo"
        assert [w.name for w in spec.workers] == [i.name for i in instances]
        for w, inst in zip(spec.workers, instances):
            assert str(w.health) == inst.health_url and w.supervised
            assert w.process.pid_file == f"/tmp/harness-dynamo-{mode}/{inst.name}.pid"
            assert ("--disaggregation-mode" in inst.argv) == (w.role != "aggregated")
        assert "DYN_IGNORE_OPENAI_FE_UNSUPPORTED_FIELDS" not in frontend.env
        assert sum(expected.values()) == (128 if mode == "many" else len(instances))


def test_without_the_dynamo_venv_the_launcher_says_how_to_make_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", "clusters.dynamo.launch", "agg", "--venv", str(tmp_path / "none"),
                          "--run-dir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stdout + out.stderr
    assert f"{tmp_path / 'none'}/bin/python is missing" in out.stdout and "clusters/dynamo/setup.sh" in out.stdout


def test_the_frontend_listens_where_it_is_told_and_an_address_not_here_is_refused(tmp_path):
    """--frontend-host: load hosts in namespaces reach the frontend on a bridge's address (bench_scale)."""
    from clusters.dynamo.launch import check_frontend_host

    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    instances, frontend, _ = build("many", venv, tmp_path / "model", tmp_path / "run", 16, 8, "198.18.72.254")
    argv = frontend.argv
    assert argv[argv.index("--http-host") + 1] == "198.18.72.254"
    assert frontend.health_url == "http://198.18.72.254:8600/health"
    assert all(i.health_url.startswith("http://127.0.0.1:") for i in instances)  # the workers stay on loopback
    _, default, _ = build("many", venv, tmp_path / "model", tmp_path / "run", 16, 8)
    assert default.argv[default.argv.index("--http-host") + 1] == "127.0.0.1"
    with pytest.raises(LaunchError, match="'frontend' is not an IP address"):
        check_frontend_host("frontend", 8600)
    with pytest.raises(LaunchError, match="cannot listen on 192.0.2.1:8600"):  # TEST-NET-1: on no interface here
        check_frontend_host("192.0.2.1", 8600)
    check_frontend_host("127.0.0.1", 0)
    out = subprocess.run([sys.executable, "-m", "clusters.dynamo.launch", "many", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert "--frontend-host" in out.stdout
