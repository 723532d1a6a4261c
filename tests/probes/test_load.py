"""Locust load runs (own process) against a real reference-engine server (tiny preset)."""

import signal
import time

import pytest

from harness.engine.core.oracle import greedy_reference
from harness.engine.serving.server import ServerProcess
from harness.engine.core.tokenizer import ByteTokenizer
from harness.errors import ProbeError
from harness.probes.client.analysis import summarize
from harness.probes.loadgen.load import LoadRunner
from harness.probes.loadgen.workload import LoadProfile, arrival_offsets, make_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    with ServerProcess("tiny") as srv:
        yield srv


def _check_tokens_against_oracle(records, profile):
    prompts = make_prompts(profile)
    tok = ByteTokenizer()
    expected = {p: greedy_reference("tiny", tok.encode(p), profile.max_tokens, ignore_eos=True) for p in
                {r.prompt for r in records}}
    assert set(expected) <= set(prompts)
    for r in records:
        assert r.token_ids == expected[r.prompt], r.request_id


def test_closed_loop_run_writes_complete_token_exact_records(server, tmp_path):
    profile = LoadProfile(mode="closed", users=2, duration_s=3.0, max_tokens=8, seed=1)
    runner = LoadRunner(server.url, profile, output_dir=tmp_path)
    records = runner.run()
    assert runner.returncode == 0 and not runner.running
    assert (tmp_path / "requests.jsonl").exists()
    assert len(records) >= 4 and all(r.status == "ok" for r in records), runner.log_tail()
    assert len({r.user for r in records}) == 2
    for r in records:
        assert r.scheduled_ns <= r.sent_ns < r.first_byte_ns <= r.first_token_ns <= r.chunk_ns[-1] <= r.end_ns
        assert r.completion_tokens == 8 and len(r.token_ids) == 8 and r.prompt_tokens == len(r.prompt.encode())
    _check_tokens_against_oracle(records, profile)
    # back to back: a user's next request is sent after its previous one ended
    by_user = {}
    for r in sorted(records, key=lambda r: r.sent_ns):
        assert r.sent_ns >= by_user.get(r.user, 0)
        by_user[r.user] = r.end_ns
    s = summarize(records)
    assert s["ok"] == len(records) and s["failed"] == 0
    assert 0 < s["latency_ms"]["sent"]["ttft_ms"]["p50"] <= s["latency_ms"]["sent"]["e2e_ms"]["p50"]


def test_open_loop_poisson_run_sends_the_seeded_schedule(server, tmp_path):
    profile = LoadProfile(mode="poisson", rate=5.0, users=4, duration_s=3.0, max_tokens=4, seed=11)
    records = LoadRunner(server.url, profile, output_dir=tmp_path).run()
    offsets = arrival_offsets("poisson", 5.0, 3.0, seed=11)
    assert len(records) == len(offsets) and all(r.ok for r in records)
    by_index = sorted(records, key=lambda r: int(r.request_id.split("-")[1]))
    t0 = by_index[0].scheduled_ns - int(offsets[0] * 1e9)
    for r, off in zip(by_index, offsets):
        assert abs(r.scheduled_ns - (t0 + int(off * 1e9))) <= 1   # the schedule, to the nanosecond rounding
        assert r.sent_ns >= r.scheduled_ns                        # never early
    s = summarize(records)
    sched, sent = s["latency_ms"]["scheduled"]["e2e_ms"], s["latency_ms"]["sent"]["e2e_ms"]
    assert sched["p50"] >= sent["p50"]  # the scheduled basis includes the generator's own delay


def test_stop_ends_a_long_run_early_and_reaps_locust(server, tmp_path):
    profile = LoadProfile(mode="closed", users=1, duration_s=300.0, max_tokens=4, stop_timeout_s=5.0)
    with LoadRunner(server.url, profile, output_dir=tmp_path) as runner:
        deadline = time.monotonic() + 60
        while not runner.records_path.exists() or runner.records_path.stat().st_size == 0:
            assert runner.running and time.monotonic() < deadline, runner.log_tail()
            time.sleep(0.2)
        records = runner.stop()
    assert runner.returncode is not None and not runner.running
    assert records and all(r.status in ("ok", "cancelled") for r in records)
    with pytest.raises(ProbeError, match="already started"):
        runner.start()


def test_multi_process_run_splits_one_schedule_over_locust_workers(server, tmp_path):
    profile = LoadProfile(mode="poisson", rate=6.0, users=4, processes=2, duration_s=3.0, max_tokens=4, seed=3)
    runner = LoadRunner(server.url, profile, output_dir=tmp_path)
    records = runner.run()
    assert runner.returncode == 0
    offsets = arrival_offsets("poisson", 6.0, 3.0, seed=3)
    # every arrival sent exactly once, by one of the two workers, each writing its own file
    assert sorted(int(r.request_id.split("-")[1]) for r in records) == list(range(len(offsets)))
    assert {r.user.split("-")[0] for r in records} == {"w0", "w1"}
    assert sorted(p.name for p in tmp_path.glob("requests*.jsonl")) == ["requests.w0.jsonl", "requests.w1.jsonl"]
    assert all(r.ok for r in records)
    assert [r.start_wall_ns() for r in records] == sorted(r.start_wall_ns() for r in records)


