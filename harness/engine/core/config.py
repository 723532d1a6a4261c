"""Model and engine configuration, the preset table, and the ``presets`` subcommand.

KV bytes per token follow Section 2.2 of the specification article
("2.2 KV Cache 传输的关键参数"): ``2 (K and V) * num_layers * num_kv_heads * head_dim * dtype_bytes``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from harness.errors import ConfigError

if TYPE_CHECKING:
    import torch

# torch is imported where tensors are made, not here: the router process reads these configs
# and must not pay for (or hold the memory of) torch.
DTYPE_BYTES: dict[str, int] = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def __getattr__(name: str):
    if name == "DTYPES":  # {name: torch.dtype}, built on first use
        import torch
        return {n: getattr(torch, n) for n in DTYPE_BYTES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# 256 byte tokens + BOS, EOS, PAD (see tokenizer.py).
BYTE_VOCAB_SIZE = 259
LEAK_KIB_PER_REQUEST_MAX = 10240   # sabotage knob leak_kib_per_request: 10 MiB a request at most


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the Llama-style decoder. Weights are a pure function of these fields."""

    name: str = "custom"
    vocab_size: int = BYTE_VOCAB_SIZE
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    max_seq_len: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    seed: int = 0
    # float64 by default: fp32 matmuls differ by batch shape (different BLAS kernels) and
    # flip near-tie argmaxes; at ~1e-16 relative error such flips are practically impossible.
    dtype: str = "float64"

    def __post_init__(self) -> None:
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                  "max_seq_len"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ModelConfig.{f} must be a positive integer, got {value!r}",
                                  fix=f"set {f} to an integer >= 1")
        if self.vocab_size < BYTE_VOCAB_SIZE:
            raise ConfigError(f"vocab_size {self.vocab_size} is smaller than the byte tokenizer's "
                              f"{BYTE_VOCAB_SIZE} tokens", fix=f"use vocab_size >= {BYTE_VOCAB_SIZE}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                              f"({self.n_kv_heads}) for grouped-query attention",
                              fix="pick n_kv_heads that divides n_heads")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}",
                              fix="use an even head_dim")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {self.dtype!r}", fix=f"use one of {sorted(DTYPE_BYTES)}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ConfigError("rope_theta and norm_eps must be positive", fix="use the preset values")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch
        return getattr(torch, self.dtype)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def kv_bytes_per_token(self) -> int:
        """Section 2.2: 2 * num_layers * num_kv_heads * head_dim * dtype_bytes."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    def num_parameters(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * self.dim * self.ffn_dim
        return 2 * self.vocab_size * self.dim + self.n_layers * (attn + mlp + 2 * self.dim) + self.dim

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ConfigError(f"unknown model preset {name!r}", fix=f"use one of {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]


PRESETS: dict[str, ModelConfig] = {
    # Unit tests: a decode step takes a few milliseconds.
    "tiny": ModelConfig(name="tiny", dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16,
                        ffn_dim=128, max_seq_len=1024, seed=1),
    # Bundled cluster default: a dozen concurrent streams on two cores.
    "small": ModelConfig(name="small", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32,
                         ffn_dim=512, max_seq_len=2048, seed=2),
    # Bandwidth work: 64 KiB of KV per token, a 2K-token prefill still takes seconds.
    "medium": ModelConfig(name="medium", dim=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64,
                          ffn_dim=1024, max_seq_len=4096, seed=3),
    # Long contexts (Section 3.3's 2K / 8K / 32K rows): a narrow model, so a 32K-token prefill is
    # bounded by its quadratic attention rather than by the weights, and 4 KiB of KV per token.
    "long": ModelConfig(name="long", dim=64, n_layers=4, n_heads=4, n_kv_heads=4, head_dim=16,
                        ffn_dim=128, max_seq_len=33792, seed=4),
}


@dataclass(frozen=True)
class EngineConfig:
    """How one engine instance runs a preset."""

    preset: str = "tiny"
    device: str = "auto"                 # "auto" = cuda when available, else cpu
    dtype: str | None = None             # None = the preset's dtype
    kv_budget_bytes: int = 64 * 1024 * 1024  # the "HBM tier": KV block pool size in bytes
    block_size: int = 16                 # tokens per KV block
    max_batch: int = 32                  # running requests at most
    max_model_len: int | None = None     # prompt + output tokens; None = the preset's max_seq_len
    max_prefill_tokens: int = 1024       # prompt tokens prefilled per step; longer prompts go in chunks
    speculative: bool = False
    spec_draft_layers: int = 1           # the draft is the target's first k layers
    spec_num_tokens: int = 3             # draft tokens proposed per step
    name: str | None = None              # worker id stamped on every TokenEvent
    # torch intra-op threads of the engine's process; None = leave torch's setting. Default 1:
    # several engines share few cores, and on a loaded 2-core machine two OpenMP threads made
    # tiny-model decode ten times slower than one (they spin-wait for each other).
    num_threads: int | None = 1
    # KV offload tiers (seed 4.3, degradation Level 3): off until set_offload or offload=True
    offload: bool = False
    offload_threshold: float = 0.85          # share of the pool above which requests are swapped out
    offload_cpu_bytes: int = 256 * 1024 * 1024
    offload_nvme_bytes: int = 1024 * 1024 * 1024
    offload_dir: str | None = None           # NVMe tier directory; None = a private temp dir
    offload_protect_priority: int = 1        # requests with priority >= this are never evicted
    offload_min_resident_steps: int = 4      # a fetched request decodes this many steps before rotating out
    # Seed 5.1 Layer 2: act on the node agent's page-retirement signal (quarantine a poisoned KV
    # block, recompute its request). False = an engine that ignores it (clusters/local-no-ecc.yaml).
    ecc_handling: bool = True
    # Sabotage knob (soak.leaks must fail): a decode worker that imports a recovered stream (resume
    # tokens: re-placed after its worker was lost, or live-migrated in) takes this many more KV
    # blocks and never frees them, as an engine that leaks a little per fault does. 0 = no leak.
    leak_kv_blocks_per_recovery: int = 0
    # Sabotage knob (soak.leaks must fail, docs/soak.md): a PD decode worker keeps this many KiB of
    # memory and one open file descriptor per request it finishes, never freed, as an engine leaking
    # per request does (clusters/local-leaky-process.yaml: 200). 0 = no leak. At most
    # LEAK_KIB_PER_REQUEST_MAX; what one process keeps is capped (worker_engine.LEAK_MEMORY_CAP_BYTES).
    leak_kib_per_request: int = 0

    def __post_init__(self) -> None:
        model = ModelConfig.from_name(self.preset)  # raises on an unknown preset
        if self.dtype is not None and self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {self.dtype!r}", fix=f"use one of {sorted(DTYPE_BYTES)}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ConfigError(f"unknown device {self.device!r}", fix="use auto, cpu or cuda[:N]")
        for f in ("kv_budget_bytes", "block_size", "max_batch", "max_prefill_tokens", "spec_num_tokens",
                  "spec_draft_layers"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"EngineConfig.{f} must be a positive integer, got {value!r}",
                                  fix=f"set {f} >= 1")
        if not 0.0 < self.offload_threshold <= 1.0:
            raise ConfigError(f"offload_threshold must be in (0, 1], got {self.offload_threshold!r}",
                              fix="use 0.85 (seed Section 4.3)")
        for f in ("offload_cpu_bytes", "offload_nvme_bytes"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 0:
                raise ConfigError(f"EngineConfig.{f} must be an integer >= 0, got {getattr(self, f)!r}",
                                  fix=f"set {f} in bytes (0 disables that tier)")
        if not isinstance(self.offload_min_resident_steps, int) or self.offload_min_resident_steps < 1:
            raise ConfigError(f"offload_min_resident_steps must be >= 1, got {self.offload_min_resident_steps!r}",
                              fix="use 4: fewer makes requests swap in and out every step")
        if not isinstance(self.ecc_handling, bool):
            raise ConfigError(f"ecc_handling must be true or false, got {self.ecc_handling!r}",
                              fix="set ecc_handling: true (false only to prove the ECC suite can fail)")
        leak = self.leak_kv_blocks_per_recovery
        if not isinstance(leak, int) or isinstance(leak, bool) or leak < 0:
            raise ConfigError(f"leak_kv_blocks_per_recovery must be an integer >= 0, got {leak!r}",
                              fix="set leak_kv_blocks_per_recovery: 0 (above 0 only to prove the soak leak "
                                  "check can fail)")
        kib = self.leak_kib_per_request
        if not isinstance(kib, int) or isinstance(kib, bool) or not 0 <= kib <= LEAK_KIB_PER_REQUEST_MAX:
            raise ConfigError(f"leak_kib_per_request must be an integer >= 0 and <= {LEAK_KIB_PER_REQUEST_MAX}, "
                              f"got {kib!r}",
                              fix="set leak_kib_per_request: 0 (above 0 only to prove the soak leak check can fail; "
                                  "200 does it in 3 minutes)")
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ConfigError(f"num_threads must be a positive integer or None, got {self.num_threads!r}",
                              fix="set num_threads=1 per engine process on a small machine")
        if self.max_model_len is not None and not 2 <= self.max_model_len <= model.max_seq_len:
            raise ConfigError(f"max_model_len {self.max_model_len} is outside [2, {model.max_seq_len}] "
                              f"for preset {self.preset!r}", fix="lower max_model_len or pick a larger preset")
        if self.spec_draft_layers >= model.n_layers:
            raise ConfigError(f"spec_draft_layers {self.spec_draft_layers} must be below the target's "
                              f"{model.n_layers} layers", fix=f"use 1..{model.n_layers - 1}")
        if self.num_blocks < 1:
            raise ConfigError(f"kv_budget_bytes {self.kv_budget_bytes} holds no KV block of "
                              f"{self.block_bytes} bytes", fix=f"raise kv_budget_bytes to >= {self.block_bytes}")

    @property
    def model(self) -> ModelConfig:
        model = ModelConfig.from_name(self.preset)
        return replace(model, dtype=self.dtype) if self.dtype else model

    @property
    def context_len(self) -> int:
        return self.max_model_len or self.model.max_seq_len

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.model.kv_bytes_per_token()

    @property
    def num_blocks(self) -> int:
        return self.kv_budget_bytes // self.block_bytes

    def torch_device(self) -> torch.device:
        import torch
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


# ---- `python -m harness presets` ----------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=2048,
                        help="also show the KV bytes of one request of this many tokens (default 2048)")


def run(args: argparse.Namespace) -> int:
    if args.context < 1:
        raise ConfigError(f"--context must be positive, got {args.context}", fix="pass --context 2048")
    shown = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq_len", "dtype")
    header = ["preset", *shown, "params", "KV B/token", f"KV @{args.context} tok"]
    rows = []
    for name, cfg in PRESETS.items():
        kv = cfg.kv_bytes_per_token()
        rows.append([name, *(str(getattr(cfg, f)) for f in shown), f"{cfg.num_parameters() / 1e6:.2f}M",
                     f"{kv} ({kv / 1024:.1f} KiB)", f"{kv * args.context / 2**20:.1f} MiB"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    return 0


__all__ = ["ModelConfig", "EngineConfig", "PRESETS", "DTYPES", "DTYPE_BYTES", "BYTE_VOCAB_SIZE"]
