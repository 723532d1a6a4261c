"""Speculative decoding with a real draft model, verified by the target (greedy only).

The draft is the target truncated to its first ``draft_layers`` layers (plus the final norm
and lm_head). Layer i's K/V depend only on layers below i, so the draft's K/V for those layers
ARE the target's: the draft reads and writes the same paged blocks and no separate draft cache
exists to transfer or migrate.

Per step and sequence, with the last token t at position p (not yet in the cache):
draft ``num_tokens`` tokens d1..dg one at a time, then run the target once over
[t, d1..dg] at positions p..p+g, take its greedy tokens g0..gg, accept the longest prefix with
d(i+1) == g(i), and emit the accepted drafts plus the target's own next token. The output is
the target's greedy output whatever the draft proposes (lossless).
"""

from __future__ import annotations

import torch

from harness.engine.core.kv_cache import KVBlockPool, PagedAttention
from harness.engine.core.model import Transformer


class SpeculativeDecoder:
    def __init__(self, model: Transformer, pool: KVBlockPool, draft_layers: int, num_tokens: int) -> None:
        assert 0 < draft_layers < model.cfg.n_layers
        self.model = model
        self.pool = pool
        self.draft_layers = draft_layers
        self.num_tokens = num_tokens
        self.draft_tokens_total = 0
        self.accepted_tokens_total = 0

    def step(self, batch: list[tuple[list[int], int, int]]) -> list[list[int]]:
        """batch: per sequence (block_table, position p of its last token, last token id); the
        block tables must cover p + num_tokens + 1 tokens. Returns each sequence's new tokens
        (1 to num_tokens + 1), whose K/V are cached except for the last one."""
        g = self.num_tokens
        model = self.model
        drafts = [[last] for _, _, last in batch]                    # per seq: [t, d1, ...]
        for j in range(g):
            segments = [(table, p + j, 1) for table, p, _ in batch]
            tokens = model.tensor([d[-1] for d in drafts])                        # [B]
            positions = model.tensor([p + j for _, p, _ in batch])                # [B]
            hidden = model.forward(tokens, positions, PagedAttention(self.pool, segments),
                                   n_layers=self.draft_layers)                    # [B, d]
            for d, token in zip(drafts, model.logits(hidden).argmax(-1).tolist()):
                d.append(token)
        segments = [(table, p, g + 1) for table, p, _ in batch]
        tokens = model.tensor([t for d in drafts for t in d])                     # [B*(g+1)]
        positions = torch.cat([torch.arange(p, p + g + 1) for _, p, _ in batch]).to(model.device)
        hidden = model.forward(tokens, positions, PagedAttention(self.pool, segments))
        target = model.logits(hidden).argmax(-1).view(len(batch), g + 1).tolist()  # [B, g+1]
        out = []
        for d, t in zip(drafts, target):
            accepted = 0
            while accepted < g and d[accepted + 1] == t[accepted]:
                accepted += 1
            self.draft_tokens_total += g
            self.accepted_tokens_total += accepted
            out.append(t[:accepted + 1])
        return out
