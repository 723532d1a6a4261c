"""A verdict's reason as data: codes plus fields, rendered to text in one place (issue 33 item 11).

A verdict's ``causes`` is a tuple of dicts, each ``{"code": ..., **fields}``: one *head* (what
decided it) and then *layers* added on the way to the final verdict (judge -> extension ->
machine gate -> final). ``Verdict.reason`` is always ``render(causes)``: nothing writes the text
by hand, so the terminal, the report, JUnit and results.json say the same thing, and tests assert
the fields (``verdict.cause["code"]``, ``verdict.cause["more_to_decide"]``), not the wording.

Heads
    ``met`` / ``missed`` / ``straddles`` / ``not_measured`` / ``thin``: judge()'s five outcomes
    (fields: the headline measurement's ``key``, ``what``, ``figure``, the threshold's words, and
    for a straddle ``more_to_decide``, ``noun``, ``resolution_bound``);
    ``capability``: the cluster lacks what the item needs (``missing``: one list of
    ``{capability, why_not, provided_by}`` per way the item could be judged);
    ``undecided``: inconclusive for the item's own ``because``; the soak's ``faults_recovered`` /
    ``faults_not_recovered`` and ``windows_met`` / ``windows_missed``;
    ``dry_run``, ``not_judged``, ``not_made``, ``skipped``, ``error``, ``summary``: said in the
    words of the code that decided (``text``), classified by the code; ``ended_cleanly``: the
    nothing-lost pass with its counts; ``recorded``: a reason read from an older results.json.
Layers
    ``extended`` (``rounds``, ``stopped``), ``machine`` (``action`` noted / kept / gated,
    ``starved``, ``would``, ``baseline``), ``note`` (``text``, ``sep``: details the item adds,
    such as its first failure).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from harness.errors import ConfigError

Cause = dict[str, Any]


def _then(c: Mapping[str, Any]) -> str:
    noun = c["noun"]
    if c.get("more_to_decide") is not None:
        return f"about {c['more_to_decide']} more {noun} would decide"
    if c.get("resolution_bound"):
        return f"more {noun} would not narrow it (a resolution bound)"
    return f"more than 10x the {noun} would be needed to decide (the figure is that close to it)"


def _met(c: Mapping[str, Any]) -> str:
    more = f" (and {c['more_met']} more threshold(s) met)" if c.get("more_met") else ""
    return f"{c['what']} was {c['figure']}, within {c['threshold']}{more}"


def _capability(c: Mapping[str, Any]) -> str:
    ways = ["; ".join(f"needs {m['capability']}" + (f" ({m['why_not']})" if m.get("why_not") else "")
                      + f", provided by {m['provided_by']}" for m in way) for way in c["missing"] if way]
    return "not judged on this cluster: " + "; or ".join(ways)


def _ended_cleanly(c: Mapping[str, Any]) -> str:
    if c.get("verified") is not None:
        return (f"all {c['total']} requests ended cleanly: {c['verified']} completed token-exact, "
                f"{c['rejected']} rejected and {c['failed_clear']} failed with a clear error; "
                "none hung, none silently wrong")
    return (f"all {c['total']} requests ended cleanly: {c['completed']} completed consistently "
            f"(no oracle for this engine: not checked token by token), {c['rejected']} rejected "
            f"and {c['failed_clear']} failed with a clear error; none hung, none cut silently")


def _text(c: Mapping[str, Any]) -> str:
    return c["text"]


HEADS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "met": _met,
    "missed": lambda c: f"{c['what']} was {c['figure']}, required {c['threshold']}: {c['why']}",
    "straddles": lambda c: f"inconclusive: {c['what']} {c['interval']} straddles {c['threshold']}; {_then(c)}",
    "not_measured": lambda c: f"inconclusive: {c['what']} could not be measured (required {c['threshold']})",
    "thin": lambda c: f"inconclusive: {c['because']} (required {c['threshold']})",
    "undecided": lambda c: f"inconclusive: {c['because']}",
    "capability": _capability,
    # the soak's items, judged over its faults and windows (harness/checks/soak.py)
    "faults_not_recovered": lambda c: (f"{c['failed']} fault(s) not recovered, first {c['first']}: {c['why']}; "
                                       f"{c['summary']}: {c['item_why']}"),
    "faults_recovered": lambda c: (f"{c['summary']}: every one by its rule (rescheduling <= {c['reschedule_limit_s']:g} s, "
                                   f"traffic again <= {c['rejoin_limit_s']:g} s)"
                                   + (f"; {c['not_injected']} not injected (named in the evidence)"
                                      if c.get("not_injected") else "")),
    "windows_missed": lambda c: f"{c['failed']} of {c['windows']} windows missed 6.2; {c['where']}: {c['first_reason']}",
    "windows_met": lambda c: (f"TTFT and TPOT within 6.2 in each of {c['windows']} windows of {c['window_s']:g} s and "
                              f"over the whole run (whole run: TTFT p99 {c['ttft_p99_ms']} ms, TPOT p99 "
                              f"{c['tpot_p99_ms']} ms, {c['requests']} requests)"),
    "ended_cleanly": _ended_cleanly,
    # classified, in the deciding code's own words
    "dry_run": _text, "not_judged": _text, "not_made": _text, "skipped": _text, "error": _text,
    "summary": _text, "recorded": _text,
}


def _machine(before: str, c: Mapping[str, Any]) -> str:
    if c["action"] == "noted":
        return f"{before}; {c['starved']}"
    if c["action"] == "kept":
        return f"{before}; {c['starved']}, but {c['baseline']}"
    return f"inconclusive: {c['starved']} while it was measured ({c['would']}: {before})"


LAYERS: dict[str, Callable[[str, Mapping[str, Any]], str]] = {
    "extended": lambda before, c: f"{before} (after {c['rounds']} extension(s); {c['stopped']})",
    "machine": _machine,
    "note": lambda before, c: f"{before.rstrip('.') if c.get('strip') else before}{c.get('sep', '; ')}{c['text']}",
}
CODES = frozenset(HEADS) | frozenset(LAYERS)
# what the end table shows of a head whose figure and threshold have columns of their own
_SHORT: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "met": lambda c: c["what"] + (f" (and {c['more_met']} more threshold(s) met)" if c.get("more_met") else ""),
    "missed": lambda c: c["what"],
    "capability": lambda c: "not judged on this cluster: needs " + " or ".join(
        ", ".join(m["capability"] for m in way) for way in c["missing"] if way),
}


# the status a head decides (None: any, the words of a suite or an older file); a machine layer
# with action "gated" makes any of them inconclusive
IMPLIED_STATUS: dict[str, str | None] = {
    "met": "pass", "faults_recovered": "pass", "windows_met": "pass", "ended_cleanly": "pass",
    "missed": "fail", "faults_not_recovered": "fail", "windows_missed": "fail",
    "straddles": "inconclusive", "not_measured": "inconclusive", "thin": "inconclusive", "undecided": "inconclusive",
    "capability": "inconclusive", "dry_run": "inconclusive", "not_judged": "inconclusive",
    "not_made": "inconclusive", "skipped": "inconclusive", "error": "error", "summary": None, "recorded": None,
}
NOT_MEASURED_CODES = ("dry_run", "not_judged", "not_made", "skipped")   # inconclusive()'s


def implied_status(causes: Iterable[Mapping[str, Any]]) -> str | None:
    """The status the causes say (``"pass"``, ...), or None where the head leaves it to its words."""
    head, *layers = check(causes)
    if any(c["code"] == "machine" and c["action"] == "gated" for c in layers):
        return "inconclusive"
    return IMPLIED_STATUS[head["code"]]


def cause(code: str, **fields: Any) -> Cause:
    """One cause, checked: a known code and the fields its rendering needs."""
    if code not in CODES:
        raise ConfigError(f"unknown reason code {code!r}", fix=f"use one of {sorted(CODES)}")
    out = {"code": code, **fields}
    try:
        (HEADS[code](out) if code in HEADS else LAYERS[code]("", out))
    except KeyError as exc:
        raise ConfigError(f"reason {code!r} lacks the field {exc.args[0]!r}", fix="pass every field it renders") from None
    return out


def check(causes: Iterable[Mapping[str, Any]]) -> tuple[Cause, ...]:
    """``causes`` as a tuple, checked: one head first, layers after it."""
    out = tuple(dict(c) for c in causes)
    if not out or out[0].get("code") not in HEADS:
        raise ConfigError(f"a verdict's causes start with one head code, got {[c.get('code') for c in out]}",
                          fix=f"start with one of {sorted(HEADS)}")
    for c in out[1:]:
        if c.get("code") not in LAYERS:
            raise ConfigError(f"reason code {c.get('code')!r} cannot follow the head", fix=f"use one of {sorted(LAYERS)}")
    return out


def render(causes: Iterable[Mapping[str, Any]]) -> str:
    """The one line every output shows: the head's words, then each layer's."""
    head, *layers = check(causes)
    text = HEADS[head["code"]](head)
    for c in layers:
        text = LAYERS[c["code"]](text, c)
    return " ".join(text.split())


def render_line(causes: Iterable[Mapping[str, Any]]) -> str:
    """The terminal's line as a verdict is recorded: the whole reason, except that a capability
    cause (600-1,500 characters when every way is spelled out) names the first way's missing
    capabilities and what would provide the first of them; each way's why stays in the report."""
    head, *layers = check(causes)
    if head["code"] != "capability" or layers:
        return render(causes)
    ways = [way for way in head["missing"] if way]
    first = ways[0]
    text = (f"not judged on this cluster: needs {', '.join(m['capability'] for m in first)}; "
            f"fix: {first[0]['provided_by']}")
    if len(ways) > 1:
        text += f" (or {len(ways) - 1} other way(s): the report names each)"
    return " ".join(text.split())


def render_short(causes: Iterable[Mapping[str, Any]]) -> str:
    """For the end table, whose columns show the figure and threshold: the head without them (what
    was measured; a capability's names only, its why and fix in the report) and a machine gate's
    'CPU-starved (would have failed)' instead of the whole window."""
    head, *layers = check(causes)
    text = _SHORT[head["code"]](head) if head["code"] in _SHORT else HEADS[head["code"]](head)
    text = text.removeprefix("inconclusive: ")
    for c in layers:
        if c["code"] == "machine":
            starved = "test machine CPU-starved" + (f" ({c['would']})" if c.get("would") else "")
            text = f"{starved}: {text}" if c["action"] == "gated" else f"{text}; {starved}"
        elif c["code"] == "extended":
            text = LAYERS["extended"](text, c)
    return " ".join(text.split())


__all__ = ["CODES", "HEADS", "IMPLIED_STATUS", "LAYERS", "NOT_MEASURED_CODES", "Cause", "cause", "check", "implied_status",
           "render", "render_line", "render_short"]
