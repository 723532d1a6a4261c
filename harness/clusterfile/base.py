"""Building blocks of the cluster file's models: names, the fix-carrying field, the strict base model,
the SSH settings that hosts and load hosts share.

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
# engine -> its metric profile in harness.probes.metrics.prometheus.ENGINE_PROFILES (openai: none known)
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


# how the harness reaches a machine over SSH: a host under `hosts:` (models.py) or a load host of its
# own (load_hosts.py); here, below both, so neither imports the other for it (a comment, not a
# docstring: the cluster file's JSON Schema stays as it was)
class SSHSettings(StrictModel):
    user: Text = field_with_fix("write `user: ops`", "SSH login", default="root")
    port: int = field_with_fix("use 1..65535", "SSH port", default=22, ge=1, le=65535)
    key_file: Text = field_with_fix("add `key_file: PATH` (the private key)", "private key file")
    known_hosts: Text = field_with_fix("add `known_hosts: PATH` (the file holding the host's key)",
                             "the only host keys accepted for this host (never learned blindly)")
    connect_timeout_s: float = field_with_fix("write a plain number such as 10", default=10.0, gt=0, allow_inf_nan=False)
