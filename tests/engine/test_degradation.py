"""Degradation controller: triggers, one level per change, dwell, hysteresis, events."""

import time

import pytest

from harness.engine.resilience.degradation import DegradationConfig, DegradationController, Signals
from harness.errors import ConfigError


def ctl(**kw):
    return DegradationController(DegradationConfig(min_dwell_s=1.0, **kw))


def run(c, signals, t0=0.0, steps=10, dt=1.0):
    for i in range(steps):
        c.evaluate(signals, t0 + i * dt)
    return c.level


def test_hbm_overload_walks_up_one_level_per_dwell_in_order():
    c = ctl()
    assert c.evaluate(Signals(hbm=0.92), 0.0).to_level == 1
    assert c.evaluate(Signals(hbm=0.92), 0.5) is None  # dwell not over
    assert c.evaluate(Signals(hbm=0.92), 1.0).to_level == 2
    assert c.evaluate(Signals(hbm=0.92), 2.0).to_level == 3
    assert c.evaluate(Signals(hbm=0.92), 3.0) is None  # 0.92 is below L4's 0.95
    assert [h.to_level for h in c.history] == [1, 2, 3]
    assert "HBM use 0.920 >= 0.850" in c.history[1].reason


@pytest.mark.parametrize("hbm,level", [(0.70, 0), (0.80, 1), (0.86, 2), (0.90, 3), (0.96, 4), (0.99, 5)])
def test_each_level_triggers_at_its_threshold(hbm, level):
    assert run(ctl(), Signals(hbm=hbm)) == level


def test_queue_depth_uses_the_article_rule_for_level_2():
    assert run(ctl(), Signals(queue=33)) == 2   # 4.2: queue_depth > 32 turns speculation off
    assert run(ctl(), Signals(queue=20)) == 1


def test_health_score_triggers_admission_control():
    assert run(ctl(), Signals(health=0.7)) == 1


def test_steps_down_only_below_the_hysteresis_band():
    c = ctl()
    run(c, Signals(hbm=0.91), steps=4)
    assert c.level == 3
    run(c, Signals(hbm=0.87), t0=10, steps=3)   # below L3's 0.90 but inside its 0.05 band
    assert c.level == 3
    run(c, Signals(hbm=0.84), t0=20, steps=1)   # out of L3's band, still inside L2's
    assert c.level == 2
    run(c, Signals(hbm=0.0), t0=30, steps=5)
    assert c.level == 0
    assert [h.to_level for h in c.history] == [1, 2, 3, 2, 1, 0]
    assert "released" in c.history[-1].reason


def test_disabled_controller_never_moves_and_reset_returns_to_zero():
    c = ctl(enabled=False)
    assert run(c, Signals(hbm=1.0)) == 0
    c = ctl()
    seen = []
    c.on_change = seen.append
    run(c, Signals(hbm=1.0), steps=2)
    assert c.reset(99.0).to_level == 0
    assert [ch.to_level for ch in seen] == [1, 2, 0]


def test_public_view_is_json_safe():
    import json
    view = ctl().public()
    json.dumps(view, allow_nan=False)
    assert view["thresholds"]["L3"] == {"hbm": 0.9, "queue": None, "health": None}


def test_config_rejects_bad_thresholds():
    with pytest.raises(ConfigError, match="5 thresholds"):
        DegradationConfig(hbm=(0.5, 0.6))
    with pytest.raises(ConfigError, match="rise with the level"):
        DegradationConfig(hbm=(0.9, 0.8, 0.9, 0.95, 0.98))
    with pytest.raises(ConfigError, match="unknown degradation"):
        DegradationConfig.from_dict({"levels": 3})
    assert DegradationConfig.from_dict({"queue": [1, 2, None, 4, 5]}).queue[2] == float("inf")


# ---- end to end through a real router and decode worker ------------------------------------

