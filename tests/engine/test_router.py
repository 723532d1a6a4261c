"""Router logic over its real control port, with scripted workers speaking the control protocol
(the real worker processes are exercised end to end in test_pd.py). Fast: no model runs here."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from harness.engine.core.types import FinishReason, GenerateRequest, SamplingParams
from harness.engine.control.codec import VERSION, frame, read_raw
from harness.engine.pd.router import Router
from harness.engine.pd.router_config import RouterConfig

FAST = {"heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 0.5}


class ScriptedWorker:
    """Registers like a worker, heartbeats, and records the commands it receives."""

    def __init__(self, wid: str, role: str, blocks: int = 1000, block_size: int = 16) -> None:
        self.id, self.role, self.blocks, self.block_size = wid, role, blocks, block_size
        self.commands: asyncio.Queue = asyncio.Queue()
        self.beating = True
        self.steps: int | None = None  # set: progress beats too, carrying this step counter
        self._tasks: list[asyncio.Task] = []

    async def connect(self, port: int) -> dict:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)
        self.send({"type": "register", "id": self.id, "role": self.role, "pid": 1, "kv_addr": ["127.0.0.1", 1],
                   "control_addr": ["127.0.0.1", 2], "kv_blocks_total": self.blocks, "block_size": self.block_size})
        welcome = await read_raw(self.reader)
        if welcome["type"] == "welcome":
            self._tasks = [asyncio.create_task(self._beat()), asyncio.create_task(self._read())]
        return welcome

    def send(self, msg: dict) -> None:
        self.writer.write(frame({"v": VERSION, **msg}))

    async def _beat(self) -> None:
        while True:
            if self.beating:
                self.send({"type": "heartbeat", "stats": {"kv_blocks_used": 0}, "transfer": {}, "queue_depth": 0})
                if self.steps is not None:
                    self.send({"type": "progress", "steps": self.steps})
            await asyncio.sleep(0.1)

    async def _read(self) -> None:
        while (msg := await read_raw(self.reader)) is not None:
            await self.commands.put(msg)
        await self.commands.put({"type": "closed"})

    async def expect(self, kind: str) -> dict:
        while True:
            msg = await asyncio.wait_for(self.commands.get(), 5)
            if msg["type"] == kind:
                return msg

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.writer.close()


async def started(config: dict, *workers: ScriptedWorker) -> tuple[Router, int]:
    router = Router("tiny", RouterConfig.from_dict({**FAST, **config}))
    _, port = await router.start_control("127.0.0.1", 0)
    for w in workers:
        assert (await w.connect(port))["type"] == "welcome"
    await asyncio.sleep(0)  # let the router handle the registrations
    return router, port


def req(rid: str, prompt_len: int = 16, max_tokens: int = 16) -> GenerateRequest:
    return GenerateRequest(rid, [65] * prompt_len, SamplingParams(max_tokens=max_tokens))


async def chosen(*decodes: ScriptedWorker) -> tuple[ScriptedWorker, dict]:
    """The decode worker that received the next import, and the import."""
    waits = {asyncio.create_task(d.expect("import")): d for d in decodes}
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    task = done.pop()
    return waits[task], task.result()


async def serve_one(prefill: ScriptedWorker, decode: ScriptedWorker, tokens: list[int], finish: bool,
                    imp: dict | None = None) -> dict:
    """Play the workers' side of one placement: import, prefill, then stream ``tokens``."""
    imp = imp or await decode.expect("import")
    decode.send({"type": "import_ready", "rid": imp["rid"]})
    pre = await prefill.expect("prefill")
    assert pre["target"]["kv"] == ["127.0.0.1", 1] and pre["resume_token_ids"] == imp["resume_token_ids"]
    prefill.send({"type": "prefill_done", "rid": pre["rid"], "prefill_s": 0.01, "seconds": 0.02, "bytes": 10,
                  "path": "fabric", "retries": 0, "fallback": False})
    for i, t in enumerate(tokens):
        last = finish and i == len(tokens) - 1
        decode.send({"type": "tokens", "rid": imp["rid"], "token_ids": [t], "text": chr(t), "finished": last,
                     "finish_reason": "length" if last else None,
                     "num_output_tokens": len(imp["resume_token_ids"]) + i + 1, "error": None})
    return imp


