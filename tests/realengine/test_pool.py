"""The shared-cluster pool's own logic without an engine (fast): which modules run together, when a held
cluster is kept for the next module, when it is stopped (tests/realengine/pool.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from tests.realengine import pool

HERE = Path(pool.__file__).parent


def _module(name: str, **attrs) -> SimpleNamespace:
    return SimpleNamespace(__name__=name, **attrs)


def _items(*modules: tuple[SimpleNamespace, str | None, int]) -> list[SimpleNamespace]:
    """(module, cluster fixture or None, number of tests) -> items as pytest collects them."""
    return [SimpleNamespace(module=m, fspath=HERE / f"{m.__name__}.py", fixturenames=[fx] if fx else [],
                            name=f"{m.__name__}::t{i}")
            for m, fx, n in modules for i in range(n)]


AGG = _module("test_dynamo_agg", DYNAMO_MODE="agg")
DISAGG = _module("test_dynamo_disagg", DYNAMO_MODE="disagg")
LAUNCHER = _module("test_dynamo_launcher")
SOAK = _module("test_dynamo_soak", DYNAMO_MODE="agg")
SUITES = _module("test_suites_on_vllm", VLLM_MODE="agg", VLLM_MODEL_PRESET="slow")
VAGG = _module("test_vllm_agg", VLLM_MODE="agg", VLLM_MODEL_PRESET="slow")
DEGR = _module("test_degradation_on_vllm", VLLM_MODE="agg", VLLM_KV_CACHE_TOKENS=4096)


def test_modules_that_share_a_cluster_run_one_after_another_and_the_rest_keep_their_places():
    """Fails on an order that puts another cluster's module between two that share one (the soak after
    disagg: two Dynamo agg starts) or that moves items outside tests/realengine."""
    outside = SimpleNamespace(module=None, fspath=HERE.parent / "test_other.py", fixturenames=[], name="other")
    items = [outside, *_items((AGG, "dynamo_cluster", 2), (DISAGG, "dynamo_cluster", 1), (LAUNCHER, None, 1),
                              (SOAK, "dynamo_cluster", 1))]
    pool.order_by_cluster(items)
    assert [i.name for i in items] == ["other", "test_dynamo_agg::t0", "test_dynamo_agg::t1", "test_dynamo_soak::t0",
                                       "test_dynamo_disagg::t0", "test_dynamo_launcher::t0"]


def test_the_key_names_mode_model_and_pool():
    """Fails when two modules that need different clusters (another preset or KV pool) get one key."""
    assert pool.cluster_key(SUITES, "vllm") == pool.cluster_key(VAGG, "vllm") == ("vllm", "agg", "slow", None)
    assert pool.cluster_key(DEGR, "vllm") == ("vllm", "agg", "tiny", 4096) != pool.cluster_key(SUITES, "vllm")
    assert pool.cluster_key(AGG, "dynamo") == pool.cluster_key(SOAK, "dynamo") != pool.cluster_key(DISAGG, "dynamo")


def test_the_next_module_to_use_the_fixture_decides_whether_the_cluster_is_kept():
    items = _items((DEGR, "vllm_cluster", 1), (AGG, "dynamo_cluster", 1), (SUITES, "vllm_cluster", 1),
                   (VAGG, "vllm_cluster", 2))
    session = SimpleNamespace(items=items)
    ask = lambda module, fixture: pool.next_user_key(SimpleNamespace(session=session, module=module), fixture)  # noqa: E731
    assert ask(DEGR, "vllm_cluster") == ("vllm", "agg", "slow", None)   # another key: DEGR's is stopped
    assert ask(SUITES, "vllm_cluster") == ("vllm", "agg", "slow", None)  # the same: kept for test_vllm_agg
    assert ask(VAGG, "vllm_cluster") is None and ask(AGG, "dynamo_cluster") is None


class _Held:
    def __init__(self, broken: str | None = None) -> None:
        self.broken = broken

    def whole(self) -> str | None:
        return self.broken


def test_a_held_cluster_is_reused_only_for_the_same_key_and_only_whole(monkeypatch, tmp_path):
    """Fails on a pool that starts the same cluster twice, or hands on one a module left broken."""
    started, stopped = [], []
    monkeypatch.setattr(pool, "start", lambda key, venv, tmp: started.append(key) or _Held())
    monkeypatch.setattr(pool, "stop", lambda cluster: stopped.append(cluster))
    p = pool.ClusterPool()
    a = p.get(("dynamo", "agg"), tmp_path, tmp_path)
    assert p.get(("dynamo", "agg"), tmp_path, tmp_path) is a and started == [("dynamo", "agg")]
    a.broken = "registered {'backend': 1}, READY had {'backend': 2}"
    b = p.get(("dynamo", "agg"), tmp_path, tmp_path)
    assert b is not a and stopped == [a] and len(started) == 2
    c = p.get(("dynamo", "disagg"), tmp_path, tmp_path)
    assert stopped == [a, b] and p.held["dynamo"] == (("dynamo", "disagg"), c)
    p.get(("vllm", "pd", "tiny", None), tmp_path, tmp_path)   # another engine: held beside it
    assert set(p.held) == {"dynamo", "vllm"} and stopped == [a, b]
    p.release("dynamo")
    assert stopped == [a, b, c] and set(p.held) == {"vllm"}


def test_a_start_interrupted_before_ready_stops_and_reaps_its_launcher(monkeypatch, tmp_path):
    """A real process stands for the launcher (it never writes its ready file); Ctrl-C arrives while the
    pool waits for READY. Planted defect: the wait without its cleanup (only the timeout stopped the
    launcher): the process is left running and this fails on its return code."""
    import subprocess
    import sys
    launched = []
    real_popen = subprocess.Popen

    def popen(argv, **kwargs):
        launched.append(real_popen([sys.executable, "-c", "import time; time.sleep(300)"], **kwargs))
        return launched[-1]

    real_sleep, calls = pool.time.sleep, []

    def interrupt(s):   # the pool's first wait for READY is interrupted; later sleeps (Popen.wait's) are real
        calls.append(s)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real_sleep(s)

    monkeypatch.setattr(pool.subprocess, "Popen", popen)
    monkeypatch.setattr(pool.time, "sleep", interrupt)
    try:
        pool.start(("dynamo", "agg"), tmp_path, tmp_path)
        raise AssertionError("start returned without a ready file")
    except KeyboardInterrupt:
        pass
    [launcher] = launched
    assert launcher.returncode is not None   # stopped and waited for (SIGTERM: -15)


def test_every_held_cluster_is_stopped_even_when_stopping_one_fails(monkeypatch, tmp_path):
    """Planted defect: the session's teardown stopping clusters one after another with no guard: the
    first stop's failure (a launcher that left a process behind) leaves the other engine's running."""
    stopped = []

    def stop(cluster):
        stopped.append(cluster)
        if len(stopped) == 1:
            raise AssertionError("the launcher left processes behind after SIGTERM: [123]")

    monkeypatch.setattr(pool, "start", lambda key, venv, tmp: _Held())
    monkeypatch.setattr(pool, "stop", stop)
    p = pool.ClusterPool()
    a, b = p.get(("dynamo", "agg"), tmp_path, tmp_path), p.get(("vllm", "agg", "tiny", None), tmp_path, tmp_path)
    try:
        p.release_all()
        raise RuntimeError("release_all hid the failure")
    except AssertionError as exc:
        assert "left processes behind" in str(exc)
    assert stopped == [a, b] and not p.held