def test_overloaded_open_loop_accounts_for_every_arrival(server, tmp_path):
    """One user cannot keep up with 20 arrivals/s of 160 tokens each (32 were fast enough once decode
    got faster): late arrivals are still sent (late), and the
    ones the run ends before sending are recorded as not sent, so none silently disappears."""
    profile = LoadProfile(mode="constant", rate=20.0, users=1, duration_s=2.0, max_tokens=160, stop_timeout_s=1.0)
    records = LoadRunner(server.url, profile, output_dir=tmp_path).run()
    offsets = arrival_offsets("constant", 20.0, 2.0, seed=0)
    assert sorted(int(r.request_id.split("-")[1]) for r in records) == list(range(len(offsets)))
    sent = [r for r in records if r.error_class != "NotSent"]
    not_sent = [r for r in records if r.error_class == "NotSent"]
    assert sent and not_sent and all(r.status == "cancelled" and not r.token_ids for r in not_sent)
    assert {r.status for r in sent} <= {"ok", "cancelled"}
    # the single user sends in schedule order, and ever later against the schedule
    sent.sort(key=lambda r: r.scheduled_ns)
    delays = [r.sent_ns - r.scheduled_ns for r in sent]
    assert delays[-1] > delays[0] and [r.sent_ns for r in sent] == sorted(r.sent_ns for r in sent)
    s = summarize(records)
    assert s["by_status"]["cancelled"] >= len(not_sent) and s["latency_ms"]["sent"]["ttft_ms"]["n"] == s["ok"]


@pytest.mark.parametrize("mode", ["closed", "poisson"])
def test_finish_ends_a_long_run_early_without_cutting_requests_in_flight(server, tmp_path, mode):
    """finish(): no request starts after it, every one in flight runs to its end (ok, token-exact),
    and the run is over long before its 300 s duration."""
    profile = LoadProfile(mode=mode, users=2, rate=4.0 if mode != "closed" else None, duration_s=300.0,
                          max_tokens=64, ignore_eos=True, stop_timeout_s=60.0, seed=5)
    with LoadRunner(server.url, profile, output_dir=tmp_path) as runner:
        deadline = time.monotonic() + 60
        while not runner.records_path.exists() or runner.records_path.stat().st_size == 0:
            assert runner.running and time.monotonic() < deadline, runner.log_tail()
            time.sleep(0.1)
        t_finish = time.monotonic()
        records = runner.finish()
        finish_s = time.monotonic() - t_finish
    assert runner.returncode == 0, runner.log_tail()
    assert finish_s < 60, f"finish() took {finish_s:.0f} s"
    sent = [r for r in records if r.error_class != "NotSent"]
    assert len(sent) >= 2 and all(r.status == "ok" and len(r.token_ids) == 64 for r in sent), \
        [(r.request_id, r.status, r.error_class) for r in sent if r.status != "ok"]
    prompts = make_prompts(profile)
    tok = ByteTokenizer()
    for r in sent:
        assert r.prompt in prompts
        assert r.token_ids == greedy_reference("tiny", tok.encode(r.prompt), 64, ignore_eos=True), r.request_id


def test_finish_while_locust_is_still_starting_ends_the_run_with_nothing_sent(server, tmp_path):
    """finish() right after start(): Locust has not imported the locustfile that handles the finish
    signal yet, so the signal ends the process (a run beside a CPU burner hit this mid-suite and the
    suite errored with "Locust exited with code -10"). The run ends, nothing was sent, no error."""
    profile = LoadProfile(mode="closed", users=2, duration_s=300.0, max_tokens=8, seed=6)
    with LoadRunner(server.url, profile, output_dir=tmp_path) as runner:
        records = runner.finish()
    assert runner.returncode in (0, -signal.SIGUSR1), runner.log_tail()
    assert all(r.error_class == "NotSent" for r in records)


def test_prompts_sized_in_tokens_are_measured_on_the_server_and_requests_end_the_run(server, tmp_path):
    # the byte tokenizer: one token per byte, no BOS; the harness must find that out from the server
    profile = LoadProfile(mode="closed", users=3, duration_s=600.0, max_tokens=4, seed=2, prompt_tokens=120,
                          requests=9)
    t0 = time.monotonic()
    runner = LoadRunner(server.url, profile, output_dir=tmp_path)
    records = runner.run()
    assert time.monotonic() - t0 < 300  # ended by the request count, not the 600 s duration
    assert runner.profile.chars_per_token == pytest.approx(1.0, abs=0.05)
    assert len(records) == 9 and all(r.ok for r in records), runner.log_tail()
    assert all(115 <= r.prompt_tokens <= 120 for r in records), [r.prompt_tokens for r in records]


def test_an_open_loop_run_with_a_request_count_sends_exactly_that_many(server, tmp_path):
    profile = LoadProfile(mode="constant", rate=20.0, users=4, duration_s=600.0, max_tokens=2, requests=6)
    records = LoadRunner(server.url, profile, output_dir=tmp_path).run()
    assert sorted(r.request_id for r in records) == [f"load-{i}" for i in range(6)] and all(r.ok for r in records)
