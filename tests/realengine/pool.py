"""Started real-engine clusters, shared by the test modules that ask for the same one (issue 34).

A module names its cluster with module attributes: ``VLLM_MODE`` (with ``VLLM_MODEL_PRESET``, default tiny,
and ``VLLM_KV_CACHE_TOKENS``, default vLLM's own pool) or ``DYNAMO_MODE``. Modules that name the same
cluster share one started launcher: the pool keeps it after a module when the next module to run asks
for the same one, and stops it otherwise (the launchers use fixed ports, so one cluster per engine runs
at a time). ``order_by_cluster`` makes the modules that share a cluster run one after another.

Before a kept cluster is handed to the next module it must be whole: every process of the launcher's
current incarnations alive and answering its /health (Dynamo: every worker registered with the frontend
again). One that is not (a module's fault left a Dynamo worker unregistered, say) is stopped and a fresh
one started, which the run's output says. Stopping checks what it always did: the launcher exits 0 on
SIGTERM and leaves no process behind; the launcher is waited for (process 1 of a container does not
reap orphans)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from clusters.dynamo.launch import registered  # standard library only

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 900  # two vLLM starts on a busy 2-core machine took 50-80 s each; leave a wide margin
FIXTURES = {"vllm_cluster": "vllm", "dynamo_cluster": "dynamo"}


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def pgrep(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@dataclass
class StartedCluster:
    engine: str
    mode: str
    ready: dict
    spec: dict  # the matching clusters/ENGINE-MODE.yaml, as plain YAML (the v2 loader is not used here)
    launcher: subprocess.Popen
    log_path: Path

    @property
    def api(self) -> str:
        return self.ready["api"]

    def worker(self, name: str) -> dict:
        return next(w for w in self.spec["workers"] if w["name"] == name)

    def launcher_log(self, since: int = 0) -> str:
        """The launcher's log, from byte ``since`` (a ``log_mark()``: what one test's faults made it say)."""
        return self.log_path.read_bytes()[since:].decode(errors="replace")

    def log_mark(self) -> int:
        return self.log_path.stat().st_size

    def engine_pid(self, name: str) -> int:
        """vLLM: the EngineCore the launcher found for ``name``'s current incarnation (READY's is the first)."""
        return int((Path(self.ready["run_dir"]) / f"{name}.engine.pid").read_text())

    def whole(self) -> str | None:
        """None when every current process answers its /health (Dynamo: and is registered); else what is not."""
        if self.launcher.poll() is not None:
            return f"the launcher exited with {self.launcher.returncode}"
        if self.engine == "vllm":
            urls = [f"{i['api']}/health" for i in self.ready["instances"].values()] + [f"{self.api}/health"]
        else:
            urls = [w["health"] for w in self.ready["workers"].values()]
        sick = [u for u in urls if not healthy(u)]
        if sick:
            return f"not healthy: {sick}"
        if self.engine == "dynamo":
            try:
                now = registered(self.api)
            except (OSError, ValueError) as exc:
                return f"the frontend's /health: {exc}"
            if now != self.ready["registered"]:
                return f"registered {now}, READY had {self.ready['registered']}"
        return None


def cluster_key(module, engine: str) -> tuple:
    if engine == "vllm":
        return ("vllm", module.VLLM_MODE, getattr(module, "VLLM_MODEL_PRESET", "tiny"),
                getattr(module, "VLLM_KV_CACHE_TOKENS", None))
    return ("dynamo", module.DYNAMO_MODE)


def start(key: tuple, venv: Path, tmp: Path) -> StartedCluster:
    """Start ``clusters/ENGINE/launch.py MODE`` for ``key`` and wait for its ready file."""
    engine, mode, *vllm = key
    ready_file, log_path = tmp / "ready.json", tmp / "launcher.log"
    options = []
    if engine == "vllm":
        preset, kv_cache_tokens = vllm
        options = ["--model-preset", preset] + (["--kv-cache-tokens", str(kv_cache_tokens)] if kv_cache_tokens else [])
    with open(log_path, "wb") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", f"clusters.{engine}.launch", mode, "--venv", str(venv), "--ready-file",
             str(ready_file), *options],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    try:   # whatever ends the wait (not ready, Ctrl-C, an unreadable ready file) stops the launcher first
        while not ready_file.exists():
            if launcher.poll() is not None:
                pytest.fail(f"the {engine} {mode} launcher exited with {launcher.returncode} before it was ready:\n"
                            + log_path.read_text(errors="replace")[-4000:])
            if time.monotonic() > deadline:
                pytest.fail(f"the {engine} {mode} cluster was not ready after {STARTUP_TIMEOUT_S} s:\n"
                            + log_path.read_text(errors="replace")[-4000:])
            time.sleep(1.0)
        spec = yaml.safe_load((REPO / "clusters" / f"{engine}-{mode}.yaml").read_text())
        return StartedCluster(engine, mode, json.loads(ready_file.read_text()), spec, launcher, log_path)
    except BaseException:
        _terminate(launcher)
        raise


def _terminate(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(60)
        except subprocess.TimeoutExpired:
            launcher.kill()
    launcher.wait()


def stop(cluster: StartedCluster) -> None:
    """SIGTERM the launcher, wait for it; it must exit 0 and leave none of its processes behind (any it
    left are SIGKILLed before that fails, so a failing stop leaves nothing running either)."""
    pids = []
    if cluster.engine == "dynamo":   # the current incarnations, before the launcher removes their pid files
        for f in Path(cluster.ready["run_dir"]).glob("*.pid"):
            try:
                pids.append(int(f.read_text()))
            except (OSError, ValueError):   # mid-rewrite by a restart: the count below names it
                pass
    _terminate(cluster.launcher)
    if cluster.engine == "vllm":
        left = [pid for name in cluster.ready["instances"] for pid in pgrep(f"^{name}::")]
        left += pgrep(f"vllm-router --host 127.0.0.1 --port {cluster.api.rsplit(':', 1)[1]}")
    else:
        left = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    _kill(left)
    if cluster.mode == "pd-nixl":   # its emulated hosts: namespaces, links and sshds gone with the launcher
        from harness.fabric.builder import leftovers

        remains = leftovers(prefix="pvn-")
        assert not remains, f"the pd-nixl launcher left its hosts behind: {remains}"
    assert cluster.launcher.returncode == 0, cluster.launcher_log()[-4000:]
    assert not left, f"the launcher left processes behind after SIGTERM: {left} of {pids or 'its processes'}"
    assert cluster.engine == "vllm" or len(pids) == len(cluster.ready["workers"]) + 1, \
        f"pid files read at stop: {pids}, expected one per worker and the frontend"


def _kill(pids: list[int]) -> None:
    """SIGKILL what a launcher left behind (its own processes, by pid) and wait until they are gone."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in pids) \
            and time.monotonic() < deadline:
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1].split("\n", 1)[0].lower()
    except (OSError, IndexError):
        return "zombie"   # gone meanwhile


