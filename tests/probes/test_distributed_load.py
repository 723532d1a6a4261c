"""Distributed load (issue 28 item 1): Locust's own master here, one Locust worker per load host over
SSH, the records streamed back over SFTP and merged with the host named.

The slow tests run on real hosts: three network namespaces, each with its own sshd, and the bundled
engine behind the namespace router (harness.fabric.sshdtest, prefix ``pdc-``). The fast ones check
the cluster file's ``load_hosts:``, the merging of record files and the runner's own checks."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from harness.clusterfile import parse_cluster
from harness.errors import ConfigError, HarnessError, ProbeError
from harness.hosts import AuditLog, SSHTarget
from harness.probes.loadgen.load import LoadRunner
from harness.probes.loadgen.load_distributed import DistributedLoadRunner, runner_for
from harness.probes.loadgen.load_hosts import LoadHostTarget, RecordStream, load_host_targets, master_bind_address
from harness.probes.client.records import RecordWriter, RequestRecord, read_records
from harness.probes.loadgen.workload import LoadProfile

MASTER_PORT = 19300
SSH = {"key_file": "k", "known_hosts": "kh"}
BASE = {"kind": "external", "endpoints": {"api": "http://10.0.0.5:8000"},
        "hosts": [{"name": "h0", "address": "10.0.0.1", "roles": ["decode"], "ssh": SSH},
                  {"name": "h1", "address": "10.0.0.2", "roles": ["decode"]}]}


# -- the cluster file ---------------------------------------------------------------------------

def test_load_hosts_name_a_host_or_bring_their_own_address_and_ssh():
    spec = parse_cluster({**BASE, "load_hosts": ["h0", {"name": "gen-1", "address": "10.0.0.9", "ssh": SSH,
                                                         "python": "/opt/venv/bin/python"}],
                          "load_master": {"bind": "10.0.0.5", "port": 19300}}, source="lab.yaml")
    targets = load_host_targets(spec, dry_run=True)
    assert [(t.name, t.ssh.host, t.python) for t in targets] == [("h0", "10.0.0.1", "python3"),
                                                                   ("gen-1", "10.0.0.9", "/opt/venv/bin/python")]
    assert spec.load_master.port == 19300 and parse_cluster(BASE, source="x.yaml").load_hosts == ()


@pytest.mark.parametrize("load_hosts, field, words", [
    (["h1"], "load_hosts[0].name", "has no ssh settings"),
    (["nope"], "load_hosts[0].name", "not a host under `hosts:`"),
    (["h0", "h0"], "load_hosts[1].name", "listed twice"),
    ([{"name": "h0", "address": "10.0.0.7", "ssh": SSH}], "load_hosts[0]", "also has its own address"),
    ([{"name": "g", "address": "10.0.0.7"}], "load_hosts[0].ssh", "has address but no ssh"),
    ([{"name": "g", "address": "10.0.0.7", "ssh": SSH, "work_dir": "tmp/x"}], "load_hosts[0].work_dir",
     "not an absolute path"),
])
def test_a_wrong_load_host_is_an_error_naming_the_field_and_the_fix(load_hosts, field, words):
    with pytest.raises(ConfigError) as err:
        parse_cluster({**BASE, "load_hosts": load_hosts}, source="lab.yaml")
    assert f"field `{field}`" in str(err.value) and words in str(err.value) and err.value.fix


# -- merging records ------------------------------------------------------------------------------

def _record(i: int) -> RequestRecord:
    return RequestRecord(request_id=f"load-{i}", sent_ns=1000 + i, end_ns=2000 + i, anchor_wall_ns=5, anchor_perf_ns=5)


def test_records_stream_in_with_their_host_named_and_a_line_being_written_waits(tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    with RecordWriter(remote / "requests.w0.jsonl") as w0, RecordWriter(remote / "requests.w1.jsonl") as w1:
        w0.write(_record(0))
        w1.write(_record(1))
    with open(remote / "requests.w0.jsonl", "a") as fh:  # the worker is in the middle of a line
        fh.write(json.dumps(_record(2).to_dict())[:40])
    merged = tmp_path / "requests.jsonl"
    with RecordWriter(merged) as out:
        stream = RecordStream("gen-1", out)
        names = lambda: os.listdir(remote)  # noqa: E731
        opener = lambda n: open(remote / n, "rb")  # noqa: E731
        assert stream.pull(names(), opener) == 2
        assert stream.pull(names(), opener) == 0  # nothing new: nothing read twice
        with open(remote / "requests.w0.jsonl", "a") as fh:
            fh.write(json.dumps(_record(2).to_dict())[40:] + "\n" + json.dumps(_record(3).to_dict())[:10])
        assert stream.pull(names(), opener, final=True) == 1  # the torn last line is not a record
    records = read_records(merged)
    assert sorted(r.request_id for r in records) == ["load-0", "load-1", "load-2"]
    assert {r.load_host for r in records} == {"gen-1"} and stream.count == 3


def test_a_line_that_is_no_record_names_the_host(tmp_path):
    (tmp_path / "requests.jsonl").write_text('{"request_id": "x", "bogus": 1}\n')
    with RecordWriter(tmp_path / "out.jsonl") as out, pytest.raises(ProbeError, match="load host gen-2"):
        RecordStream("gen-2", out).pull(["requests.jsonl"], lambda n: open(tmp_path / n, "rb"))


# -- the runner's own checks ------------------------------------------------------------------------

def _targets(n: int) -> list[LoadHostTarget]:
    return [LoadHostTarget(f"gen-{i}", SSHTarget(host="127.0.0.1", user="root", key_filename="k",
                                                 known_hosts_file="kh", require_files=False)) for i in range(n)]


def test_each_load_host_runs_one_worker_with_at_least_one_user(tmp_path):
    profile = LoadProfile(mode="poisson", rate=4, users=4)
    with pytest.raises(ConfigError, match="4 Locust processes, but 3 load hosts"):
        DistributedLoadRunner("http://127.0.0.1:1", LoadProfile(users=4, processes=4), _targets(3), master_bind="127.0.0.1")
    with pytest.raises(ConfigError, match="2 users cannot be spread over 3 load hosts"):
        DistributedLoadRunner("http://127.0.0.1:1", LoadProfile(users=2), _targets(3), master_bind="127.0.0.1")
    with pytest.raises(ConfigError, match="named twice"):
        DistributedLoadRunner("http://127.0.0.1:1", profile, _targets(1) * 2, master_bind="127.0.0.1")
    runner = DistributedLoadRunner("http://127.0.0.1:1", profile, _targets(3), master_bind="127.0.0.1",
                                   master_port=MASTER_PORT, api_key="sk-secret", output_dir=tmp_path)
    assert runner.profile.processes == 3  # each worker takes every third arrival of the one schedule
    master = runner.command()
    assert master[master.index("--expect-workers") + 1] == "3" and "--master" in master
    assert master[master.index("--master-bind-port") + 1] == str(MASTER_PORT)


def test_the_master_listens_where_the_hosts_route_to_and_no_load_hosts_means_the_local_runner(tmp_path):
    assert master_bind_address(_targets(2)) == "127.0.0.1"
    spec = parse_cluster(BASE, source="x.yaml")
    assert type(runner_for(spec, "http://127.0.0.1:1", LoadProfile(), output_dir=tmp_path)) is LoadRunner


# -- on real hosts --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    """Three namespace hosts with sshd and the bundled engine (router on the control bridge)."""
    from harness.fabric.builder import leftovers
    from harness.fabric.sshdtest import SshdTest, unavailable_reason

    from tests.fabric.conftest import missing, require_fabric

    require_fabric()
    if reason := unavailable_reason():
        missing(reason)
    if leftovers(prefix="pdc-"):
        missing(f"a pdc- fabric is already up: {leftovers(prefix='pdc-')}")
    state = tmp_path_factory.mktemp("dload")
    with SshdTest(state, hosts=3, engine=True, prefix="pdc-", fabric_subnet="198.18.51.0/24",
                  control_subnet="198.18.52.0/24") as st:
        yield st, state
    assert leftovers(prefix="pdc-") == []


def _load_hosts(st, state: Path) -> list[LoadHostTarget]:
    import sys

    return [LoadHostTarget(name, SSHTarget(host=addr, user="root", key_filename=str(st.key),
                                           known_hosts_file=str(st.known_hosts), port=port),
                           python=sys.executable, work_dir=str(state / "work"))
            for name, addr, port in st.endpoints()]


def _server_count(api: str) -> float:
    """Requests the router counted: every one that ended (any finish reason) or got an HTTP error."""
    from harness.probes.metrics.prometheus import PrometheusScraper

    scraper = PrometheusScraper(f"{api}/metrics")
    try:
        samples = scraper.scrape_once()
    finally:
        scraper.stop()
    return sum(s.value for s in samples
               if s.name in ("pdengine_requests_finished_total", "pdengine_http_errors_total"))


def _cmdline(pid: str) -> str | None:
    """A process's command line, or None when it ended between listing and reading (CI hit that race:
    an SSH session process of the run exiting while the namespace's pids were read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _nothing_left(st, state: Path) -> None:
    """No Locust process of the run on any host, no run folder left on any host."""
    for name, _, _ in st.endpoints():
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
        cmds = [c for c in (_cmdline(p) for p in pids) if c is not None]
        assert not [c for c in cmds if "locust" in c], f"{name} still runs {cmds}"
    assert not list((state / "work").glob("*")), list((state / "work").iterdir())
    left = subprocess.run(["pgrep", "-f", f"master-port {MASTER_PORT}"], capture_output=True, text=True).stdout
    assert left == "", left


