"""``results.json``: the whole run as JSON, for CI tools and for comparing runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

from harness.errors import ConfigError
from harness.report.result import RunResult

SCHEMA_VERSION = 1


def write_json(result: RunResult, path: str | os.PathLike) -> None:
    data = {"schema_version": SCHEMA_VERSION, **result.to_dict()}
    Path(path).write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")


def read_json(path: str | os.PathLike) -> RunResult:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    version = data.pop("schema_version", None)
    if version != SCHEMA_VERSION:
        raise ConfigError(f"{path}: results schema version {version!r}, this harness reads {SCHEMA_VERSION}",
                          fix="read it with the harness version that wrote it")
    return RunResult.from_dict(data)
