"""The types every metrics source shares (harness/probes/metrics/metrics_source.py, the module doc): a
:class:`Reading` of every endpoint, a :data:`Series` over a window, and the :class:`MetricsSource`
interface that direct scraping (``ScrapeSource``) and the cluster's Prometheus (``PrometheusSource``,
harness/probes/metrics/promql.py) implement. Kept below both so neither imports the other's module."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Sequence

from harness.errors import ProbeError
from harness.probes.metrics.prometheus import ENGINE_PROFILES, quantity_labels

Series = dict[str, list[tuple[int, float]]]   # endpoint URL -> (wall ns, value), oldest first


@dataclass
class Reading:
    """One read of every endpoint: quantity -> value (summed over the endpoint's label sets) per URL, and
    why an endpoint gave nothing. A quantity an endpoint does not expose is absent from its dict.
    ``t_wall_ns`` is when the read began; ``times`` when each endpoint's values held, where the source knows
    it apart (direct scraping reads the endpoints one after another: on a loaded machine the later ones
    answer seconds after the read began, CI 2026-12-07)."""

    t_wall_ns: int
    values: dict[str, dict[str, float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    times: dict[str, int] = field(default_factory=dict)

    def time_of(self, url: str) -> int:
        """When ``url``'s values held (wall ns): its own time where known, else the read's."""
        return self.times.get(url, self.t_wall_ns)

    def total(self, quantity: str) -> float | None:
        """``quantity`` summed over the endpoints that expose it (None: none does)."""
        found = [v[quantity] for v in self.values.values() if quantity in v]
        return sum(found) if found else None


class MetricsSource(abc.ABC):
    """The engine metrics of one cluster, read with one metric profile (see the module doc)."""

    label: str

    def __init__(self, profile: str) -> None:
        if profile not in ENGINE_PROFILES:
            raise ProbeError(f"unknown engine profile {profile!r}", fix=f"use one of {', '.join(ENGINE_PROFILES)}")
        self.profile = profile

    def family(self, quantity: str) -> str:
        try:
            return ENGINE_PROFILES[self.profile][quantity]
        except KeyError:
            raise ProbeError(f"quantity {quantity!r} has no metric in the {self.profile} profile",
                             fix=f"use one of {', '.join(sorted(ENGINE_PROFILES[self.profile]))}") from None

    def labels(self, quantity: str) -> dict[str, str]:
        """The labels a series must carry to count for ``quantity`` ({}: every series of its family;
        e.g. Dynamo's ``migrations_ongoing``: migration_type="ongoing_request")."""
        return quantity_labels(self.profile, quantity)

    @abc.abstractmethod
    def read(self, urls: Sequence[str], quantities: Sequence[str], *, settled: bool = False) -> Reading:
        """The current value of each quantity on each endpoint (see the module doc for ``settled``)."""

    @abc.abstractmethod
    def series(self, urls: Sequence[str], quantity: str, start_wall_ns: int, end_wall_ns: int) -> Series:
        """Each endpoint's values of ``quantity`` between two wall times (both included)."""

    def close(self) -> None:
        """Release the source's connections (idempotent)."""

    def __enter__(self) -> MetricsSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MetricsSource", "Reading", "Series"]
