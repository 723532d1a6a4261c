"""Two aggregated vLLM instances behind vllm-router, supervised (clusters/vllm-agg.yaml): the proof target
of the black-box 6.2 and 6.1.4 suites. Slow: each vLLM start takes about a minute on 2 cores.

Shares its started cluster (slow model, vLLM's own KV pool per instance) with test_suites_on_vllm.py,
which runs first on it (tests/realengine/pool.py): none of these tests needs a fresh one. Each reads the
launcher's current state, not READY's first one (the EngineCore the launcher found for the current
incarnation, the launcher's log from the test's own start), and the pool hands the cluster over only
whole (every instance and the router answering /health). test_degradation_on_vllm.py cannot share it (the tiny model: the slow one
fills the pool too slowly to reach its levels), nor test_vllm_pd.py (another mode)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tests.realengine.conftest import healthy, pgrep, scrape, stream_chat, stream_chat_outcome

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # vLLM start-up and restarts take minutes under load
VLLM_MODE = "agg"
VLLM_MODEL_PRESET = "slow"  # ~30 ms per token: a stream is still in flight when its engine is killed
VLLM_KV_CACHE_TOKENS = None  # test_suites_on_vllm.py's cluster: shared


def test_router_streams_completions(vllm_cluster):
    outcome = stream_chat(vllm_cluster.api, vllm_cluster.spec["model"], "hello there, how are you?", 16)
    assert "".join(outcome.pieces)  # content arrived in SSE deltas, then usage, then [DONE]


def test_each_worker_exports_vllm_metrics_and_the_router_its_own(vllm_cluster):
    for worker in vllm_cluster.spec["workers"]:
        samples = scrape(worker["metrics"])
        assert any(k.startswith("vllm:kv_cache_usage_perc") for k in samples), worker["name"]
        assert any(k.startswith("vllm:time_to_first_token_seconds_bucket") for k in samples), worker["name"]
    router = scrape(vllm_cluster.spec["endpoints"]["metrics"])
    assert router.get("vllm_router_active_workers") == 2.0, router


def test_each_process_pattern_names_exactly_one_engine_core(vllm_cluster):
    for worker in vllm_cluster.spec["workers"]:
        pids = pgrep(worker["hang_process"]["pgrep"])
        assert pids == [vllm_cluster.engine_pid(worker["name"])], (worker, pids)


def test_no_instance_is_pinned_to_one_core(vllm_cluster):
    """vLLM's default CPU binding pinned both instances' Workers (and a restarting EngineCore) to core
    0; under load a restarted instance then took over 10 minutes to start (the launcher sets
    VLLM_CPU_OMP_THREADS_BIND=nobind). Every process of every instance may run on every CPU we may."""
    allowed = os.sched_getaffinity(0)
    for name in vllm_cluster.ready["instances"]:
        pids = pgrep(f"^{name}::")  # its EngineCore and Worker
        assert len(pids) >= 2, (name, pids)
        for pid in pids:
            assert os.sched_getaffinity(pid) == allowed, (name, pid, sorted(os.sched_getaffinity(pid)), sorted(allowed))


def test_a_stopped_engine_core_keeps_health_200_while_its_requests_stall(vllm_cluster):
    """Why 6.1.4 judges a hang by the stall clients see: vLLM's /health does not notice a stopped engine."""
    worker = vllm_cluster.worker("vllm-1")
    [engine] = pgrep(worker["hang_process"]["pgrep"])
    body = {"model": vllm_cluster.spec["model"], "prompt": "stalled", "max_tokens": 4}
    os.kill(engine, signal.SIGSTOP)
    try:
        with httpx.Client(timeout=httpx.Timeout(10, read=3)) as client:
            with pytest.raises(httpx.ReadTimeout):  # cannot answer at all while its engine is stopped
                client.post(f"{worker['api']}/v1/completions", json=body)
            assert client.get(worker["health"]).status_code == 200
    finally:
        os.kill(engine, signal.SIGCONT)
    done = httpx.post(f"{worker['api']}/v1/completions", json=body, timeout=60)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4


def _successes(metrics_url: str) -> float:
    return sum(v for k, v in scrape(metrics_url).items() if k.startswith("vllm:request_success_total{"))


def _running(metrics_url: str) -> float:
    return sum(v for k, v in scrape(metrics_url).items() if k.startswith("vllm:num_requests_running{"))


def test_supervisor_restarts_a_killed_instance_and_the_router_serves_it_again(vllm_cluster):
    worker = vllm_cluster.worker("vllm-0")
    [engine] = pgrep(worker["hang_process"]["pgrep"])
    mark = vllm_cluster.log_mark()  # the cluster is shared: what the launcher says from here on
    in_flight: list = []

    def stream() -> None:
        try:
            in_flight.append(stream_chat_outcome(worker["api"], vllm_cluster.spec["model"], "in flight", 300))
        except AssertionError as cut:  # cut with no error event
            in_flight.append(cut)
    streamer = threading.Thread(target=stream)
    streamer.start()
    deadline = time.monotonic() + 60
    while not _running(worker["metrics"]):  # the request is on the engine: prefilling or decoding
        assert streamer.is_alive() and time.monotonic() < deadline, f"never ran: {in_flight}"
        time.sleep(0.05)
    subprocess.run(["kill", "-KILL", str(engine)], check=True)
    streamer.join(120)
    # What vLLM does to a stream whose engine dies: an error event and [DONE], not a silent cut.
    [victim] = in_flight
    assert not isinstance(victim, AssertionError), victim
    assert victim.error and "EngineCore" in victim.error and victim.completion_tokens is None, victim
    # Meanwhile the router serves from the other instance. For a few seconds the victim's API server still
    # accepts streams and ends them with an error event ("EngineCore encountered an issue"): a clear error,
    # never a silent cut (stream_chat_outcome fails on that) and never a hang.
    outcomes = [stream_chat_outcome(vllm_cluster.api, vllm_cluster.spec["model"], "while one is down", 4)
                for _ in range(4)]
    assert all(o.completion_tokens == 4 or o.error for o in outcomes), outcomes
    assert any(o.error is None for o in outcomes), outcomes  # the healthy instance kept serving
    deadline = time.monotonic() + 600
    while not (pgrep(worker["hang_process"]["pgrep"]) not in ([], [engine]) and healthy(worker["health"])):
        assert time.monotonic() < deadline, "vllm-0 did not come back:\n" + vllm_cluster.launcher_log()[-3000:]
        time.sleep(2)
    log = vllm_cluster.launcher_log(mark)
    assert "vllm-0 (pid" in log and "exited with code 0" in log, log
    before = _successes(worker["metrics"])
    for _ in range(4):  # round robin: the restarted instance gets its share again
        stream_chat(vllm_cluster.api, vllm_cluster.spec["model"], "after the restart", 4)
    assert _successes(worker["metrics"]) > before
