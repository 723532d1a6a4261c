"""The cluster file's ``degradation:`` section (6.1.3 by load): it loads, the schema shows it, every
typo in it exits 3 naming file, field and fix."""

import json

import pytest

from harness.cli import main as cli_main
from harness.clusterfile import load_cluster
from harness.errors import ConfigError

BASE = """\
version: 2
kind: external
engine: vllm
endpoints: {api: http://127.0.0.1:8100, metrics: http://127.0.0.1:8100/metrics}
degradation:
  levels:
    - {level: 2, kv_use_above: 0.80, expect: {queue: true, no_errors: true}}
    - {level: 5, kv_use_above: 0.95, expect: {reject: {status: [429, 503], retry_after: true}, max_tokens_cap: 16}}
  load: {prompt_tokens: 800, output_tokens: 256, max_concurrency: 48, ramp_budget_s: 90, hold_s: 5}
"""


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_the_section_loads_with_its_defaults(tmp_path):
    spec = load_cluster(_write(tmp_path, BASE))
    l2, l5 = spec.degradation.levels
    assert (l2.level, l2.kv_use_above, l2.expect.queue, l2.expect.no_errors) == (2, 0.8, True, True)
    assert (l5.expect.reject.status, l5.expect.reject.retry_after, l5.expect.max_tokens_cap) == ((429, 503), True, 16)
    assert spec.degradation.load.max_concurrency == 48
    short = load_cluster(_write(tmp_path, BASE.split("  load:")[0].replace("retry_after: true", "status: [503]")))
    assert short.degradation.load.hold_s == 10.0 and short.degradation.levels[1].expect.reject.status == (503,)
    assert load_cluster("vllm-agg").degradation.levels[-1].expect.queue  # the shipped vLLM file states its levels


TYPOS = [
    ("kv_use_above: 0.80", "kv_use_abov: 0.80", "degradation.levels[0].kv_use_abov", "did you mean `kv_use_above`"),
    ("kv_use_above: 0.80", "kv_use_above: 80", "degradation.levels[0].kv_use_above", "between 0 and 1"),
    ("queue: true, no_errors", "queue: sure, no_errors", "degradation.levels[0].expect.queue", "queue: true"),
    ("retry_after: true", "retry_afer: true", "degradation.levels[1].expect.reject.retry_afer",
     "did you mean `retry_after`"),
    ("status: [429, 503]", "status: [429, 200]", "degradation.levels[1].expect.reject.status", "[429, 503]"),
    ("max_tokens_cap: 16", "max_tokens_cap: 0", "degradation.levels[1].expect.max_tokens_cap", "such as 32"),
    ("expect: {queue: true, no_errors: true}", "expect: {}", "degradation.levels[0].expect", "write one of reject"),
    ("{queue: true, no_errors: true}", "{queue: true, reject: {status: [429]}}", "degradation.levels[0].expect.reject",
     "not both"),
    ("level: 5, kv_use_above: 0.95", "level: 5, kv_use_above: 0.75", "degradation.levels[1]", "rising order"),
    ("hold_s: 5", "hold: 5", "degradation.load.hold", "did you mean `hold_s`"),
    ("max_concurrency: 48", "max_concurrency: 0", "degradation.load.max_concurrency", "such as 64"),
    ("  levels:", "  level:", "degradation.level", "did you mean `levels`"),
]


@pytest.mark.parametrize("old, new, field, fix", TYPOS, ids=[t[2] for t in TYPOS])
def test_a_typo_names_file_field_and_fix(tmp_path, old, new, field, fix):
    assert old in BASE
    path = _write(tmp_path, BASE.replace(old, new, 1))
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    msg = str(err.value)
    assert str(path) in msg and f"`{field}`" in msg and fix in msg, msg


def test_a_typo_exits_3_and_the_schema_shows_the_section(tmp_path, capsys):
    assert cli_main(["schema", "--check", str(_write(tmp_path, BASE.replace("hold_s", "hodl_s")))]) == 3
    assert "field `degradation.load.hodl_s`" in capsys.readouterr().err
    assert cli_main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {"Degradation", "DegradationLevel", "LevelExpectation", "Rejection"} <= set(schema["$defs"])
    assert "degradation" in schema["properties"]
