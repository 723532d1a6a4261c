"""URL checks shared by every probe that talks HTTP."""

from __future__ import annotations

from harness.errors import ProbeError


def http_url(url: str, what: str, example: str = "http://127.0.0.1:8000") -> str:
    """``url`` without a trailing slash; a ProbeError naming ``what`` if it is not http(s)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ProbeError(f"{what} {url!r} has no http:// or https:// scheme", fix=f"pass e.g. {example}")
    return url.rstrip("/")
