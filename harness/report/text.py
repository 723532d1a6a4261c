"""Short text for narrow places (a chart's note, a status line): cut at a word, never inside an id."""

from __future__ import annotations


def fit_words(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a space, marked "…" when cut."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, max(limit - 1, 1))
    return text[:cut if cut > 0 else max(limit - 1, 0)].rstrip(" ;,:") + " …"


def faults_summary(faults: list[tuple[str, float]], budget: int) -> str:
    """Active faults per kind, oldest first: each target once with its count and the kind's oldest
    age, without the admin URL each label repeats; cut at a fault (never inside one) to fit
    ``budget`` characters."""
    if not faults:
        return "no fault active"
    kinds: dict[str, dict[str, int]] = {}
    oldest: dict[str, float] = {}
    for label, age in faults:
        kind, _, target = label.split(" via ", 1)[0].partition(" ")
        if target.startswith(kind.replace("_", " ")):  # "speculative_decoding speculative decoding on"
            kind, target = target, ""
        kinds.setdefault(kind, {})[target] = kinds.get(kind, {}).get(target, 0) + 1
        oldest[kind] = max(age, oldest.get(kind, age))
    names = [(" ".join([kind, ", ".join(f"{t}{f' x{n}' if n > 1 else ''}" for t, n in kinds[kind].items() if t)])
              .strip(), f" ({oldest[kind]:.0f} s)") for kind in sorted(kinds, key=lambda k: -oldest[k])]
    parts = [name + age for name, age in names]
    text = f"faults {len(faults)}: " if len(faults) > 1 else "fault "
    for i, part in enumerate(parts):
        rest = len(parts) - i - 1
        room = budget - len(text) - (len(f"; +{rest} more") if rest else 0)
        if len(part) > room:
            if i:
                return f"{text}+{len(parts) - i} more"
            part = fit_words(names[0][0], max(room, 12))  # the oldest fault, without its age
        text += part + ("; " if rest else "")
    return text
