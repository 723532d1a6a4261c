"""Building blocks of the cluster file's models: names, the fix-carrying field, the strict base model.

Every model of the cluster file (models.py, behaviour.py) is a :class:`StrictModel` whose fields are made
with :func:`field_with_fix`, so a wrong value's error names the fix; cross-field checks raise
:class:`FieldProblem` (all three from :mod:`harness.checklists.validation`, the leaf they share
with the checklist).
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlparse

from pydantic import AfterValidator, StringConstraints

# the project's one validation style (shared with the checklist): callers import these from here too
from harness.checklists.validation import FieldProblem, StrictModel, Text, field_with_fix  # noqa: F401

KINDS = ("bundled", "external")
ENGINES = ("bundled", "vllm", "sglang", "dynamo", "openai")
ROLES = ("router", "prefill", "decode", "aggregated")  # roles a host may serve
WORKER_ROLES = ("prefill", "decode", "aggregated")
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
ENV_VAR_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
# engine -> its metric profile in harness.probes.prometheus.ENGINE_PROFILES (openai: none known)
MAX_BUNDLED_WORKERS = 16  # per role: each worker is a process with its own model on this one machine
METRIC_PROFILES = {"bundled": "pdengine", "vllm": "vllm", "sglang": "sglang", "dynamo": "dynamo"}
# the fault kinds harness.faults registers (safety.allowed_faults names them): kept here, below the
# faults layer, so the cluster file is checked without importing it; a test keeps the two equal
FAULT_KINDS = ("dcgm_inject", "ecc_poison", "hbm_fill", "hbm_fill_host", "live_migration", "nic_flap", "pfc_storm",
               "process_hang", "process_kill", "speculative_decoding")


def _http_url(value: str) -> str:
    parsed = urlparse(value)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise FieldProblem(f"{value!r} is not an http(s) URL", "write e.g. http://10.0.0.5:8000")
    return value.rstrip("/")


Url = Annotated[Text, AfterValidator(_http_url)]
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
