"""The black-box 6.1.4 plan on a foreign cluster's inventory: which faults, on which roles, and the
dry run's description of what would be signalled and how each worker comes back."""

from harness.clusterfile.models import Worker
from harness.scenarios.blackbox_faults import describe_plan, plan, victims, without_survivor


def worker(name: str, role: str, **extra) -> Worker:
    return Worker.model_validate({"name": name, "role": role, "host": "localhost", "api": "http://127.0.0.1:8101",
                                  "process": {"pgrep": f"^{name}::EngineCore"}, **extra})


def test_kills_only_roles_that_can_come_back_and_hangs_every_role_as_often():
    workers = [worker("p0", "prefill", restart={"command": "systemctl restart p0"}),
               worker("p1", "prefill", restart={"command": "systemctl restart p1"}),
               worker("d0", "decode"), worker("d1", "decode")]
    assert plan(workers, 2) == [("process_kill", "prefill"), ("process_kill", "prefill"),
                                ("process_hang", "prefill"), ("process_hang", "decode"),
                                ("process_hang", "prefill"), ("process_hang", "decode")]
    agg = [worker("vllm-0", "aggregated", supervised=True), worker("vllm-1", "aggregated", supervised=True)]
    assert plan(agg, 1) == [("process_kill", "aggregated"), ("process_hang", "aggregated")]


def test_a_role_with_one_worker_is_not_faulted_and_says_why():
    """Nothing can take over the only prefill worker's work: faulting it measures an outage by design."""
    workers = [worker("prefill-0", "prefill", supervised=True), worker("decode-0", "decode", supervised=True),
               worker("decode-1", "decode", supervised=True)]
    assert without_survivor(workers) == {"prefill": "only one prefill worker (prefill-0): nothing can take over"}
    assert plan(workers, 1) == [("process_kill", "decode"), ("process_hang", "decode")]
    pd = [worker("prefill-0", "prefill", supervised=True), worker("decode-0", "decode", supervised=True)]
    assert plan(pd, 3) == [] and set(without_survivor(pd)) == {"prefill", "decode"}


def test_the_dry_run_says_how_each_worker_is_found_held_and_brought_back():
    agg = [worker("vllm-0", "aggregated", supervised=True),
           worker("vllm-1", "aggregated", restart={"command": "systemctl restart vllm-1"})]
    lines = describe_plan(agg, plan(agg, 1), hang_s=8.0, observe_s=5.0)
    assert lines[0].startswith("kill -s KILL <pid> of one aggregated worker")
    assert "pgrep -f '^vllm-0::EngineCore'" in lines[0] and "hold 5 s" in lines[0]
    assert "vllm-0: supervised" in lines[0] and "vllm-1: run `systemctl restart vllm-1`" in lines[0]
    assert lines[1].startswith("kill -s STOP <pid>") and "hold 8 s; kill -s CONT <pid>" in lines[1]


def test_a_hang_stops_the_hang_process_when_the_worker_names_one():
    """vLLM: a kill ends the API server (pid file), a hang stops the EngineCore behind it (whose
    /health the API server keeps answering)."""
    w = [worker(f"vllm-{i}", "aggregated", supervised=True, process={"pid_file": f"/tmp/vllm-{i}.pid"},
                hang_process={"pgrep": f"^vllm-{i}::EngineCore"}) for i in (0, 1)]
    kill, hang = describe_plan(w[:1], plan(w, 1), hang_s=8.0, observe_s=5.0)
    assert "cat /tmp/vllm-0.pid" in kill and "EngineCore" not in kill
    assert "pgrep -f '^vllm-0::EngineCore'" in hang


def test_victims_go_round_every_worker_before_any_is_faulted_again():
    """Seen on Dynamo's 16 mocker processes: 8 kills by independent seeded picks hit one worker twice."""
    many = [worker(f"mocker-{i:02d}", "aggregated", supervised=True) for i in range(16)]
    steps = [("process_kill", "aggregated")] * 16 + [("process_hang", "aggregated")] * 3
    picked = [w.name for w in victims(many, steps, seed=7)]
    assert sorted(picked[:16]) == sorted(w.name for w in many)   # 16 kills, 16 different workers
    assert len(set(picked[16:])) == 3                             # hangs take their own round
    assert picked == [w.name for w in victims(many, steps, seed=7)] != [w.name for w in victims(many, steps, seed=8)]
    mixed = [worker("a", "aggregated", supervised=True), worker("b", "aggregated")]   # b cannot come back
    assert {w.name for w in victims(mixed, [("process_kill", "aggregated")] * 3, seed=0)} == {"a"}
