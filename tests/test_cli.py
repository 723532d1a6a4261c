import subprocess
import sys


def test_help_lists_subcommands():
    out = subprocess.run([sys.executable, "-m", "harness", "--help"], capture_output=True, text=True, check=True)
    for name in ("serve", "up", "presets", "revert"):
        assert name in out.stdout


def test_unknown_subcommand_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "harness", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
