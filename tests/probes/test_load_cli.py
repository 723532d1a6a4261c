import json
import subprocess
import sys

import pytest

from harness.cli import main
from harness.engine.server import ServerProcess


def _load(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness", "load", *args], capture_output=True, text=True,
                          timeout=300)


def test_bad_options_name_the_problem(capsys):
    assert main(["load", "http://127.0.0.1:1", "--mode", "poisson"]) == 3
    err = capsys.readouterr().err
    assert "needs rate > 0" in err and "fix:" in err
    with pytest.raises(SystemExit) as exc:
        main(["load", "http://127.0.0.1:1", "--rate", "-1"])
    assert exc.value.code == 2 and "--rate: must be > 0" in capsys.readouterr().err


@pytest.mark.slow
def test_load_command_runs_locust_and_prints_the_summary(tmp_path):
    with ServerProcess("tiny") as server:
        proc = _load(server.url, "--mode", "constant", "--rate", "4", "--users", "2", "--duration", "2",
                     "--max-tokens", "4", "--output", str(tmp_path), "--slo-ttft-ms", "60000", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 8 and summary["ok"] == 8      # 4/s for 2 s, constant schedule
    assert summary["slo_attainment"] == 1.0
    assert summary["records"] == str(tmp_path / "requests.jsonl")
    assert len((tmp_path / "requests.jsonl").read_text().splitlines()) == 8
