"""clusters/vllm/nixl_errors.py on real vLLM 0.32 / NIXL 1.5.1 log excerpts (tests/realengine/data/nixl_errors/,
each file's ``#|`` header says how its failure was planted and which lines were kept). Fast: no processes.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from clusters.vllm.nixl_errors import (
    START_MARK, NixlFailure, classify, last_error_line, message, since_last_start)

DATA = Path(__file__).parent / "data" / "nixl_errors"
CONTEXT = {"venv": "/srv/.venv-vllm", "host": "nx-h0", "netns": "pvn-h0", "side_port": "5611",
           "ucx_tls": "bogus", "peer": "198.18.31.1:5611", "peer_ip": "198.18.31.1"}


def excerpt(name: str) -> str:
    return "\n".join(line for line in (DATA / name).read_text().splitlines() if not line.startswith("#|"))


def named(name: str, **ctx: str) -> NixlFailure:
    failure = classify(excerpt(name), **{**CONTEXT, **ctx})
    assert failure is not None, name
    return failure


def test_a_bogus_ucx_tls_is_named_by_ucx_s_own_line_and_the_fix_says_tcp():
    """Planted: UCX_TLS=bogus. Catches: NIXL's consequence ("backend creation failed", NIXL_ERR_BACKEND)
    named instead of UCX's cause, or a fix that does not say UCX_TLS must include tcp."""
    f = named("ucx_tls_bogus.prefill-0.log")
    assert f.what == "UCX transport"
    assert "transport 'bogus' is not available" in f.line
    assert "UCX_TLS=bogus" in f.fix and "must include tcp" in f.fix


def test_nixl_missing_from_the_vllm_venv_names_setup_sh_with_the_venv():
    """Planted: nixl and nixl_cu12 unimportable. Catches: the pattern missing vLLM's "NIXL is not available"
    (the API server logs it 20 s before the engine fails), or a fix without setup.sh and the venv's path."""
    f = named("nixl_missing.decode-0.log")
    assert f.what == "NIXL agent" and "NIXL is not available" in f.line
    assert "clusters/vllm/setup.sh /srv/.venv-vllm" in f.fix and "--no-deps" in f.fix


def test_no_nixl_plugin_is_named_and_not_taken_for_a_missing_nixl():
    """Planted: NIXL_PLUGIN_DIR at an empty folder. Catches: the plugin failure named "NIXL agent" (the
    fix would be a reinstall, while the cause is the variable)."""
    f = named("nixl_no_plugins.prefill-0.log")
    assert f.what == "NIXL plugins" and "No plugins available" in f.line
    assert "NIXL_PLUGIN_DIR" in f.fix


def test_a_taken_side_channel_port_names_the_port_the_host_and_how_to_find_its_owner():
    """Planted: 198.18.31.1:5611 held by another socket in pvn-h0 (vLLM never exits on it). Catches: the
    pattern not matching ZMQ's line, the port or host missing from the fix."""
    f = named("side_channel_port.prefill-0.log")
    assert f.what == "side-channel port" and "Address already in use" in f.line and ":5611" in f.line
    assert "port 5611" in f.fix and "nx-h0" in f.fix and "ip netns exec pvn-h0 ss -ltnp" in f.fix


def test_address_in_use_on_another_port_is_not_called_the_side_channel():
    """Catches: any "Address already in use" (the API port's, for one) blamed on NIXL's side channel."""
    assert classify(excerpt("side_channel_port.prefill-0.log"), **{**CONTEXT, "side_port": "5612"}) is None


@pytest.mark.parametrize("name", ["fabric_unreachable.decode-0.log", "handshake_timeout.decode-0.log"])
def test_a_handshake_timeout_is_named_with_the_peer_to_check(name):
    """Planted: prefill's fabric address unreachable from decode's host (a prohibit route); and a real
    timeout under load, not planted. Catches: the pattern missing vLLM's "handshake_setup_failed", a fix
    that does not name the peer's address."""
    f = named(name, host="nx-h1", netns="pvn-h1")
    assert f.what == "handshake" and "handshake_setup_failed" in f.line
    assert "198.18.31.1:5611" in f.fix and "ip netns exec pvn-h1 ping 198.18.31.1" in f.fix


