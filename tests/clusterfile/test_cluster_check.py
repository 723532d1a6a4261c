"""`python -m harness schema --check` runs the check a run makes before it starts
(harness.clusterfile.load.check_cluster) on every file it is given; YAML errors name the line to
fix; `schema | head` ends quietly."""

import subprocess
import sys

import pytest

from harness.cli import main as cli_main
from harness.clusterfile import check_cluster, load_cluster, missing_ssh_files
from harness.errors import ConfigError

GOOD = """\
kind: external
endpoints: {api: "http://127.0.0.1:9/v1"}
"""


@pytest.fixture
def no_ssh_home(tmp_path, monkeypatch):
    """A home folder without ~/.ssh: the shipped prod-a.yaml's key files do not exist."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def test_prod_a_is_refused_for_a_run_for_its_missing_key_file_and_fine_for_a_dry_run(no_ssh_home):
    with pytest.raises(ConfigError, match=r"field `hosts\[0\]\.ssh\.key_file`: ~/.ssh/pd_chaos_ed25519 does not exist"):
        check_cluster("prod-a")
    spec = check_cluster("prod-a", dry_run=True)  # a dry run contacts no host: it reads no key
    assert [str(p).split(": field ")[1].split(":")[0] for p in missing_ssh_files(spec)] == [
        "`hosts[0].ssh.key_file`", "`hosts[0].ssh.known_hosts`", "`hosts[1].ssh.key_file`", "`hosts[1].ssh.known_hosts`"]


def test_a_readable_key_file_passes(no_ssh_home, monkeypatch):
    (no_ssh_home / ".ssh").mkdir()
    for name in ("pd_chaos_ed25519", "known_hosts"):
        (no_ssh_home / ".ssh" / name).write_text("x\n")
    monkeypatch.setenv("PROD_A_API_KEY", "k")
    assert check_cluster("prod-a").name == "prod-a"
    assert missing_ssh_files(load_cluster("prod-a")) == []


def test_every_problem_before_a_run_is_named_at_once(tmp_path, no_ssh_home, monkeypatch, capsys):
    """Issue 37: `harness schema --check` named one missing file per run, passed an empty key file and
    never mentioned the unset API-key variable. Now one check names them all: two missing key files
    (on two hosts), an empty known_hosts file and the unset variable. Planted defects: raising the
    first problem only (the old check_before_start); the empty file passing; the variable not read."""
    monkeypatch.delenv("PROD_A_API_KEY", raising=False)
    (no_ssh_home / ".ssh").mkdir()
    (no_ssh_home / ".ssh" / "known_hosts").write_text("")   # empty: no host key can be verified
    with pytest.raises(ConfigError) as err:
        check_cluster("prod-a")
    text = str(err.value)
    assert text.startswith("5 problems before a run can start:"), text
    for field in ("hosts[0].ssh.key_file", "hosts[1].ssh.key_file", "hosts[0].ssh.known_hosts",
                  "hosts[1].ssh.known_hosts", "auth.api_key_env"):
        assert f"field `{field}`" in text, (field, text)
    assert "known_hosts is empty" in text and "$PROD_A_API_KEY is not set" in text
    assert cli_main(["schema", "--check", "prod-a"]) == 3
    assert "5 problems before a run can start" in capsys.readouterr().err


def test_schema_check_reports_every_bad_file_and_flags_prod_a_as_a_run_does(tmp_path, no_ssh_home, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text(GOOD.replace("kind:", "knd:"))
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    assert cli_main(["schema", "--check", str(typo), "prod-a", str(good), "no-such-cluster"]) == 3
    out, err = capsys.readouterr()
    assert f"{typo}: field `knd`: unknown field" in err
    assert "hosts[0].ssh.key_file" in err and "no cluster named 'no-such-cluster'" in err
    assert "3 of 4 cluster file(s) bad" in err
    assert f"{good}: ok (external" in out  # checked although files before it were bad
    assert cli_main(["schema", "--dry-run", "--check", "prod-a"]) == 0
    assert "prod-a.yaml: ok (external, engine vllm, 2 workers; checked as a dry run" in capsys.readouterr().out


def test_schema_piped_into_head_ends_quietly():
    proc = subprocess.run(f"{sys.executable} -m harness schema | head -2", shell=True, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.startswith("{\n") and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("text, where", [
    ("name: y\nkind external\nendpoints:\n  api: x\n", "at line 2, column 1: could not find expected ':'"),
    ("kind: external\ndescription: 'unclosed\nname: y\n", "at line 2, column 14: found unexpected end of stream"),
    ("kind: external\nendpoints:\n  api: x\n metrics: y\n", "at line 4, column 2: expected <block end>"),
    ("kind: external\nendpoints: {api: x\nname: y\n", "at line 3, column 5: expected ',' or '}'"),
], ids=["missing-colon", "unclosed-quote", "indentation", "unclosed-brace"])
def test_a_yaml_error_names_the_line_to_fix_counted_from_1(tmp_path, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    assert f"{path}: not valid YAML {where}" in str(err.value), str(err.value)