MEDIAN_MARGIN_MS = 20.0   # see the test below


@pytest.mark.slow
@pytest.mark.root
def test_three_load_hosts_send_what_the_server_counts_with_the_latency_of_one(hosts, tmp_path):
    from harness.fabric.sshdtest import ENGINE_PORT
    from harness.probes.client.analysis import requests_frame
    from harness.stats import nearest_rank
    from harness.stats.intervals import percentile_interval

    st, state = hosts
    api = f"http://{st.fabric.control_gateway_ip}:{ENGINE_PORT}"
    load_hosts = _load_hosts(st, state)
    profile = LoadProfile(mode="poisson", rate=4.0, users=6, duration_s=120, requests=60, max_tokens=8, seed=7)
    audit = AuditLog(tmp_path / "audit.jsonl")

    before = _server_count(api)
    three = DistributedLoadRunner(api, profile, load_hosts, master_port=MASTER_PORT, join_timeout_s=60,
                                  output_dir=tmp_path / "three", audit=audit)
    assert three.master_bind == st.fabric.control_gateway_ip  # found from the route to the hosts
    with three:
        assert three.joined_hosts() == {h.name for h in load_hosts}
        merged = three.wait()
    counted = _server_count(api) - before
    _nothing_left(st, state)

    assert len(merged) == 60 == counted  # every request the load hosts sent, and only those, reached the server
    assert sorted(r.request_id for r in merged) == sorted(f"load-{i}" for i in range(60))  # each arrival once
    by_host = {h.name: sum(r.load_host == h.name for r in merged) for h in load_hosts}
    assert all(n > 0 for n in by_host.values()) and sum(by_host.values()) == 60, by_host
    assert three.records_by_host() == by_host
    assert all(r.scheduled_ns is not None for r in merged)  # open loop: measured from the intended send
    assert (tmp_path / "three" / "requests.jsonl").exists()
    for h in load_hosts:  # every worker was started and ended over SSH, and audited
        argvs = [e["argv"] for e in audit.entries() if e["host"] == h.ssh.host]
        assert any("--worker" in a for a in argvs) and any(a[:3] == ["rm", "-rf", "--"] for a in argvs)

    one = DistributedLoadRunner(api, profile, load_hosts[:1], master_port=MASTER_PORT, output_dir=tmp_path / "one",
                                audit=audit)
    alone = one.run()
    _nothing_left(st, state)
    assert len(alone) == 60 and {r.load_host for r in alone} == {load_hosts[0].name}
    assert all(r.ok for r in merged + alone), [(r.status, r.error_class) for r in merged + alone if not r.ok]

    ttft = {k: requests_frame(recs)["ttft_sched_ms"].tolist() for k, recs in (("three", merged), ("one", alone))}
    iv = {k: percentile_interval(v, 50) for k, v in ttft.items()}
    figures = {k: f"median {sorted(v)[len(v) // 2]:.1f} ms, 95 % {iv[k].describe('ms')}" for k, v in ttft.items()}
    print(f"TTFT from the scheduled send: {figures}; records per host {by_host}; server counted {counted:.0f}")
    assert iv["three"].bounded and iv["one"].bounded
    # The same latency within a stated margin, not interval overlap: the two runs are sequential on a
    # shared 2-core machine, where identical runs' medians moved 2x (15 -> 35 ms) with the load
    # average at 4-5. What distributing could break (a wrong clock anchor, a host's records timed
    # from its own start, coordinated omission) moves the median by seconds, far past the margin.
    median = {k: nearest_rank(v, 50) for k, v in ttft.items()}
    assert abs(median["three"] - median["one"]) <= max(MEDIAN_MARGIN_MS, median["one"]), figures


