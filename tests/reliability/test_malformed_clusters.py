"""30 malformed cluster files of the kinds a new user writes (non-UTF-8, unknown preset, unreadable
key files, worker counts out of bounds, misspelt keys anywhere): each is refused before anything
starts, naming file, field and fix. In process (fast), and as a real run: exit 3, the field named,
no run record, no process and no namespace left (slow)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from harness.clusterfile import check_before_start, load_cluster
from harness.errors import ConfigError

from .machine import marked_processes

ROOT = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "name": "bad", "kind": "bundled", "description": "a cluster file with one mistake",
    "bundled": {"prefill": 1, "decode": 1, "preset": "tiny", "router": {}, "engine": {}},
    "fabric": {"enabled": True},
    "hosts": [{"name": "localhost", "address": "127.0.0.1", "roles": ["router", "prefill", "decode"],
               "ssh": {"user": "root", "key_file": "KEY", "known_hosts": "KNOWN"}}],
    "safety": {"production": False, "allowed_faults": "all"},
}


def _set(path: str, value: Any) -> Callable[[dict], None]:
    def apply(doc: dict) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[int(last) if last.isdigit() else last] = value
    return apply


def _rename(path: str, new: str) -> Callable[[dict], None]:
    def apply(doc: dict) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[new] = node.pop(last)
    return apply


def _bytes(text: bytes) -> bytes:
    return text


# (case id, a change to BASE or raw bytes, text the error must name)
CASES: list[tuple[str, Any, str]] = [
    ("latin1-description", b"name: bad\nkind: bundled\ndescription: caf\xe9 cluster\n", "not UTF-8"),
    ("latin1-comment", b"# r\xe9seau\nname: bad\nkind: bundled\n", "not UTF-8"),
    ("utf16-file", "name: bad\nkind: bundled\n".encode("utf-16"), "not UTF-8"),
    ("binary-garbage", b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "not UTF-8"),
    ("cp1252-quote", b"name: bad\nkind: bundled\ndescription: \x93quoted\x94\n", "not UTF-8"),
    ("unknown-preset", _set("bundled.preset", "llama-70b"), "bundled.preset"),
    ("misspelt-preset", _set("bundled.preset", "tinny"), "bundled.preset"),
    ("empty-preset", _set("bundled.preset", " "), "bundled.preset"),
    ("missing-key-file", _set("hosts.0.ssh.key_file", "/nonexistent/id_ed25519"), "hosts[0].ssh.key_file"),
    ("relative-missing-key", _set("hosts.0.ssh.key_file", "keys/missing"), "hosts[0].ssh.key_file"),
    ("key-file-is-dir", _set("hosts.0.ssh.key_file", "DIR"), "hosts[0].ssh.key_file"),
    ("missing-known-hosts", _set("hosts.0.ssh.known_hosts", "/nonexistent/known_hosts"), "hosts[0].ssh.known_hosts"),
    ("prefill-zero", _set("bundled.prefill", 0), "bundled.prefill"),
    ("decode-negative", _set("bundled.decode", -1), "bundled.decode"),
    ("prefill-too-many", _set("bundled.prefill", 17), "bundled.prefill"),
    ("decode-thousand", _set("bundled.decode", 1000), "bundled.decode"),
    ("decode-text", _set("bundled.decode", "two"), "bundled.decode"),
    ("prefill-bool", _set("bundled.prefill", True), "bundled.prefill"),
    ("top-level-typo", _rename("safety", "saftey"), "saftey"),
    ("bundled-typo", _rename("bundled.decode", "decodes"), "bundled.decodes"),
    ("router-typo", _set("bundled.router", {"reschedule_enabeld": True}), "bundled.router.reschedule_enabeld"),
    ("router-unknown", _set("bundled.router", {"turbo": 1}), "bundled.router.turbo"),
    ("engine-typo", _set("bundled.engine", {"ecc_handlin": False}), "bundled.engine.ecc_handlin"),
    ("fabric-typo", _set("fabric", {"enabled": True, "line_rate": 5e8}), "fabric.line_rate"),
    ("safety-typo", _set("safety", {"production": False, "allowed_fault": "all"}), "safety.allowed_fault"),
    ("host-typo", _rename("hosts.0.address", "adress"), "hosts[0].adress"),
    ("ssh-typo", _rename("hosts.0.ssh.key_file", "keyfile"), "hosts[0].ssh.keyfile"),
    ("workload-typo", _set("workload", {"prompt_token": 200}), "workload.prompt_token"),
    ("fault-kind-typo", _set("safety.allowed_faults", ["process_kil"]), "safety.allowed_faults[0]"),
    ("kind-typo", _set("kind", "bundeld"), "kind"),
]
assert len(CASES) == 30


def write_case(tmp: Path, change: Any) -> Path:
    """The case's cluster file in tmp (key files KEY/KNOWN exist there; DIR is a directory)."""
    (tmp / "id_ed25519").write_text("not really a key\n")
    (tmp / "known_hosts").write_text("127.0.0.1 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI0000\n")   # non-empty: an empty one is refused
    (tmp / "keydir").mkdir(exist_ok=True)
    path = tmp / "bad.yaml"
    if isinstance(change, bytes):
        path.write_bytes(change)
        return path
    doc = copy.deepcopy(BASE)
    change(doc)
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)
    text = text.replace("KEY", str(tmp / "id_ed25519")).replace("KNOWN", str(tmp / "known_hosts"))
    path.write_text(text.replace("DIR", str(tmp / "keydir")), encoding="utf-8")
    return path


def test_the_base_file_is_valid(tmp_path):
    spec = load_cluster(write_case(tmp_path, lambda doc: None))
    check_before_start(spec)
    assert spec.bundled.prefill == 1 and spec.fabric.enabled


@pytest.mark.parametrize("change,field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_before_start_naming_file_field_and_fix(tmp_path, change, field):
    path = write_case(tmp_path, change)
    with pytest.raises(ConfigError) as info:
        check_before_start(load_cluster(path))
    message = str(info.value)
    assert "bad.yaml" in message and field in message and "(fix: " in message, message


PROBE = """import pytest

pytestmark = pytest.mark.conformance


def test_probe(cluster, conformance):
    raise AssertionError("the cluster must never have started")
"""


def _fabric_namespaces() -> set[str]:
    res = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return {line.split()[0] for line in res.stdout.splitlines() if line.startswith("pdh")}


@pytest.mark.slow
@pytest.mark.parametrize("change,field", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_run_exits_3_and_starts_nothing(tmp_path, change, field):
    from harness.fabric.cli import SLOT_PREFIX, slot_held

    path = write_case(tmp_path, change)
    (tmp_path / "test_probe.py").write_text(PROBE)
    marker = uuid.uuid4().hex
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HARNESS_STATE_DIR": str(state), "S5B_MALFORMED": marker}
    before = _fabric_namespaces()
    proc = subprocess.run([sys.executable, "-m", "pytest", "test_probe.py", f"--cluster={path}", "-q",
                           "-p", "no:cacheprovider", "--live=off", f"--report-dir={tmp_path / 'reports'}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert "bad.yaml" in out and field in out and "fix: " in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not list((state / "runs").glob("*.json")) if (state / "runs").exists() else True
    assert marked_processes("S5B_MALFORMED", marker) == []
    leaked = [ns for ns in _fabric_namespaces() - before
              if not slot_held(int(SLOT_PREFIX.match(ns).group(1) or 0))]  # a live run's own fabric is not ours
    assert leaked == [], leaked
