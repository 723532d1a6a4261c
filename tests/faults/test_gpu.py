"""HBM fill and ECC poisoning faults against a real router and decode worker."""

from __future__ import annotations

import threading

import httpx
import pytest

from harness.engine.core.oracle import greedy_reference
from harness.engine.core.tokenizer import ByteTokenizer
from harness.engine.pd.topology import Topology
from harness.errors import ConfigError, FaultError
from harness.faults import EccPoison, Fault, FaultRunner, HbmFill, Ledger
from harness.probes.client.streaming import CompletionRequest, StreamingClient

PRESET = "tiny"


def test_config_is_validated():
    with pytest.raises(ConfigError, match="share"):
        HbmFill(admin_url="http://127.0.0.1:1", worker_id="decode-0", share=1.5)
    with pytest.raises(ConfigError, match="admin_url"):
        EccPoison(admin_url="127.0.0.1:1", worker_id="decode-0")
    with pytest.raises(ConfigError, match="count"):
        EccPoison(admin_url="http://x", worker_id="decode-0", count=0)


def test_plan_names_every_call_and_the_ledger_round_trips():
    f = HbmFill(admin_url="http://127.0.0.1:9/admin", worker_id="decode-1", share=0.9, fault_id="abc")
    plan = "\n".join(f.plan())
    assert "POST http://127.0.0.1:9/admin/faults/hbm_fill" in plan
    assert "DELETE http://127.0.0.1:9/admin/faults/hbm_fill/abc" in plan
    again = Fault.from_ledger(f.to_ledger())
    assert isinstance(again, HbmFill) and again.share == 0.9 and again.fault_id == "abc"


def test_unreachable_router_fails_loudly():
    f = EccPoison(admin_url="http://127.0.0.1:9", worker_id="decode-0", timeout_s=0.5)
    with pytest.raises(FaultError, match="failed"):
        f.prepare(None)


def test_revert_seen_says_no_without_a_revert_reply_or_a_router_and_never_raises():
    """Catches EccPoison.revert_seen crashing the ECC suite (a FaultError out of the poll when the
    router is gone) or saying a revert showed that was never replied to; the suite then stops
    poisoning that worker (harness/suites/test_ecc_poisoning.py)."""
    f = EccPoison(admin_url="http://127.0.0.1:9", worker_id="decode-0", timeout_s=0.5)
    assert f.revert_seen(0.2) is False   # no revert reply: nothing to wait for
    f.revert_reply = {"kv_blocks_poisoned": 0}
    assert f.revert_seen(0.2) is False   # the router does not answer


@pytest.fixture(scope="module")
def topo():
    with Topology(prefill=1, decode=1, preset=PRESET, router_config={"degradation_enabled": False}) as t:
        yield t


def decode0(topo: Topology) -> dict:
    return next(w for w in topo.workers() if w["id"] == "decode-0")


@pytest.mark.slow
def test_hbm_fill_raises_kv_use_by_the_share_and_reverts(topo, tmp_path):
    with FaultRunner(Ledger(tmp_path / "ledger.json"), handle_signals=False) as runner:
        fault = runner.inject(HbmFill(admin_url=topo.api_url, worker_id="decode-0", share=0.6))
        assert decode0(topo)["kv_used_ratio"] >= 0.58
        blocks = fault.reply["blocks"]
        assert blocks == round(0.6 * decode0(topo)["kv_blocks_total"])
        runner.revert(fault)
    assert [r.action.value for r in runner.records] == ["inject", "verify", "revert", "verify_reverted"]
    assert all(r.status.value == "succeeded" for r in runner.records)
    faults = httpx.get(f"{topo.api_url}/admin/faults").json()
    assert next(f for f in faults if f["fault_id"] == fault.fault_id)["active"] is False


@pytest.mark.slow
def test_ecc_poison_quarantines_recomputes_token_exact_and_reverts(topo, tmp_path):
    prompt, n = "Poisoned pages must never be read:", 900
    out = {}
    decoding = threading.Event()

    def on_message(rec, msg) -> None:  # tokens after the first come from the decode worker
        if len(rec.token_ids) >= 5:
            decoding.set()

    def stream() -> None:
        with StreamingClient(topo.api_url, model=PRESET, read_timeout_s=120) as client:
            out["rec"] = client.send(CompletionRequest(prompt=prompt, max_tokens=n, ignore_eos=True),
                                     on_message=on_message)

    t = threading.Thread(target=stream)
    t.start()
    try:
        # poison as soon as the stream shows decoding: the tiny model's 900 tokens take a few
        # hundred ms on a fast core, and polling the admin API (heartbeat figures) until it showed
        # the request active left it finished before the poison in half the runs
        assert decoding.wait(30), "the request never started decoding"
        with FaultRunner(Ledger(tmp_path / "ledger.json"), handle_signals=False) as runner:
            fault = runner.inject(EccPoison(admin_url=topo.api_url, worker_id="decode-0", count=2))
            assert fault.reply["affected"], "the poisoned blocks belonged to no running request"
            w = decode0(topo)
            assert w["kv_blocks_poisoned"] >= 2 and w["kv_blocks_quarantined"] >= 2
            runner.revert(fault)
            # the ECC suite waits for this before its next poisoning (issue 33 item 8)
            assert fault.revert_reply.get("kv_blocks_poisoned") == 0 and fault.revert_seen(5.0)
            assert decode0(topo)["kv_blocks_poisoned"] == 0
            fault.revert_reply = {"kv_blocks_poisoned": -1}   # a revert the table can never show: times out
            assert fault.revert_seen(0.3) is False
    finally:
        t.join(180)
    rec = out["rec"]
    assert rec.status == "ok", rec.error_message
    assert rec.token_ids == greedy_reference(PRESET, ByteTokenizer().encode(prompt), n, ignore_eos=True)
    assert all(r.status.value == "succeeded" for r in runner.records)
