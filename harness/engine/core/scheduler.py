"""Which requests run this step, and whose KV gives way: a waiting deque, a running deque and
a status enum over the paged block pool.

Per step the scheduler spends a prompt-token budget, first on running requests whose prompt is
partly prefilled, then on admitting waiting requests first-come first-served while the batch
has room and free blocks cover the whole prompt (a prompt longer than the budget is prefilled in
chunks over several steps, so running streams keep decoding). When a running request needs a
block and none is free, the newest request of the lowest priority is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed from its tokens.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

from harness.engine.core.kv_cache import KVBlockPool
from harness.engine.core.output import OutputTracker
from harness.engine.core.types import GenerateRequest

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PAUSED = "paused"      # live migration: out of the batch, KV kept until the target confirms
    SWAPPED = "swapped"    # KV offloaded to a lower tier (offload.py), fetched back before decoding
    FINISHED = "finished"


@dataclass
class Sequence:
    req: GenerateRequest
    tracker: OutputTracker
    seed: int
    status: RequestStatus = RequestStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0              # tokens whose K/V are in the cache
    pending_token: int | None = None   # first token of a PD import, emitted by the next step

    @property
    def tokens(self) -> list[int]:
        return self.req.prompt_token_ids + self.tracker.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.req.prompt_token_ids) + len(self.tracker.output_ids)


class Scheduler:
    def __init__(self, pool: KVBlockPool, max_batch: int, max_prefill_tokens: int, context_len: int,
                 max_positions: int) -> None:
        self.pool = pool
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.context_len = context_len
        self.max_positions = max_positions  # RoPE table length: no token may sit beyond it
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.preemptions_total = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def join_running(self, seq: Sequence) -> None:
        """A request that arrives with its KV already in its blocks (PD import, migration)."""
        seq.status = RequestStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted request out and free its blocks."""
        if seq.status is RequestStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is RequestStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.pool.free(seq.block_table)
            seq.block_table = []
        seq.status = RequestStatus.FINISHED

    def plan_prefills(self) -> tuple[list[tuple[Sequence, int]], list[tuple[Sequence, str]]]:
        """This step's prefill work: [(request, tokens to feed)], plus the waiting requests that can
        never fit in the pool, each with the reason (the caller ends them with an error)."""
        budget = self.max_prefill_tokens
        plan: list[tuple[Sequence, int]] = []
        rejected: list[tuple[Sequence, str]] = []
        for seq in self.running:
            remaining = seq.num_tokens - seq.num_computed
            if remaining > 1 and budget > 0:
                plan.append((seq, min(remaining, budget)))
                budget -= plan[-1][1]
        usable = self.pool.num_blocks - len(self.pool.quarantined)
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            # the most this request can ever hold: prompt + max_tokens, capped by the context
            peak = min(len(seq.req.prompt_token_ids) + seq.req.params.max_tokens, self.context_len)
            if self.pool.blocks_for(peak) > usable:
                self.waiting.popleft()
                rejected.append((seq, f"request needs up to {self.pool.blocks_for(peak)} KV blocks ({peak} "
                                      f"tokens) but the KV cache holds {usable}; lower max_tokens or the prompt "
                                      "length, or raise kv_budget_bytes"))
                continue
            need = self.pool.blocks_for(seq.num_tokens) - len(seq.block_table)
            if self.pool.blocks_for(peak) > usable - self.pool.num_held:
                break  # cannot finish beside an HBM fill: wait for its release, not recompute itself forever
            if need > self.pool.num_free:
                break  # wait for KV to free up; FCFS, so later requests wait too
            seq.block_table += self.pool.allocate(need)
            self.waiting.popleft()
            seq.status = RequestStatus.RUNNING
            self.running.append(seq)
            plan.append((seq, min(seq.num_tokens - seq.num_computed, budget)))
            budget -= plan[-1][1]
        return plan, rejected

    def reserve(self, seq: Sequence, extra_tokens: int, preempt: bool) -> bool:
        """Make seq's block table cover num_computed + extra_tokens tokens. Without ``preempt``
        gives up when the pool is short; with it, preempts the newest running request of the
        lowest priority (possibly seq itself, which then returns False)."""
        if seq.num_computed + extra_tokens > self.max_positions:
            return False
        need = self.pool.blocks_for(seq.num_computed + extra_tokens) - len(seq.block_table)
        while need > self.pool.num_free:
            if not preempt:
                return False
            # the newest of the least important: high-priority KV is never given up first (4.3)
            victim = min(reversed(self.running), key=lambda s: s.req.params.priority)
            self.preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table += self.pool.allocate(need)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free a running request's KV and queue it first, to be recomputed from its tokens."""
        assert seq.pending_token is None, "stream an imported first token before preempting"
        logger.info("preempting %s (%d tokens) to free KV; it will be recomputed", seq.req.request_id,
                    seq.num_tokens)
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table, seq.num_computed = [], 0
        seq.status = RequestStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions_total += 1
