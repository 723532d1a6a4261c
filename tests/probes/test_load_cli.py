import json
import subprocess
import sys

import pytest

from harness.cli import main
from harness.engine.serving.server import ServerProcess


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


@pytest.mark.slow
def test_load_command_takes_prompt_and_output_tokens_a_request_count_and_a_concurrency(tmp_path):
    with ServerProcess("tiny") as server:
        proc = _load(server.url, "--prompt-tokens", "64", "--output-tokens", "3", "--requests", "5",
                     "--concurrency", "2", "--output", str(tmp_path), "--json")
        rated = _load(server.url, "--rate", "10", "--requests", "4", "--output-tokens", "2",
                      "--output", str(tmp_path / "rated"), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 5 and summary["ok"] == 5
    assert 60 <= summary["prompt_tokens_server"]["p50"] <= 64
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert {r["completion_tokens"] for r in records} == {3} and len({r["user"] for r in records}) == 2
    assert rated.returncode == 0, rated.stderr  # --rate alone: open loop (poisson), 4 requests then done
    assert json.loads(rated.stdout)["requests"] == 4


def test_a_request_count_or_token_length_below_one_is_refused(capsys):
    for opt in ("--requests", "--prompt-tokens", "--output-tokens", "--concurrency"):
        with pytest.raises(SystemExit) as exc:
            main(["load", "http://127.0.0.1:1", opt, "0"])
        assert exc.value.code == 2 and f"{opt}" in capsys.readouterr().err