FAST = {"hbm": [0.1, 0.2, 0.3, 0.4, 0.9], "queue": [None] * 5, "health": [None] * 5, "min_dwell_s": 0.2}


def _wait_level(url, level, timeout_s=30.0):
    import httpx

    deadline = time.monotonic() + timeout_s
    while (state := httpx.get(f"{url}/admin/degradation").json())["level"] != level:
        assert time.monotonic() < deadline, f"level stayed {state['level']}, expected {level}: {state['signals']}"
        time.sleep(0.05)  # polling the admin API
    return state


@pytest.mark.slow
def test_levels_4_and_5_cap_and_refuse_then_recover():
    import httpx

    from harness.engine.core.oracle import greedy_reference
    from harness.engine.pd.topology import Topology

    with Topology(prefill=1, decode=1, preset="tiny",
                  router_config={"degradation": FAST, "auto_migrate": False}) as topo:
        url = topo.api_url
        fill = httpx.post(f"{url}/admin/faults/hbm_fill", json={"worker": "decode-0", "share": 0.45}).json()
        state = _wait_level(url, 4)
        assert [h["to_level"] for h in state["history"]] == [1, 2, 3, 4]
        body = {"model": "tiny", "prompt": "Degraded but available", "max_tokens": 100, "ignore_eos": True,
                "temperature": 0, "return_token_ids": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert "max_tokens capped from 100 to 32" in r.json()["degraded"]
        want = greedy_reference("tiny", list(b"Degraded but available"), 32, ignore_eos=True)
        assert r.json()["choices"][0]["token_ids"] == want
        more = httpx.post(f"{url}/admin/faults/hbm_fill", json={"worker": "decode-0", "share": 0.5}).json()
        _wait_level(url, 5)
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "circuit_open" and "Level 5" in r.json()["error"]["message"]
        for f in (more, fill):
            assert httpx.delete(f"{url}/admin/faults/hbm_fill/{f['fault_id']}").json()["active"] is False
        _wait_level(url, 0)
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and "degraded" not in r.json()
        metrics = httpx.get(f"{url}/metrics").text
        assert "pdengine_degradation_level 0.0" in metrics
        assert 'pdengine_degradation_rejected_requests_total{status="503"} 1.0' in metrics


@pytest.mark.slow
def test_level_1_answers_429_with_retry_after_while_requests_wait_for_kv():
    import threading

    import httpx

    from harness.engine.pd.topology import Topology

    l1_only = {"hbm": [0.1, None, None, None, None], "queue": [None] * 5, "health": [None] * 5,
               "min_dwell_s": 0.2, "l1_queue_cap": 1, "retry_after_s": 2}
    with Topology(prefill=1, decode=1, preset="tiny",
                  router_config={"degradation": l1_only, "auto_migrate": False}) as topo:
        url = topo.api_url
        # leave less free KV than 1.2 x a 900-token request needs, so it waits for a placement
        fill = httpx.post(f"{url}/admin/faults/hbm_fill", json={"worker": "decode-0", "share": 0.97}).json()
        _wait_level(url, 1)
        body = {"model": "tiny", "prompt": "wait for me", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
        waiting: dict = {}
        t = threading.Thread(target=lambda: waiting.setdefault(
            "r", httpx.post(f"{url}/v1/completions", json=body, timeout=120)))
        t.start()
        try:
            deadline = time.monotonic() + 20
            while httpx.get(f"{url}/admin/degradation").json()["signals"]["queue"] < 1:
                assert time.monotonic() < deadline, "the big request never queued"
                time.sleep(0.05)  # polling the admin API
            r = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
            assert r.status_code == 429 and r.headers["Retry-After"] == "2"
            assert r.json()["error"]["type"] == "rate_limit_error" and "admission control" in r.json()["error"]["message"]
        finally:
            httpx.delete(f"{url}/admin/faults/hbm_fill/{fill['fault_id']}")
            t.join(120)
        assert waiting["r"].status_code == 200  # the queued request was served once KV was free
