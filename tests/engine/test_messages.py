"""The router <-> worker control protocol (harness/engine/control/messages.py and codec.py): every kind round-trips,
malformed frames are refused with a reason, and a peer that sends one does not take the router down."""

from __future__ import annotations

import asyncio
import json
import logging
import struct

import pytest

from harness.engine.control import codec
from harness.engine.control import messages as m
from harness.engine.core.types import GenerateRequest, SamplingParams
from harness.engine.pd.router import Router
from harness.engine.pd.router_config import RouterConfig

PARAMS = {"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": None, "stop": ["\n"], "ignore_eos": False,
          "priority": 1}
SAMPLES: dict[str, m.Message] = {
    "register": m.Register("decode-0", "decode", 42, ["10.0.0.2", 7000], ["10.1.0.2", 7001], 512, 16),
    "welcome": m.Welcome(1.0, 0.1),
    "refused": m.Refused("worker id decode-0 is already registered and healthy"),
    "heartbeat": m.Heartbeat({"kv_blocks_used": 3, "kv_used_ratio": 0.25}, {"frames": 9}, 2),
    "progress": m.Progress(1234),
    "import": m.Import("r1#0", [72, 105], [33], PARAMS),
    "prefill": m.Prefill("r1#0", [72, 105], [], PARAMS, transfer={"mode": "layerwise"},
                         target={"kv": ["10.0.0.2", 7000], "control": ["10.1.0.2", 7001]}),
    "abort": m.Abort("r1#0"),
    "set_speculative": m.SetSpeculativeCommand(False),
    "set_offload": m.SetOffloadCommand(True, 0.85),
    "fault": m.CorruptFrames(2),
    "hbm_fill": m.HbmFillCommand("f-1", 0.5),
    "hbm_release": m.HbmReleaseCommand("f-1"),
    "ecc_poison": m.EccPoisonCommand("f-2", blocks=[3, 4]),
    "ecc_clear": m.EccClearCommand("f-2"),
    "fault_state": m.FaultStateReport("f-2", "ecc_poison", True, 0.5, 2, 2, blocks=[3, 4], affected=["r1#0"],
                                ecc_handling=True),
    "import_ready": m.ImportReady("r1#0"),
    "import_failed": m.ImportFailed("r1#0", "no KV headroom"),
    "prefill_failed": m.PrefillFailed("r1#0", "prefill: boom"),
    "prefill_done": m.PrefillDone("r1#0", 0.01, "fabric", 4096, 0.002, 0, False),
    "tokens": m.Tokens("r1#0", [108, 108], "ll", True, "length", 3),
    "transfer_event": m.TransferEvent("r1#0", "retry", {"attempt": 1}),
    "migrate_in": m.MigrateIn("r1#0", m.request_dict(GenerateRequest("r1", [72], SamplingParams()), "r1#0"), 3,
                              [105, 33]),
    "migrate_out": m.MigrateOut("r1#0", 3, ["10.0.0.3", 7000], max_kv_tokens=5, target_id="decode-1",
                                target_control=["10.1.0.3", 7001], transfer={}),
    "migrate_ready": m.MigrateReady("r1#0", 3, 34),
    "migrate_committed": m.MigrateCommitted("r1#0", 0.003),
    "migrated": m.Migrated("r1#0", "decode-0", "decode-1", 0.001, 0.002, 8192, "fabric", 0, False, 1),
    "migrate_failed": m.MigrateFailed("r1#0", "target refused", side="target"),
}


def test_the_samples_cover_every_message_kind():
    assert set(SAMPLES) == set(m.KINDS) and len(m.KINDS) >= 27


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_every_kind_round_trips_through_the_wire_format(kind):
    msg = SAMPLES[kind]
    wire = codec.encode(msg)
    (n,) = struct.unpack("!I", wire[:4])
    assert n == len(wire) - 4
    data = json.loads(wire[4:])
    assert data["type"] == kind and data["v"] == codec.VERSION
    back = codec.decode(wire[4:])
    assert type(back) is type(msg) and back == msg


def test_requests_survive_the_trip_as_requests():
    imp = codec.decode(codec.encode(SAMPLES["import"])[4:])
    req = imp.request()
    assert req.request_id == "r1#0" and req.resume_token_ids == [33] and req.params.stop == ("\n",)
    mig = codec.decode(codec.encode(SAMPLES["migrate_in"])[4:])
    assert m.request_from_dict(mig.request, mig.rid).prompt_token_ids == [72]


