"""Checklist items: measured values + thresholds + evidence -> verdicts.

``verdict`` holds the Verdict type, ``judge`` and the run's exit-code rule; ``thresholds`` loads
``checklists/section6.yaml``; ``invariants`` checks the nothing-lost invariant over a request
history; ``reschedule`` measures rescheduling time per fault (checklist item 6.1.4).
"""