async def collect(router: Router, request: GenerateRequest) -> list:
    return [ev async for ev in router.generate(request)]


async def collect_rest(stream) -> list:
    return [ev async for ev in stream]


def test_decode_target_needs_1_2x_headroom_then_least_load():
    async def main():
        p = ScriptedWorker("prefill-0", "prefill")
        small = ScriptedWorker("decode-a", "decode", blocks=2)   # 2 blocks: 1.2 x 2 needed does not fit
        big = ScriptedWorker("decode-b", "decode", blocks=100)
        router, _ = await started({}, p, small, big)
        task = asyncio.create_task(collect(router, req("r1", 16, 16)))  # 32 tokens = 2 blocks
        imp = await serve_one(p, big, [66, 67], finish=True)
        events = await task
        assert imp["rid"] == "r1#0" and [e.token_ids for e in events] == [[66], [67]]
        assert all(e.worker == "decode-b" for e in events) and small.commands.empty()
        await router.close()

    asyncio.run(main())


def test_admission_queue_waits_for_headroom_then_times_out_with_an_error():
    async def main():
        p, d = ScriptedWorker("prefill-0", "prefill"), ScriptedWorker("decode-0", "decode", blocks=3)
        router, _ = await started({"admission_timeout_s": 1.0}, p, d)
        first = asyncio.create_task(collect(router, req("r1")))
        imp = await serve_one(p, d, [70], finish=False)  # holds 2 of the 3 blocks
        second = asyncio.create_task(collect(router, req("r2")))
        while router.stats().extra["admission_queue"] != 1:
            await asyncio.sleep(0.01)
        assert d.commands.empty()  # r2 waits: 1 free block < 1.2 x 2
        d.send({"type": "tokens", "rid": imp["rid"], "token_ids": [71], "text": "G", "finished": True,
                "finish_reason": "length", "num_output_tokens": 2, "error": None})
        assert [e.token_ids for e in await first] == [[70], [71]]
        await serve_one(p, d, [72], finish=False)  # r2 is placed once r1 freed its blocks
        third = await collect(router, req("r3"))  # r2 never finishes: r3 times out
        assert third[-1].finish_reason == FinishReason.ERROR and "within 1.0 s" in third[-1].error
        assert router.stats().extra["admission_queue"] == 0
        second.cancel()
        await router.close()

    asyncio.run(main())


def test_dead_decode_resumes_elsewhere_with_streamed_tokens_and_no_duplicates():
    async def main():
        p = ScriptedWorker("prefill-0", "prefill")
        a, b = ScriptedWorker("decode-a", "decode"), ScriptedWorker("decode-b", "decode", blocks=999)
        router, _ = await started({}, p, a, b)
        stream = router.generate(req("r1"))
        first_event = asyncio.create_task(stream.__anext__())
        victim, imp = await chosen(a, b)
        other = b if victim is a else a
        first = await serve_one(p, victim, [80, 81, 82], finish=False, imp=imp)
        events = [await first_event]
        while len(events) < 3:
            events.append(await stream.__anext__())
        await victim.close()  # connection lost after three tokens reached the client
        rest = asyncio.create_task(collect_rest(stream))
        second = await serve_one(p, other, [83, 84], finish=True)
        events += await rest
        assert first["rid"] == "r1#0" and second["rid"] == "r1#1"
        assert second["resume_token_ids"] == [80, 81, 82]
        assert [t for e in events for t in e.token_ids] == [80, 81, 82, 83, 84]
        assert [e.worker for e in events] == [victim.id] * 3 + [other.id] * 2
        kinds = [e["type"] for e in router.events]
        assert kinds.index("worker_down") < kinds.index("reschedule") < kinds.index("resumed")
        await router.close()

    asyncio.run(main())


def test_sabotage_knob_ends_affected_requests_with_an_error():
    async def main():
        p = ScriptedWorker("prefill-0", "prefill")
        a, b = ScriptedWorker("decode-a", "decode"), ScriptedWorker("decode-b", "decode")
        router, _ = await started({"reschedule_enabled": False}, p, a, b)
        task = asyncio.create_task(collect(router, req("r1")))
        victim, _ = await chosen(a, b)
        await victim.close()
        events = await task
        assert events[-1].finish_reason == FinishReason.ERROR and "rescheduling is disabled" in events[-1].error
        await router.close()

    asyncio.run(main())


