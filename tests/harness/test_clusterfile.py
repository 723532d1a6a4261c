"""Cluster file version 2 (pydantic models): every new field loads, every typo in one exits 3
naming file, field and fix, the JSON Schema is valid and accepts every shipped file."""

import json
import textwrap

import jsonschema
import pytest
import yaml

from harness.cli import main as cli_main
from harness.cluster import ClusterHandle
from harness.clusterfile import CLUSTERS_DIR, json_schema, load_cluster
from harness.errors import ConfigError

V2 = textwrap.dedent("""\
    version: 2
    name: vllm-agg
    kind: external
    engine: vllm
    model: tiny-llama
    auth: {api_key_env: HARNESS_TEST_KEY}
    endpoints: {api: http://127.0.0.1:8100, metrics: http://127.0.0.1:8100/metrics, admin: null}
    workload: {prompt_tokens: 200, output_tokens: 64, mix: [{prompt_tokens: 200, output_tokens: 64, weight: 1}]}
    migration: {on_worker_loss: true}
    workers:
      - name: vllm-0
        role: aggregated
        host: localhost
        api: http://127.0.0.1:8101
        health: http://127.0.0.1:8101/health
        metrics: http://127.0.0.1:8101/metrics
        process: {pgrep: "vllm.entrypoints.openai.api_server.*--port 8101"}
        restart: {command: "systemctl restart vllm-0"}
      - name: vllm-1
        role: aggregated
        host: localhost
        api: http://127.0.0.1:8102
        process: {pid_file: /run/vllm-1.pid}
        supervised: true
    hosts: [{name: localhost, address: 127.0.0.1, roles: [aggregated]}]
    safety: {production: true, allowed_faults: [process_kill]}
""")


def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def _handle(spec):
    return ClusterHandle(spec, spec.checklist(), "http://127.0.0.1:9", None, None)


def test_version_2_fields_reach_the_handle(tmp_path, monkeypatch):
    spec = load_cluster(_write(tmp_path, V2))
    handle = _handle(spec)
    assert (handle.engine, handle.model, spec.metric_profile) == ("vllm", "tiny-llama", "vllm")
    assert [(w.name, w.role, w.process.how[0], w.restartable) for w in handle.workers] == [
        ("vllm-0", "aggregated", "pgrep", True), ("vllm-1", "aggregated", "pid_file", True)]
    assert handle.workers[0].health == "http://127.0.0.1:8101/health"
    assert (handle.workload.prompt_tokens, handle.workload.mix[0].output_tokens) == (200, 64)
    monkeypatch.setenv("HARNESS_TEST_KEY", "s3cret")
    assert handle.api_key() == "s3cret" and handle.auth_headers() == {"Authorization": "Bearer s3cret"}
    described = json.dumps(handle.describe())
    assert "s3cret" not in described and "HARNESS_TEST_KEY" in described  # the variable's name, never the key


