"""The vLLM launcher's own logic, with stand-in processes instead of vLLM (fast; runs without .venv-vllm)."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clusters.vllm.launch import LaunchError, check_ports_free

REPO = Path(__file__).resolve().parents[2]

# An "instance" that starts a long-lived child (as vLLM's API server starts its EngineCore and Worker)
# and then exits: the supervisor must kill the child it left behind and start the instance again.
SCENARIO = textwrap.dedent("""
    import ctypes, json, os, sys, time
    from pathlib import Path
    from clusters.vllm import launch

    run = Path(sys.argv[1])
    ctypes.CDLL(None).prctl(launch.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # as the launcher's main()
    child = ("import subprocess, sys, pathlib, os; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
             "pathlib.Path(sys.argv[1], f'child-{os.getpid()}').write_text(str(p.pid))")
    inst = launch.Instance("fake-0", [sys.executable, "-c", child, str(run)], dict(os.environ),
                           run / "fake-0.log", "http://127.0.0.1:9/health", run)
    sup = launch.Supervisor([inst], launch.Instance("router", [sys.executable, "-c", "import time; time.sleep(300)"],
                            dict(os.environ), run / "router.log", None, run), startup_timeout_s=60)
    inst.start(); sup.router.start()
    first = inst.popen.pid
    grandchild_file = run / f"child-{first}"
    while not grandchild_file.exists() or inst.alive():
        time.sleep(0.05)
    grandchild = int(grandchild_file.read_text())
    assert Path(f"/proc/{grandchild}").exists()
    sup.tick()  # sees fake-0 exited: kills its group (the grandchild), restarts it
    alive_after_tick = Path(f"/proc/{grandchild}/stat").exists() and \\
        Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    second = inst.popen.pid
    pid_file = int((run / "fake-0.pid").read_text())
    sup.stop()
    launch.reap_orphans(set())
    print(json.dumps({"first": first, "second": second, "pid_file": pid_file, "restarts": inst.restarts,
                      "exits": inst.exits, "grandchild_alive_after_tick": alive_after_tick,
                      "grandchild_exists_at_end": Path(f"/proc/{grandchild}").exists(),
                      "pid_files_left": sorted(p.name for p in run.glob("*.pid"))}))
""")


def test_supervisor_restarts_an_exited_instance_and_kills_what_it_left_behind(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["restarts"] == 1 and result["exits"] == [0]
    assert result["second"] != result["first"] and result["pid_file"] == result["second"]
    assert not result["grandchild_alive_after_tick"]
    assert not result["grandchild_exists_at_end"]  # killed and reaped (no zombie left for init)


def test_launcher_without_the_vllm_venv_says_how_to_make_it(tmp_path):
    out = subprocess.run([sys.executable, "-m", "clusters.vllm.launch", "agg", "--venv", str(tmp_path / "none"),
                          "--run-dir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 3, out.stdout + out.stderr
    assert f"{tmp_path / 'none'}/bin/python is missing" in out.stdout
    assert "clusters/vllm/setup.sh" in out.stdout


def test_launcher_rejects_an_unknown_mode():
    out = subprocess.run([sys.executable, "-m", "clusters.vllm.launch", "disagg"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice: 'disagg'" in out.stderr


def test_a_taken_port_is_named_before_any_vllm_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port} \\(vllm-0\\) is not free"):
            check_ports_free({"vllm-0": port})
    check_ports_free({"vllm-0": port})  # free again: no error


def test_a_second_launcher_in_the_same_run_dir_is_refused(tmp_path):
    """Two launchers on the same fixed ports would serve from each other's processes (seen on a shared host)."""
    with open(tmp_path / "launcher.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        (tmp_path / "vllm-0.pid").write_text("4243\n")
        out = subprocess.run([sys.executable, "-m", "clusters.vllm.launch", "agg", "--run-dir", str(tmp_path),
                              "--venv", str(tmp_path / "none")], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "another launcher (pid 4242) already runs" in out.stdout
    assert (tmp_path / "vllm-0.pid").read_text() == "4243\n"  # the running launcher's files are left alone


def test_vllm_ipc_sockets_go_to_a_short_folder_of_the_run_that_serve_removes(tmp_path):
    """Planted defect: vLLM's default temp folder (/tmp itself): every instance 6.1.4 kills leaves
    its ZMQ sockets and vllm_dist_* file in /tmp for good (about 800 and 40 found there).
    Each instance gets the run's own folder, short enough for a socket path (107 bytes with vLLM's
    uuid), and serve() removes it with the KV store at start and at stop (a child process, as the
    launcher runs: serve() takes over its signals and makes it a subreaper). Stand-in venv, no vLLM."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "vllm-router"):
        (venv / "bin" / name).write_text("")
    run_dir = tmp_path / ("a-long-run-folder-name-" * 4)
    script = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from clusters import supervise
        from clusters.vllm import launch
        run_dir, venv = Path({str(run_dir)!r}), Path({str(venv)!r})
        instances, _ = launch.build("agg", venv, venv / "model", run_dir)
        rpc = launch.rpc_dir(run_dir)
        (rpc / "left-by-a-killed-engine").write_text("")   # a stale socket of the last run
        run_dir.mkdir(parents=True, exist_ok=True)
        seen = {{}}

        def bring_up(register):
            seen["at_start"] = rpc.exists()
            launch.build("agg", venv, venv / "model", run_dir)   # as the launcher does: makes it again
            (rpc / "socket").write_text("")
            raise KeyboardInterrupt   # as the launcher's signal handler does when it is stopped

        rc = supervise.serve(run_dir, {{}}, None, [run_dir / "kv-store", rpc], bring_up)
        print(json.dumps({{"rc": rc, "env": sorted({{i.env[k] for i in instances for k in ("VLLM_RPC_BASE_PATH", "TMPDIR")}}),
                          "compile_cache": sorted({{i.env["TORCHINDUCTOR_CACHE_DIR"] for i in instances}}),
                          "rpc": str(rpc), "other": str(launch.rpc_dir(run_dir / "other")),
                          "at_start": seen["at_start"], "at_stop": rpc.exists()}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0 and got["env"] == [got["rpc"]] and got["other"] != got["rpc"]
    assert len(got["compile_cache"]) == 1 and not got["compile_cache"][0].startswith(got["rpc"])  # kept between runs
    assert len(f"{got['rpc']}/{'0' * 36}") <= 107
    assert got["at_start"] is False and got["at_stop"] is False   # removed at start and at stop


def _stand_in_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "vllm-router"):
        (venv / "bin" / name).write_text("")
    return venv


def _max_num_seqs(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--max-num-seqs"]


@pytest.mark.parametrize("mode", ["agg", "pd", "pd-nixl"])
def test_max_num_seqs_reaches_every_instance_of_every_mode(tmp_path, mode):
    """Planted defect: the option ignored (``--max-num-seqs 16`` hard-coded in vllm_argv, or build()
    not passing it on): issue 36's acceptance pair (16 against 4) would compare a cluster with itself.
    build() gives each instance's argv exactly one ``--max-num-seqs`` with the value asked, and the
    default stays 16. Stand-in venv and hosts, no vLLM started."""
    from types import SimpleNamespace

    from clusters.vllm import launch

    venv = _stand_in_venv(tmp_path)
    hosts = SimpleNamespace(hosts=[SimpleNamespace(exec_prefix=lambda: [], control_ip=f"127.0.0.{i + 1}",
                                                   fabric_ip=f"198.18.32.{i + 1}") for i in range(2)])
    for asked, expected in ((4, "4"), (None, "16")):
        kwargs = {} if asked is None else {"max_num_seqs": asked}
        instances, router = launch.build(mode, venv, tmp_path / "model", tmp_path / f"run-{asked}",
                                         hosts=hosts if mode == "pd-nixl" else None, **kwargs)
        assert len(instances) == 2
        for inst in instances:
            assert _max_num_seqs(inst.argv) == [expected], (mode, inst.name, inst.argv)
        assert "--max-num-seqs" not in router.argv


def test_launcher_command_line_passes_max_num_seqs_to_build(tmp_path, monkeypatch):
    """Planted defect: main() parses --max-num-seqs but does not hand it to build() (every instance
    would get the default 16). The launcher's own main(), with serve() and build() replaced by
    recorder around the real build(): no ports taken, no process started."""
    from clusters import supervise
    from clusters.vllm import launch

    seen: dict = {}
    real_build = launch.build

    def record_build(*args, **kwargs):
        seen["instances"], _ = real_build(*args, **kwargs)
        raise LaunchError("recorded")   # stop before any process starts

    def fake_serve(run_dir, ports, ready_file, scratch, bring_up):
        with pytest.raises(LaunchError, match="recorded"):
            bring_up(lambda supervisor: None)
        return 0

    monkeypatch.setattr(launch, "build", record_build)
    monkeypatch.setattr(launch, "serve", fake_serve)
    monkeypatch.setattr(launch, "check_ports_free", lambda ports: None)
    monkeypatch.setattr(supervise, "LOG_PREFIX", list(supervise.LOG_PREFIX))   # main() sets it
    assert launch.main(["agg", "--max-num-seqs", "4", "--run-dir", str(tmp_path / "run"),
                        "--venv", str(_stand_in_venv(tmp_path))]) == 0
    assert [_max_num_seqs(i.argv) for i in seen["instances"]] == [["4"], ["4"]]


@pytest.mark.parametrize("bad, says", [("0", "0 is not positive"), ("-3", "-3 is not positive"),
                                       ("four", "'four' is not a whole number"),
                                       ("2.5", "'2.5' is not a whole number")])
def test_launcher_refuses_a_max_num_seqs_that_is_not_a_positive_integer(bad, says, capsys, tmp_path):
    """Planted defect: --max-num-seqs taken as given (0 or a negative reaches vLLM, which fails only
    after the model loads, a minute later, or schedules nothing). The parser refuses it at once, exit 2,
    naming the value and the fix. A missing venv, so that with the defect planted nothing starts."""
    from clusters.vllm import launch

    with pytest.raises(SystemExit) as stopped:
        launch.main(["agg", "--max-num-seqs", bad, "--venv", str(tmp_path / "none"), "--run-dir", str(tmp_path)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "argument --max-num-seqs" in err and says in err and "pass a positive integer" in err


# A stand-in for vLLM's NIXL Worker: a process in its own session whose second thread pins itself to
# the last CPU (as nixl/base_worker.py pins the model thread), and a child that pins its main thread.
PINNED = textwrap.dedent("""
    import os, signal, subprocess, sys, threading, time
    last = max(os.sched_getaffinity(0))
    def worker():
        os.sched_setaffinity(0, {last})
        time.sleep(300)
    threading.Thread(target=worker, name="model", daemon=True).start()
    child = subprocess.Popen([sys.executable, "-c",
                              f"import os, time; os.sched_setaffinity(0, {{{last}}}); time.sleep(300)"])
    def stop(*_):  # the test's SIGTERM: the child goes first, waited for (no orphan left to init)
        child.kill(); child.wait(); os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    time.sleep(300)
""")


def _pinned_threads(pgid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            out += [int(t.name) for t in (stat.parent / "task").iterdir()
                    if len(os.sched_getaffinity(int(t.name))) < len(os.sched_getaffinity(0))]
        except (OSError, ValueError):
            continue
    return out


def test_unpin_groups_gives_every_cpu_back_to_each_pinned_thread_of_the_group_and_no_other():
    """clusters.supervise.unpin_groups on real processes: a session whose second thread and whose child
    pinned themselves to the last CPU gets both back on every CPU, and a pinned process outside the
    group is left as it is. Planted defects it catches: setting the affinity of the process id only
    (the pinned thread is not the main one), looking at the group leader only (the child stays pinned),
    matching the session by pid instead of the group (the outsider gets unpinned)."""
    import time

    from clusters.supervise import unpin_groups

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing to pin away from")
    group = subprocess.Popen([sys.executable, "-c", PINNED], start_new_session=True)
    outsider = subprocess.Popen([sys.executable, "-c", PINNED], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (len(_pinned_threads(group.pid)) < 2
                                               or len(_pinned_threads(outsider.pid)) < 2):
            time.sleep(0.05)
        assert len(_pinned_threads(group.pid)) == 2 and len(_pinned_threads(outsider.pid)) == 2
        changed = unpin_groups({group.pid})
        assert len(changed) == 2 and all(f"group {group.pid}:" in line for line in changed), changed
        assert _pinned_threads(group.pid) == []
        assert len(_pinned_threads(outsider.pid)) == 2
        assert unpin_groups({group.pid}) == []   # nothing left to do: nothing logged again
    finally:
        for p in (group, outsider):
            p.terminate()
            p.wait(timeout=30)
