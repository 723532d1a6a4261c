"""The reference engine placed on the emulated fabric: workers in their own hosts, KV on the
fabric NIC in the lossless class, heartbeats over the control NIC. A flapping fabric NIC must not
lose a request: each one completes token-exact against the oracle (or fails with a clear error)."""

from __future__ import annotations

import functools
import threading
import time

import pytest

from harness.engine.core.oracle import greedy_reference
from harness.engine.core.tokenizer import ByteTokenizer
from harness.engine.pd.topology import Topology
from harness.fabric.shaping import LOSSLESS_CLASS, TCP_CLASS, read_classes
from harness.faults import FaultRunner, Ledger, NicFlap
from harness.hosts import LocalExecutor
from harness.probes.client.streaming import CompletionRequest, StreamingClient

pytestmark = [pytest.mark.root, pytest.mark.slow]
PRESET = "tiny"
WORKERS = ["prefill-0", "decode-0"]


@functools.lru_cache(maxsize=None)
def oracle(prompt: str, max_tokens: int) -> list[int]:
    return greedy_reference(PRESET, ByteTokenizer().encode(prompt), max_tokens, ignore_eos=True)


def send(base_url: str, prompt: str, max_tokens: int = 16):
    with StreamingClient(base_url, model=PRESET, read_timeout_s=90) as client:
        return client.send(CompletionRequest(prompt=prompt, max_tokens=max_tokens, ignore_eos=True))


@pytest.fixture
def cluster_on_fabric(make_fabric):
    fabric = make_fabric(hosts=2)
    with Topology(prefill=1, decode=1, preset=PRESET, **fabric.topology_kwargs(WORKERS)) as topo:
        yield fabric, topo
    for p in [topo._router, *topo._procs.values()]:
        assert p.popen.poll() is not None, f"{p.id} was not reaped"


def test_kv_travels_on_the_fabric_in_the_lossless_class(cluster_on_fabric):
    fabric, topo = cluster_on_fabric
    prefill_host = fabric.hosts[0]
    assert {w["id"]: w["addresses"]["kv"].split(":")[0] for w in topo.workers()}["decode-0"] == fabric.hosts[1].fabric_ip
    before = read_classes(LocalExecutor(), prefill_host.fabric_dev, prefill_host.netns)
    prompts = [f"fabric request {i} " * 8 for i in range(4)]
    for prompt in prompts:
        rec = send(topo.api_url, prompt)
        assert rec.status == "ok" and rec.token_ids == oracle(prompt, 16)
    after = read_classes(LocalExecutor(), prefill_host.fabric_dev, prefill_host.netns)
    kv_bytes = sum(e["bytes"] for e in topo.events() if e["type"] == "kv_transfer" and e["path"] == "fabric")
    lossless = after[LOSSLESS_CLASS].sent_bytes - before[LOSSLESS_CLASS].sent_bytes
    tcp = after[TCP_CLASS].sent_bytes - before[TCP_CLASS].sent_bytes
    assert kv_bytes > 0 and lossless >= kv_bytes  # every KV byte left the prefill host in the lossless class
    assert tcp < kv_bytes / 10                     # the TCP class saw only stray packets (ARP, none of the KV)


def test_engine_keeps_serving_token_exact_while_the_decode_nic_flaps(cluster_on_fabric, tmp_path):
    fabric, topo = cluster_on_fabric
    results: list = []
    stop = threading.Event()

    def client_loop(n: int) -> None:
        i = 0
        while not stop.is_set():
            prompt = f"client {n} request {i} "
            results.append((prompt, send(topo.api_url, prompt)))
            i += 1

    clients = [threading.Thread(target=client_loop, args=(n,)) for n in range(3)]
    for c in clients:
        c.start()
    try:
        with FaultRunner(Ledger.for_cluster("fabric-test", tmp_path), handle_signals=False) as runner:
            # down 3 s of every 4: longer than the KV socket timeout, so transfers must retry or fall back
            flap = runner.inject(NicFlap.on_fabric_host(fabric.hosts[1], period_s=4.0, duty=0.75, count=2))
            flap.wait_done(LocalExecutor())
    finally:
        stop.set()
        for c in clients:
            c.join(120)
    assert not any(c.is_alive() for c in clients), "a client request hung"
    assert len(results) >= 6
    for prompt, rec in results:
        if rec.status == "ok":
            assert rec.token_ids == oracle(prompt, 16), f"{prompt!r} diverged from the oracle"
        else:
            assert rec.error_message, f"{prompt!r} failed without a clear error"
    transfers = [e for e in topo.events() if e["type"] == "kv_transfer"]
    assert any(e["fallback"] or e["retries"] or e["transfer_s"] > 1.0 for e in transfers), \
        "no KV transfer was affected by the flaps: the fault did not reach the data plane"