@pytest.mark.slow
@pytest.mark.root
def test_a_host_that_never_joins_is_named_and_nothing_is_left_anywhere(hosts, tmp_path):
    import sys

    st, state = hosts
    api = f"http://{st.fabric.control_gateway_ip}:8390"
    load_hosts = _load_hosts(st, state)
    # the last host's "python" starts its worker toward a port where no master listens
    wrong = tmp_path / "python-wrong-port"
    wrong.write_text(f'#!/bin/sh\n[ "$1" = -m ] || exec {sys.executable} "$@"\n'
                     f'exec {sys.executable} "$@" --master-port {MASTER_PORT + 1}\n')
    wrong.chmod(0o755)
    load_hosts[-1] = LoadHostTarget(load_hosts[-1].name, load_hosts[-1].ssh, python=str(wrong),
                                    work_dir=load_hosts[-1].work_dir)
    runner = DistributedLoadRunner(api, LoadProfile(mode="poisson", rate=2.0, users=3, requests=10, max_tokens=4),
                                   load_hosts, master_port=MASTER_PORT, join_timeout_s=8, output_dir=tmp_path / "out")
    with pytest.raises(HarnessError) as err:
        runner.start()
    assert f"{load_hosts[-1].name} never joined" in str(err.value), err.value
    assert load_hosts[0].name not in str(err.value).split("never joined")[0]
    assert not runner.running and runner.returncode is not None  # the master reaped
    _nothing_left(st, state)
