"""Token selection: greedy argmax, or seeded temperature / top-p sampling.

A sampled token is a pure function of (logits, params, seed, output index): each draw seeds
its own ``torch.Generator`` from the request seed and the index of the token in the output.
So a request's tokens do not depend on batch composition, preemption, speculative decoding,
or which worker continues it after a failure (resume).
"""

from __future__ import annotations

import random

import torch
from torch import Tensor

from harness.engine.core.types import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads nearby (seed, index) pairs apart


def resolve_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a fresh random one when none is given."""
    return params.seed if params.seed is not None else random.SystemRandom().randrange(2**62)


def sample_token(logits: Tensor, params: SamplingParams, seed: int, output_index: int) -> int:
    """logits: [V] for one position; output_index: how many output tokens precede this one."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits.double() / params.temperature, dim=-1)      # [V]
    sorted_probs, order = torch.sort(probs, descending=True)                  # [V], [V]
    if params.top_p < 1.0:
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = (torch.cumsum(sorted_probs, 0) - sorted_probs) < params.top_p
        sorted_probs = sorted_probs * keep
    cdf = torch.cumsum(sorted_probs, 0).cpu()                                 # [V]
    gen = torch.Generator().manual_seed((seed * _MIX + output_index) % 2**63)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    pick = min(int(torch.searchsorted(cdf, u, right=True).item()), cdf.shape[0] - 1)
    return int(order[pick].item())
