"""Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) with seeded weights.

The forward pass runs over a packed batch of tokens (``[T]``, several sequences back to back)
and delegates "store this layer's K/V, then attend over the sequence's context" to an
``AttentionBackend``: the paged KV cache in the engine, a dense per-layer cache in the oracle
and on the PD prefill side. Both backends call the same ``causal_attention``, so paged and
dense attention differ only in where K/V live.

Weights are a pure function of ``ModelConfig`` (generated in float64 on the CPU from the seed,
then cast and moved), so every process that builds a preset builds bit-identical weights.
Later layers' residual branches are scaled down so that the first k layers alone (the
speculative draft) predict the full model's next token reasonably often.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Iterator, Protocol

import torch
from torch import Tensor

from harness.engine.core.config import ModelConfig

logger = logging.getLogger(__name__)

# Residual-branch scale of layer i (i >= 1); layer 0 is unscaled. Smaller = the draft agrees more.
LATER_LAYER_SCALE = 0.35
# Printable ASCII and newline get a logit bonus so that generated text is mostly readable.
PRINTABLE_BIAS = 4.0
# EOS a little below printable text: requests end by themselves now and then, not constantly.
EOS_BIAS = 3.0
LOGIT_SCALE = 4.0

OnLayer = Callable[[int, Tensor, Tensor], None]


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Store this step's K/V of ``layer`` and attend over each sequence's whole context.
        q: [T, n_heads, head_dim]; k, v: [T, n_kv_heads, head_dim] -> [T, n_heads, head_dim]."""
        ...


# Score elements (heads x query rows x context) computed at once: a 32K-token prompt's full
# score matrix would need 32 GiB in float64; query blocks keep one block near 128 MiB.
MAX_SCORE_ELEMENTS = 1 << 24


