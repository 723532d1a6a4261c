"""Name a NIXL or UCX failure of a pd-nixl instance from its vLLM log (``python -m clusters.vllm.launch pd-nixl``).

Pure functions (no processes, no files): :func:`classify` reads the text of one instance's log since its
last start and returns the first known failure it shows, with the decisive line and the fix; the
launcher (clusters/vllm/nixl_hosts.py ``HostedSupervisor``) calls it while the instances start and when
the warm-up request fails, and stops with :func:`message`. Every pattern was read from a real vLLM
0.32 / NIXL 1.5.1 log with the failure planted (tests/realengine/data/nixl_errors/, which say how).

What vLLM does with each, unhelped (measured here, docs/vllm.md "When pd-nixl does not start"):
the EngineCore raises while making its NIXL agent and the API server exits 1 after a traceback of about
80 lines; a side-channel port already taken kills only vLLM's listener thread, and the engine then waits
for it forever (no exit, /health never answers).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

START_MARK = "==== start "   # clusters/supervise.py Instance.start writes it before every (re)start


@dataclass(frozen=True)
class NixlFailure:
    what: str   # "NIXL agent", "NIXL plugins", "UCX transport", "UCX device", "side-channel port", "handshake"
    line: str   # the decisive line of vLLM's log, its blanks collapsed, cut to LINE_MAX characters
    fix: str


LINE_MAX = 300

# (pattern, what, fix) in order of precedence: the first pattern found anywhere in the log wins, so
# a cause beats its consequences (UCX's "transport 'x' is not available" beats NIXL's backend error,
# which beats vLLM's own "NIXL is not available"). Fixes are formatted with the context :func:`classify`
# is given: {venv}, {host}, {side_port}, {ucx_tls}, {peer}.
PATTERNS: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"UCX\s+WARN\s+transport '[^']*' is not available"), "UCX transport",
     "UCX_TLS={ucx_tls} names a transport UCX does not have: it must include tcp (the fabric link is TCP); "
     "start the launcher without --ucx-tls (default tcp,self)"),
    (re.compile(r"UCX\s+WARN\s+network device '[^']*' is not available"), "UCX device",
     "the fabric NIC is missing in {host}'s namespace (UCX_NET_DEVICES=fab0): the emulated host was not "
     "built whole; remove what is left with `python -m harness fabric down --force` and start again"),
    (re.compile(r"UCX\s+ERROR\s+no usable transports/devices"), "UCX transport",
     "UCX found no transport of UCX_TLS={ucx_tls} on fab0: UCX_TLS must include tcp; start the launcher "
     "without --ucx-tls (default tcp,self)"),
    (re.compile(r"UCX\s+ERROR\s+no active messages transport"), "UCX transport",
     "UCX_TLS={ucx_tls} has no network transport: UCX_TLS must include tcp (sm or self alone cannot reach "
     "the other host); start the launcher without --ucx-tls (default tcp,self)"),
    (re.compile(r"No plugins available"), "NIXL plugins",
     "NIXL found no backend plugin (is NIXL_PLUGIN_DIR set to a folder without libplugin_UCX.so? unset it); "
     "or reinstall nixl and nixl-cu12 into the vLLM venv with --no-deps: clusters/vllm/setup.sh {venv}"),
    (re.compile(r"createBackend: backend creation failed for 'UCX'|NIXL_ERR_BACKEND"), "UCX transport",
     "NIXL could not start its UCX backend: check UCX_TLS={ucx_tls} (it must include tcp) and that fab0 "
     "exists in {host}'s namespace"),
    (re.compile(r"(?<![\w-])NIXL is not available"), "NIXL agent",
     "vLLM cannot import nixl: install nixl and nixl-cu12 into the vLLM venv with --no-deps: "
     "clusters/vllm/setup.sh {venv}"),
    (re.compile(r"Address already in use.*:{side_port}\b|:{side_port}\b.*Address already in use"),
     "side-channel port",
     "port {side_port} (NIXL side channel) is in use on host {host}: find the owner with "
     "`ip netns exec {netns} ss -ltnp 'sport = :{side_port}'` and stop it"),
    (re.compile(r"handshake_setup_failed|handshake_failed"), "handshake",
     "decode could not fetch prefill's NIXL metadata from {peer} within vLLM's 5 s: check that the fabric "
     "address is reachable from {host} (`ip netns exec {netns} ping {peer_ip}`) and that nothing filters "
     "the side-channel port"),
]


def since_last_start(text: str) -> str:
    """The part of a (possibly appended-to) instance log written by its last start."""
    at = text.rfind(START_MARK)
    return text if at < 0 else text[at:]


def classify(text: str, **context: str) -> NixlFailure | None:
    """The first known NIXL/UCX failure in ``text`` (one instance's log since its last start), or None.
    ``context`` fills the fix: venv, host, netns, side_port, ucx_tls, peer, peer_ip (missing keys read "?")."""
    ctx = _Context(context)
    lines = text.splitlines()
    for pattern, what, fix in PATTERNS:
        rx = re.compile(pattern.pattern.replace("{side_port}", re.escape(ctx["side_port"])))
        for line in lines:
            if rx.search(line):
                return NixlFailure(what, _trim(line), fix.format_map(ctx))
    return None


def last_error_line(text: str) -> str | None:
    """The last line that looks like a Python exception (``SomethingError: ...``), for failures
    :func:`classify` does not know: better than "see the log"."""
    found = None
    for line in text.splitlines():
        if re.search(r"(^|\] )[\w.]+(Error|Exception): ", line):
            found = line
    return _trim(found) if found else None


def message(instance: str, failure: NixlFailure, log_path: object) -> str:
    """The launcher's one error: which instance, what failed, vLLM's line, the log, the fix."""
    return (f"{instance}: {failure.what} failed: vLLM's log says \"{failure.line}\" (log {log_path}). "
            f"Fix: {failure.fix}")


def _trim(line: str) -> str:
    line = " ".join(line.split())   # UCX pads its lines with runs of spaces
    return line if len(line) <= LINE_MAX else line[:LINE_MAX - 3] + "..."


class _Context(dict):
    def __missing__(self, key: str) -> str:
        return "?"
