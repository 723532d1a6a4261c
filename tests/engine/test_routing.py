"""The routing table (harness/engine/control/routing.py): the one owner of worker state keeps every
counter consistent through placement, KV arrival, live migration, release and worker loss."""

from __future__ import annotations

import asyncio

from harness.engine.core.types import GenerateRequest, SamplingParams
from harness.engine.control.codec import decode
from harness.engine.control.messages import Abort
from harness.engine.control.routing import Attempt, RoutingTable, RouterWorker, WorkerLost


class Wire:
    """The worker's end of the control connection: what the table sent it, decoded."""

    def __init__(self) -> None:
        self.sent: list = []

    def write(self, data: bytes) -> None:
        self.sent.append(decode(data[4:]))

    def is_closing(self) -> bool:
        return False


def table_with(*specs: tuple[str, str, int]) -> RoutingTable:
    table = RoutingTable(kv_headroom_factor=1.2)
    for wid, role, blocks in specs:
        table.join(RouterWorker(wid, role, 1, ("127.0.0.1", 1), ("127.0.0.1", 2), Wire(), blocks, 16))
    return table


def attempt(table: RoutingTable, rid: str, prompt: int = 16, max_tokens: int = 16) -> Attempt:
    req = GenerateRequest(rid, [65] * prompt, SamplingParams(max_tokens=max_tokens))
    picked = table.pick(lambda block_size: -(-(prompt + max_tokens) // block_size))
    assert isinstance(picked, tuple), picked
    prefill, decode_worker, blocks = picked
    att = Attempt(f"{rid}#0", prefill.id, decode_worker.id, blocks, asyncio.Queue(), req, [])
    table.place(att)
    return att


def counters(w: RouterWorker) -> tuple[int, int, set]:
    return w.queue_depth, w.reserved_blocks, set(w.attempts)


def test_place_arrive_release_moves_every_counter_and_back():
    table = table_with(("p", "prefill", 0), ("d", "decode", 100))
    p, d = table.workers["p"], table.workers["d"]
    att = attempt(table, "r1")
    assert counters(p) == (1, 0, {"r1#0"}) and counters(d) == (1, 2, {"r1#0"}) and d.free_blocks() == 98
    assert table.serves(p) and table.serves(d)
    table.kv_arrived(att)
    table.kv_arrived(att)  # a second report changes nothing
    assert counters(p) == (0, 0, set()) and not table.serves(p)
    assert table.release(att) and not table.release(att)
    assert counters(d) == (0, 0, set()) and table.attempts == {}
    assert d.writer.sent == [Abort("r1#0")] and p.writer.sent == []  # the prefill side was done already


def test_release_before_the_kv_arrived_frees_the_prefill_worker_too():
    table = table_with(("p", "prefill", 0), ("d", "decode", 100))
    att = attempt(table, "r1")
    table.release(att)
    assert counters(table.workers["p"]) == (0, 0, set()) and table.workers["p"].writer.sent == [Abort("r1#0")]


def test_a_migration_reserves_on_the_target_then_switches_or_undoes():
    table = table_with(("p", "prefill", 0), ("a", "decode", 100), ("b", "decode", 100))
    att = attempt(table, "r1")
    src = table.workers[att.decode]
    tgt = table.workers["b" if src.id == "a" else "a"]
    table.kv_arrived(att)
    table.reserve_target(att, tgt)
    assert counters(tgt) == (1, 2, {"r1#0"}) and not table.serves(tgt)  # a reservation, not its request
    table.undo_target(att, tgt)
    assert counters(tgt) == (0, 0, set()) and tgt.writer.sent == [Abort("r1#0")]
    table.reserve_target(att, tgt)
    table.switch(att, src, tgt)
    assert att.decode == tgt.id and counters(src) == (0, 0, set()) and counters(tgt) == (1, 2, {"r1#0"})
    table.release(att)
    assert counters(tgt) == (0, 0, set())


def test_pick_needs_headroom_and_skips_draining_and_dead_workers():
    table = table_with(("p", "prefill", 0), ("small", "decode", 2), ("big", "decode", 100))
    assert table.pick(lambda bs: 2)[1].id == "big"          # 2 free blocks < 1.2 x 2
    table.set_draining("big", True)
    assert "headroom" in table.pick(lambda bs: 2)
    table.set_draining("big", False)
    table.lose(table.workers["big"], "connection_lost", 0.0)
    assert "headroom" in table.pick(lambda bs: 2)
    table.lose(table.workers["p"], "connection_lost", 0.0)
    assert table.pick(lambda bs: 1) == "0 healthy prefill and 1 healthy decode workers"


def test_the_readmit_sabotage_keeps_a_re_registered_worker_out_of_placement_while_listed_healthy():
    table = RoutingTable(kv_headroom_factor=1.2, readmit_delay_s=3600.0)
    for wid, role in (("p", "prefill"), ("d0", "decode"), ("d1", "decode")):
        table.join(RouterWorker(wid, role, 1, ("127.0.0.1", 1), ("127.0.0.1", 2), Wire(), 100, 16))
    assert not table.held_out  # a first registration is not held out
    table.lose(table.workers["d1"], "connection_lost", 0.0)
    table.join(RouterWorker("d1", "decode", 2, ("127.0.0.1", 1), ("127.0.0.1", 2), Wire(), 100, 16))
    assert [w.id for w in table.healthy("decode")] == ["d0", "d1"]
    for i in range(4):  # least-loaded would alternate; the held-out worker never gets one
        att = attempt(table, f"r{i}")
        assert att.decode == "d0"
    table.held_out["d1"] = 0.0  # the hold is over
    assert attempt(table, "r9").decode == "d1"


def test_losing_a_worker_tells_the_attempts_it_serves():
    table = table_with(("p", "prefill", 0), ("d", "decode", 100))
    att = attempt(table, "r1")
    assert table.lose(table.workers["d"], "heartbeat_timeout", 5.0) == ["r1#0"]
    assert att.inbox.get_nowait() == WorkerLost("d", "heartbeat_timeout", 5.0)
    assert table.workers["d"].health == "dead" and table.workers["d"].down_reason == "heartbeat_timeout"
    table.release(att)  # the stream gives up on it: the dead worker's counters still come back
    assert counters(table.workers["d"]) == (0, 0, set())


def test_the_admission_queue_counts_waiters_on_every_exit_path():
    table = table_with()
    try:
        with table.waiting_for_placement():
            assert table.waiting == 1
            raise TimeoutError
    except TimeoutError:
        pass
    assert table.waiting == 0
