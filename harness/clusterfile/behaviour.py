"""What the cluster file says the engine does, for items judged from outside: how it migrates
streams (6.1.2 without an admin API), how it degrades under KV pressure (6.1.3 by load), and which
GPUs its workers run on and how DCGM reaches them (ecc through DCGM injection).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from harness.clusterfile.base import FieldProblem, Text, Url, field_with_fix, StrictModel


class MigrationSettings(StrictModel):
    """How the engine moves a stream to another worker (item 6.1.2 where there is no admin API)."""

    on_worker_loss: bool = field_with_fix("write `on_worker_loss: true` when the engine resumes a stream on another worker "
                                "after its worker is lost (NVIDIA Dynamo: --migration-limit above 0)", default=False)


# -- 6.1.3 by load on a foreign engine: per level, the KV use that starts it and what the cluster does there --

Fraction = Annotated[float, Field(gt=0, lt=1, allow_inf_nan=False)]


class Rejection(StrictModel):
    """New requests refused cleanly: an HTTP status from ``status``, and a Retry-After header if asked."""

    status: tuple[Annotated[int, Field(ge=400, le=599)], ...] = field_with_fix(
        "write e.g. `status: [429, 503]`", "the HTTP statuses a refused request may get", default=(429, 503),
        min_length=1, strict=False)
    retry_after: bool = field_with_fix("write `retry_after: true` when every refusal carries a Retry-After header",
                             default=False)


class LevelExpectation(StrictModel):
    """What the cluster is expected to do while KV use is above a level's threshold, checked on the API
    (responses of the requests sent meanwhile) and on the engine's metrics."""

    reject: Rejection | None = field_with_fix("write e.g. `reject: {status: [429, 503], retry_after: true}`",
                                    "new requests are refused cleanly", default=None)
    max_tokens_cap: int | None = field_with_fix("write a whole number of tokens such as 32",
                                      "completions are capped at this many tokens", default=None, ge=1)
    queue: bool = field_with_fix("write `queue: true`", "requests wait (waiting or preemption counts rise) and none errors",
                       default=False)
    no_errors: bool = field_with_fix("write `no_errors: true`", "no request sent meanwhile ends with an error",
                           default=False)

    @model_validator(mode="after")
    def _says_something(self) -> "LevelExpectation":
        if self.reject is None and self.max_tokens_cap is None and not self.queue and not self.no_errors:
            raise FieldProblem("a level must expect at least one action",
                               "write one of reject, max_tokens_cap, queue: true, no_errors: true")
        if self.reject is not None and (self.no_errors or self.queue):
            raise FieldProblem("a level cannot both refuse new requests and expect none to error",
                               "keep `reject:` or `queue`/`no_errors`, not both", field="reject")
        return self


class DegradationLevel(StrictModel):
    level: int = field_with_fix("write the level number, e.g. `level: 2`", ge=1, le=9)
    kv_use_above: Fraction = field_with_fix("write a fraction between 0 and 1 such as 0.80",
                                  "KV use (the engine's metric, 0..1, fullest worker) above which this level holds")
    expect: LevelExpectation = field_with_fix("write e.g. `expect: {queue: true, no_errors: true}`")


class DegradationLoad(StrictModel):
    """How the 6.1.3 suite drives KV use up: concurrent streams of long prompts, ramped (defaults: the
    workload's prompt and output lengths)."""

    prompt_tokens: int | None = field_with_fix("write a whole number of tokens such as 800", default=None, ge=1)
    output_tokens: int | None = field_with_fix("write a whole number of tokens such as 256", default=None, ge=1)
    max_concurrency: int = field_with_fix("write a whole number such as 64", "most streams in flight", default=64, ge=1,
                                le=4096)
    ramp_budget_s: float = field_with_fix("write seconds such as 120", "most time to reach each level", default=120.0,
                                gt=0, allow_inf_nan=False)
    hold_s: float = field_with_fix("write seconds such as 10", "how long each level is held", default=10.0, gt=0,
                         allow_inf_nan=False)


class Degradation(StrictModel):
    """``degradation:`` of a version 2 cluster file (docs/clusters.md, 6.1.3 by load)."""

    levels: tuple[DegradationLevel, ...] = field_with_fix(
        "write e.g. `levels: [{level: 2, kv_use_above: 0.80, expect: {queue: true}}]`", min_length=1, strict=False)
    load: DegradationLoad = field_with_fix("write e.g. `load: {prompt_tokens: 800, output_tokens: 256}`",
                                 default_factory=DegradationLoad)

    @model_validator(mode="after")
    def _ascending(self) -> "Degradation":
        for i, (a, b) in enumerate(zip(self.levels, self.levels[1:]), start=1):
            if b.level <= a.level or b.kv_use_above <= a.kv_use_above:
                raise FieldProblem(f"level {b.level} (KV use above {b.kv_use_above}) does not come after level "
                                   f"{a.level} (above {a.kv_use_above})",
                                   "list the levels in rising order of level and of kv_use_above",
                                   field=f"levels[{i}]")
        return self


class HostDcgm(StrictModel):
    """The host runs NVIDIA DCGM (its host engine and ``dcgmi``): ECC/XID errors can be injected into
    its monitoring (the ecc item on a real cluster, harness/faults/dcgm.py)."""

    dcgmi: Text = field_with_fix("write the dcgmi command or its path, e.g. `dcgmi: /usr/bin/dcgmi`", default="dcgmi")
    exporter: Url | None = field_with_fix("write e.g. `exporter: http://10.0.2.10:9400/metrics`",
                                "the host's dcgm-exporter: its ECC/XID counters are read at the start and the end "
                                "of a run", default=None)


GpuBinding = Annotated[int, Field(ge=0, le=1023)]
