"""Marks the slow test files that may run two at a time (``parallel``): CI runs them in a phase of their
own, ``-m "slow and parallel" -n 2 --dist loadfile``, and the rest of the slow half serially
(``-m "slow and not parallel"``); together they are every slow test once (.ci/run, README "Tests").

A file is listed only when both hold (read from its code; each entry says what its assertions are): its assertions hold no timing threshold and no verdict of a timed item (6.2, 6.1.1-6.1.5, nic
flap, soak: the machine gate turns those into inconclusive on a busy machine), and it shares nothing with
another slow file: no fixed port or namespace name used elsewhere, no machine-wide scan of processes,
links or namespaces, no SIGKILLed fabric run leaving unheld namespaces behind. Kept serial for that
reason alone: reliability/test_kill_points.py and test_killed_run_leftovers.py (they leave, and scan for,
unheld ``pdhN-`` namespaces: test_malformed_clusters.py's leak check would read theirs as its own),
probes/test_promql_server.py and test_distributed_load.py (fixed ports 19100-19112, 19300),
fabric/test_builder.py (which fabric slots are free machine-wide), every realengine file (one shared
pool of engine clusters on fixed ports)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

PARALLEL = {  # file (under tests/) -> why it is safe beside another
    "engine/test_client.py": "token-exact outputs and exit codes; its own children",
    "engine/test_degradation.py": "levels and HTTP codes, waited for up to 30 s; a free port",
    "engine/test_migration.py": "oracle tokens and refusals; a free port",
    "engine/test_server.py": "SSE framing, error codes, reaping its own children",
    "engine/test_topology.py": "exit codes and pids gone; a free port",
    "fabric/test_fanout_ssh.py": "error text, ledger, audit; prefix pdb- and 198.18.41-42 no other file uses",
    "fabric/test_linerate.py": "tc and sysfs rates as configured; the fabric tests' lock, prefix pdt-",
    "fabric/test_sshdtest.py": "an echo over SSH and nothing left; port 2222 no other file uses",
    "faults/test_crash.py": "ledger and revert; its own state folder",
    "faults/test_gpu.py": "fill and poison reverted, oracle tokens; a free port",
    "faults/test_gpu_hosts_ssh.py": "an error message",
    "faults/test_runner.py": "exit codes 143/130 and the revert; its own state folder",
    "harness/test_capability_gate.py": "inconclusive reasons; a full run's exit code accepted in 0-2",
    "harness/test_checklist_once.py": "a dry run's parse count",
    "harness/test_cli_run.py": "collect-only, dry-run and usage exit codes; its own state folder",
    "harness/test_compare_e2e.py": "the run's and `compare`'s figures agree, whatever they are",
    "harness/test_ecc_dcgm.py": "ecc fail and nothing-lost pass: items the machine gate never touches",
    "harness/test_machine_wiring.py": "machine limits set to always or never over",
    "harness/test_plugin.py": "synthetic verdicts, no cluster",
    "harness/test_plugin_faults.py": "exit 3 when interrupted; a fixed 6.1.4 time the gate never moves",
    "harness/test_safety.py": "refusals; its own state folder and sleeper",
    "harness/test_soak_dry_run.py": "dry runs only",
    "harness/test_wheel_install.py": "dry run and exit codes of an installed wheel; its own copy",
    "probes/test_admin_client.py": "admin API answers; a free port",
    "probes/test_auth.py": "auth refusals; a free port",
    "probes/test_inventory.py": "the inventory read; a free port",
    "probes/test_load.py": "counts, order and oracle; its floor (4 requests in 3 s) has a 10x margin",
    "probes/test_load_cli.py": "arrival counts; a 60 s TTFT limit",
    "probes/test_prometheus.py": "0 < TTFT p50 < 60 s",
    "probes/test_streaming.py": "record fields; a slower machine only helps",
    "reliability/test_locust_orphan.py": "no orphan within 30 s; its own worker",
    "reliability/test_malformed_clusters.py": "exit 3 naming the field; its own marker and held slots",
    "report/test_browser.py": "the DOM and a screenshot's size; its own chromium profile",
    "report/test_live.py": "the live line's format; its own state folder",
    "report/test_real_report_browser.py": "a stored results.json rendered; its own chromium profile",
    "report/test_results_schema.py": "the schema",
    "report/test_scorecard.py": "the layout; its own chromium profile",
    "scenarios/test_blackbox_rejoin.py": "rejoin within 30 s or never; free ports",
    "test_bench_mooncake.py": "bytes and messages; Mooncake picks its own port",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            rel = Path(str(item.fspath)).resolve().relative_to(HERE).as_posix()
        except ValueError:
            continue
        if rel in PARALLEL:
            item.add_marker(pytest.mark.parallel)
