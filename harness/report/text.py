"""Short text for narrow places (a chart's note, a status line): cut at a word, never inside an id."""

from __future__ import annotations


def fit_words(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a space, marked "…" when cut."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, max(limit - 1, 1))
    return text[:cut if cut > 0 else max(limit - 1, 0)].rstrip(" ;,:") + " …"