def test_a_healthy_start_names_nothing():
    """A whole healthy decode start ("NIXL is available", "Backend UCX was instantiated"). Catches: a
    pattern that matches a healthy line (e.g. "NIXL is not available" written to match "is available")."""
    text = excerpt("healthy.decode-0.log")
    assert "NIXL is available" in text and "Backend UCX was instantiated" in text
    assert classify(text, **CONTEXT) is None


@pytest.mark.parametrize("name", ["ucx_tls_bogus.prefill-0.log", "nixl_missing.decode-0.log",
                                  "nixl_no_plugins.prefill-0.log", "side_channel_port.prefill-0.log"])
def test_only_the_last_start_counts(name):
    """The launcher's logs are appended to across runs. Catches: an old run's failure named for a clean
    restart (classify given the whole file instead of ``since_last_start``)."""
    old = excerpt(name)
    healthy = excerpt("healthy.decode-0.log")
    text = f"{START_MARK}2026-12-06 10:00:00 restarts=0\n{old}\n{START_MARK}2026-12-06 11:00:00 restarts=0\n{healthy}"
    assert classify(since_last_start(text), **CONTEXT) is None
    assert classify(since_last_start(text + f"\n{START_MARK}x\n{old}"), **CONTEXT) is not None


def test_the_message_is_one_line_with_instance_what_line_log_and_fix():
    """Catches: a message that drops the log's path or the fix, or spans lines (a traceback's shape)."""
    f = named("ucx_tls_bogus.prefill-0.log")
    msg = message("prefill-0", f, "/tmp/harness-vllm-pd-nixl/prefill-0.log")
    assert "\n" not in msg
    assert msg.startswith("prefill-0: UCX transport failed: ")
    assert "/tmp/harness-vllm-pd-nixl/prefill-0.log" in msg and "Fix: UCX_TLS=bogus" in msg


def test_an_unknown_failure_still_gets_its_last_exception_line():
    """Catches: an exited instance reported with no line at all when no pattern knows its failure."""
    text = excerpt("nixl_missing.decode-0.log")
    assert last_error_line(text) == ("RuntimeError: Engine core initialization failed. See root cause above. "
                                     "Failed core proc(s): {}")
    assert last_error_line(excerpt("healthy.decode-0.log")) is None


def test_the_supervisor_names_only_this_start_s_failure_with_its_host_s_context(tmp_path):
    """HostedSupervisor.named_failure on real excerpts in an appended log (no processes). Catches: an
    earlier run's failure above the last start mark named again, the fix given the other host's port
    or namespace, the router's log classified."""
    from types import SimpleNamespace

    from clusters.supervise import Instance
    from clusters.vllm.nixl_hosts import HostedSupervisor

    hosts = SimpleNamespace(hosts=[SimpleNamespace(index=i, netns=f"pvn-h{i}", fabric_ip=f"198.18.31.{i + 1}")
                                   for i in range(2)])
    py = "/srv/.venv-vllm/bin/python"
    insts = [Instance(n, [py, "-m", "vllm"], {"UCX_TLS": "tcp,self"}, tmp_path / f"{n}.log", None, tmp_path)
             for n in ("prefill-0", "decode-0")]
    router = Instance("router", ["vllm-router"], {}, tmp_path / "router.log", None, tmp_path)
    sup = HostedSupervisor(hosts, insts, router, 60.0)   # type: ignore[arg-type]
    prefill, decode = insts
    old = excerpt("side_channel_port.prefill-0.log")
    prefill.log_path.write_text(f"{START_MARK}old\n{old}\n{START_MARK}new\n{excerpt('healthy.decode-0.log')}\n")
    decode.log_path.write_text(f"{START_MARK}new\n{excerpt('fabric_unreachable.decode-0.log')}\n")
    router.log_path.write_text(old)
    assert sup.named_failure(prefill) is None and sup.named_failure(router) is None
    with open(prefill.log_path, "a") as f:   # the same start goes on writing: read from its mark
        f.write(old + "\n")
    named = sup.named_failure(prefill)
    assert named and named.startswith("prefill-0: side-channel port failed") and "ip netns exec pvn-h0 ss" in named
    named = sup.named_failure(decode)
    assert named and "decode-0: handshake failed" in named and "198.18.31.1:5611" in named
    assert "ip netns exec pvn-h1 ping 198.18.31.1" in named and str(decode.log_path) in named
