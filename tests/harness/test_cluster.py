import textwrap

import pytest

from harness.clusterfile import CLUSTERS_DIR, load_cluster, resolve_cluster_path
from harness.errors import ConfigError, FaultError


def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_default_cluster_is_bundled_and_allows_faults():
    spec = load_cluster("local")
    assert spec.kind == "bundled" and spec.bundled.prefill >= 1 and spec.bundled.decode >= 1
    spec.safety.check_allowed("process_kill", spec.name)  # no exception
    assert spec.checklist().threshold("6.1.4", "reschedule_p100_s").value == 3.0


def test_every_shipped_cluster_file_validates():
    names = sorted(p.stem for p in CLUSTERS_DIR.glob("*.yaml"))
    assert {"local", "local-sabotaged", "example-prod", "ssh-test"} <= set(names)
    for name in names:
        assert load_cluster(name).name == name


def test_no_ecc_cluster_turns_ecc_handling_off_in_every_engine():
    assert load_cluster("local-no-ecc").bundled.engine.model_dump(exclude_unset=True) == {"ecc_handling": False}
    assert load_cluster("local").bundled.engine.model_dump(exclude_unset=True) == {}


def test_sabotaged_cluster_carries_the_router_setting():
    assert load_cluster("local-sabotaged").bundled.router.reschedule_delay_s > 3.0


def test_production_cluster_refuses_faults_unless_listed(tmp_path):
    prod = load_cluster("example-prod")
    assert prod.kind == "external" and prod.safety.production
    assert prod.endpoints.api.startswith("http://")
    with pytest.raises(FaultError, match="production.*fix: list 'process_kill' under safety.allowed_faults"):
        prod.safety.check_allowed("process_kill", prod.name)
    path = _write(tmp_path, """
        kind: external
        endpoints: {api: "http://127.0.0.1:1"}
        safety: {production: true, allowed_faults: [process_kill]}
    """)
    spec = load_cluster(path)
    spec.safety.check_allowed("process_kill", spec.name)
    with pytest.raises(FaultError):
        spec.safety.check_allowed("process_hang", spec.name)


def test_non_production_cluster_with_a_list_refuses_others():
    spec = load_cluster("ssh-test")
    spec.safety.check_allowed("process_hang", spec.name)
    with pytest.raises(FaultError, match="not allowed.*fix: add 'nic_flap'"):
        spec.safety.check_allowed("nic_flap", spec.name)
    assert spec.hosts[0].ssh.port == 2222


def test_production_cannot_allow_all(tmp_path):
    path = _write(tmp_path, """
        kind: external
        endpoints: {api: "http://127.0.0.1:1"}
        safety: {production: true, allowed_faults: all}
    """)
    with pytest.raises(ConfigError, match="safety.allowed_faults"):
        load_cluster(path)


@pytest.mark.parametrize("body, field, fix", [
    ("kind: cloud\n", "kind", "kind: bundled"),
    ("kind: bundled\nbundled: {prefill: 0}\n", "bundled.prefill", "whole number"),
    ("kind: bundled\nbundled: {workers: 3}\n", "bundled.workers", "use only"),
    ("kind: external\n", "endpoints", "add `endpoints:"),
    ("kind: external\nendpoints: {api: 'localhost:8000'}\n", "endpoints.api", "http://"),
    ("kind: bundled\nhosts: [{name: a, address: x, roles: [gpu]}]\n", "hosts[0].roles", "roles: [prefill]"),
    ("kind: bundled\nhosts: [{name: a, address: x, roles: [decode], ssh: {port: 70000}}]\n",
     "hosts[0].ssh.port", "1..65535"),
    ("kind: bundled\nsafety: {production: yes-please}\n", "safety.production", "production: true"),
    ("kind: bundled\nthresholds: {'6.1.4': {reschedule_p100_s: slow}}\n",
     "thresholds.6.1.4.reschedule_p100_s", "plain number"),
    ("kind: bundled\nfaults: []\n", "faults", "use only"),
    ("kind: bundled\nbundled: {engine: {ecc_handeling: false}}\n", "bundled.engine.ecc_handeling",
     "use only block_size"),
    ("kind: bundled\nbundled: {engine: {ecc_handling: maybe}}\n", "bundled.engine.ecc_handling",
     "set ecc_handling: true"),
    ("kind: bundled\nbundled: {engine: {block_size: 0}}\n", "bundled.engine.block_size", "set block_size >= 1"),
    ("kind: bundled\nbundled: {engine: {preset: small}}\n", "bundled.engine.preset", "set bundled.preset"),
    ("kind: bundled\nbundled: {engine: [ecc_handling]}\n", "bundled.engine", "engine: {ecc_handling: false}"),
    ("kind: bundled\nbundled: {preset: huge, engine: {ecc_handling: false}}\n", "bundled.preset", "use one of"),
    ("kind: bundled\nbundled: {engine: {block_size: 64, kv_budget_bytes: 65536}}\n",
     "bundled.engine", "raise kv_budget_bytes"),
])
def test_malformed_files_name_file_field_and_fix(tmp_path, body, field, fix):
    path = _write(tmp_path, body)
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    msg = str(err.value)
    assert str(path) in msg and f"`{field}`" in msg and fix in msg, msg


def test_unknown_cluster_name_lists_known_ones_and_the_one_meant():
    """A misspelt name gets "did you mean" with the close one (issue 37: local-loopbak); a name
    close to none gets the list only. Planted defect: no suggestion (the old message)."""
    with pytest.raises(ConfigError, match="no cluster named 'nope'.*local") as err:
        resolve_cluster_path("nope")
    assert "did you mean" not in str(err.value)
    with pytest.raises(ConfigError, match="did you mean --cluster=local-loopback\\?"):
        resolve_cluster_path("local-loopbak")
    with pytest.raises(ConfigError, match="neither a cluster name nor a path"):
        resolve_cluster_path("a b")


def test_ssh_targets_are_resolved_per_host_on_demand(tmp_path):
    from harness.cluster import ClusterHandle

    def handle(spec):
        return ClusterHandle(spec, spec.checklist(), "http://127.0.0.1:9", None, None)

    assert handle(load_cluster("local")).ssh_target("localhost") is None  # local commands
    key, known = tmp_path / "id", tmp_path / "known_hosts"
    key.write_text("k")
    known.write_text("h")
    path = tmp_path / "c.yaml"
    path.write_text(f"kind: bundled\nhosts: [{{name: localhost, address: 127.0.0.1, roles: [decode], "
                    f"ssh: {{user: root, port: 2222, key_file: {key}, known_hosts: {known}}}}}]\n")
    target = handle(load_cluster(path)).ssh_target("127.0.0.1")
    assert (target.host, target.port, target.key_filename) == ("127.0.0.1", 2222, str(key))
    with pytest.raises(ConfigError, match="key_filename .* is not a readable file"):
        handle(load_cluster("ssh-test")).ssh_target("localhost")  # its key is made by the SSH tests


def test_ssh_settings_require_key_and_known_hosts(tmp_path):
    path = _write(tmp_path, "kind: bundled\nhosts: [{name: a, address: x, roles: [decode], ssh: {user: u}}]\n")
    with pytest.raises(ConfigError, match=r"`hosts\[0\]\.ssh\.key_file`: missing"):
        load_cluster(path)
