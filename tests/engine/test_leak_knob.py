"""The planted KV leak (EngineConfig.leak_kv_blocks_per_recovery): a decode worker that imports a
recovered stream keeps N blocks it never frees, so soak.leaks has a cluster it must fail. Driven
through a WorkerEngine's public side, as the control session and the KV receiver drive it (its
engine thread runs; no processes, no sockets)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from harness.clusterfile import load_cluster
from harness.engine.control.messages import (Abort, Import, ImportFailed, ImportReady, Message, MigrateFailed,
                                             MigrateIn, MigrateReady, Tokens, request_dict)
from harness.engine.core.config import EngineConfig
from harness.engine.core.engine_core import EngineCore
from harness.engine.core.tokenizer import ByteTokenizer
from harness.engine.core.types import GenerateRequest, SamplingParams
from harness.engine.pd.worker_engine import WorkerEngine
from harness.errors import ConfigError
from harness.waiting import wait_until

PROMPT = ByteTokenizer().encode("a request re-placed after its worker died")
PREFILL = EngineCore(EngineConfig(preset="tiny"))   # computes the KV a prefill worker would send


class Worker:
    """A decode WorkerEngine with its engine thread running and every published message kept."""

    def __init__(self, leak: int, **config) -> None:
        self.published: list[Message] = []
        self._lock = threading.Lock()
        self.engine = WorkerEngine("decode-0", "decode",
                                   EngineConfig(preset="tiny", leak_kv_blocks_per_recovery=leak, **config),
                                   publish=self.publish, on_failure=lambda: None)
        self.engine.start()

    def publish(self, msg: Message) -> None:
        with self._lock:
            self.published.append(msg)

    def seen(self, kind: type, rid: str) -> list:
        with self._lock:
            return [m for m in self.published if isinstance(m, kind) and m.rid == rid]

    def wait_for(self, kind: type, rid: str, what: str) -> None:
        wait_until(lambda: self.seen(kind, rid), 60, 0.01, what=what)

    def used(self, blocks: int) -> None:
        """Wait until the heartbeat (what the router's /admin/workers shows) reports ``blocks`` in use."""
        wait_until(lambda: self.engine.heartbeat().stats["kv_blocks_used"], 30, 0.02,
                   accept=lambda n: n == blocks, what=f"{blocks} KV blocks in use")

    def serve(self, rid: str, resume: list[int], attempt: int = 0) -> None:
        """What the router and a prefill worker do for one (re-placed) request; waits for its end."""
        params = {"max_tokens": len(resume) + 6, "ignore_eos": True}
        self.engine.submit(Import(rid, list(PROMPT), list(resume), params, attempt=attempt))
        self.wait_for(ImportReady, rid, f"{rid}'s import to be ready")
        req = GenerateRequest(rid, list(PROMPT), SamplingParams(**params), resume_token_ids=list(resume))
        result = PREFILL.prefill_for_transfer(req)
        assert self.engine.kv_layout(rid) is not None
        kv = torch.stack([torch.stack([k, v]) for k, v in result.kv])   # [layers, 2, T, H, D]
        self.engine.kv_write(rid, 0, kv, release=lambda: None)
        self.engine.kv_complete(rid, result.first_token_id)
        wait_until(lambda: any(t.finished for t in self.seen(Tokens, rid)), 60, 0.01, what=f"{rid} to finish")
        assert not any(t.error for t in self.seen(Tokens, rid))

    def stop(self) -> None:
        self.engine.stop()


@pytest.fixture
def worker():
    made: list[Worker] = []

    def make(leak: int, **config) -> Worker:
        made.append(Worker(leak, **config))
        return made[-1]
    yield make
    for w in made:
        w.stop()


@pytest.mark.parametrize("leak", [0, 3])
def test_a_resumed_import_leaks_exactly_n_blocks_that_stay_used_after_it_finished(leak, worker, caplog):
    w = worker(leak)
    with caplog.at_level(logging.WARNING, logger="harness.engine.pd.worker_engine"):
        w.serve("r1", resume=[65, 66, 67])
    w.used(leak)
    assert len(w.engine.leaked_blocks) == leak
    warnings = [r.getMessage() for r in caplog.records if "sabotage" in r.getMessage()]
    assert warnings == ([f"sabotage: leaking {leak} KV blocks (leak_kv_blocks_per_recovery) on recovered request "
                         "r1; 3 leaked so far"] if leak else [])
    w.serve("r2", resume=[70])          # a second recovery leaks as much again
    w.used(2 * leak)


def test_a_fresh_import_leaks_nothing_and_leaked_blocks_survive_a_reset(worker):
    w = worker(4)
    w.serve("fresh", resume=[])
    w.used(0)
    w.serve("resumed", resume=[65])
    w.engine.reset()                    # the router reconnected: every request dropped
    w.used(4)
    assert len(w.engine.leaked_blocks) == 4


def test_a_request_re_placed_before_its_first_token_leaks_too(worker):
    """A kill can find only requests that had not streamed a token yet: the router re-places them as
    attempt 1 with nothing to resume. They are recovered streams as much as any (clusters/local-leaky.yaml
    says so), and the planted leak must take its blocks for them too, or a soak whose kill found
    only such requests has no leak to judge. Planted defect it fails on: the knob keyed on resumed
    tokens alone, as before 2026-12-07 (then a 3-minute soak on clusters/local-leaky.yaml whose kill of
    decode-1 re-placed two requests with resumed_tokens=0 leaked nothing and passed soak.leaks, twice)."""
    w = worker(4)
    w.serve("r#1", resume=[], attempt=1)
    w.used(4)
    assert len(w.engine.leaked_blocks) == 4


def test_a_pool_short_of_blocks_leaks_what_is_free_and_never_fails_the_request(worker):
    w = worker(1000, kv_budget_bytes=12 * EngineConfig(preset="tiny").block_bytes)
    w.engine.submit(Import("r", list(PROMPT), [65], {"max_tokens": 4}))
    w.wait_for(ImportReady, "r", "the import to be ready")
    w.used(12)                          # the request's blocks and every free one
    held = len(w.engine.leaked_blocks)
    assert 0 < held < 12
    w.engine.submit(Abort("r"))
    w.used(held)
    w.engine.submit(Import("again", list(PROMPT), [65], {"max_tokens": 4}))
    w.wait_for(ImportReady, "again", "the second import to be ready")   # nothing left to leak: no crash
    assert len(w.engine.leaked_blocks) == held and not w.seen(ImportFailed, "again")


def test_an_accepted_live_migration_leaks_too_and_a_refused_one_does_not(worker):
    w = worker(2)
    req = GenerateRequest("m", list(PROMPT), SamplingParams(max_tokens=20))
    w.engine.submit(MigrateIn("m", request_dict(req, "m"), len(PROMPT) + 3, [65, 66, 67]))
    w.wait_for(MigrateReady, "m", "the migration to be accepted")
    w.engine.submit(Abort("m"))         # called off: its import is freed, the leak is not
    w.used(2)
    w.engine.submit(MigrateIn("bad", request_dict(req, "bad"), 1, [65]))
    w.wait_for(MigrateFailed, "bad", "the bad migration to be refused")
    w.used(2)
    assert len(w.engine.leaked_blocks) == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_the_knob_must_be_a_whole_number_of_blocks(bad):
    with pytest.raises(ConfigError, match="leak_kv_blocks_per_recovery must be an integer >= 0") as info:
        EngineConfig(preset="tiny", leak_kv_blocks_per_recovery=bad)
    assert "soak leak check" in info.value.fix


def test_the_leaky_cluster_file_sets_the_knob_in_every_engine():
    spec = load_cluster("local-leaky")
    assert spec.name == "local-leaky" and "soak.leaks" in spec.description
    assert spec.bundled.engine.model_dump(exclude_unset=True) == {"leak_kv_blocks_per_recovery": 8}
    assert spec.fabric.enabled
    assert load_cluster("local").bundled.engine.model_dump(exclude_unset=True) == {}
