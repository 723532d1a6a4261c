"""Find, read and validate a cluster file; turn pydantic's errors into the project's one
config-error shape (``FILE: field `a.b`: problem (fix: ...)``, exit code 3)."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from harness.checklists import Checklist
from harness.checklists.validation import config_error as pydantic_config_error
from harness.checklists.validation import display_path, field_error, load_yaml_mapping
from harness.clusterfile.models import NAME_PATTERN, ClusterFile, ClusterSpec
from harness.errors import ConfigError

# the shipped examples (a link to clusters/ in a checkout); `--cluster NAME` looks in ./clusters/ first
CLUSTERS_DIR = Path(__file__).resolve().parents[1] / "clusters"
_NAME = re.compile(NAME_PATTERN)


def cluster_search_path(cwd: Path | None = None) -> list[Path]:
    """Where ``--cluster NAME`` looks, in order: the user's ``./clusters/``, then the shipped examples."""
    dirs = [(cwd or Path.cwd()) / "clusters", CLUSTERS_DIR]
    unique: list[Path] = []
    for d in dirs:
        if d.is_dir() and all(d.resolve() != u.resolve() for u in unique):
            unique.append(d)
    return unique


def _search_order() -> str:
    """The lookup order in words, for the error when a name is not found."""
    own = Path.cwd() / "clusters"
    if own.is_dir() and own.resolve() == CLUSTERS_DIR.resolve():
        return f"./clusters/ ({own}, the shipped examples themselves)"
    state = "" if own.is_dir() else ": no such folder"
    return f"1. ./clusters/ of the current directory ({own}{state}), then 2. the shipped examples ({CLUSTERS_DIR})"


def resolve_cluster_path(name_or_path: str, clusters_dir: Path | None = None) -> Path:
    """``local`` -> ``./clusters/local.yaml`` if it exists, else the shipped ``local.yaml``
    (or only ``clusters_dir`` when given); anything with a slash or a .yaml suffix is a path."""
    if "/" in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        return Path(name_or_path)
    if not _NAME.match(name_or_path):
        raise ConfigError(f"--cluster {name_or_path!r} is neither a cluster name nor a path",
                          fix="pass a name from clusters/ (e.g. local) or a path to a .yaml file")
    dirs = [clusters_dir] if clusters_dir is not None else cluster_search_path()
    for d in dirs:
        path = d / f"{name_or_path}.yaml"
        if path.is_file():
            return path
    known = sorted({p.stem for d in dirs for p in d.glob("*.yaml")})
    looked = str(clusters_dir) if clusters_dir is not None else _search_order()
    close = difflib.get_close_matches(name_or_path, known, n=1, cutoff=0.75)
    mean = f"did you mean --cluster={close[0]}? " if close else ""
    raise ConfigError(f"--cluster {name_or_path}: no cluster named {name_or_path!r} (looked for "
                      f"{name_or_path}.yaml in {looked})",
                      fix=f"{mean}use one of {', '.join(known) or '(none)'}, put {name_or_path}.yaml in ./clusters/ "
                          "or pass a path to a cluster file")


def load_cluster(name_or_path: str | Path, *, checklist: Checklist | None = None) -> ClusterSpec:
    """Read and validate a cluster inventory (name under ``clusters/`` or a path); its threshold
    overrides are checked against ``checklist`` (the run's; None: the shipped one)."""
    path = resolve_cluster_path(str(name_or_path))
    _check_utf8(path)
    data = load_yaml_mapping(path)
    spec = parse_cluster(data, source=display_path(path))
    spec.checklist(checklist)  # validates the threshold overrides against the checklist now, not mid-run
    return spec


def parse_cluster(data: dict[str, Any], *, source: str) -> ClusterSpec:
    if "path" in data:  # a ClusterSpec field, but set by the loader
        raise field_error(source, "path", "unknown field", f"use only {', '.join(ClusterFile.model_fields)}")
    data = {"name": Path(source).stem, **data}
    try:
        spec = ClusterSpec.model_validate({**data, "path": source})
    except ValidationError as exc:
        raise config_error(exc, source) from None
    return spec