def causal_attention(q: Tensor, k: Tensor, v: Tensor, start_pos: int) -> Tensor:
    """Attention of one sequence's new tokens over its context.

    q: [n, H, hd] new tokens at positions start_pos .. start_pos+n-1;
    k, v: [ctx, KVH, hd] with ctx == start_pos + n (positions 0 .. ctx-1); returns [n, H, hd].
    Query head h reads KV head h // (H // KVH) (grouped-query attention); the group is folded
    into the query rows rather than copying K/V per head. Long prompts go in blocks of query
    rows, each attending only to the keys up to its last row (causal), so memory stays bounded.
    """
    n, n_heads, _ = q.shape
    ctx = k.shape[0]
    assert ctx == start_pos + n, (ctx, start_pos, n)
    rows = max(1, MAX_SCORE_ELEMENTS // (n_heads * ctx))
    if n <= rows:
        return _causal_block(q, k, v, start_pos)
    out = [_causal_block(q[i:i + rows], k[:start_pos + i + rows], v[:start_pos + i + rows], start_pos + i)
           for i in range(0, n, rows)]  # the last slice is shorter: k[:ctx]
    return torch.cat(out)


def _causal_block(q: Tensor, k: Tensor, v: Tensor, start_pos: int) -> Tensor:
    n, n_heads, head_dim = q.shape
    ctx, n_kv_heads, _ = k.shape
    assert ctx == start_pos + n, (ctx, start_pos, n)
    group = n_heads // n_kv_heads
    qg = q.view(n, n_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(n_kv_heads, group * n, head_dim)
    scores = qg @ k.permute(1, 2, 0) / math.sqrt(head_dim)             # [KVH, G*n, ctx]
    if n > 1:
        query_pos = torch.arange(start_pos, ctx, device=q.device).repeat(group)[:, None]  # [G*n, 1]
        key_pos = torch.arange(ctx, device=q.device)[None, :]                             # [1, ctx]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1)                               # [KVH, G*n, ctx]
    out = probs @ v.transpose(0, 1)                                     # [KVH, G*n, hd]
    return out.view(n_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, n_heads, head_dim)


class DenseKV:
    """Contiguous per-layer K/V of ONE sequence (oracle, PD prefill side)."""

    def __init__(self, n_layers: int) -> None:
        self.k: list[Tensor | None] = [None] * n_layers  # each [ctx, KVH, hd]
        self.v: list[Tensor | None] = [None] * n_layers

    def length(self, layer: int = 0) -> int:
        return 0 if self.k[layer] is None else self.k[layer].shape[0]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        start = self.length(layer)
        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k])
        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v])
        return causal_attention(q, self.k[layer], self.v[layer], start)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: [T, heads, hd]; cos, sin: [T, 1, hd/2] (rotate-half convention)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Transformer:
    """Inference-only decoder; holds plain weight tensors (no autograd)."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = cfg.torch_dtype
        gen = torch.Generator().manual_seed(cfg.seed)

        def randn(*shape: int, std: float) -> Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float64) * std
            return w.to(self.dtype).to(self.device)

        d, hd, H, KVH, F = cfg.dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim
        self.embed = randn(cfg.vocab_size, d, std=1.0)                      # [V, d]
        self.layers: list[dict[str, Tensor]] = []
        for i in range(cfg.n_layers):
            scale = 1.0 if i == 0 else LATER_LAYER_SCALE
            self.layers.append({
                "attn_norm": torch.ones(d, dtype=self.dtype, device=self.device),
                "wq": randn(d, H * hd, std=d ** -0.5),                      # [d, H*hd]
                "wk": randn(d, KVH * hd, std=d ** -0.5),                    # [d, KVH*hd]
                "wv": randn(d, KVH * hd, std=d ** -0.5),                    # [d, KVH*hd]
                "wo": randn(H * hd, d, std=scale * (H * hd) ** -0.5),       # [H*hd, d]
                "ffn_norm": torch.ones(d, dtype=self.dtype, device=self.device),
                "w1": randn(d, F, std=d ** -0.5),                           # [d, F] gate
                "w3": randn(d, F, std=d ** -0.5),                           # [d, F] up
                "w2": randn(F, d, std=scale * F ** -0.5),                   # [F, d] down
            })
        self.norm = torch.ones(d, dtype=self.dtype, device=self.device)
        self.lm_head = randn(d, cfg.vocab_size, std=LOGIT_SCALE * d ** -0.5)  # [d, V]
        bias = torch.zeros(cfg.vocab_size, dtype=torch.float64)
        bias[32:127] = PRINTABLE_BIAS
        bias[10] = PRINTABLE_BIAS
        bias[257] = EOS_BIAS  # ByteTokenizer.EOS
        self.logit_bias = bias.to(self.dtype).to(self.device)               # [V]
        # RoPE tables: [max_seq_len, hd/2]
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv_freq)
        self.rope_cos = angles.cos().to(self.dtype).to(self.device)
        self.rope_sin = angles.sin().to(self.dtype).to(self.device)
        logger.debug("built model %s on %s (%d params)", cfg.name, self.device, cfg.num_parameters())

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, backend: AttentionBackend,
                n_layers: int | None = None, on_layer: OnLayer | None = None) -> Tensor:
        """tokens, positions: [T] (long, on self.device); returns final-normed hidden [T, d].

        ``n_layers`` < cfg.n_layers runs only the first layers (the speculative draft).
        ``on_layer(i, k, v)`` is called as soon as layer i's K/V ([T, KVH, hd]) exist.
        """
        cfg = self.cfg
        T = tokens.shape[0]
        cos = self.rope_cos[positions][:, None, :]                          # [T, 1, hd/2]
        sin = self.rope_sin[positions][:, None, :]
        h = self.embed[tokens]                                              # [T, d]
        for i, w in enumerate(self.layers[:n_layers or cfg.n_layers]):
            x = _rms_norm(h, w["attn_norm"], cfg.norm_eps)
            q = _rope((x @ w["wq"]).view(T, cfg.n_heads, cfg.head_dim), cos, sin)     # [T, H, hd]
            k = _rope((x @ w["wk"]).view(T, cfg.n_kv_heads, cfg.head_dim), cos, sin)  # [T, KVH, hd]
            v = (x @ w["wv"]).view(T, cfg.n_kv_heads, cfg.head_dim)                   # [T, KVH, hd]
            if on_layer is not None:
                on_layer(i, k, v)
            attn = backend.attend(i, q, k, v)                               # [T, H, hd]
            h = h + attn.reshape(T, -1) @ w["wo"]
            x = _rms_norm(h, w["ffn_norm"], cfg.norm_eps)
            h = h + (torch.nn.functional.silu(x @ w["w1"]) * (x @ w["w3"])) @ w["w2"]
        return _rms_norm(h, self.norm, cfg.norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: Tensor) -> Tensor:
        """hidden: [N, d] -> logits [N, V]."""
        return hidden @ self.lm_head + self.logit_bias

    def tensor(self, values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with n torch intra-op threads, then restore the previous setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


_CACHE: dict[tuple[ModelConfig, str], Transformer] = {}


def load_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> Transformer:
    """Build (once per process) the model of a config; weights are read-only, so sharing is safe."""
    key = (cfg, str(torch.device(device)))
    if key not in _CACHE:
        _CACHE[key] = Transformer(cfg, device)
    return _CACHE[key]
