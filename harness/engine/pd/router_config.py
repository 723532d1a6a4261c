"""The router's configuration: the knobs a cluster file's ``router:`` section sets (docs/pd.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.engine.resilience.degradation import DegradationConfig
from harness.engine.resilience.health import HealthConfig
from harness.engine.kvtransfer.config import TransferConfig, config_from_dict
from harness.errors import ConfigError


@dataclass
class RouterConfig:
    """Knobs a cluster file can set (docs/pd.md). The sabotage knobs (``reschedule_enabled=False``,
    ``reschedule_delay_s``) exist so the harness can prove its suites fail on a bad cluster."""

    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 2.0
    # progress beats (worker.py) every progress_interval_s; a worker serving requests that sends
    # nothing for hang_timeout_s is declared down (no_progress), well before heartbeat_timeout_s
    progress_interval_s: float = 0.1
    hang_timeout_s: float = 0.8
    reschedule_enabled: bool = True
    reschedule_delay_s: float = 0.0
    # sabotage knob: a worker that registers again (restarted, or back from a hang) gets no new
    # placement for this long although the router lists it healthy, as a circuit breaker that
    # stays open does (vllm-router kept a restarted instance out for 100+ s): proves 6.1.4's
    # recovery check fails a cluster that does not take its workers back
    readmit_delay_s: float = 0.0
    max_reschedules: int = 3
    admission_timeout_s: float = 30.0   # a new request waits this long for KV headroom
    reschedule_wait_s: float = 5.0      # a rescheduled request waits this long for a worker
    kv_headroom_factor: float = 1.2     # seed 5.3: free KV must exceed 1.2 x the request's KV
    max_events: int = 10000
    transfer: dict = field(default_factory=dict)  # TransferConfig fields, sent to prefill workers
    # resilience (docs/pd.md); turning one off is how a suite proves it fails without the feature
    degradation_enabled: bool = True
    degradation: dict = field(default_factory=dict)  # DegradationConfig fields (thresholds, dwell, caps)
    offload_enabled: bool = True        # Level 3 turns KV offload on
    offload_threshold: float = 0.85     # seed 4.3
    migration_enabled: bool = True      # live KV migration (admin API, drain, health decisions)
    auto_migrate: bool = True           # health decisions (seed 5.3) migrate without an operator
    migration_timeout_s: float = 10.0
    health: dict = field(default_factory=dict)       # HealthConfig fields (window, weights, threshold)
    control_interval_s: float = 0.25    # how often the degradation level and health scores are evaluated

    def __post_init__(self) -> None:
        positive = ("heartbeat_interval_s", "heartbeat_timeout_s", "admission_timeout_s", "kv_headroom_factor",
                    "progress_interval_s", "hang_timeout_s")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ConfigError(f"router.{name} must be positive, got {getattr(self, name)!r}",
                                  fix=f"set router.{name} to a positive number")
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError(f"router.heartbeat_timeout_s ({self.heartbeat_timeout_s}) must exceed "
                              f"heartbeat_interval_s ({self.heartbeat_interval_s})",
                              fix="use e.g. interval 1 s and timeout 2 s")
        if self.hang_timeout_s < 4 * self.progress_interval_s:
            raise ConfigError(f"router.hang_timeout_s ({self.hang_timeout_s}) must be at least 4 x "
                              f"progress_interval_s ({self.progress_interval_s}), or one late beat is a false alarm",
                              fix="use e.g. progress_interval_s 0.1 and hang_timeout_s 0.8")
        if min(self.reschedule_delay_s, self.reschedule_wait_s, self.max_reschedules, self.readmit_delay_s) < 0:
            raise ConfigError("router.reschedule_delay_s, reschedule_wait_s, max_reschedules and readmit_delay_s "
                              "must be >= 0",
                              fix="use non-negative values")
        TransferConfig.from_dict(self.transfer)  # validate now, not at the first request
        for name in ("migration_timeout_s", "control_interval_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"router.{name} must be positive, got {getattr(self, name)!r}",
                                  fix=f"set router.{name} to a positive number")
        if not 0 < self.offload_threshold < 1:
            raise ConfigError(f"router.offload_threshold must be in (0, 1), got {self.offload_threshold!r}",
                              fix="use 0.85 (seed Section 4.3)")
        DegradationConfig.from_dict(self.degradation)
        try:
            HealthConfig(**self.health)
        except TypeError as exc:
            raise ConfigError(f"router.health: {exc}", fix="use HealthConfig fields (docs/pd.md)") from None

    @classmethod
    def from_dict(cls, data: dict | None) -> "RouterConfig":
        return config_from_dict(cls, data, "router")


__all__ = ["RouterConfig"]
