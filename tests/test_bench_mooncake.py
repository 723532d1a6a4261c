"""bench/mooncake_peer.py: the Mooncake baseline of bench_transfer.py (an optional `bench` extra)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

from mooncake_peer import INSTALL_HINT, MooncakePair, MooncakeUnavailable, interpreter  # noqa: E402


def _has_mooncake() -> bool:
    if importlib.util.find_spec("mooncake") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True)
    return probe.returncode == 0  # found but not importable: libibverbs missing


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    """A virtualenv without Mooncake (nor this environment's packages)."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv


def test_interpreter_takes_a_venv_or_its_python(bare_venv):
    assert interpreter(None) == sys.executable
    assert interpreter(str(bare_venv)) == str(bare_venv / "bin" / "python")
    assert interpreter(str(bare_venv / "bin" / "python")) == str(bare_venv / "bin" / "python")


def test_interpreter_rejects_a_path_without_python(tmp_path):
    with pytest.raises(ValueError, match=r"no Python interpreter there \(fix: give a virtualenv"):
        interpreter(str(tmp_path))


@pytest.mark.slow
def test_python_without_mooncake_is_reported_with_the_import_error(bare_venv, capsys):
    with pytest.raises(MooncakeUnavailable, match=r"cannot import mooncake.engine \(No module named 'mooncake'\)"):
        MooncakePair(interpreter(str(bare_venv)), "127.0.0.1", 4096)
    import bench_transfer  # the bench's own line: says so, says how to install, and goes on
    from harness.engine.core.config import ModelConfig
    assert bench_transfer.start_mooncake(interpreter(str(bare_venv)), "127.0.0.1", ModelConfig.from_name("tiny"),
                                         16, required=False) is None
    assert f"Mooncake: not measured: {bare_venv}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=INSTALL_HINT.split("`")[0]):
        bench_transfer.start_mooncake(interpreter(str(bare_venv)), "127.0.0.1", ModelConfig.from_name("tiny"),
                                      16, required=True)


@pytest.mark.slow
def test_mooncake_write_lands_the_bytes_in_the_receiver(tmp_path):
    if not _has_mooncake():
        reason = f"Mooncake not installed here (optional bench extra): {INSTALL_HINT}"
        if os.environ.get("CI", "").lower() == "true":  # .ci/run installs it: a skip there would hide a gap
            pytest.fail(f"{reason} (in CI this is a failure, not a skip)")
        pytest.skip(reason)
    payload = bytes(range(256)) * 4096  # 1 MiB
    src = tmp_path / "kv.bin"
    src.write_bytes(payload)
    pair = MooncakePair(sys.executable, "127.0.0.1", len(payload))
    try:
        assert pair.seconds(str(src), len(payload), zlib.crc32(payload)) > 0
        with pytest.raises(AssertionError, match="received bytes differ"):  # the check can fail
            pair.seconds(str(src), len(payload), zlib.crc32(payload) ^ 1)
        with pytest.raises(RuntimeError, match="2097152 bytes do not fit the 1048576 registered"):
            pair.seconds(str(src), 2 * len(payload), 0)
        src.write_bytes(payload[:1000])
        with pytest.raises(RuntimeError, match="holds 1000 bytes, not 1048576"):
            pair.seconds(str(src), len(payload), 0)
    finally:
        pair.close()
