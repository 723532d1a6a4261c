"""Building blocks of the cluster file's models: names, the fix-carrying field, the strict base model.

Every model of the cluster file (models.py, behaviour.py) is a :class:`StrictModel` whose fields are made
with :func:`field_with_fix`, so a wrong value's error names the fix; cross-field checks raise
:class:`FieldProblem`.
"""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlparse

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

KINDS = ("bundled", "external")
ENGINES = ("bundled", "vllm", "sglang", "dynamo", "openai")
ROLES = ("router", "prefill", "decode", "aggregated")  # roles a host may serve
WORKER_ROLES = ("prefill", "decode", "aggregated")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
ENV_VAR_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
# engine -> its metric profile in harness.probes.prometheus.ENGINE_PROFILES (openai: none known)
MAX_BUNDLED_WORKERS = 16  # per role: each worker is a process with its own model on this one machine
METRIC_PROFILES = {"bundled": "pdengine", "vllm": "vllm", "sglang": "sglang", "dynamo": "dynamo"}


class FieldProblem(ValueError):
    """Raised by a validator: ``field`` is relative to the model (or field) being validated."""

    def __init__(self, problem: str, fix: str, field: str = "") -> None:
        self.problem, self.fix, self.field = problem, fix, field
        super().__init__(problem)


def field_with_fix(fix: str, description: str = "", **kwargs: Any) -> Any:
    """A pydantic Field whose JSON Schema carries ``x-fix``: the fix a validation error names."""
    return Field(description=description or None, json_schema_extra={"x-fix": fix}, **kwargs)


def _http_url(value: str) -> str:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise FieldProblem(f"{value!r} is not an http(s) URL", "write e.g. http://10.0.0.5:8000")
    return value.rstrip("/")


Text = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]
Url = Annotated[Text, AfterValidator(_http_url)]
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]


class StrictModel(BaseModel):
    """The cluster file's models: unknown keys rejected, no type coercion, immutable."""
    # strict: YAML's `yes-please` is not a bool, `true` is not a count (ints still widen to floats)
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
