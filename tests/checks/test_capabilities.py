"""What a cluster provides, what each item needs, and the inconclusive verdict that names the gap."""

import textwrap

import pytest

from harness.checks.capabilities import (ITEM_ALTERNATIVES, ITEM_NEEDS, PROVIDERS, Capabilities, capabilities_of,
                                         coverage, needs_of, not_supported, ways_of)
from harness.checks.verdict import Status, Verdict
from harness.cluster import ClusterHandle
from harness.clusterfile import load_cluster
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
    assert set(ITEM_ALTERNATIVES) <= set(ITEM_NEEDS)
    assert {c for ways in ITEM_ALTERNATIVES.values() for needs in ways for c in needs} <= set(PROVIDERS)


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
    assert caps.missing(needs_of(["6.1.2"])) == ["live_migration"]
    assert "migration: {on_worker_loss: true}" in caps.reason(["live_migration"])
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
    first = verdicts[0].cause
    assert first["code"] == "capability" and [m["capability"] for m in first["missing"][0]] == ["admin_api", "fault_hooks"]
    assert first["missing"][0][0]["why_not"] == "no endpoints.admin in the cluster file"
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


def test_an_engine_that_migrates_on_worker_loss_provides_live_migration_with_restartable_workers(tmp_path):
    hosts = "hosts: [{name: h, address: 127.0.0.1, roles: [decode]}]\n"
    worker = "  - {{name: {n}, role: decode, host: h, api: 'http://127.0.0.1:81{i}'{extra}}}\n"
    body = "engine: dynamo\nmigration: {on_worker_loss: true}\n" + hosts + "workers:\n"
    both = _external(tmp_path, body + worker.format(n="d0", i=0, extra=", supervised: true")
                     + worker.format(n="d1", i=1, extra=", restart: {command: 'systemctl restart d1'}"))
    assert capabilities_of(_handle(both)).missing(needs_of(["6.1.2"])) == []
    one_stuck = _external(tmp_path, body + worker.format(n="d0", i=0, extra=", supervised: true")
                          + worker.format(n="d1", i=1, extra=""))
    caps = capabilities_of(_handle(one_stuck))
    assert caps.missing(needs_of(["6.1.2"])) == ["live_migration"]
    assert "migrates on worker loss, but d1 cannot come back after a kill" in caps.reason(["live_migration"])
    no_claim = capabilities_of(_handle(_external(tmp_path, "engine: dynamo\nmigration: {on_worker_loss: false}\n")))
    assert "does not say the engine migrates" in no_claim.reason(["live_migration"])


LEVELS = "degradation: {levels: [{level: 2, kv_use_above: 0.8, expect: {queue: true}}]}\n"
WORKER = ("hosts: [{name: h, address: 127.0.0.1, roles: [aggregated]}]\n"
          "workers: [{name: w0, role: aggregated, host: h, api: 'http://127.0.0.1:81', "
          "metrics: 'http://127.0.0.1:81/metrics', supervised: true}]\n")


def test_6_1_3_has_two_ways_the_bundled_hooks_or_load_against_stated_levels():
    assert ways_of(["6.1.3", "nothing-lost"]) == [("admin_api", "fault_hooks"), ("kv_use_metric", "degradation_expectations")]
    assert ways_of(["6.1.3"], override=["admin_api"]) == [("admin_api",)]
    assert ways_of(["6.1.4"]) == [ITEM_NEEDS["6.1.4"]]


def test_a_vllm_cluster_with_worker_metrics_and_stated_levels_can_be_judged_by_load(tmp_path):
    caps = capabilities_of(_handle(_external(tmp_path, "engine: vllm\n" + WORKER + LEVELS)))
    missing = [caps.missing(w) for w in ways_of(["6.1.3"])]
    assert missing == [["admin_api", "fault_hooks"], []]  # the second way is met: the suite runs


def test_without_stated_levels_or_a_kv_metric_the_reason_names_every_way(tmp_path):
    handle = _handle(_external(tmp_path, "engine: vllm\n" + WORKER))
    caps = handle.capabilities()
    missing = [caps.missing(w) for w in ways_of(["6.1.3"])]
    assert missing == [["admin_api", "fault_hooks"], ["degradation_expectations"]]
    [verdict] = not_supported(handle.thresholds, ["6.1.3"], caps, missing[0], missing[1:])
    ways = verdict.cause["missing"]
    assert [[m["capability"] for m in way] for way in ways] == missing
    assert ways[1][0]["why_not"] == "the cluster file states no degradation expectations (degradation.levels)"
    assert verdict.reason.startswith("not judged on this cluster: needs admin_api")   # rendered from them
    assert verdict.evidence["missing_per_way"] == missing
    openai = capabilities_of(_handle(_external(tmp_path, "engine: openai\n" + LEVELS),
                                     metrics="http://127.0.0.1:9/metrics"))
    assert not openai.provided["kv_use_metric"] and "no metric profile" in openai.why_not["kv_use_metric"]
    no_urls = capabilities_of(_handle(_external(tmp_path, "engine: sglang\n" + LEVELS)))
    assert no_urls.why_not["kv_use_metric"] == "no endpoints.metrics or workers[].metrics"


def test_ecc_can_be_judged_through_dcgm_when_a_decode_workers_gpus_sit_on_a_dcgm_host(tmp_path):
    hosts = "hosts: [{name: h, address: 127.0.0.1, roles: [decode], dcgm: {dcgmi: /usr/bin/dcgmi}}]\n"
    worker = "workers: [{name: d0, role: decode, host: h, api: 'http://127.0.0.1:81', gpus: [0, 1]}]\n"
    caps = capabilities_of(_handle(_external(tmp_path, "engine: dynamo\n" + hosts + worker)))
    assert [caps.missing(w) for w in ways_of(["ecc"])] == [["admin_api", "fault_hooks"], []]
    no_gpus = capabilities_of(_handle(_external(tmp_path, "engine: dynamo\n" + hosts + worker.replace(
        ", gpus: [0, 1]", ""))))
    assert "workers[].gpus" in no_gpus.reason(["gpu_fault_injection"])