def test_unset_api_key_variable_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("HARNESS_TEST_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"environment variable HARNESS_TEST_KEY .* is not set.*fix: export"):
        _handle(load_cluster(_write(tmp_path, V2))).api_key()


def test_version_1_defaults_are_unchanged():
    local, prod = load_cluster("local"), load_cluster("example-prod")
    assert (local.version, local.engine_name, local.metric_profile, local.workers) == (None, "bundled", "pdengine", ())
    assert (prod.engine_name, prod.metric_profile, prod.auth, prod.model) == ("openai", None, None, None)
    assert _handle(local).api_key() is None


# (text in V2, replacement, field named in the error, text of the fix)
TYPOS = [
    ("version: 2", "version: 3", "version", "version: 2"),
    ("engine: vllm", "engine: vlm", "engine", "vllm"),
    ("engine: vllm", "engin: vllm", "engin", "did you mean `engine`"),
    ("model: tiny-llama", "model: ''", "model", "model: tiny-llama"),
    ("api_key_env: HARNESS_TEST_KEY", "api_key_env: 'my key'", "auth.api_key_env", "NAME of an environment variable"),
    ("api_key_env: HARNESS_TEST_KEY", "api_key: HARNESS_TEST_KEY", "auth.api_key", "did you mean `api_key_env`"),
    ("workload: {prompt_tokens: 200", "workload: {prompt_token: 200", "workload.prompt_token",
     "did you mean `prompt_tokens`"),
    ("workload: {prompt_tokens: 200", "workload: {prompt_tokens: -5", "workload.prompt_tokens", "whole number"),
    ("output_tokens: 64, weight: 1", "output_tokens: 64, weight: 0", "workload.mix[0].weight", "positive number"),
    ("mix: [{prompt_tokens: 200,", "mix: [{prompts: 200,", "workload.mix[0].prompts", "use only prompt_tokens"),
    ("role: aggregated\n    host: localhost\n    api: http://127.0.0.1:8101",
     "role: agregated\n    host: localhost\n    api: http://127.0.0.1:8101", "workers[0].role", "role: aggregated"),
    ("    host: localhost\n    api: http://127.0.0.1:8101", "    host: elsewhere\n    api: http://127.0.0.1:8101",
     "workers[0].host", "use one of localhost"),
    ("api: http://127.0.0.1:8101", "api: 127.0.0.1:8101", "workers[0].api", "http://"),
    ("health: http://127.0.0.1:8101/health", "helth: http://127.0.0.1:8101/health", "workers[0].helth",
     "did you mean `health`"),
    ("metrics: http://127.0.0.1:8101/metrics", "metrics: 8101", "workers[0].metrics", "metrics: http://"),
    ('process: {pgrep: "vllm', 'process: {prgep: "vllm', "workers[0].process.prgep", "did you mean `pgrep`"),
    ("process: {pid_file: /run/vllm-1.pid}", "process: {pid_file: /run/x.pid, systemd_unit: x}",
     "workers[1].process", "process: {pgrep:"),
    ('restart: {command: "systemctl restart vllm-0"}', 'restart: {cmd: "systemctl restart vllm-0"}',
     "workers[0].restart.cmd", "use only command"),
    ("supervised: true", "supervised: sure", "workers[1].supervised", "supervised: true"),
    ('restart: {command: "systemctl restart vllm-0"}', 'restart: {command: "x"}\n    supervised: true',
     "workers[0].supervised", "remove `restart:`"),
    ("- name: vllm-1", "- name: vllm-0", "workers[1].name", "its own name"),
    ("admin: null", "admin: 'ftp://x'", "endpoints.admin", "http://"),
    ("kind: external", "kind: bundled", "endpoints", "use `kind: external`"),
    ("migration: {on_worker_loss: true}", "migration: {on_worker_los: true}", "migration.on_worker_los",
     "did you mean `on_worker_loss`"),
    ("migration: {on_worker_loss: true}", "migration: {on_worker_loss: often}", "migration.on_worker_loss",
     "on_worker_loss: true"),
]


@pytest.mark.parametrize("old, new, field, fix", TYPOS, ids=[t[2] + ":" + t[1][:12] for t in TYPOS])
def test_a_typo_in_any_new_field_names_file_field_and_fix(tmp_path, old, new, field, fix):
    assert old in V2
    path = _write(tmp_path, V2.replace(old, new, 1))
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    msg = str(err.value)
    assert str(path) in msg and f"`{field}`" in msg and fix in msg, msg


def test_a_typo_exits_3_from_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HARNESS_TEST_KEY", "k")   # V2 names it: a check before a run needs it set
    path = _write(tmp_path, V2.replace("engine: vllm", "engine: vlm"))
    assert cli_main(["schema", "--check", str(path)]) == 3
    err = capsys.readouterr().err
    assert f"{path}: field `engine`" in err and "fix:" in err
    assert cli_main(["schema", "--check", str(_write(tmp_path, V2, "ok.yaml"))]) == 0


def test_path_is_set_by_the_loader_not_the_file(tmp_path):
    with pytest.raises(ConfigError, match="field `path`: unknown field"):
        load_cluster(_write(tmp_path, V2 + "path: /etc\n"))


def test_schema_command_prints_a_valid_json_schema_that_accepts_every_shipped_file(tmp_path, capsys):
    assert cli_main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    files = sorted(CLUSTERS_DIR.glob("*.yaml"))
    assert len(files) >= 5
    for path in [*files, _write(tmp_path, V2)]:
        errors = [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
        assert not errors, (path, errors)
        load_cluster(path)  # and the loader agrees
    assert list(validator.iter_errors({"kind": "external", "engine": "vlm"}))  # the schema rejects typos too
    assert "x-fix" in json.dumps(schema["properties"]["engine"])


def test_bundled_kind_alone_means_the_default_topology(tmp_path):
    spec = load_cluster(_write(tmp_path, "kind: bundled\n"))
    assert (spec.bundled.prefill, spec.bundled.decode, spec.bundled.preset) == (2, 2, "tiny")
    assert spec.safety.allowed_faults is None and not spec.fabric.enabled
