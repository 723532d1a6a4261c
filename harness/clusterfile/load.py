"""Find, read and validate a cluster file; turn pydantic's errors into the project's one
config-error shape (``FILE: field `a.b`: problem (fix: ...)``, exit code 3)."""

from __future__ import annotations

import json
import re
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from harness.checks.thresholds import display_path, field_error, load_yaml_mapping
from harness.clusterfile.models import NAME_PATTERN, ClusterFile, ClusterSpec, FieldProblem, did_you_mean
from harness.errors import ConfigError

# the shipped examples (a link to clusters/ in a checkout); `--cluster NAME` looks in ./clusters/ first
CLUSTERS_DIR = Path(__file__).resolve().parents[1] / "clusters"
_NAME = re.compile(NAME_PATTERN)
# set by the harness per worker, not by a cluster file
_ENGINE_RESERVED = {"preset": "bundled.preset", "name": "the worker id"}


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
    raise ConfigError(f"--cluster {name_or_path}: no cluster named {name_or_path!r} (looked for "
                      f"{name_or_path}.yaml in {looked})",
                      fix=f"use one of {', '.join(known) or '(none)'}, put {name_or_path}.yaml in ./clusters/ "
                          "or pass a path to a cluster file")


def load_cluster(name_or_path: str | Path) -> ClusterSpec:
    """Read and validate a cluster inventory (name under ``clusters/`` or a path)."""
    path = resolve_cluster_path(str(name_or_path))
    _check_utf8(path)
    data = load_yaml_mapping(path)
    spec = parse_cluster(data, source=display_path(path))
    spec.checklist()  # validates the threshold overrides against the checklist now, not mid-run
    return spec


def parse_cluster(data: dict[str, Any], *, source: str) -> ClusterSpec:
    if "path" in data:  # a ClusterSpec field, but set by the loader
        raise field_error(source, "path", "unknown field", f"use only {', '.join(ClusterFile.model_fields)}")
    data = {"name": Path(source).stem, **data}
    try:
        spec = ClusterSpec.model_validate({**data, "path": source})
    except ValidationError as exc:
        raise config_error(exc, source) from None
    if spec.bundled is not None:
        _check_preset(source, spec.bundled.preset)
        _check_router(source, spec.bundled.router)
    if spec.bundled is not None and spec.bundled.engine:
        _check_engine(source, spec.bundled.engine, spec.bundled.preset)
    return spec


def check_cluster(name_or_path: str | Path, *, dry_run: bool = False) -> ClusterSpec:
    """Everything a run checks in a cluster file before it starts anything: the file itself
    (:func:`load_cluster`), then, unless ``dry_run``, what only a run that acts needs
    (:func:`check_before_start`: the SSH key and known_hosts files). A dry run contacts no host, so
    it needs no key file; it names the missing ones in its plan instead (:func:`missing_ssh_files`).
    ``pytest suites/`` and ``python -m harness schema --check`` both call this."""
    spec = load_cluster(name_or_path)
    if not dry_run:
        check_before_start(spec)
    return spec


def missing_ssh_files(spec: ClusterSpec) -> list[ConfigError]:
    """What :func:`check_before_start` would refuse, one error per unreadable file (a dry run's plan)."""
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
            fh.read(1)
    except OSError as exc:
        why = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc.strerror})"
        return field_error(source, f"hosts[{index}].ssh.{key}", f"{value} {why}",
                           f"point `{key}` at a readable file (relative paths are from {Path.cwd()}); "
                           + ("create the key with ssh-keygen and authorize it on the host" if key == "key_file"
                              else "add the host's verified key with ssh-keyscan"))
    return None


def check_before_start(spec: ClusterSpec) -> None:
    """What must hold before a run starts anything, beyond the file's own validity: every SSH key
    and known_hosts file the cluster names is a readable file (absolute in the ledger later). Not
    part of :func:`load_cluster`, so a shipped example naming keys of another machine still loads."""
    problems = missing_ssh_files(spec)
    if problems:
        raise problems[0]


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


def _check_preset(source: str, preset: str) -> None:
    from harness.engine.core.config import PRESETS  # no torch at import

    if preset not in PRESETS:
        raise field_error(source, "bundled.preset", f"unknown model preset {preset!r}",
                          f"{did_you_mean(preset, PRESETS)}use one of {', '.join(sorted(PRESETS))} "
                          "(`python -m harness presets` lists them)")


def _check_router(source: str, raw: dict[str, Any]) -> None:
    """``bundled.router``: RouterConfig fields, each key by name, then the whole (before the
    cluster starts: a misspelt knob must not be found by a router that is already running)."""
    from harness.engine.pd.router_config import RouterConfig

    allowed = set(RouterConfig.__dataclass_fields__)
    for key in raw:
        if key not in allowed:
            raise field_error(source, f"bundled.router.{key}", "unknown router setting",
                              f"{did_you_mean(key, allowed)}use only {', '.join(sorted(allowed))}")
    try:
        RouterConfig.from_dict(raw)
    except (ConfigError, TypeError, ValueError) as exc:
        fix = getattr(exc, "fix", None)
        problem = str(exc).removesuffix(f" (fix: {fix})") if fix else str(exc)
        raise field_error(source, "bundled.router", problem, fix or "see RouterConfig in harness/engine/pd/router.py") \
            from None