class ClusterPool:
    """At most one started cluster per engine; ``get`` returns the held one when it is the same and whole."""

    def __init__(self) -> None:
        self.held: dict[str, tuple[tuple, StartedCluster]] = {}
        self.starts: list[tuple] = []   # every start, in order (the run's output lists them)

    def get(self, key: tuple, venv: Path, tmp: Path) -> StartedCluster:
        engine = key[0]
        if engine in self.held:
            held_key, cluster = self.held[engine]
            broken = cluster.whole() if held_key == key else None
            if held_key == key and broken is None:
                return cluster
            if broken:
                print(f"\n[pool] {held_key} is not whole ({broken}): stopping it, starting a fresh one")
            self.release(engine)
        cluster = start(key, venv, tmp)
        self.held[engine] = (key, cluster)
        self.starts.append(key)
        return cluster

    def release(self, engine: str) -> None:
        if engine in self.held:
            _, cluster = self.held.pop(engine)
            stop(cluster)

    def release_all(self) -> None:
        """Stop every held cluster, each even when stopping another failed; then raise the first failure."""
        errors = []
        for engine in list(self.held):
            try:
                self.release(engine)
            except BaseException as exc:  # noqa: BLE001 - the others are stopped first, then it is raised
                errors.append(exc)
        if errors:
            raise errors[0]


def next_user_key(request, fixture: str) -> tuple | None:
    """The cluster key of the next module after ``request``'s that uses ``fixture`` (None: none does)."""
    items = request.session.items
    mine = [i for i, item in enumerate(items) if getattr(item, "module", None) is request.module]
    for item in items[(mine[-1] + 1 if mine else len(items)):]:
        if fixture in getattr(item, "fixturenames", ()):
            return cluster_key(item.module, FIXTURES[fixture])
    return None


def order_by_cluster(items: list) -> None:
    """Reorder, in place, the real-engine items so that modules sharing a cluster run one after another:
    each group where its first module was, modules in their collected order; every other item keeps its place."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in Path(str(item.fspath)).parents]
    module_key: dict[str, tuple] = {}
    for i in slots:
        item = items[i]
        uses = [f for f in FIXTURES if f in getattr(item, "fixturenames", ())]
        if uses and str(item.fspath) not in module_key:
            module_key[str(item.fspath)] = cluster_key(item.module, FIXTURES[uses[0]])
    first: dict[tuple, int] = {}
    ranked = []
    for n, i in enumerate(slots):
        item = items[i]
        key = module_key.get(str(item.fspath), ("module", str(item.fspath)))
        ranked.append((first.setdefault(key, n), n, item))
    for i, (_, _, item) in zip(slots, sorted(ranked, key=lambda r: r[:2])):
        items[i] = item