@pytest.mark.parametrize("body,words", [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"v": 1, "type": "teleport", "rid": "x"}', "unknown control message type 'teleport'"),
    (b'{"v": 1, "rid": "x"}', "unknown control message type None"),
    (b'{"v": 2, "type": "abort", "rid": "x"}', "protocol version 2"),
    (b'{"type": "abort", "rid": "x"}', "protocol version None"),
    (b'{"v": 1, "type": "abort"}', "required field 'rid'"),
    (b'{"v": 1, "type": "abort", "rid": "x", "force": true}', "unknown field(s) ['force']"),
    (b'{"v": 1, "type": "abort", "rid": 7}', "abort.rid"),
    (b'{"v": 1, "type": "progress", "steps": true}', "progress.steps"),
    (b'{"v": 1, "type": "progress", "steps": 1.5}', "progress.steps"),
    (b'{"v": 1, "type": "tokens", "rid": "x", "token_ids": [1, "a"], "text": "", "finished": false, '
     b'"finish_reason": null, "num_output_tokens": 1}', "tokens.token_ids[1]"),
    (b'{"v": 1, "type": "transfer_event", "rid": "x", "event": "teleport"}', "transfer_event.event"),
    (b'{"v": 1, "type": "set_offload", "enabled": true, "threshold": "high"}', "set_offload.threshold"),
])
def test_malformed_messages_are_refused_naming_the_problem(body, words):
    with pytest.raises(codec.MessageError) as info:
        codec.decode(body)
    assert words in str(info.value) and info.value.fix


def test_encode_takes_only_typed_messages():
    with pytest.raises(AttributeError):
        codec.encode({"type": "abort", "rid": "x"})


def _reader(*chunks: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    for c in chunks:
        reader.feed_data(c)
    reader.feed_eof()
    return reader


def test_read_message_skips_a_bad_frame_with_a_logged_reason(caplog):
    async def main():
        bad = codec.frame({"v": 1, "type": "teleport"})
        reader = _reader(bad, struct.pack("!I", 5) + b"nope!", codec.encode(m.Abort("r9")))
        with caplog.at_level(logging.WARNING, logger="harness.engine.control.codec"):
            first = await codec.read_message(reader, "decode-0")
            rest = await codec.read_message(reader, "decode-0")
        return first, rest

    first, rest = asyncio.run(main())
    assert first == m.Abort("r9") and rest is None
    reasons = [r.getMessage() for r in caplog.records]
    assert any("decode-0" in r and "teleport" in r for r in reasons) and any("not JSON" in r for r in reasons)


def test_an_oversized_frame_is_refused_not_read():
    async def main():
        await codec.read_message(_reader(struct.pack("!I", codec.MAX_MSG_BYTES + 1)))

    with pytest.raises(codec.MessageError, match="exceeds"):
        asyncio.run(main())


def test_the_router_survives_malformed_messages_and_keeps_serving(caplog):
    async def main():
        router = Router("tiny", RouterConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=5))
        _, port = await router.start_control("127.0.0.1", 0)
        try:
            # a peer that never registers properly is refused and the router carries on
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(codec.encode(m.Abort("x")))
            assert (await codec.read_message(reader)) == m.Refused("the first message must be register, got abort")
            writer.close()
            # a registered worker's garbage is dropped with a reason; the worker stays healthy
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(codec.encode(SAMPLES["register"]))
            assert isinstance(await codec.read_message(reader), m.Welcome)
            writer.write(codec.frame({"v": 1, "type": "teleport"}) + codec.frame({"v": 1, "type": "progress", "steps": "x"}))
            writer.write(codec.encode(m.Welcome(1.0)))  # a router -> worker kind sent the wrong way
            writer.write(codec.encode(m.Progress(77)))
            for _ in range(100):
                if router.workers["decode-0"].steps == 77:
                    break
                await asyncio.sleep(0.02)
            w = router.workers["decode-0"]
            assert w.steps == 77 and w.health == "healthy"
            writer.close()
        finally:
            await router.close()

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "teleport" in text and "progress.steps" in text and "workers do not send it" in text
