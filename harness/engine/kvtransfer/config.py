"""KV transfer settings (``TransferConfig``) and the strict dict-to-dataclass loader the router
and workers share. Kept free of torch: the router process validates them without importing it."""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import ConfigError


@dataclass
class TransferConfig:
    mode: str = "layerwise"          # "layerwise" (stream during prefill) or "whole" (after prefill)
    compression: str | None = None   # None or "zstd"
    zstd_level: int = 1
    layers_per_frame: int = 1        # layers per DATA frame at least
    # ... and bytes per DATA frame at least (the last frame of a transfer may hold fewer): every
    # frame costs each end a fixed 0.05-0.1 ms of Python (header, checksum, landing), which at
    # small layers is longer than the layer's bytes take on a fast path; but a transfer sent as
    # one frame leaves the receiver idle until its last layer is produced. 512 KiB (a 1 MiB
    # transfer in two frames) measured best (bench_transfer.py: 1 MiB transfers 0.64-0.74 of raw
    # TCP against 0.50-0.53 in one frame and 0.43-0.45 in four); 0 = one frame per
    # layers_per_frame layers whatever their size
    min_frame_bytes: int = 512 << 10
    timeout_s: float = 2.0           # a socket operation making no progress this long fails the attempt
    max_retries: int = 3             # per path, after the first attempt
    backoff_base_s: float = 0.01     # seed 3.3: 10 ms x 2^attempt
    backoff_max_s: float = 0.5
    fallback_enabled: bool = True
    max_frame_bytes: int = 1 << 31

    def __post_init__(self) -> None:
        if self.mode not in ("layerwise", "whole"):
            raise ConfigError(f"transfer mode {self.mode!r} is unknown", fix="use 'layerwise' or 'whole'")
        if self.compression not in (None, "zstd"):
            raise ConfigError(f"compression {self.compression!r} is unknown", fix="use null or 'zstd'")
        if (self.layers_per_frame < 1 or self.min_frame_bytes < 0 or self.max_retries < 0 or self.timeout_s <= 0
                or self.backoff_base_s < 0):
            raise ConfigError("layers_per_frame >= 1, min_frame_bytes >= 0, max_retries >= 0, timeout_s > 0 and "
                              "backoff_base_s >= 0 "
                              f"are required, got {self}", fix="correct the transfer section of the config")

    @classmethod
    def from_dict(cls, data: dict | None) -> "TransferConfig":
        return config_from_dict(cls, data, "transfer")


def config_from_dict(cls, data: dict | None, section: str):
    """Build config dataclass ``cls`` from a mapping, refusing unknown keys by name."""
    data = dict(data or {})
    unknown = set(data) - set(cls.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown {section} options {sorted(unknown)}",
                          fix=f"use only {sorted(cls.__dataclass_fields__)}")
    return cls(**data)
