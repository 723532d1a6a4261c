"""What a cluster provides, what each item needs, and the inconclusive verdict that names the gap."""

import textwrap

import pytest

from harness.checks.capabilities import (ITEM_NEEDS, PROVIDERS, Capabilities, capabilities_of, coverage, needs_of,
                                         not_supported)
from harness.checks.verdict import Status, Verdict
from harness.cluster import ClusterHandle, load_cluster
from harness.errors import ConfigError


def _handle(spec, *, admin=None, metrics=None, topology=None, fabric=None, unavailable=None):
    return ClusterHandle(spec, spec.checklist(), "http://127.0.0.1:9", metrics, admin, topology=topology,
                         fabric=fabric, fabric_unavailable=unavailable)


def _external(tmp_path, body):
    path = tmp_path / "c.yaml"
    path.write_text("kind: external\nendpoints: {api: http://127.0.0.1:9}\n" + textwrap.dedent(body))
    return load_cluster(path)


def test_every_item_of_the_checklist_declares_its_needs_and_every_need_has_a_provider():
    checklist = load_cluster("local").checklist()
    assert set(ITEM_NEEDS) == set(checklist.items)
    assert {c for needs in ITEM_NEEDS.values() for c in needs} <= set(PROVIDERS)


def test_bundled_cluster_on_loopback_lacks_only_the_fabric_and_what_it_cannot_have():
    handle = _handle(load_cluster("local"), admin="http://127.0.0.1:9", metrics="http://127.0.0.1:9/metrics",
                     topology=object(), unavailable="needs root and iproute2")
    caps = handle.capabilities()
    for cap in ("admin_api", "live_migration", "fault_hooks", "worker_inventory", "restartable_workers",
                "engine_metrics"):
        assert caps.provided[cap], cap
    assert caps.missing(needs_of(["6.1.1", "6.1.4", "6.1.2"])) == ["emulated_fabric"]
    assert "needs root and iproute2" in caps.reason(["emulated_fabric"])


def test_external_openai_server_without_admin_can_only_be_judged_black_box(tmp_path):
    caps = capabilities_of(_handle(_external(tmp_path, "engine: openai\n")))
    assert caps.missing(needs_of(["6.2.ttft", "6.2.tpot", "nothing-lost"])) == []
    assert caps.missing(needs_of(["6.1.2"])) == ["admin_api", "live_migration"]
    assert caps.missing(needs_of(["6.1.4"])) == ["worker_inventory", "restartable_workers"]
    reason = caps.reason(caps.missing(needs_of(["6.1.1"])))
    assert reason.startswith("not judged on this cluster: needs emulated_fabric")
    assert "`ssh:` and `fabric:` settings on two or more hosts" in reason
    assert "0 host(s) with both `ssh:` and `fabric:` settings" in reason


def test_two_ssh_hosts_with_fabric_settings_provide_the_fabric_items(tmp_path):
    key = tmp_path / "key"
    key.write_text("k")
    host = ("  - {{name: h{i}, address: 10.0.0.{i}, roles: [{role}], ssh: {{key_file: {k}, known_hosts: {k}}}, "
            "fabric: {{interface: eth1, address: 10.1.0.{i}, lossless_class: '1:10'}}}}\n")
    spec = _external(tmp_path, "engine: openai\nhosts:\n" + host.format(i=1, role="prefill", k=key)
                     + host.format(i=2, role="decode", k=key))
    caps = capabilities_of(_handle(spec))
    assert caps.missing(needs_of(["6.1.1", "6.1.5", "nic-flap"])) == []


def test_workers_inventory_and_their_way_back_come_from_the_cluster_file(tmp_path):
    hosts = "hosts: [{name: h, address: 127.0.0.1, roles: [aggregated]}]\n"
    worker = "  - {{name: {n}, role: aggregated, host: h, api: 'http://127.0.0.1:81{i}'{extra}}}\n"
    some = _external(tmp_path, "engine: vllm\n" + hosts + "workers:\n"
                     + worker.format(n="w0", i=0, extra=", supervised: true")
                     + worker.format(n="w1", i=1, extra=""))
    caps = capabilities_of(_handle(some, metrics="http://127.0.0.1:9/metrics"))
    assert caps.provided["worker_inventory"] and caps.provided["engine_metrics"]
    assert not caps.provided["restartable_workers"]
    assert "no way back for w1" in caps.reason(["restartable_workers"])
    every = _external(tmp_path, "engine: vllm\n" + hosts + "workers:\n"
                      + worker.format(n="w0", i=0, extra=", supervised: true")
                      + worker.format(n="w1", i=1, extra=", restart: {command: 'systemctl restart w1'}"))
    assert capabilities_of(_handle(every)).provided["restartable_workers"]
    assert not capabilities_of(_handle(every)).provided["engine_metrics"]  # no metrics endpoint


def test_an_engine_without_a_profile_has_no_engine_metrics(tmp_path):
    caps = capabilities_of(_handle(_external(tmp_path, "engine: openai\n"), metrics="http://127.0.0.1:9/metrics"))
    assert not caps.provided["engine_metrics"] and "no metric profile" in caps.why_not["engine_metrics"]


def test_not_supported_records_one_inconclusive_verdict_per_item_naming_the_capability(tmp_path):
    handle = _handle(_external(tmp_path, "engine: openai\n"))
    caps = handle.capabilities()
    verdicts = not_supported(handle.thresholds, ["6.1.3", "nothing-lost"], caps, ["admin_api", "fault_hooks"])
    assert [(v.item, v.status) for v in verdicts] == [("6.1.3", Status.INCONCLUSIVE),
                                                       ("nothing-lost", Status.INCONCLUSIVE)]
    assert "needs admin_api (no endpoints.admin in the cluster file)" in verdicts[0].reason
    assert verdicts[0].evidence["missing_capabilities"] == ["admin_api", "fault_hooks"]


def test_needs_override_and_unknown_capability():
    assert needs_of(["6.1.4"], override=["worker_inventory"]) == ("worker_inventory",)
    with pytest.raises(ConfigError, match="unknown capabilities"):
        Capabilities({"teleport": True})


def test_coverage_separates_judged_from_not_judged_and_not_run():
    def v(item, status, reason="r"):
        return Verdict(item=item, title=item, status=status, reason=reason)

    cov = coverage([v("6.1.4", "pass"), v("nothing-lost", "inconclusive", "a"), v("nothing-lost", "fail"),
                    v("6.1.1", "inconclusive", "needs emulated_fabric")], ["6.1.1", "6.1.4", "nothing-lost", "ecc"])
    assert cov == {"judged": {"6.1.4": "pass", "nothing-lost": "fail"},
                   "not_judged": {"6.1.1": ["needs emulated_fabric"]}, "not_run": ["ecc"]}