def check_cluster(name_or_path: str | Path, *, dry_run: bool = False,
                  checklist: Checklist | None = None) -> ClusterSpec:
    """Everything a run checks in a cluster file before it starts anything: the file itself
    (:func:`load_cluster`), then, unless ``dry_run``, what only a run that acts needs
    (:func:`check_before_start`: the SSH key and known_hosts files). A dry run contacts no host, so
    it needs no key file; it names the missing ones in its plan instead (:func:`missing_ssh_files`).
    ``pytest suites/`` and ``python -m harness schema --check`` both call this."""
    spec = load_cluster(name_or_path, checklist=checklist)
    if not dry_run:
        check_before_start(spec)
    return spec


def missing_ssh_files(spec: ClusterSpec) -> list[ConfigError]:
    """The SSH files :func:`check_before_start` would refuse, one error per unreadable or empty file."""
    problems = []
    for i, host in enumerate(spec.hosts):
        if host.ssh is None:
            continue
        for key, value in (("key_file", host.ssh.key_file), ("known_hosts", host.ssh.known_hosts)):
            problem = _ssh_file_error(spec.path, i, key, value)
            if problem is not None:
                problems.append(problem)
    return problems


def _ssh_file_error(source: str, index: int, key: str, value: str) -> ConfigError | None:
    try:
        with open(Path(value).expanduser(), "rb") as fh:
            empty = fh.read(1) == b""
    except OSError as exc:
        empty, why = False, ("does not exist" if isinstance(exc, FileNotFoundError)
                             else f"cannot be read ({exc.strerror})")
    else:
        why = "is empty"
        if not empty:
            return None
    return field_error(source, f"hosts[{index}].ssh.{key}", f"{value} {why}",
                       f"point `{key}` at a readable, non-empty file (relative paths are from {Path.cwd()}); "
                       + ("create the key with ssh-keygen and authorize it on the host" if key == "key_file"
                          else "add the host's verified key with ssh-keyscan"))


def start_problems(spec: ClusterSpec) -> list[ConfigError]:
    """Everything :func:`check_before_start` refuses, each problem once: the SSH key and
    known_hosts files (missing, unreadable or empty) and an API-key variable that is not set."""
    problems = missing_ssh_files(spec)
    auth = spec.auth
    if auth is not None and not os.environ.get(auth.api_key_env, "").strip():
        problems.append(field_error(spec.path, "auth.api_key_env",
                                    f"the API key's variable ${auth.api_key_env} is not set (or empty)",
                                    f"export {auth.api_key_env}=<the cluster's API key> before the run"))
    return problems


def check_before_start(spec: ClusterSpec) -> None:
    """What must hold before a run starts anything, beyond the file's own validity: every SSH key
    and known_hosts file the cluster names is a readable, non-empty file (absolute in the ledger
    later) and the API-key variable, when the file names one, is set. Every problem at once (one
    run of `harness schema --check` lists them all). Not part of :func:`load_cluster`, so a shipped
    example naming keys of another machine still loads."""
    problems = start_problems(spec)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        listed = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1))
        raise ConfigError(f"{len(problems)} problems before a run can start:\n{listed}",
                          fix="fix each as its line says, then check again with `harness schema --check`")


def _check_utf8(path: Path) -> None:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return  # load_yaml_mapping says "file not found"
    except OSError as exc:
        raise field_error(display_path(path), "<file>", f"cannot be read ({exc.strerror})",
                          "check the file's permissions") from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise field_error(display_path(path), "<file>",
                          f"not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line} (offset {exc.start})",
                          "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)") from None


def config_error(exc: ValidationError, source: str) -> ConfigError:
    """The first of pydantic's errors as ``FILE: field `a.b`: problem (fix: ...)``."""
    return pydantic_config_error(exc, source, ClusterSpec, default_fix="see docs/clusters.md", hidden=("path",))


def json_schema() -> dict[str, Any]:
    """The cluster file's JSON Schema (``python -m harness schema``)."""
    schema = ClusterFile.model_json_schema()
    schema["required"] = [r for r in schema.get("required", []) if r != "name"]  # the loader defaults it
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "PD conformance harness cluster file"
    return schema