def config_error(exc: ValidationError, source: str) -> ConfigError:
    """The first of pydantic's errors as ``FILE: field `a.b`: problem (fix: ...)``."""
    errors = exc.errors(include_url=False)
    err = errors[0]
    if err["type"] == "missing":  # a misspelt required key: the unknown key (with did-you-mean) says more
        err = next((e for e in errors if e["type"] == "extra_forbidden" and e["loc"][:-1] == err["loc"][:-1]), err)
    path, info, model, dropped = _walk(err["loc"], err["type"] == "extra_forbidden")
    kind, given = err["type"], err.get("input")
    problem_error = (err.get("ctx") or {}).get("error")
    if isinstance(problem_error, FieldProblem):
        path += dropped  # the validator ran on that list entry: keep its index
        base, sub = (_join(path) if path else ""), problem_error.field
        field = base + sub if sub.startswith("[") else ".".join(x for x in (base, sub) if x)
        return field_error(source, field, problem_error.problem, problem_error.fix)
    fix = ((info.json_schema_extra or {}).get("x-fix") if info is not None else None) or "see docs/clusters.md"
    if kind == "extra_forbidden":
        allowed = list(model.model_fields) if model is not None else []
        allowed = [a for a in allowed if a != "path"]
        return field_error(source, _join(path), "unknown field",
                           f"{did_you_mean(path[-1], allowed)}use only {', '.join(allowed)}")
    if kind == "missing":
        return field_error(source, _join(path), "missing", fix)
    problem = err["msg"].replace("Input should be", "expected").replace("Value error, ", "")
    shown = json.dumps(given) if isinstance(given, (str, int, float, bool, type(None))) else repr(given)
    problem = f"{problem}, got {shown}"
    if dropped:
        problem = f"entry {dropped[0]}: {problem}"
    return field_error(source, _join(path), problem, fix)


def _walk(loc: tuple[Any, ...], extra: bool) -> tuple[list[Any], Any, type[BaseModel] | None, list[int]]:
    """Follow ``loc`` through the models. Returns the path of field names and list indexes (without
    pydantic's union-member tags, and without trailing indexes into lists of plain values, which
    are returned apart), the deepest FieldInfo, and the model holding the last key."""
    model: type[BaseModel] | None = ClusterSpec
    holder, info, path = model, None, []
    in_dict = False
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path.append(part)
        elif model is not None and part in model.model_fields:
            holder, info = model, model.model_fields[part]
            path.append(part)
            model = _model_in(info.annotation)
            in_dict = typing.get_origin(info.annotation) is dict
        elif in_dict or (extra and i == len(loc) - 1):
            holder = model or holder
            path.append(part)  # a mapping's key, or the unknown key itself
        # else: a union member's tag (e.g. "function-after[...]"), not a key
    dropped = []
    while path and isinstance(path[-1], int):
        dropped.insert(0, path.pop())
    return path, info, holder, dropped


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class inside an annotation (``X | None``, ``tuple[X, ...]``, ``Annotated[X, ...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _join(path: list[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "<top level>"


def _check_engine(source: str, raw: dict[str, Any], preset: str) -> None:
    """``bundled.engine``: EngineConfig fields, checked by EngineConfig's own validation one key
    at a time (so the error names the key), then together."""
    from harness.engine.core.config import EngineConfig  # imports torch: only when a file sets engine fields

    def check(where: str, **values: Any) -> None:
        try:
            EngineConfig(preset=preset, **values)
        except (ConfigError, TypeError, ValueError) as exc:
            fix = getattr(exc, "fix", None)
            problem = str(exc).removesuffix(f" (fix: {fix})") if fix else str(exc)
            raise field_error(source, where, problem, fix or "see EngineConfig in harness/engine/core/config.py") from exc

    check("bundled.preset")
    allowed = {f.name for f in fields(EngineConfig)} - set(_ENGINE_RESERVED)
    for key, value in raw.items():
        if key in _ENGINE_RESERVED:
            raise field_error(source, f"bundled.engine.{key}", f"is set by the harness ({_ENGINE_RESERVED[key]})",
                              "remove it" + ("; set bundled.preset instead" if key == "preset" else ""))
        if key not in allowed:
            raise field_error(source, f"bundled.engine.{key}", "unknown engine setting",
                              f"{did_you_mean(key, allowed)}use only {', '.join(sorted(allowed))}")
        check(f"bundled.engine.{key}", **{key: value})
    check("bundled.engine", **raw)


def json_schema() -> dict[str, Any]:
    """The cluster file's JSON Schema (``python -m harness schema``)."""
    schema = ClusterFile.model_json_schema()
    schema["required"] = [r for r in schema.get("required", []) if r != "name"]  # the loader defaults it
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "PD conformance harness cluster file"
    return schema