def test_silent_worker_is_declared_dead_by_heartbeat_timeout_and_its_connection_closed():
    async def main():
        p, d = ScriptedWorker("prefill-0", "prefill"), ScriptedWorker("decode-0", "decode")
        router, port = await started({}, p, d)
        d.beating = False
        assert (await d.expect("closed"))["type"] == "closed"
        down = next(e for e in router.events if e["type"] == "worker_down")
        assert (down["worker"], down["reason"]) == ("decode-0", "heartbeat_timeout")
        again = ScriptedWorker("decode-0", "decode")  # the same id rejoins
        assert (await again.connect(port))["type"] == "welcome"
        assert router.workers["decode-0"].health == "healthy"
        dup = ScriptedWorker("decode-0", "decode")    # but a second live one is refused
        assert (await dup.connect(port))["type"] == "refused"
        await router.close()

    asyncio.run(main())


HANG = {"heartbeat_timeout_s": 30.0, "progress_interval_s": 0.1, "hang_timeout_s": 0.4}


def test_serving_worker_that_stops_its_progress_beats_is_down_for_no_progress_not_heartbeat():
    async def main():
        p, d = ScriptedWorker("prefill-0", "prefill"), ScriptedWorker("decode-0", "decode")
        d.steps = p.steps = 0
        router, _ = await started(HANG, p, d)
        task = asyncio.create_task(collect(router, req("r1")))
        await serve_one(p, d, [70], finish=False)
        d.beating = False  # as under SIGSTOP: no thread of the worker runs
        assert (await d.expect("closed"))["type"] == "closed"  # within 5 s; heartbeat_timeout is 30 s
        down = next(e for e in router.events if e["type"] == "worker_down")
        assert (down["worker"], down["reason"], down["steps"]) == ("decode-0", "no_progress", 0)
        assert down["affected"] == ["r1#0"]
        task.cancel()
        await router.close()

    asyncio.run(main())


def test_busy_worker_whose_step_counter_stands_still_but_keeps_beating_is_not_declared_hung():
    async def main():
        p, d = ScriptedWorker("prefill-0", "prefill"), ScriptedWorker("decode-0", "decode")
        idle = ScriptedWorker("decode-1", "decode", blocks=1)  # no headroom: never placed
        d.steps = p.steps = idle.steps = 0
        router, _ = await started(HANG, p, d, idle)
        task = asyncio.create_task(collect(router, req("r1")))
        imp = await serve_one(p, d, [70], finish=False)
        idle.beating = False  # silent, but serves nothing: only the heartbeat timeout may judge it
        await asyncio.sleep(3 * HANG["hang_timeout_s"])  # one long engine step: the counter stays at 0
        assert [e for e in router.events if e["type"] == "worker_down"] == []
        d.send({"type": "tokens", "rid": imp["rid"], "token_ids": [71], "text": "G", "finished": True,
                "finish_reason": "length", "num_output_tokens": 2, "error": None})
        assert [e.token_ids for e in await task] == [[70], [71]]
        await router.close()

    asyncio.run(main())


def test_router_config_validation():
    with pytest.raises(Exception, match="kv_headroom_factor"):
        RouterConfig(kv_headroom_factor=0)
    with pytest.raises(Exception, match="reschedule_delay_s"):
        RouterConfig(reschedule_delay_s=-1)
    with pytest.raises(Exception, match="hang_timeout_s"):
        RouterConfig(progress_interval_s=0.5, hang_timeout_s=0.8)


def test_router_process_does_not_import_torch():
    """The router only routes: importing torch cost it seconds of start-up and ~200 MiB it never used."""
    code = ("import sys, harness.engine.pd.router_server as rs\n"
            "from harness.engine.serving.api import build_app\n"
            "from harness.engine.pd.router import Router\n"
            "from harness.engine.pd.router_config import RouterConfig\n"
            "router = Router('tiny', RouterConfig.from_dict({'transfer': {'mode': 'whole'}}))\n"
            "build_app(router, extra_routers=[rs.admin_api(router)])\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
