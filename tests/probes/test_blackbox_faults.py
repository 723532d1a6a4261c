"""The black-box 6.1.4 plan on a foreign cluster's inventory: which faults, on which roles, and the
dry run's description of what would be signalled and how each worker comes back."""

from harness.clusterfile.models import Worker
from harness.probes.blackbox_faults import describe_plan, plan


def worker(name: str, role: str, **extra) -> Worker:
    return Worker.model_validate({"name": name, "role": role, "host": "localhost", "api": "http://127.0.0.1:8101",
                                  "process": {"pgrep": f"^{name}::EngineCore"}, **extra})


def test_kills_only_roles_that_can_come_back_and_hangs_every_role():
    workers = [worker("p0", "prefill", restart={"command": "systemctl restart p0"}), worker("d0", "decode"),
               worker("d1", "decode")]
    assert plan(workers, 2) == [("process_kill", "prefill"), ("process_kill", "prefill"),
                                ("process_hang", "prefill"), ("process_hang", "decode")]
    agg = [worker("vllm-0", "aggregated", supervised=True), worker("vllm-1", "aggregated", supervised=True)]
    assert plan(agg, 1) == [("process_kill", "aggregated"), ("process_hang", "aggregated")]


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
    w = worker("vllm-0", "aggregated", supervised=True, process={"pid_file": "/tmp/vllm-0.pid"},
               hang_process={"pgrep": "^vllm-0::EngineCore"})
    kill, hang = describe_plan([w], plan([w], 1), hang_s=8.0, observe_s=5.0)
    assert "cat /tmp/vllm-0.pid" in kill and "EngineCore" not in kill
    assert "pgrep -f '^vllm-0::EngineCore'" in hang
