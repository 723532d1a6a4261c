"""When a worker is back: a real HTTP server started here serves a worker's and a router's
Prometheus text, whose counters the test raises (or not) after the worker is healthy. Most watch a
restarted worker (a new process: its own counters count only requests sent after the revert); a
resumed one with no API of its own cannot be watched on counters (tests/probes/test_rejoin_served.py
covers the probe and the work queued during a hang)."""

from __future__ import annotations

import threading
import time
from http.server import ThreadingHTTPServer
from typing import Iterator

import httpx
import pytest

from harness.probes.workers.rejoin import RejoinWatch
from tests.probes.conftest import QuietHandler

W0, W1 = "http://127.0.0.1:8101", "http://127.0.0.1:8102"


class Pages:
    """What each path answers: (status, text), changed by the test while the watch polls."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.pages: dict[str, tuple[int, str]] = {}

    def set(self, path: str, text: str, status: int = 200) -> str:
        self.pages[path] = (status, text)
        return self.url + path


@pytest.fixture
def pages() -> Iterator[Pages]:
    holder: dict[str, Pages] = {}

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            status, text = holder["p"].pages.get(self.path, (404, "not found"))
            self.reply(text, status)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder["p"] = Pages(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield holder["p"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def vllm(prompt_tokens: float, finished: float = 0.0) -> str:
    return ("# TYPE vllm:prompt_tokens_total counter\n"
            f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt_tokens}\n'
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{finished_reason="length"}} {finished}\n'
            "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1\n")


def router(sent_w0: float, sent_w1: float, breaker_w1: int) -> str:
    return ("# TYPE vllm_router_processed_requests_total counter\n"
            f'vllm_router_processed_requests_total{{worker="{W0}"}} {sent_w0}\n'
            f'vllm_router_processed_requests_total{{worker="{W1}"}} {sent_w1}\n'
            "# TYPE vllm_router_cb_state gauge\n"
            f'vllm_router_cb_state{{worker="{W0}"}} 0\nvllm_router_cb_state{{worker="{W1}"}} {breaker_w1}\n')


def watch(worker_metrics: str | None = None, router_metrics: str | None = None, limit_s: float = 600.0,
          profile: str | None = "vllm", restarted: bool = True, probe=None) -> RejoinWatch:
    return RejoinWatch("vllm-1", worker_api=W1 + "/", worker_metrics=worker_metrics, profile=profile,
                       router_metrics=router_metrics, limit_s=limit_s, poll_s=0.05, restarted=restarted, probe=probe)


def until(done, safety_s: float = 60.0) -> None:
    """Wait for ``done()`` (a condition, not a timing bound: ``safety_s`` only ends a hung test)."""
    deadline = time.monotonic() + safety_s
    while not done():
        assert time.monotonic() < deadline, "the condition never came true"
        time.sleep(0.01)


def test_new_prompt_tokens_on_the_worker_after_it_was_healthy_mean_it_is_back(pages):
    w = watch(pages.set("/w", vllm(100)))
    w.start()
    pages.set("/w", vllm(150))   # the router sent it a request: prefilled
    r = w.wait(600)
    assert r.back and r.observable and r.seen_by.startswith("vllm:prompt_tokens on ")
    assert r.kept_out_s is not None and r.kept_out_s == r.after_healthy_s
    assert r.sentence().startswith("the cluster took vllm-1 back ") and r.to_dict()["back"]
    assert r.served_wall == r.traffic_wall and r.served_how == r.seen_by   # a new process: its counter is served


def test_requests_finishing_without_new_prompt_tokens_are_not_new_traffic(pages):
    """A resumed worker finishes the requests it held before (finished count rises): no new work."""
    w = watch(pages.set("/w", vllm(100, finished=5)), limit_s=0.3)
    w.start()
    pages.set("/w", vllm(100, finished=9))
    r = w.wait(0.3)
    assert not r.back and r.kept_out_s >= 0.3 and r.served_wall is None
    assert r.sentence().startswith("the cluster kept vllm-1 out for ") and r.sentence().endswith(
        "+ s after it was healthy")


def test_a_worker_that_exports_only_finished_requests_is_watched_on_them(pages):
    only = "# TYPE vllm:request_success_total counter\nvllm:request_success_total{finished_reason=\"stop\"} 3\n"
    w = watch(pages.set("/w", only))
    w.start()
    pages.set("/w", only.replace("} 3", "} 4"))
    r = w.wait(600)
    assert r.back and r.seen_by.startswith("vllm:request_success on ")


def test_the_routers_view_of_the_worker_and_its_circuit_breaker(pages):
    """vllm-router: requests it sent per worker URL (the other worker's count rising is not this
    one's), counted only once the worker served a request sent straight to it after the revert
    (the probe: a real GET of this server, answered once ``/serve`` exists); its breaker state kept
    as it changes. Planted defect: the router's count alone taken as back before the worker served."""
    def probe():
        sent = time.time()
        status = httpx.get(pages.url + "/serve").status_code
        return sent, (time.time() if status == 200 else None), (None if status == 200 else f"HTTP {status}")

    url = pages.set("/r", router(50, 20, breaker_w1=0))
    w = watch(router_metrics=url, limit_s=0.3, probe=probe)
    w.start()
    pages.set("/r", router(80, 25, breaker_w1=0))   # sent to it, not served yet (a worker still draining)
    until(lambda: w.result.problems)                 # the probe's first request was answered 404
    r = w.wait(0.3)
    assert not r.back and r.served_wall is None and r.probes >= 1 and "HTTP 404" in r.problems[-1]
    assert r.sentence().startswith("vllm-1 served no request sent after the revert")
    pages.set("/serve", "ok")
    pages.set("/r", router(85, 25, breaker_w1=1))    # served; the breaker opened meanwhile
    until(lambda: w._loop.served is not None)        # the probe's next request got its answer (no timing bound)
    r = w.wait(0.3)                                  # polls at least once: sees it served
    assert r.served_wall is not None and not r.back and r.kept_out_by == "vllm-router"
    pages.set("/r", router(90, 26, breaker_w1=2))   # half open: a trial request reaches it, the rest go elsewhere
    r = w.wait(0.3)                                  # resumed: the same watch
    assert r.traffic_wall is not None and f"worker={W1}" in r.seen_by and not r.back
    assert r.sentence().startswith("vllm-router kept vllm-1 out for ") and r.sentence().endswith("half_open)")
    pages.set("/r", router(95, 27, breaker_w1=0))   # the trials passed: closed, in rotation
    r = w.wait(600)                                  # learning when it came back
    assert r.back and r.serving_wall >= r.traffic_wall >= r.served_wall
    assert [state for _, state in r.breaker] == ["closed", "open", "half_open", "closed"]
    assert r.sentence() == f"vllm-router kept vllm-1 out for {r.after_healthy_s:.0f} s after it was healthy"  # > 0.3 s


def test_a_resumed_worker_without_an_api_of_its_own_is_not_watched_on_its_counters(pages):
    """Planted defect: a resumed worker's counter rise taken as back (requests queued during the hang
    move it as they drain); with nothing to send it a request straight, its rejoin is not observed,
    named so, never "taken back" nor back by health alone."""
    w = watch(pages.set("/w", vllm(100)), restarted=False)
    w.start()
    pages.set("/w", vllm(500))
    r = w.wait(600)                                  # returns at once: nothing can tell
    assert not r.back and not r.observable and r.kept_out_s is None
    assert "cannot tell its new requests from work queued while it was stopped" in r.sentence()
    assert r.sentence().endswith("its rejoin was not observed, never taken as back by health alone")


def test_without_metrics_or_a_router_view_its_rejoin_is_not_observed_never_back_by_health(pages):
    not_a_router = pages.set("/engine", vllm(1))
    r = watch(router_metrics=not_a_router, profile="openai").wait(600)   # returns at once
    assert not r.observable and r.kept_out_s is None and r.watched == []
    assert "cannot be observed (no metrics URL on the worker and no router view of it)" in r.sentence()
    assert r.sentence().endswith("its rejoin was not observed, never taken as back by health alone")


def test_a_metrics_url_that_fails_is_evidence_never_an_error(pages):
    r = watch(pages.set("/w", "boom", status=500)).wait(0.3)
    assert not r.observable and not r.back
    assert "its metrics could not be read" in r.sentence() and "HTTP 500" in r.sentence()
    r = watch(pages.set("/w", 'vllm:prompt_tokens_total{engine="0" 12\n')).wait(0.3)   # not Prometheus text
    assert not r.observable and "not Prometheus text format" in r.sentence()
    r = watch(router_metrics=pages.set("/r", "down", status=503), profile="openai").wait(0.3)   # router down
    assert not r.observable and "HTTP 503" in r.sentence()


def test_a_hung_worker_behind_its_frontend_whose_counter_rises_is_not_observed_and_6_1_4_cannot_pass(pages):
    """A Dynamo mocker's case (issue 33): resumed, no API of its own (its ``api`` is the frontend's), its
    own ``dynamo_component_requests`` rising after the revert (the requests queued in its socket during
    the stop: a real frontend once listed 1 of 2 workers then). Planted defect: that rise, or its health,
    taken as back: the watch would say back and 6.1.4 would pass on samples all within 3 s."""
    from harness.checks.reschedule_blackbox import client_view_verdict
    from harness.checklists import Checklist
    from harness.checks.verdict import Status
    from tests.checks.test_reschedule_blackbox import quick_faults

    page = "# TYPE dynamo_component_requests_total counter\ndynamo_component_requests_total{{endpoint=\"generate\"}} {}\n"
    w = RejoinWatch("dynamo-0", worker_api=pages.url, worker_metrics=pages.set("/w", page.format(10)), profile="dynamo",
                    router_metrics=pages.set("/frontend", "dynamo_frontend_requests_total 40\n"), limit_s=600.0,
                    poll_s=0.05, restarted=False)
    w.start()
    pages.set("/w", page.format(25))    # queued work drained (or new requests: nothing tells them apart)
    r = w.wait(600)                      # returns at once: nothing can tell
    assert not r.back and not r.observable and r.served_wall is None and r.probes == 0
    v = client_view_verdict(quick_faults(victim="dynamo-0"), Checklist.load(), rejoins=[("hang dynamo-0", r)])
    assert v.status is Status.INCONCLUSIVE, v.reason
    assert "rejoin not observed after hang dynamo-0: dynamo-0 answers its health URL" in v.reason
    assert "cannot tell its new requests from work queued while it was stopped" in v.reason
